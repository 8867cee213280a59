"""Multi-process swarms through the real CLI on loopback (DESIGN §7)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from lowcomm.node import localswarm
from lowcomm.node.checkpoint import list_checkpoints
from lowcomm.node.localswarm import node_command

from .conftest import FAST, act_at_line

pytestmark = pytest.mark.multiprocess

ROUND_WAIT = 90  # generous bound for one round on a loaded 2-core machine (deadlines are 15 s + 8 s)


def group_rounds(node, size):
    return [e for e in node.rounds() if e["group_size"] >= size]


def hash_at(node, step, timeout=ROUND_WAIT):
    """The params hash ``node`` committed (or caught up with) for outer step ``step``."""
    event = node.wait_for(
        lambda e: e.get("event") in ("round_done", "state_downloaded", "missed_rounds_applied")
        and e.get("outer_step") == step, timeout)
    return event["params_sha256"]


def test_three_peers_train_in_sync_and_a_late_joiner_catches_up(swarm):
    first = swarm.start(0)
    ready = first.ready()
    initial_eval = ready["eval_loss"]
    second = swarm.start(1, [first.multiaddr])
    third = swarm.start(2, [first.multiaddr])
    trio = [first, second, third]

    # Three rounds in which all three peers averaged together, with identical results per step.
    second.wait_for(lambda e: e.get("event") == "round_done" and len(group_rounds(second, 3)) >= 2, ROUND_WAIT * 3)
    late = swarm.start(3, [first.multiaddr])
    second.wait_for(lambda e: e.get("event") == "round_done" and len(group_rounds(second, 3)) >= 3, ROUND_WAIT * 3)
    for event in group_rounds(second, 3)[:3]:
        step = event["outer_step"]
        assert {hash_at(node, step) for node in trio} == {event["params_sha256"]}, f"hashes differ at step {step}"

    # The late joiner downloads the swarm's state, then averages with the others, bit-identically.
    downloaded = late.wait_event("state_downloaded", ROUND_WAIT)
    assert downloaded["outer_step"] >= 2
    joined = late.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 4, ROUND_WAIT * 2)
    step = joined["outer_step"]
    assert {hash_at(node, step) for node in trio} == {joined["params_sha256"]}

    # `status --json`, `status` and `healthcheck` report the same state through the real CLI
    # (started together: each spends seconds importing, and they do not depend on each other).
    grpc_address = first.ready()["grpc_address"]
    commands = {name: subprocess.Popen([*node_command(), *args, "--target", grpc_address], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                for name, args in (("json", ["status", "--json"]), ("human", ["status"]),
                                   ("health", ["healthcheck"]))}
    try:
        out = {name: (proc.communicate(timeout=60)[0], proc.returncode) for name, proc in commands.items()}
    finally:
        for proc in commands.values():
            if proc.poll() is None:
                proc.kill()
    assert out["json"][1] == 0 and out["human"][1] == 0, out
    status = json.loads(out["json"][0])
    for key in ("peer_id", "outer_step", "params_sha256", "swarm_peers", "loss", "tokens_total"):
        assert key in status
    assert status["swarm_peers"] >= 3 and status["tokens_total"] > 0
    assert status["outer_step"] >= step
    assert status["checkpoint_failure"] is None  # its checkpoints are written
    own = next(peer for peer in status["swarm"] if peer["peer_id"] == status["peer_id"])
    assert (own["outer_step"], own["params_sha256"]) == (status["outer_step"], status["params_sha256"])
    human = out["human"][0]
    assert status["peer_id"] in human and "swarm" in human
    assert sum(1 for line in human.splitlines() if "tok/s" in line and "lag" in line) >= 3  # one line per peer
    assert out["health"][1] == 0 and "SERVING" in out["health"][0]

    # Training helps: the global model's eval loss is below the initial one.
    assert first.rounds()[-1]["eval_loss"] < initial_eval


def test_killed_peer_does_not_stall_the_round_and_rejoins_after_restart(swarm):
    first = swarm.start(0, extra=["--log-level", "debug"])  # group_formed events
    second = swarm.start(1, [first.multiaddr], extra=["--log-level", "debug"])
    # The victim stalls inside its 2nd round (after the group formed), and is then SIGKILLed.
    victim = swarm.start(2, [first.multiaddr], env={"LOWCOMM_FAULT_HOLD_ROUND": "2"})
    hold = victim.wait_event("fault_hold", ROUND_WAIT * 3)
    step = hold["outer_step"]
    # When the victim leads, its replies may still be in flight as it holds: kill it only once
    # the others have the group.
    for node in (first, second):
        node.wait_for(lambda e: e.get("event") == "group_formed" and e["outer_step"] == step, ROUND_WAIT)
    # SIGKILL the node process alone: its DHT process and p2pd must not outlive it.
    orphans = swarm.descendants(victim)
    victim.signal(signal.SIGKILL)
    _, alive = psutil.wait_procs(orphans, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"orphaned after SIGKILL: {alive}"

    # The survivors finish that round within its deadlines, skipping the dead owner's shard ...
    done = [node.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 1, ROUND_WAIT)
            for node in (first, second)]
    assert done[0]["params_sha256"] == done[1]["params_sha256"]
    # The dead peer's shard is skipped, unless the leader gave it none (layout.owner_shares: a
    # member whose declared bandwidth is far below the others' owns nothing; on loopback only a
    # loaded machine that stalls a peer's uploads past twice MIN_TIMED_UPLOAD_SECONDS does that).
    victim_share = 1.0 - sum(e["owned_share"] for e in done)
    assert all(e["group_size"] == 3 and (e["skipped_shards"] >= 1) == (victim_share > 1e-6) for e in done), done
    assert all(e["round_seconds"] < 15 + 8 * 1.25 + 10 for e in done), done  # matchmaking + reduce deadlines
    # ... and go on training together.
    after = first.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == step + 2, ROUND_WAIT)
    assert hash_at(second, step + 2) == after["params_sha256"]

    # The killed peer restarts from its checkpoint (same identity and directory) and rejoins.
    restarted = swarm.start(2, [first.multiaddr])
    ready = restarted.ready()
    assert ready["peer_id"] == hold.get("peer_id", ready["peer_id"])
    assert ready["outer_step"] >= 1  # resumed from its checkpoint, not from scratch
    restarted.wait_event("state_downloaded", ROUND_WAIT)
    rejoined = restarted.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 3, ROUND_WAIT * 2)
    assert hash_at(first, rejoined["outer_step"]) == rejoined["params_sha256"]

    # SIGTERM: every node exits 0 within the grace period, checkpoints, and leaves no child behind.
    nodes = [first, second, restarted]
    children = [swarm.descendants(node) for node in nodes]
    assert any(children), "expected p2pd children"
    for node in nodes:
        node.signal(signal.SIGTERM)
    for node in nodes:
        assert node.wait_exit(timeout=10 + 15) == 0
        node.wait_event("node_stopped", 5)
    # p2pd dies with its node; torch's shared-memory manager exits once its last client is gone.
    _, alive = psutil.wait_procs([child for kids in children for child in kids], timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], f"children outlived their node: {alive}"
    for index in range(3):
        assert list_checkpoints(swarm.workdir / f"peer-{index}"), "no checkpoint written"


# -- the demo launcher (`make demo`: python -m lowcomm.node.localswarm) ------------------------------

DEMO_ROUND = re.compile(r"^\[(peer-\d+)\] step \d+ \|.*\| group (\d+) \|")


def run_demo(tmp_path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The demo as `make demo` runs it; whatever it started is killed if it outlives ``timeout``."""
    proc = subprocess.Popen([sys.executable, "-m", "lowcomm.node.localswarm", *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # each node runs in its own session: kill them one by one
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    child.kill()
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def no_nodes(monkeypatch):
    """localswarm.main in this process with NodeProcess replaced: the list records each start
    as (name, the workdir's entries at that moment), then the start fails as a timeout would."""
    started = []

    def fake(name, args, *_, **__):
        workdir = Path(args[args.index("--checkpoint-dir") + 1]).parent
        started.append((name, sorted(p.name for p in workdir.iterdir()) if workdir.is_dir() else None))
        raise TimeoutError(f"{name}: no real node in this test")

    monkeypatch.setattr(localswarm, "NodeProcess", fake)
    return started


def test_demo_refuses_a_workdir_holding_files_it_did_not_make(tmp_path, no_nodes, capsys):
    workdir = tmp_path / "important"
    (workdir / "peer-0").mkdir(parents=True)
    (workdir / "thesis.txt").write_text("years of work")
    assert localswarm.main(["--workdir", str(workdir), "--rounds", "1"]) == 2
    assert (workdir / "thesis.txt").read_text() == "years of work"
    assert (workdir / "peer-0").is_dir()  # nothing removed, not even what looks like the demo's
    assert no_nodes == []
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--workdir" in err[0] and "thesis.txt" in err[0] and "--keep" in err[0], err
    # --keep resumes in it: nothing is removed either.
    assert localswarm.main(["--workdir", str(workdir), "--rounds", "1", "--keep"]) == 1
    assert no_nodes == [("peer-0", ["peer-0", "thesis.txt"])]


def test_demo_rerun_removes_the_peer_folders_of_the_last_demo_only(tmp_path, no_nodes):
    workdir = tmp_path / "demo"
    for name in ("peer-0", "peer-4"):  # a previous demo, with more peers
        (workdir / name).mkdir(parents=True)
        (workdir / name / "step-000000001.ckpt").write_bytes(b"old")
    assert localswarm.main(["--workdir", str(workdir), "--rounds", "1"]) == 1  # fails at the fake start
    assert no_nodes == [("peer-0", [])]  # started afresh in the same folder, without asking


@pytest.mark.parametrize("flag, value", [("--peers", "0"), ("--peers", "-2"), ("--rounds", "0"),
                                         ("--rounds", "-1"), ("--peers", "three")])
def test_demo_refuses_fewer_than_one_peer_or_round(tmp_path, no_nodes, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        localswarm.main(["--workdir", str(tmp_path / "demo"), flag, value])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}:" in error and "at least 1" in error and value in error, error
    assert no_nodes == []


def test_demo_stops_its_peers_when_its_terminal_hangs_up(tmp_path):
    # The nodes run in sessions of their own: when the terminal of `make demo` closed, the demo
    # died of the hangup and its peers trained on as orphans.
    nodes: list[psutil.Process] = []

    def hang_up(proc: subprocess.Popen) -> None:
        nodes.extend(psutil.Process(proc.pid).children(recursive=True))
        proc.send_signal(signal.SIGHUP)

    try:
        _, code, out, err = act_at_line([sys.executable, "-m", "lowcomm.node.localswarm", "--peers", "1",
                                         "--workdir", str(tmp_path / "demo"), "--", *FAST], "[peer-0] ready:", hang_up)
    finally:
        for node in nodes:  # in sessions of their own: the helper's cleanup does not reach them
            if node.is_running():
                node.kill()
    assert nodes, "the demo started no node"
    assert code == 0, err
    assert "all peers stopped cleanly" in out
    assert not [node for node in nodes if node.is_running() and node.status() != psutil.STATUS_ZOMBIE]


def test_demo_reports_a_peers_own_error_not_a_timeout(tmp_path):
    result = run_demo(tmp_path, "--peers", "2", "--rounds", "1", "--workdir", str(tmp_path / "demo"),
                      "--", "--no-such-flag")
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert "did not come" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "peer-0 exited with code 2" in lines[0] and "unrecognized arguments: --no-such-flag" in lines[0]


def test_demo_rounds_with_short_inner_phases_every_peer_takes_part(tmp_path):
    # Two inner steps: the first peer finished rounds alone in a fraction of a second, long before
    # the others had started (once it stopped after its 2 rounds and they found nobody to join;
    # later it took solo outer steps before they came and after they left: steps 17 vs 15). Now
    # every peer waits for the others (--wait-for-peers) and does exactly its rounds.
    flags = [*FAST, "--set", "train.inner_steps=2"]
    workdir = tmp_path / "demo"
    result = run_demo(tmp_path, "--peers", "3", "--rounds", "2", "--workdir", str(workdir), "--", *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every peer completed 2 round(s)" in result.stdout and "all peers stopped cleanly" in result.stdout
    rounds: dict[str, list[int]] = {}
    for line in result.stdout.splitlines():
        if match := DEMO_ROUND.match(line):
            rounds.setdefault(match.group(1), []).append(int(match.group(2)))
    assert sorted(rounds) == ["peer-0", "peer-1", "peer-2"], result.stdout
    assert all(len(sizes) == 2 and sizes[0] >= 2 for sizes in rounds.values()), rounds  # no solo round first
    assert "[peer-0] waiting for 3 peers before training (--wait-for-peers): 1 in the swarm" in result.stdout
    for index in range(3):
        assert list_checkpoints(workdir / f"peer-{index}")

    # The command it prints at the end takes the model out of peer-0's last checkpoint.
    command = result.stdout.strip().splitlines()[-1].split("torch loads: ")[1]
    assert command.startswith(f"lowcomm-node export --checkpoint-dir {workdir}/peer-0 --set train.inner_steps=20 ")
    exported = subprocess.run([*node_command(), *shlex.split(command)[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "demo-model" / "lowcomm.json").read_text())["outer_step"] == 2
