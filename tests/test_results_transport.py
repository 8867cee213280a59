"""bench/results.py's transport goal lines: a configuration below 0.8 whose agents kept the
machine's cores busy says so with the ceiling the CPU alone allows; a link-bound miss does not."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import results  # noqa: E402


def row(peers: int, mbit: float, efficiency: float, seconds: float, bound: float, cores_busy: float) -> dict:
    return {"impl": "lowcomm ring", "peers": peers, "payload_mb": 4, "mbit": mbit, "efficiency": efficiency,
            "seconds": seconds, "bound_seconds": bound, "machine": {"cores": 2},
            "rounds": [{"cpu_cores_busy": cores_busy, "seconds": seconds}]}


def test_a_cpu_bound_miss_gives_its_ceiling_and_a_link_bound_miss_does_not():
    goals: list[str] = []
    cpu_bound = row(8, 1000, 0.40, seconds=0.15, bound=0.06, cores_busy=1.8)  # 0.27 CPU s over 2 cores: 0.135 s
    link_bound = row(8, 100, 0.70, seconds=0.80, bound=0.56, cores_busy=0.9)
    results.transport_goals([cpu_bound, link_bound], [], "lowcomm ring", "Transport", goals)
    line = goals[0]
    assert "MISSED" in line
    assert "N=8 S=4 MB at 1000 Mbit/s (0.40; 1.80 of 2 cores busy, CPU ceiling 0.44)" in line
    assert "N=8 S=4 MB at 100 Mbit/s (0.70)" in line


def test_the_ceiling_is_capped_at_one_and_needs_the_machine_record():
    fast_cpu = row(4, 1000, 0.76, seconds=0.06, bound=0.048, cores_busy=1.6)  # floor 0.048 s: ceiling 1.0
    assert results._cpu_profile(fast_cpu) == "; 1.60 of 2 cores busy, CPU ceiling 1.00"
    assert results._cpu_profile({**fast_cpu, "machine": None}) == ""
