"""The long convergence benchmark's seeds and its mean-and-range summary (bench/convergence.py
--long, bench/results.py section 1b), without running the long benchmark itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import convergence  # noqa: E402
import results  # noqa: E402


def record(method: str, seed: int, points: list[tuple[int, float]], app: float) -> dict:
    return {"bench": "convergence", "run_id": "r1", "method": method, "seed": seed, "ok": True,
            "command": "python bench/convergence.py --long", "peers": 4, "app_bytes_sent_per_peer": app,
            "workload": {"preset": "tiny", "steps": 1000, "batch_size": 8, "seq_len": 128, "seed": seed},
            "curve": [{"tokens": t, "eval_loss": loss} for t, loss in points]}


def test_seed_summary_compares_at_equal_tokens_with_mean_and_range():
    records = [
        # ddp evaluates often and runs past the others' last point: read at 1,000 tokens.
        record("ddp", 0, [(0, 4.0), (500, 3.0), (1500, 2.0)], 1e9),
        record("ddp", 1, [(0, 4.0), (1000, 2.0)], 1e9),
        record("sparseloco-H20", 0, [(0, 4.0), (1000, 2.2)], 1e5),
        record("sparseloco-H20", 1, [(0, 4.0), (1000, 2.6)], 1e5),
        {"bench": "convergence", "run_id": "r1", "method": "diloco-int8-H50", "seed": 0, "ok": False,
         "curve": [], "error": "peer-2: boom"},
    ]
    tokens, methods, short = results.seed_summary(records)
    assert short == []  # the workload here has no global_batch: nothing counts as short
    assert tokens == 1000
    ddp = methods["ddp"]
    assert ddp["losses"] == [pytest.approx(2.5), 2.0] and ddp["mean"] == pytest.approx(2.25)
    assert (ddp["min"], ddp["max"]) == (2.0, pytest.approx(2.5))
    sparse = methods["sparseloco-H20"]
    assert sparse["mean"] == pytest.approx(2.4) and sparse["seeds"] == [0, 1]
    assert "diloco-int8-H50" not in methods  # a failed run has no curve: listed as failed instead

    goals: list[str] = []
    lines = "\n".join(results.long_convergence_section(records, goals))
    assert "| sparseloco-H20 | 0, 1 | 2.4000 | 2.2000 – 2.6000 | +6.7 % | 100.0 kB | – | 10,000× |" in lines
    assert "**FAILED: diloco-int8-H50** — peer-2: boom" in lines
    # +6.7 % misses the +3 % goal although 10,000x fewer bytes meets the bytes part.
    assert any("sparseloco-H20 within +3 %" in g and "MISSED" in g and "10,000× fewer" in g for g in goals)
    assert any("diloco-int8-H50 within +2 % of ddp (long, mean of seeds): **not measured**" in g for g in goals)


def test_the_named_sparseloco_method_sets_its_codec_and_outer_rule(monkeypatch, tmp_path):
    seen = {}

    def fake_run_diloco(work, net, logdir, codec, h, rounds, target, time_limit, extra_sets):
        seen.update(codec=codec, h=h, rounds=rounds, sets=extra_sets)
        return {"method": f"diloco-{codec}-H{h}", "curve": []}

    monkeypatch.setattr(convergence, "run_diloco", fake_run_diloco)
    work = convergence.workload_from(type("A", (), dict(peers=2, steps=40, batch_size=4, seq_len=32, preset="tiny",
                                                        seed=0, eval_every=5))())
    got = convergence.run_method("sparseloco-H20", work, None, tmp_path, 60, node_sets=["sync.outer_lr=1.0"])
    assert got["method"] == "sparseloco-H20"
    assert seen == {"codec": "sparseloco", "h": 20, "rounds": 2, "sets": ["sync.method=sparseloco", "sync.outer_lr=1.0"]}
    with pytest.raises(SystemExit, match="sparseloco-H<h>"):
        convergence.parse_methods("sparseloco-20")


@pytest.mark.multiprocess
def test_seeds_repeat_a_method_with_other_weights_and_data(tmp_path):
    out = tmp_path / "long.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "convergence.py"), "--methods", "single",
                           "--seeds", "1,2", "--network", "loopback", "--peers", "2", "--steps", "6",
                           "--batch-size", "2", "--eval-every", "3", "--json-out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seed"] for r in got] == [1, 2] and len({r["run_id"] for r in got}) == 1
    assert [r["workload"]["seed"] for r in got] == [1, 2]
    assert got[0]["curve"][0]["eval_loss"] != got[1]["curve"][0]["eval_loss"]  # other initial weights
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "convergence.py"), "--seeds", "0,x"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "expected comma-separated integers" in bad.stderr
