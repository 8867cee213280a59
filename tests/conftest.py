"""Shared fixtures: a factory of real `lowcomm-node join` processes that always cleans up."""

from __future__ import annotations

import json
import multiprocessing.util
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import psutil
import pytest

from lowcomm.node.checkpoint import list_checkpoints
from lowcomm.node.localswarm import NodeProcess, peer_args


def session_processes(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (a process started with ``start_new_session``, and
    everything it started: a node's DHT process and p2pd run in a process group of their own,
    node/dht.py, so a look at the node's group alone would miss them)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return found


def act_at_line(command: list[str], needle: str, act: Callable[[subprocess.Popen], None], timeout: float = 120,
                env: dict[str, str] | None = None) -> tuple[int, int, str, str]:
    """Run ``command`` in a session of its own; at the first line of its stdout holding
    ``needle``, call ``act(proc)`` (send it a signal, say); returns its pid (its session's id),
    exit code, whole stdout and stderr. Whatever of its session outlives ``timeout`` is killed."""
    # The child starts with the default hangup disposition even when the suite runs under
    # `nohup`, whose ignored SIGHUP children inherit (and our processes then leave alone).
    hangup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})
    finally:
        signal.signal(signal.SIGHUP, hangup)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if needle in line:
                act(proc)
                break
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            for process in session_processes(proc.pid):
                process.kill()
            proc.wait()
    return proc.pid, proc.returncode, "".join(seen) + out, err


def json_messages(out: str) -> list[str]:
    return [json.loads(line)["msg"] for line in out.splitlines() if line.startswith("{")]


def assert_stopped_cleanly_with_its_checkpoint(out: str, checkpoints: Path) -> None:
    """The node (or Swarm) logged a stop request and a clean stop at a step >= 1, whose
    checkpoint is the newest."""
    messages = json_messages(out)
    assert any(msg.startswith("stop requested") for msg in messages), messages
    stopped = [msg for msg in messages if msg.startswith("stopped cleanly at outer step ")]
    assert stopped, messages
    step = int(stopped[0].split()[5])
    assert step >= 1 and list_checkpoints(checkpoints)[-1].name == f"step-{step:09d}.ckpt"


# Small, fast settings for CLI swarms on 2 cores: short inner phases, short deadlines, and a
# heartbeat that spreads news of steps quickly. The multi-process tests are CPU-bound, and the
# inner phase is most of a round's CPU: 4 sequences per step cost a solo node 0.5-0.6 CPU-s per
# round instead of 1.0-1.4 s with 8. The tests wait for rounds, never for an amount of training.
FAST = [
    "--set", "train.inner_steps=20",
    "--set", "train.batch_size=4",
    "--set", "sync.matchmaking_timeout=15",
    "--set", "sync.reduce_timeout=8",
    "--set", "node.heartbeat_interval=1",
    "--set", "node.grace_period=10",
]


class Swarm:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[NodeProcess] = []

    def start(self, index: int, peers: list[str] = (), extra: list[str] = (), env: dict | None = None,
              fast: bool = True) -> NodeProcess:
        args = peer_args(self.workdir, index, peers, [*(FAST if fast else []), *extra])
        node = NodeProcess(f"peer-{index}", args, env=env)
        self.nodes.append(node)
        return node

    def descendants(self, node: NodeProcess) -> list[psutil.Process]:
        try:
            return psutil.Process(node.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def cleanup(self) -> None:
        for node in self.nodes:
            node.kill_all()
        # Every node's output next to its data, so that a failed run can be read afterwards
        # (pytest keeps the last few base temp directories).
        for number, node in enumerate(self.nodes):
            (self.workdir / f"{number:02d}-{node.name}.log").write_text("\n".join(node.raw_lines) + "\n")


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory):
    """TMPDIR for the session: a short folder under /tmp that is removed at the end. Nodes put
    p2pd's unix sockets there (node/dht.py ``place_p2pd_sockets``), and the suite SIGKILLs nodes
    by the dozen, whose sockets nobody else removes (about 80 files per run in /tmp before).
    pytest's own folders (tmp_path) stay where they were, for a failed run to be read."""
    tmp_path_factory.getbasetemp()  # fixed before TMPDIR changes
    # This process's multiprocessing folder too: multiprocessing removes it at exit, after the
    # session, and would find it gone (a traceback) if it were in the folder removed below.
    multiprocessing.util.get_temp_dir()
    before = os.environ.get("TMPDIR")
    folder = tempfile.mkdtemp(prefix="lct-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # tempfile caches the folder it chose: let it choose again
    try:
        yield Path(folder)
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = None
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def swarm(tmp_path: Path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.cleanup()
