"""Six real `lowcomm-node` processes with `[sync] group_size = 2`: a step that expects six peers
matchmakes in B = 2 buckets (protocol/buckets.py), whose leaders meet the step coordinator, and
the step's three groups of two still commit one params hash (one step plan, crossgroup.py),
with no state download after a node's first round."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytestmark = pytest.mark.multiprocess

PEERS, GROUP, STEPS = 6, 2, 2
SPLIT = ["--set", f"sync.group_size={GROUP}", "--set", "train.inner_steps=10"]
WAIT = 240  # seconds, for six processes to start, catch up and run the steps on 2 loaded cores


def test_six_peers_in_two_buckets_commit_one_hash_per_step(swarm):
    first = swarm.start(0, extra=SPLIT)
    nodes = [first] + [swarm.start(i, [first.multiaddr], extra=SPLIT) for i in range(1, PEERS)]

    def bucketed_steps() -> dict[int, list[dict]]:
        """Steps that all six committed in groups of two and that went through buckets."""
        by_step: dict[int, list[dict]] = defaultdict(list)
        bucketed: set[int] = set()
        for node in nodes:
            bucketed.update(e["outer_step"] for e in node.events if e.get("event") == "bucket_closed")
            for event in node.rounds():
                if event["group_size"] == GROUP:
                    by_step[event["outer_step"]].append(event)
        return {step: events for step, events in by_step.items() if len(events) == PEERS and step in bucketed}

    first.wait_for(lambda _e: len(bucketed_steps()) >= STEPS, WAIT)
    for step, events in sorted(bucketed_steps().items()):
        assert len({e["params_sha256"] for e in events}) == 1, (step, [e["params_sha256"][:8] for e in events])
    closed = [e for node in nodes for e in node.events if e.get("event") == "bucket_closed"]
    assert {e["bucket"] for e in closed} <= {"b2.0", "b2.1"} and any(e["coordinated"] for e in closed)
    for node in nodes:
        first_round = next(i for i, e in enumerate(node.events) if e.get("event") == "round_done")
        later = [e for e in node.events[first_round:] if e.get("event") == "state_downloaded"]
        assert not later, f"{node.name} downloaded the state after its first round: {later}"
        assert node.proc.poll() is None, f"{node.name} exited"
