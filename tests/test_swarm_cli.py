"""Multi-process swarms through the real CLI on loopback (DESIGN §7)."""

from __future__ import annotations

import json
import signal
import subprocess

import psutil
import pytest

from lowcomm.node.checkpoint import list_checkpoints
from lowcomm.node.localswarm import node_command

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
    # member whose declared bandwidth is far below the others' owns nothing; loopback estimates vary).
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
