"""A swarm larger than `group_size` splits into several groups per round and stays one swarm."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

pytestmark = pytest.mark.multiprocess

PEERS, GROUP = 6, 3
SMALL = ["--set", f"sync.group_size={GROUP}", "--set", "train.inner_steps=10"]


def latest_hash_per_step(node) -> dict[int, str]:
    """The params hash a node finally held for each step (its round result or the state it adopted)."""
    held = {}
    for event in node.events:
        if event.get("event") in ("round_done", "state_downloaded"):
            held[event["outer_step"]] = event["params_sha256"]
    return held


def test_six_peers_with_group_size_three_average_in_two_groups(swarm):
    first = swarm.start(0, extra=SMALL)
    nodes = [first] + [swarm.start(i, [first.multiaddr], extra=SMALL) for i in range(1, PEERS)]

    def split_steps() -> list[int]:
        # Steps at which two different groups of three each committed their own average.
        results = defaultdict(Counter)
        for node in nodes:
            for e in node.rounds():
                if e["group_size"] == GROUP:
                    results[e["outer_step"]][e["params_sha256"]] += 1
        return sorted(step for step, c in results.items() if sorted(c.values()) == [GROUP, GROUP])

    first.wait_for(lambda _e: bool(split_steps()), 400)
    split = split_steps()[0]

    # After a split round the swarm agrees again: at that step or a later one, every peer holds
    # the same parameters (the smaller group's peers adopt the winning state and carry their own
    # contribution in their residual).
    def agreed_after_split(_event) -> bool:
        finals = [latest_hash_per_step(node) for node in nodes]
        common = set.intersection(*(set(f) for f in finals))
        return any(s >= split and len({f[s] for f in finals}) == 1 for s in common)

    first.wait_for(agreed_after_split, 400)
    for node in nodes:
        assert node.proc.poll() is None, f"{node.name} exited"
