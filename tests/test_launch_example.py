"""examples/launch.py, the launcher of N peers of a training script, with a stand-in script
that speaks its protocol (prints the example_ready line, takes --checkpoint-dir, --min-peers
and --peers) without torch: what the launcher does when all goes well, when a peer fails and
when it is told to stop. tests/test_api_swarm.py runs the real train_hf.py peers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "examples" / "launch.py"

PEER = """
import argparse, json, os, pathlib, signal, sys
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir"); parser.add_argument("--min-peers", type=int)
parser.add_argument("--peers", nargs="*", default=[]); parser.add_argument("--joiners-fail", action="store_true")
parser.add_argument("--train", action="store_true", help="run until Ctrl-C instead of ending at once")
args = parser.parse_args()
folder = pathlib.Path(args.checkpoint_dir)
folder.mkdir(parents=True, exist_ok=True)
# Written whole or not at all: the launcher may stop a joiner as it starts, and a pid file cut
# between its creation and its write (empty) broke the fixture's check of what outlived the launcher.
(folder / "pid.partial").write_text(str(os.getpid()))
os.replace(folder / "pid.partial", folder / "pid")
if args.joiners_fail and args.peers:
    print("cannot join", flush=True)
    sys.exit(3)
# A Swarm takes SIGTERM as a graceful stop from the moment it is entered, before its ready line.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print(json.dumps({"event": "example_ready", "multiaddrs": ["/ip4/127.0.0.1/tcp/1/p2p/QmFirst"]}), flush=True)
if args.train:
    signal.sigwait({signal.SIGTERM})
# Many lines at the end: a launcher that returned at the peer's exit would lose some.
for line in range(300):
    print(f"{folder.name} line {line}")
print(json.dumps({"event": "example_done", "min_peers": args.min_peers, "peers": args.peers}), flush=True)
sys.exit(143 if args.train else 0)
"""


@pytest.fixture
def launch(tmp_path):
    """Start the launcher with the stand-in peer; afterwards no peer of it may be left running
    (each wrote its pid: they run in sessions of their own, out of the launcher's group)."""
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    started: list[subprocess.Popen] = []

    def run(nproc: int, *peer_args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(LAUNCHER), "--nproc", str(nproc), "--workdir",
                                 str(tmp_path / "runs"), "--", str(script), *peer_args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        return proc

    yield run
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = []
    for pid_file in (tmp_path / "runs").glob("peer-*/pid"):
        try:
            peer = psutil.Process(int(pid_file.read_text()))
        except psutil.NoSuchProcess:
            continue
        if peer.status() != psutil.STATUS_ZOMBIE:
            left.append(pid_file.parent.name)
            peer.kill()
    assert not left, f"peers outlived the launcher: {left}"


def test_every_peer_runs_with_the_first_ones_address_and_every_line_is_shown(launch) -> None:
    proc = launch(3)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    for index in range(3):
        lines = [line for line in out.splitlines() if line.startswith(f"[peer-{index}] ")]
        assert f"[peer-{index}] peer-{index} line 299" in lines  # the last lines before its exit too
        done = [line for line in lines if "example_done" in line]
        assert len(done) == 1
        assert ('"min_peers": 3' in done[0]) and (('"peers": []' in done[0]) == (index == 0))


def test_a_peer_that_fails_stops_the_others_instead_of_leaving_them_waiting_for_it(launch) -> None:
    # The first peer waits for --min-peers 3 that never come: it used to wait forever.
    proc = launch(3, "--train", "--joiners-fail")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "stopping the others" in err and err.strip().splitlines()[-1] in ("peer-1 exited with 3",
                                                                            "peer-2 exited with 3")
    assert "[peer-0] peer-0 line 299" in out  # it stopped gracefully (SIGTERM), to its last line


def until_ready(proc: subprocess.Popen, peers: int) -> None:
    """Read the launcher's output until each of its ``peers`` said it is ready."""
    ready = set()
    for line in proc.stdout:
        if "example_ready" in line:
            ready.add(line.split()[0])
        if len(ready) == peers:
            return
    raise AssertionError(f"the launcher's output ended with {len(ready)} of {peers} peers ready")


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGHUP], [signal.SIGINT],
                                     [signal.SIGTERM, signal.SIGHUP]],
                         ids=["term", "hangup", "ctrl-c", "term-and-hangup-at-once"])
def test_a_stop_signal_to_the_launcher_stops_every_peer_gracefully(launch, signals) -> None:
    # Its peers run in sessions of their own: a launcher that died of SIGTERM or SIGHUP (its
    # terminal closed) used to leave them training on. Two at once (coreutils `timeout` signals
    # the launcher and then its process group; a supervisor may send SIGTERM and SIGHUP) are one
    # stop, not a graceful one and a kill. (Two SIGTERMs sent back to back merge in the kernel.)
    proc = launch(2, "--train")
    until_ready(proc, 2)
    for sent in signals:
        os.kill(proc.pid, sent)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in {128 + signum for signum in signals}, err  # pending signals come lowest first
    assert "stopping the peers" in err
    assert "[peer-0] peer-0 line 299" in out and "[peer-1] peer-1 line 299" in out


def test_only_the_launchers_main_thread_can_take_a_stop_signal(launch) -> None:
    # Python runs signal handlers in the main thread, which sleeps in its queue's get(); the kernel
    # gives a signal sent to the process to any thread that does not block it. One taken by a relay
    # thread (asleep reading its quiet peer) woke nobody: the launcher never stopped its peers.
    # In CI: SIGTERM and SIGHUP sent back to back, the second to a relay thread while the first
    # was pending in the main one, 3 times in 100 (the test above). Seen here in the threads'
    # blocked masks, which decide it every time.
    proc = launch(2, "--train")
    until_ready(proc, 2)
    stop_mask = sum(1 << (signum - 1) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    blocked = {}
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        blocked[int(task.name)] = int(status["SigBlk"], 16) & stop_mask
    assert blocked.pop(proc.pid) == 0  # the main thread takes them
    assert len(blocked) == 2 and all(mask == stop_mask for mask in blocked.values()), blocked  # one relay per peer
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM


def test_a_launcher_killed_outright_takes_its_peers_along(launch, tmp_path) -> None:
    # SIGKILL (or the OOM killer) gives the launcher no chance to stop its peers, which run in
    # sessions of their own: they trained on as orphans. The kernel now sends each a SIGTERM.
    proc = launch(2, "--train")
    until_ready(proc, 2)
    peers = [psutil.Process(int(path.read_text())) for path in sorted((tmp_path / "runs").glob("peer-*/pid"))]
    assert len(peers) == 2
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(peers, timeout=60)
    assert not alive, f"peers outlived a killed launcher: {alive}"


def test_a_peer_count_below_one_is_a_usage_error(launch) -> None:
    proc = launch(0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--nproc: must be a whole number of peers, at least 1 (got '0')" in err
