"""bench/results.py's section "Scale" from a sweep (sim/sweep.py's summaries): the goal lines
judge N=1,024 against N=16 as issue 15 defines them, met or MISSED with the profile of a miss,
and the figure is drawn next to the other plots (one command for the table, plot and goals)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summary(variant: str, peers: int, **figures: float) -> dict:
    row = {"variant": variant, "peers": peers, "rounds": 5, "matchmaking": "buckets",
           "mean_share_averaged": 1.0, "min_share_averaged": 1.0, "mean_form_p50_s": 8.0, "mean_form_p95_s": 12.0,
           "mean_dht_reads_per_peer": 18.0, "mean_dht_writes_per_peer": 18.0,
           "mean_dht_subkeys_read_per_peer": 250.0, "mean_dht_busiest_holder_requests": 500.0,
           "mean_busiest_peer_rpcs": 70.0, "mean_busiest_peer_joins": 40.0,
           "mean_busiest_peer_rpc_kinds": {"JoinGroup": 40.0, "Reduce": 15.0, "ReportShards": 15.0},
           "mean_bytes_per_peer_mb": 100.0, "mean_hashes": 1.0, "mean_consensus_distance": 0.0}
    return {**row, **figures}


def test_the_scale_goals_judge_n1024_against_n16_and_the_figure_is_drawn(tmp_path: Path) -> None:
    scale = tmp_path / "in" / "scale"
    scale.mkdir(parents=True)
    rows = [summary("allreduce-g16", 16),
            # Records read 14x N=16's and the busiest peer 1.3x: one goal missed, one met.
            summary("allreduce-g16", 1024, mean_dht_subkeys_read_per_peer=3500.0, mean_busiest_peer_rpcs=91.0,
                    mean_form_p95_s=12.3, mean_bytes_per_peer_mb=108.0),
            summary("gossip-k2", 1024, mean_consensus_distance=0.01, rounds_to_halve_consensus=1),
            # Groups of 64 cannot form at N=16: the miss says how the busiest peer moves from N=64 on.
            summary("allreduce-g64", 16, mean_group_size_median=16.0),
            summary("allreduce-g64", 64, mean_group_size_median=57.0, mean_busiest_peer_rpcs=220.0),
            summary("allreduce-g64", 1024, mean_group_size_median=64.0, mean_busiest_peer_rpcs=253.0)]
    (scale / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "results.py"), "--in-dir", str(tmp_path / "in"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    goal = next(line for line in text.splitlines() if line.startswith("- Scale (simulated, allreduce-g16"))
    assert "N=16 → N=1024" in goal and "**formation p95 within 2×: met** (12.0 → 12.3 s" in goal
    assert "**DHT records read per peer within 2×: MISSED** (250 → 3500 per round, 14.0×" in goal \
        and "round start" in goal  # with its profile
    assert "**Busiest peer's RPCs within 2×: met** (70 → 91, 1.30×; by method at N=1024: JoinGroup 40" in goal
    assert "**Bytes per peer flat (≤1.25×): met** (1.08×)" in goal
    g64 = next(line for line in text.splitlines() if line.startswith("- Scale (simulated, allreduce-g64"))
    assert "**Busiest peer's RPCs within 2×: MISSED** (70 → 253, 3.61×" in g64
    assert "from N=64, whose groups already hold 57 peers (N=16: 16): 220 → 253, 1.15×" in g64
    assert "consensus distance halves within log₂N = 10 rounds: met** (1 round(s))" in text
    assert "| allreduce-g16 | 1024 | 5 |" in text and "![scale](plots/scale.png)" in text
    assert (tmp_path / "plots" / "scale.png").stat().st_size > 0
