"""The figures of bench/real_swarm.py from synthetic node events (no processes: the bench itself
is not a test). What it must get right: groups counted from the sizes, distinct hashes per
step, and a node's first catch-up told apart from a later download."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("real_swarm", BENCH / "real_swarm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


class FakeNode:
    def __init__(self, name: str, events: list[dict[str, Any]]) -> None:
        self.name, self.events = name, events

    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "round_done"]


def done(step: int, size: int, digest: str, mm: float = 1.0) -> dict[str, Any]:
    return {"event": "round_done", "outer_step": step, "group_size": size, "params_sha256": digest * 8,
            "matchmaking_seconds": mm, "round_seconds": 2.0, "bytes_sent": 10, "bytes_received": 20,
            "skipped_shards": 0}


def test_step_figures_count_groups_hashes_and_only_later_downloads():
    bench = load_bench()
    catch_up = {"event": "state_downloaded", "outer_step": 1}
    nodes = [FakeNode(f"peer-{i}", ([catch_up] if i else []) + [done(2, 2, "aa"), done(3, 2, "bb" if i < 2 else "cc")])
             for i in range(4)]
    nodes[3].events.append({"event": "state_downloaded", "outer_step": 3})  # the minority's download
    nodes[3].events.append(done(4, 1, "dd"))
    steps = {s["outer_step"]: s for s in bench.step_records(nodes, peers=4)}
    assert steps[2]["groups"] == {"2": 2.0} and steps[2]["hashes"] == 1 and steps[2]["share_averaged"] == 1.0
    assert steps[3]["hashes"] == 2 and steps[3]["hash_counts"] == [2, 2]
    assert steps[3]["downloads_after_first_round"] == 1 and steps[2]["downloads_after_first_round"] == 0
    assert steps[4]["solo"] == 1 and steps[4]["groups"] == {} and steps[4]["share_averaged"] == 0.0
    assert [len(bench.later_downloads(n)) for n in nodes] == [0, 0, 0, 1]
    assert bench.group_rounds(nodes[3]) == 2


def test_percentile_is_nearest_rank():
    bench = load_bench()
    assert bench.percentile([], 0.5) is None
    assert bench.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert bench.percentile([float(i) for i in range(1, 21)], 0.95) == 19.0


def test_a_run_says_whether_its_nodes_matchmade_in_buckets_default_included():
    from lowcomm.node.config_sections import SyncSection

    bench = load_bench()
    assert bench.buckets_on([]) is SyncSection().matchmaking_buckets  # the node's default decides
    assert bench.buckets_on(["sync.matchmaking_buckets=false"]) is False
    assert bench.buckets_on(["sync.matchmaking_buckets=false", "sync.matchmaking_buckets=True"]) is True
