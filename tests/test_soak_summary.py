"""bench/soak.py without processes: the memory reader, the summary and its RESULTS.md section.

The soak itself runs minutes (hundreds of rounds, restarts); here only its bookkeeping, so that
the numbers it reports keep their meaning (the flatness slope, which samples count).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
soak = pytest.importorskip("soak")


def sample(node: int, step: int, rss: float, life: int = 1, rounds_in_life: int = 1) -> dict:
    processes = {"main": {"rss_mb": rss, "pss_mb": rss / 2, "threads": 10},
                 "dht": {"rss_mb": 200.0, "pss_mb": 130.0, "threads": 1}}
    return {"kind": "sample", "node": node, "life": life, "outer_step": step, "rounds_in_life": rounds_in_life,
            "processes": processes, "total_rss_mb": rss + 200.0, "total_pss_mb": rss / 2 + 130.0}


def test_memory_reads_this_process_as_main() -> None:
    got = soak.memory(os.getpid())
    assert got["main"]["rss_mb"] > 10 and got["main"]["pss_mb"] > 0
    assert soak.memory(2**22 + 7) == {}  # gone (pid beyond pid_max): nothing, no error


def test_summary_skips_starting_processes_and_measures_the_slope() -> None:
    samples = [sample(0, step, 500.0 + step * 0.1) for step in range(0, 200, 5)]  # +10 MB per 100 rounds
    samples += [sample(1, 15, 520.0), sample(1, 20, 100.0, life=2, rounds_in_life=0),  # restarted, still starting
                sample(1, 25, 510.0, life=2), sample(1, 190, 515.0, life=2)]
    summary = soak.summarize(samples, peers=2, warmup=40)
    assert summary["peer0_rss_slope_mb_per_100_rounds"] == pytest.approx(10.0)
    assert summary["peer0_main_rss_slope_mb_per_100_rounds"] == pytest.approx(10.0)
    assert summary["peer0_rss_slope_second_half_mb_per_100_rounds"] == pytest.approx(10.0)
    peer1 = summary["nodes"]["peer-1"]
    assert peer1["at_round_20"]["outer_step"] == 25 and peer1["at_round_20"]["life"] == 2
    assert peer1["at_end"]["outer_step"] == 190
    record = {"bench": "soak", "kind": "summary", "command": "python bench/soak.py", "env": {}, "peers": 2,
              "inner_steps": 5, "batch_size": 4, "seq_len": 64, "churn_every": 20, "rounds": 200, "restarts": 9,
              "wall_seconds": 600.0, "notes": [], "run_id": "r1", "warmup": 40, **summary}
    text = "\n".join(soak.soak_section([record]))
    assert "**200 rounds, 9 restarts**" in text and "| peer-1 | round 20 | 25 | 2 | 510 (255) | 200 (130) |" in text
    assert "slope +10.0 MB per 100 rounds" in text
    assert soak.soak_section([]) == ["## 6. Soak: memory over hundreds of rounds with churn", "", "Not run.", ""]
