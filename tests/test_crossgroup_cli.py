"""Six real `lowcomm-node` processes with `[sync] group_size = 3`: every step splits into two
groups of three, and both groups commit one params hash by arithmetic (protocol/crossgroup.py),
not by the minority downloading the majority's state."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow: make test stays under 15 min

PEERS, GROUP, STEPS = 6, 3, 3
SPLIT = ["--set", f"sync.group_size={GROUP}", "--set", "train.inner_steps=10"]
WAIT = 240  # seconds, for six processes to start, catch up and run three split steps on 2 cores


def test_two_groups_per_step_commit_one_hash_and_nobody_downloads_after_catching_up(swarm):
    first = swarm.start(0, extra=SPLIT)
    nodes = [first] + [swarm.start(i, [first.multiaddr], extra=SPLIT) for i in range(1, PEERS)]

    def split_steps() -> dict[int, list[dict]]:
        """Steps at which all six peers committed a round in groups of three (so two groups)."""
        by_step: dict[int, list[dict]] = defaultdict(list)
        for node in nodes:
            for event in node.rounds():
                if event["group_size"] == GROUP:
                    by_step[event["outer_step"]].append(event)
        return {step: events for step, events in by_step.items() if len(events) == PEERS}

    first.wait_for(lambda _e: len(split_steps()) >= STEPS, WAIT)
    steps = split_steps()
    for step, events in sorted(steps.items()):
        assert len({e["params_sha256"] for e in events}) == 1, (step, [e["params_sha256"][:8] for e in events])
    for node in nodes:
        first_round = next(i for i, e in enumerate(node.events) if e.get("event") == "round_done")
        later = [e for e in node.events[first_round:] if e.get("event") == "state_downloaded"]
        assert not later, f"{node.name} downloaded the state after its first round: {later}"
        assert node.proc.poll() is None, f"{node.name} exited"
