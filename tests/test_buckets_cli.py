"""Eight real `lowcomm-node` processes with `[sync] group_size = 2` and `matchmaking_buckets =
true`: a step that expects eight peers matchmakes in B = 4 buckets (protocol/buckets.py), whose leaders meet the step
coordinator, and the step's four groups of two still commit one params hash (one step plan,
crossgroup.py), with no state download after a node's first round; a round right after such a
plan starts without a read of the peer table (its members know their buckets from the plan)."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow: make test stays under 15 min

PEERS, GROUP, STEPS = 8, 2, 2
SPLIT = ["--set", f"sync.group_size={GROUP}", "--set", "sync.matchmaking_buckets=true", "--set", "train.inner_steps=10"]
WAIT = 240  # seconds, for eight processes to start, catch up and run the steps on 2 loaded cores


def test_eight_peers_in_four_buckets_commit_one_hash_per_step(swarm):
    first = swarm.start(0, extra=SPLIT)
    nodes = [first] + [swarm.start(i, [first.multiaddr], extra=SPLIT) for i in range(1, PEERS)]

    def bucketed_steps() -> dict[int, list[dict]]:
        """Steps that all eight committed in groups of two, all eight through buckets. (While
        views are in flux, a peer whose view shows fewer than eight at the step matchmakes on
        the single level instead, which test_crossgroup_cli and the unit tests cover.)"""
        by_step: dict[int, list[dict]] = defaultdict(list)
        through_buckets: Counter[int] = Counter()  # peers that bucket leaders brought into the plan
        for node in nodes:
            for e in node.events:
                if e.get("event") == "bucket_closed":
                    through_buckets[e["outer_step"]] += e["bucket_members"]
            for event in node.rounds():
                if event["group_size"] == GROUP:
                    by_step[event["outer_step"]].append(event)
        # round_done reports the step its round produced: the round of step r - 1.
        return {step: events for step, events in by_step.items()
                if len(events) == PEERS and through_buckets[step - 1] == PEERS}

    def after_a_plan(steps: dict[int, list[dict]]) -> list[int]:
        """Bucketed steps whose round began right after a plan of all eight (the step before is
        bucketed too): every member knew its bucket from that plan (buckets.bucketed_by_plan)."""
        return [step for step in steps if step - 1 in steps]

    first.wait_for(lambda _e: len(steps := bucketed_steps()) >= STEPS and after_a_plan(steps), WAIT)
    for step, events in sorted(bucketed_steps().items()):
        # On a failure, say who planned the step (two coordinators mean two plans)...
        closed = [(node.name, e["bucket"], e["bucket_members"], e["coordinated"]) for node in nodes
                  for e in node.events if e.get("event") == "bucket_closed" and e["outer_step"] == step - 1]
        # ... and whether a group skipped a shard the others applied (crossgroup.py's faults).
        hashes = [(e["params_sha256"][:8], e["skipped_shards"]) for e in events]
        assert len({e["params_sha256"] for e in events}) == 1, (step, hashes, closed)
    for step in after_a_plan(bucketed_steps()):
        # Such a round starts from the heartbeat's view: no member read the table at its start
        # (only a bucket leader reads it, at its first look: RoundPeers.read_first).
        started = [e["round_start_read"] for e in bucketed_steps()[step]]
        assert not any(started), (step, started)
    closed = [e for node in nodes for e in node.events if e.get("event") == "bucket_closed"]
    assert {e["bucket"] for e in closed} <= {f"b4.{i}" for i in range(4)} and any(e["coordinated"] for e in closed)
    for node in nodes:
        first_round = next(i for i, e in enumerate(node.events) if e.get("event") == "round_done")
        later = [e for e in node.events[first_round:] if e.get("event") == "state_downloaded"]
        assert not later, f"{node.name} downloaded the state after its first round: {later}"
        assert node.proc.poll() is None, f"{node.name} exited"
