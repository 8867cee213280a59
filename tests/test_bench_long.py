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
import long_records  # noqa: E402
import plots  # noqa: E402
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
    assert any("diloco-int8-H50 (default 1.0/0.5) within +2 % of ddp (long, mean of seeds): **not measured**" in g
               for g in goals)


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
    assert (got["sync_method"], got["outer_lr"], got["outer_momentum"]) == ("sparseloco", 1.0, 0.0)
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


@pytest.mark.parametrize("method,node_method,optimizer", [("desloc-H50", "desloc", "adamw"),
                                                          ("mtdao-H50", "mtdao", "mtdao")])
def test_the_state_sync_methods_run_the_node_method_with_int8_and_record_their_outer_settings(
        monkeypatch, tmp_path, method, node_method, optimizer):
    seen = {}

    def fake_run_diloco(work, net, logdir, codec, h, rounds, target, time_limit, extra_sets):
        seen.update(codec=codec, h=h, rounds=rounds, sets=extra_sets)
        return {"method": f"diloco-{codec}-H{h}", "curve": []}

    monkeypatch.setattr(convergence, "run_diloco", fake_run_diloco)
    assert convergence.parse_methods(f"ddp,{method}") == ["ddp", method]
    assert method in convergence.LONG.split(",")
    work = convergence.workload_from(type("A", (), dict(peers=2, steps=100, batch_size=4, seq_len=32, preset="tiny",
                                                        seed=0, eval_every=5))())
    got = convergence.run_method(method, work, None, tmp_path, 60)
    assert seen == {"codec": "int8", "h": 50, "rounds": 2, "sets": [f"sync.method={node_method}"]}
    # What the nodes run: the node's own config of these flags (the method picks the optimizer).
    config = work.config(extra=["train.inner_steps=50", "sync.codec=int8", *seen["sets"]])
    assert config.sync.method == node_method and config.train.optimizer == optimizer and config.sync.state_sync
    assert (got["method"], got["sync_method"]) == (method, node_method)
    assert (got["outer_lr"], got["outer_momentum"]) == (config.sync.outer_lr, config.sync.outer_momentum)
    got = convergence.run_method(method, work, None, tmp_path, 60, node_sets=["sync.outer_momentum=0.9"])
    assert got["outer_momentum"] == 0.9 and seen["sets"] == [f"sync.method={node_method}", "sync.outer_momentum=0.9"]


def long_record(method: str, seed: int, run: str, date: str, loss: float, **fields) -> dict:
    r = record(method, seed, [(0, 4.0), (1000, loss)], 1e7)
    r.update(run_id=run, date=date, network="netns", **fields)
    return r


OLD, NEW = "2026-12-01T11:30:00+00:00", "2026-12-01T16:40:00+00:00"  # before and after the change of defaults


def test_old_default_records_are_labelled_apart_from_the_new_defaults():
    current = (1.0, 0.5)
    label = lambda r: long_records.label(r, current)  # noqa: E731
    old = long_record("diloco-int8-H50", 0, "r1", OLD, 2.0)  # no outer fields: the defaults of then
    assert long_records.outer_settings(old) == (0.7, 0.9)
    assert label(old) == "diloco-int8-H50 (old defaults 0.7/0.9)"
    new = long_record("diloco-int8-H50", 0, "r3", NEW, 1.9, outer_lr=1.0, outer_momentum=0.5)
    assert label(new) == "diloco-int8-H50 (default 1.0/0.5)"
    # --set flags of that time say what ran; after the change a record without either is unknown.
    confirm = long_record("diloco-int8-H50", 0, "r2", "2026-12-01T15:56:00+00:00", 1.8,
                          node_sets=["sync.outer_lr=1.0", "sync.outer_momentum=0.5"])
    assert label(confirm) == label(new)
    assert label(long_record("diloco-int8-H50", 0, "r2", OLD, 2.0, node_sets=["sync.outer_momentum=0.5"])) == \
        "diloco-int8-H50 (outer lr 0.7 / momentum 0.5)"
    assert label(long_record("diloco-int8-H50", 0, "r2", NEW, 2.0)) == "diloco-int8-H50 (outer settings not recorded)"
    # Baselines carry no outer label, SparseLoCo its step size α (its own outer rule); other --set flags show.
    assert label(long_record("ddp", 0, "r1", OLD, 1.7)) == "ddp"
    alpha = long_records.current_sparseloco_alpha()
    assert label(long_record("sparseloco-H20", 0, "r1", OLD, 2.1)) == (  # no α recorded: the old default's
        "sparseloco-H20 (default α 1.5)" if alpha == 1.5 else "sparseloco-H20 (α 1.5)")
    assert label(long_record("sparseloco-H20", 0, "r3", NEW, 2.0, outer_lr=alpha, outer_momentum=0.0)) == \
        f"sparseloco-H20 (default α {alpha:g})"
    assert label(long_record("sparseloco-H20", 0, "r3", NEW, 2.0, node_sets=["sync.outer_lr=7"])) == "sparseloco-H20 (α 7)"
    assert label(long_record("desloc-H50", 0, "r3", NEW, 1.9, outer_lr=1.0, outer_momentum=0.5,
                             node_sets=["sync.method=desloc", "sync.state_codec=fp32"])) == \
        "desloc-H50 (default 1.0/0.5) [sync.state_codec=fp32]"


def test_rows_combine_runs_taking_the_newest_record_per_method_settings_and_seed(tmp_path):
    current = (1.0, 0.5)
    outer = {"outer_lr": 1.0, "outer_momentum": 0.5}
    records = [
        long_record("ddp", 0, "r1", OLD, 1.70), long_record("ddp", 1, "r1", OLD, 1.72),
        long_record("diloco-int8-H50", 0, "r1", OLD, 1.85), long_record("diloco-int8-H50", 1, "r1", OLD, 1.87),
        long_record("ddp", 1, "r2", NEW, 1.71),  # a newer ddp seed 1 replaces the older one
        long_record("diloco-int8-H50", 1, "r3", NEW, 1.80, **outer),
        long_record("diloco-int8-H50", 2, "r3", NEW, 1.82, **outer),
        # A newer failure does not hide the complete record of the same row and seed.
        {**long_record("diloco-int8-H50", 2, "r4", NEW, 9.9, **outer), "ok": False, "curve": [], "error": "boom"},
        long_record("mtdao-H50", 0, "r4", NEW, 1.95, **outer),
    ]
    combined = long_records.combine(records, current)
    rows = {(r["label"], r["seed"]): (r["run_id"], r["curve"][-1]["eval_loss"]) for r in combined}
    assert rows == {("ddp", 0): ("r1", 1.70), ("ddp", 1): ("r2", 1.71),
                    ("diloco-int8-H50 (old defaults 0.7/0.9)", 0): ("r1", 1.85),
                    ("diloco-int8-H50 (old defaults 0.7/0.9)", 1): ("r1", 1.87),
                    ("diloco-int8-H50 (default 1.0/0.5)", 1): ("r3", 1.80),
                    ("diloco-int8-H50 (default 1.0/0.5)", 2): ("r3", 1.82),
                    ("mtdao-H50 (default 1.0/0.5)", 0): ("r4", 1.95)}
    goals: list[str] = []
    text = "\n".join(results.long_convergence_section(combined, goals, tmp_path, current))
    # ddp's mean is (1.70 + 1.71) / 2; the goal uses the current default's rows, not the old ones.
    assert "| diloco-int8-H50 (default 1.0/0.5) | 1, 2 | 1.8100 | 1.8000 – 1.8200 | +6.2 % |" in text
    assert "| diloco-int8-H50 (old defaults 0.7/0.9) | 0, 1 | 1.8600 |" in text
    assert text.index("(default 1.0/0.5) | 1, 2") < text.index("| mtdao-H50") < text.index("(old defaults 0.7/0.9) |")
    assert any("diloco-int8-H50 (default 1.0/0.5) within +2 % of ddp (long benchmark, mean of 2 seeds): MISSED"
               in g and "+6.2 %; the old defaults +9.1 % on 2 seeds" in g for g in goals)
    assert "![long_convergence_tokens](plots/long_convergence_tokens.png)" in text
    assert "boom" not in text  # the failed record lost to the complete one


def test_the_long_plots_draw_mean_and_range_per_row(tmp_path):
    def rec(seed: int, losses: list[float], step_bytes: float) -> dict:
        return {"peers": 4, "curve": [{"tokens": t, "eval_loss": loss, "app_bytes_sent": step_bytes * (i + 1)}
                                      for i, (t, loss) in enumerate(zip((100, 200, 300), losses))]}
    band = plots._seed_band([rec(0, [3.0, 2.0, 1.0], 10), rec(1, [3.0, 2.4, 1.4], 30)], lambda p: p["app_bytes_sent"])
    xs, mean, low, high = band
    assert xs == pytest.approx([20, 40, 60]) and mean == pytest.approx([3.0, 2.2, 1.2])
    assert low == pytest.approx([3.0, 2.0, 1.0]) and high == pytest.approx([3.0, 2.4, 1.4])
    groups = {"ddp": [rec(0, [3.0, 2.0, 1.0], 1e6)], "single": [rec(0, [3.1, 2.1, 1.1], 0)]}
    paths = plots.long_convergence(groups, tmp_path / "plots")
    assert [p.name for p in paths] == ["long_convergence_tokens.png", "long_convergence_bytes.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in paths)
