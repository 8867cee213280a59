#!/usr/bin/env python
"""Regenerate bench/RESULTS.md and bench/plots/*.png from the benchmarks' JSON lines.

    python bench/results.py [--in-dir bench/out] [--out bench/RESULTS.md] [--plots bench/plots]

Takes the newest run (``run_id``) of each benchmark in ``--in-dir`` (convergence.jsonl, convergence_long.jsonl
(all runs, newest per method, settings and seed: bench/long_records.py), outer_sweep.jsonl (all of it),
slow_links.jsonl, transport.jsonl, codecs.jsonl, overlap.jsonl, soak.jsonl, standard.jsonl), writes the tables, checks
the issue's goals against the numbers (met / missed, never asserted), draws the plots, and
appends bench/analysis.md (the hand-written reading of the profile of the committed run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import long_records
import plots
from common import BENCH, OUT, nearest_rank, now_iso, read_jsonl
from data_memory import results_section as data_memory_section
from outer_sweep_results import node_defaults
from outer_sweep_results import results_section as outer_sweep_section
from inner_lr_results import floor_text as inner_lr_floor
from inner_lr_results import results_section as inner_lr_section
from overlap_delay_results import profile_text as overlap_delay_profile
from overlap_delay_results import results_section as overlap_delay_section
from overlap import stable_meetings
from soak import soak_section

GOAL_LOSS = 0.04
GOAL_BYTES = 190
GOAL_EFFICIENCY = 0.8
# A round whose agents keep this share of the machine's cores busy is CPU-bound: its goal line says so.
CPU_BOUND_SHARE = 0.75
GOAL_SPEEDUP = 10
GOAL_UTILIZATION = 0.95
GOAL_OVERLAP_PENALTY = 0.01
GOAL_LONG_DEFAULT = 0.02  # issue 16: the default method within +2 % of ddp (mean of the seeds)
GOAL_LONG_SPARSE = 0.03  # sparseloco within +3 % of ddp ...
GOAL_LONG_SPARSE_BYTES = 1000  # ... at >= 1,000x fewer payload bytes per peer
LONG_DEFAULT_METHOD = "diloco-int8-H50"


def newest(records: list[dict]) -> list[dict]:
    records = [r for r in records if r.get("run_id")]
    if not records:
        return []
    run = max(r["run_id"] for r in records)
    return [r for r in records if r["run_id"] == run]


def by_method(records: list[dict]) -> dict[str, dict]:
    return {r["method"]: r for r in records if r.get("method")}  # the last record of a method wins


def f(value, digits: int = 3, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def mb(value) -> str:
    if value is None:
        return "–"
    if value >= 1e9:
        return f"{value / 1e9:.2f} GB"
    if value >= 1e6:
        return f"{value / 1e6:.2f} MB"
    return f"{value / 1e3:.1f} kB"


def _estimated(record: dict | None) -> bool:
    return bool(record and (record.get("time_to_target") or {}).get("estimated"))


def cell(record: dict) -> str:
    """Notes and error of a record, on one table line."""
    text = "; ".join(record.get("notes") or [])
    if record.get("error"):
        text += f" ERROR: {record['error'][-300:]}"
    return text.replace("\n", " ").replace("|", "/")


def failures(records: list[dict]) -> list[str]:
    """One line per failed run: what failed, the end of its error, where its logs are."""
    lines = []
    for r in records:
        if r.get("error"):
            what = r.get("method") or r.get("mode") or r.get("impl") or r.get("bench")
            where = f" at {r['mbit']:g} Mbit/s" if r.get("mbit") else ""
            last = r["error"].strip().splitlines()
            shown = last if len(last) <= 3 else [last[0], "…", *last[-2:]]
            lines.append(f"- **FAILED: {what}{where}** — {' / '.join(shown)[:400]}"
                         + (f" (logs: `{r['logs']}`)" if r.get("logs") else ""))
    return ["Runs that failed (the other runs of the set went on):", "", *lines, ""] if lines else []


def skip_note(records: list[dict], goals: list[str], goal: str) -> list[str] | None:
    """Where a benchmark was skipped (no namespaces here): the goal line and the section's text."""
    skipped = next((r["skipped"] for r in records if r.get("skipped")), None)
    if skipped is None:
        return None
    goals.append(f"- {goal}: not measured here ({skipped}).")
    return [f"Skipped: {skipped}.", ""]


def images(paths: list[Path]) -> list[str]:
    """Markdown image lines of the plots (relative to RESULTS.md), then a blank line."""
    return [*(f"![{path.stem}](plots/{path.name})" for path in paths), ""]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    return ["| " + " | ".join(header) + " |", align, *("| " + " | ".join(row) + " |" for row in rows), ""]


def machine_section(all_records: list[dict], standard: list[dict]) -> list[str]:
    source = next((r for r in all_records if r.get("machine")), None)
    lines = ["## Machine and commands", ""]
    if source:
        m = source["machine"]
        lines += [f"- Machine: {m['cores']} cores, CPU `{m['cpu_model']}`, Linux {m['kernel']}, Python {m['python']}, "
                  f"torch {m['torch']}, {'GPU ' + m['gpu'] if m.get('gpu') else 'no GPU'}. "
                  "Load average (1, 5, 15 min) when the runs started: "
                  + ", ".join(f"{r['bench']} {r['machine']['loadavg_at_start']}" for r in _first_per_bench(all_records))
                  + "."]
    runs: dict[tuple, str] = {}
    for r in all_records:
        if r.get("command"):
            key = (r["bench"], r.get("run_id"), r["command"])
            runs[key] = min(runs.get(key, r["date"]), r["date"])
    for (bench, run_id, command), date in sorted(runs.items(), key=lambda item: item[1]):
        lines.append(f"- `{command}` — {bench}, run {run_id}, first record {date}")
    if standard:
        steps = [r for r in standard if r["step"] != "total"]
        total = next((r for r in standard if r["step"] == "total"), None)
        lines += ["", "Standard set (`make bench`, i.e. `python bench/run_all.py`) run "
                  f"{standard[0]['run_id']}: " + ", ".join(f"{r['step']} {r['seconds']:.0f} s" for r in steps)
                  + (f"; **total {total['seconds'] / 60:.1f} min**" if total else "") + "."]
    return lines + [f"- This file was generated by `python bench/results.py` on {now_iso()}.", ""]


def _first_per_bench(records: list[dict]) -> list[dict]:
    seen, out = set(), []
    for r in records:
        if r.get("machine") and r["bench"] not in seen:
            seen.add(r["bench"])
            out.append(r)
    return out


def convergence_section(records: list[dict], plot_dir: Path, goals: list[str]) -> list[str]:
    lines = ["## 1. Convergence at equal tokens", ""]
    if not records:
        goals.append("- diloco-int8-H50 vs ddp: not measured (no convergence run in bench/out).")
        return lines + ["Not run.", ""]
    methods = by_method(records)
    ddp = methods.get("ddp") if (methods.get("ddp") or {}).get("final_eval_loss") else None
    # The peer count of a multi-peer method (single's record says 1).
    first = next((r for r in records if r.get("workload") and r.get("peers", 1) > 1), None) or next(
        (r for r in records if r.get("workload")), None)
    if first is None:
        goals.append("- diloco-int8-H50 vs ddp: not measured (every convergence run failed).")
        return lines + ["Every method failed.", "", *failures(records)]
    w = first["workload"]
    lines += [f"`tiny` preset (445,952 parameters), default corpus, {first['peers']} peers with one torch thread each, "
              f"{w['steps']} steps per peer of {w['batch_size']} × {w['seq_len']} tokens (global batch "
              f"{w['global_batch']} sequences; `single`: one process with the global batch), seed {w['seed']}. "
              f"Network: {first.get('link')}. Eval loss: the global model on the node's fixed held-out batches.", ""]
    rows = []
    for name, r in methods.items():
        app, wire = r.get("app_bytes_sent_per_peer"), r.get("wire_bytes_sent_per_peer")
        vs = None if not ddp or not r.get("final_eval_loss") else r["final_eval_loss"] / ddp["final_eval_loss"] - 1
        fewer_app = ddp["app_bytes_sent_per_peer"] / app if ddp and app else None
        ddp_wire = ddp.get("wire_bytes_sent_per_peer") if ddp else None
        fewer_wire = ddp_wire / wire if ddp_wire and wire else None
        est = "≈" if r.get("app_bytes_estimated") else ""
        rows.append([name, f(r.get("final_eval_loss"), 4), "–" if vs is None else f"{vs * 100:+.1f} %",
                     f(r.get("tokens")), est + mb(app) if app else ("0" if app == 0 else "–"), mb(wire),
                     "–" if fewer_app is None else f"{fewer_app:,.0f}×",
                     "–" if fewer_wire is None else f"{fewer_wire:,.0f}×",
                     f(r.get("wall_seconds"), 1), f(r.get("compute_utilization"), 2),
                     cell(r)])
    lines += table(["method", "final eval loss", "vs ddp", "tokens", "sent/peer (payload)", "sent/peer (wire)",
                    "fewer bytes than ddp (payload)", "(wire)", "wall-clock s", "compute util.", "notes"], rows)
    lines += ["- *payload*: what the method itself sends: the node's all-reduce counter (`round_done.bytes_sent`), "
              "the ring all-reduce volume for ddp (2·(N−1)/N·4·numel per step), an estimate for hivemind "
              "(≈: 2·(g−1)/g × its 8-bit payload for every round a peer logged as 'Averaged parameters with g "
              "peers'; hivemind counts nothing). *wire*: bytes the peer's "
              "interface transmitted (root-side veth counter; TCP/IP, gRPC/libp2p framing and DHT traffic "
              "included), only inside network namespaces.",
              "- *wall-clock*: from the moment all peers start training to the last evaluation; start-up of the "
              "processes is excluded for every method; ddp/single leave their own evaluation time out, the "
              "DiLoCo node evaluates inside its round and that time is included.",
              "- *compute utilization*: share of a peer's wall-clock spent in its own forward/backward/optimizer "
              "steps (ddp: outside the gradient all-reduce; DiLoCo: inside inner phases, from the node's debug "
              "line that starts a round; hivemind: outside steps in which the epoch moved). Four peers share "
              "two cores, so every process is also descheduled about half the time; that is not separated.",
              ""]
    lines += failures(records)
    lines += images(plots.convergence(records, plot_dir))
    target = methods.get("diloco-int8-H50")
    if ddp and target and target.get("final_eval_loss"):
        gap = target["final_eval_loss"] / ddp["final_eval_loss"] - 1
        ratio_app = ddp["app_bytes_sent_per_peer"] / target["app_bytes_sent_per_peer"] if target.get(
            "app_bytes_sent_per_peer") else None
        ratio_wire = (ddp["wire_bytes_sent_per_peer"] / target["wire_bytes_sent_per_peer"]
                      if target.get("wire_bytes_sent_per_peer") and ddp.get("wire_bytes_sent_per_peer") else None)
        loss_ok, bytes_ok = gap <= GOAL_LOSS, (ratio_app or 0) >= GOAL_BYTES
        goals.append(f"- **diloco-int8-H50 within 4 % of ddp's final eval loss: {'met' if loss_ok else 'MISSED'}** "
                     f"({target['final_eval_loss']:.4f} vs {ddp['final_eval_loss']:.4f}, {gap * 100:+.1f} %). "
                     f"**≥190× fewer bytes per peer: {'met' if bytes_ok else 'MISSED'}** ({f(ratio_app, 0)}× fewer "
                     f"payload bytes" + (f", {ratio_wire:.0f}× fewer bytes on the wire" if ratio_wire else "") + ").")
    else:
        missing = [m for m, r in (("ddp", ddp), ("diloco-int8-H50", target))
                   if not (r and r.get("final_eval_loss"))]
        goals.append(f"- diloco-int8-H50 vs ddp: **not measured** ({', '.join(missing)} missing or failed; "
                     "see section 1).")
    return lines


SHORT_RUN = 0.95  # a run whose model holds less than this share of the tokens it was given lost rounds


def _nominal_tokens(record: dict) -> float | None:
    w = record.get("workload") or {}
    if not all(w.get(k) for k in ("steps", "global_batch", "seq_len")):
        return None
    return w["steps"] * w["global_batch"] * w["seq_len"]


def seed_summary(records: list[dict]) -> tuple[float | None, dict[str, dict], list[dict]]:
    """Per method over its seeds: the eval loss at equal tokens (mean, min, max) and mean bytes.

    Equal tokens: the most tokens every complete record reached, each curve linearly
    interpolated there (DiLoCo evaluates once per outer step, the baselines every few steps).
    A run whose model ended with fewer than SHORT_RUN of the tokens its peers trained on (rounds
    that failed, e.g. under load) would drag every method back to its last point; it is left out
    of the means and returned as the third value, to be listed."""
    ok = [r for r in records if r.get("ok", True) and r.get("curve")]
    short = [r for r in ok if _nominal_tokens(r) and max(p["tokens"] for p in r["curve"]) < SHORT_RUN * _nominal_tokens(r)]
    ok = [r for r in ok if r not in short]
    if not ok:
        return None, {}, short
    tokens = min(max(p["tokens"] for p in r["curve"]) for r in ok)
    methods: dict[str, dict] = {}
    for r in ok:
        loss = loss_at([(p["tokens"], p["eval_loss"]) for p in r["curve"] if p.get("eval_loss") is not None], tokens)
        # A row is the record's label (method and settings, bench/long_records.py) where it has one.
        m = methods.setdefault(r.get("label", r["method"]), {"losses": [], "seeds": [], "app": [], "wire": []})
        if loss is not None:
            m["losses"].append(loss)
            m["seeds"].append(r.get("seed", (r.get("workload") or {}).get("seed")))
        for key, field in (("app", "app_bytes_sent_per_peer"), ("wire", "wire_bytes_sent_per_peer")):
            if r.get(field) is not None:
                m[key].append(r[field])
    for m in methods.values():
        losses = m["losses"]
        m["mean"] = statistics.fmean(losses) if losses else None
        m["min"], m["max"] = (min(losses), max(losses)) if losses else (None, None)
        m["app_mean"] = statistics.fmean(m["app"]) if m["app"] else None
        m["wire_mean"] = statistics.fmean(m["wire"]) if m["wire"] else None
    return tokens, methods, short


def _seeds(n: int) -> str:
    return f"{n} seed" + ("" if n == 1 else "s")


def long_convergence_section(records: list[dict], goals: list[str], plot_dir: Path | None = None,
                             current: tuple[float, float] | None = None,
                             sweep_records: list[dict] = ()) -> list[str]:
    """``records``: the long benchmark's records combined across runs (long_records.combine: each
    with its row in ``label``); ``current``: the node's outer defaults (the default method's row);
    ``sweep_records``: the emulator's (outer_sweep.jsonl), for the profile of a missed goal."""
    lines = ["## 1b. Long convergence, mean and range over seeds (`python bench/convergence.py --long`)", ""]
    tokens, methods, short = seed_summary(records)
    if not methods:
        goals.append(f"- {LONG_DEFAULT_METHOD} within +2 % of ddp, sparseloco within +3 % at ≥1,000× fewer "
                     "bytes (long benchmark, 3 seeds): **not measured** (no run in bench/out/convergence_long.jsonl).")
        return lines + ["Not run.", "", *failures(records)]
    current = current or node_defaults()
    first = next(r for r in records if r.get("workload"))
    w = first["workload"]
    lines += [f"{w['preset']} preset, {first.get('peers', 4)} peers, {w['steps']} steps per peer of "
              f"{w['batch_size']} × {w['seq_len']} tokens; eval loss of the global model at {tokens:,.0f} tokens "
              "(equal for every method), mean and range over the seeds. A method meets a goal only on the mean. "
              "The rows combine the runs below, the newest record per method, settings and seed. A node method's "
              "row names the outer lr / momentum it ran with: records written before commit 2519153 carry none "
              f"and ran with the defaults of then ({long_records.outer_text(long_records.OLD_OUTER)}); "
              f"the node's defaults are {long_records.outer_text(current)} now.", ""]
    for run in sorted({r.get("run_id") for r in records if r.get("run_id")}):
        mine = [r for r in records if r.get("run_id") == run]
        loads = [r["machine"]["loadavg_at_start"][0] for r in mine if (r.get("machine") or {}).get("loadavg_at_start")]
        commands = "; ".join(f"`{c}`" for c in dict.fromkeys(r.get("command") for r in mine))
        lines.append(f"- run {run}: {commands} ({len(mine)} record{'s' if len(mine) != 1 else ''}"
                     + (f", 1-minute load average {min(loads):.1f}" + (f"–{max(loads):.1f} at their starts"
                                                                        if max(loads) > min(loads) else " at its start")
                        if loads else "")
                     + ")")
    lines.append("")
    ddp = methods.get("ddp", {})
    rows = []
    for name, m in sorted(methods.items(), key=lambda item: long_records.row_order(item[0])):
        vs = m["mean"] / ddp["mean"] - 1 if ddp.get("mean") and m["mean"] else None
        fewer = ddp["app_mean"] / m["app_mean"] if ddp.get("app_mean") and m["app_mean"] else None
        rows.append([name, ", ".join(str(s) for s in sorted(m["seeds"])), f(m["mean"], 4),
                     f"{f(m['min'], 4)} – {f(m['max'], 4)}", "–" if vs is None else f"{vs * 100:+.1f} %",
                     mb(m["app_mean"]) if m["app_mean"] is not None else "–", mb(m["wire_mean"]),
                     "–" if fewer is None else f"{fewer:,.0f}×"])
    lines += table(["method", "seeds", "eval loss (mean)", "range", "vs ddp (mean)", "sent/peer (payload)",
                    "(wire)", "fewer payload bytes than ddp"], rows)
    for r in short:
        last = max(r["curve"], key=lambda p: p["tokens"])
        lines.append(f"- Left out of the means: **{r.get('label', r['method'])} seed {r.get('seed')}**, whose model "
                     f"ended with {last['tokens']:,.0f} of the {_nominal_tokens(r):,.0f} tokens its peers trained on "
                     f"(rounds that failed or were skipped); eval loss {f(last.get('eval_loss'), 4)} at that point.")
    lines += [""] if short else []
    lines += failures(records)
    if plot_dir is not None:
        used = [r for r in records if r.get("ok", True) and r.get("curve") and r not in short]
        groups: dict[str, list[dict]] = {}
        for r in sorted(used, key=lambda r: long_records.row_order(r.get("label", r["method"]))):
            groups.setdefault(r.get("label", r["method"]), []).append(r)
        lines += ["Eval loss vs tokens and vs payload bytes per peer (log scale): the mean over the seeds as a "
                  "line, their range as a band.", "", *images(plots.long_convergence(groups, plot_dir))]

    def gap(name: str) -> float | None:
        m = methods.get(name, {})
        return m["mean"] / ddp["mean"] - 1 if ddp.get("mean") and m.get("mean") else None

    default_row = f"{LONG_DEFAULT_METHOD} (default {long_records.outer_text(current)})"
    old_row = f"{LONG_DEFAULT_METHOD} (old defaults {long_records.outer_text(long_records.OLD_OUTER)})"
    old_gap = gap(old_row)
    old_text = "" if old_gap is None else (f"; the old defaults {old_gap * 100:+.1f} % on "
                                           f"{_seeds(len(methods[old_row]['losses']))}")
    default_gap = gap(default_row)
    floor = inner_lr_floor(sweep_records)
    if default_gap is None:
        goals.append(f"- {default_row} within +2 % of ddp (long, mean of seeds): **not measured**{old_text}.")
    else:
        goals.append(f"- **{default_row} within +2 % of ddp (long benchmark, mean of "
                     f"{_seeds(len(methods[default_row]['losses']))}): "
                     f"{'met' if default_gap <= GOAL_LONG_DEFAULT else 'MISSED'}** ({default_gap * 100:+.1f} %"
                     f"{old_text}{'; ' + floor if floor and default_gap > GOAL_LONG_DEFAULT else ''}).")
    # The method's current default α first (long_records labels it), else any sparseloco row.
    sparse = next((n for n in methods if n.startswith("sparseloco") and "(default" in n),
                  next((n for n in methods if n.startswith("sparseloco")), None))
    sparse_gap = gap(sparse) if sparse else None
    if sparse_gap is None:
        goals.append("- sparseloco within +3 % of ddp at ≥1,000× fewer payload bytes (long): **not measured**.")
    else:
        m = methods[sparse]
        fewer = ddp["app_mean"] / m["app_mean"] if ddp.get("app_mean") and m["app_mean"] else 0
        met = sparse_gap <= GOAL_LONG_SPARSE and fewer >= GOAL_LONG_SPARSE_BYTES
        goals.append(f"- **{sparse} within +3 % of ddp at ≥1,000× fewer payload bytes (long, mean of "
                     f"{len(m['losses'])} seeds): {'met' if met else 'MISSED'}** ({sparse_gap * 100:+.1f} %, "
                     f"{fewer:,.0f}× fewer).")
    return lines + [""]


def _count(value) -> int:
    """A figure recorded either as a number or as the list of its cases."""
    return len(value) if isinstance(value, (list, dict)) else int(value)


def real_swarm_lines(path: Path) -> list[str]:
    """The newest real-swarm summary per N and matchmaking (bench/real_swarm.py): real processes next to sim/."""
    newest_by_n: dict[tuple[int, str], dict] = {}
    for r in read_jsonl(path):
        if r.get("kind") == "summary" and r.get("steps_measured"):  # a run that measured no step has no row
            # Records written before the field (and before buckets became the default) say it
            # only through their settings.
            buckets = "sync.matchmaking_buckets=true" in (r.get("settings") or [])
            newest_by_n[(r["peers"], r.get("matchmaking") or ("buckets" if buckets else "single level"))] = r
    if not newest_by_n:
        return []
    rows = []
    for (n, matchmaking), r in sorted(newest_by_n.items()):
        rows.append([str(n), str(r["group_size"]), matchmaking, str(r["steps_measured"]), f(r["share_averaged_mean"], 2),
                     str(_count(r["steps_with_more_than_one_hash"])), str(_count(r["downloads_after_first_round"])),
                     f"{f(r['matchmaking_p50_s'], 2)} / {f(r['matchmaking_p95_s'], 2)}",
                     mb(r.get("bytes_total_per_round_median") or (r["bytes_sent_per_round_median"]
                                                                  + r["bytes_received_per_round_median"])),
                     f(r.get("dht_gets_per_peer_round_median"), 1), f(r.get("dht_stores_per_peer_round_median"), 1),
                     f(r.get("grpc_handled_per_round_busiest"), 1), f(r.get("join_group_per_round_busiest"), 0)])
    first = newest_by_n[min(newest_by_n)]
    return ["Real processes (`python bench/real_swarm.py --peers N --group-size 8 --rounds 10 --inner-steps 10`, "
            "tiny model, one torch thread each, loopback; every step split into groups of 8): figures over the "
            f"steps every node committed. Settings of the newest run: {' '.join(first.get('settings') or [])}; "
            "*buckets*: the same with `--set sync.matchmaking_buckets=true`. "
            "The simulator at the same N and settings: bench/analysis.md (\"Scale\").", "",
            *table(["N", "group size", "matchmaking", "steps", "share averaged", "steps with >1 hash", "downloads after first round",
                    "formation p50 / p95 s", "bytes/peer/round", "DHT gets/peer/round", "DHT stores/peer/round",
                    "busiest peer's calls/round", "busiest JoinGroup/round"], rows)]


SCALE_CURRENT = ("allreduce-g16", "allreduce-g64", "gossip-k2")  # the protocol now (buckets for large steps)
SCALE_BEFORE = ("single-level-g16", "single-level-g64")  # one leader per (step, hash): bench/out/scale/single-level/
SCALE_WHATIF = ("allreduce-g16-catchup",)  # labelled what-ifs of sim/whatif.py


def _round_means(path: Path) -> dict[str, float]:
    """Means over the rounds after the first of a run's round lines (failures by reason among them)."""
    rounds = [r for r in read_jsonl(path) if r.get("round", 0) > 0]
    if not rounds:
        return {}
    out: dict[str, float] = {}
    for key in ("groups", "busiest_peer_rpcs", "busiest_peer_joins", "downloads_behind", "downloads_minority",
                "hashes", "live", "averaged", "skipped_shards"):
        out[key] = sum(r.get(key, 0) for r in rounds) / len(rounds)
    spreads = [r["commit_spread_s"] for r in rounds if r.get("commit_spread_s") is not None]
    out["commit_spread_max_s"] = max(spreads, default=0.0)
    for reason in ("behind", "matchmaking", "no_group"):
        out[f"failed_{reason}"] = sum(r.get("failed", {}).get(reason, 0) for r in rounds) / len(rounds)
    return out


def _scale_goals(rows: dict[tuple[str, int], dict], variant: str, out_dir: Path) -> list[str]:
    """Issue 15's goals for ``variant``, N=16 against N=1,024 as the issue defines them (against
    its largest N when 1,024 was not run), each met/MISSED with the profile of a miss; the
    largest N beyond 1,024 is reported beside them."""
    import math

    small, ns = rows.get((variant, 16)), sorted(n for v, n in rows if v == variant)
    target = 1024 if 1024 in ns else (ns[-1] if ns else 16)
    big = rows.get((variant, target))
    if not (small and big) or target == 16:
        return [f"- Scale goals ({variant}): **not measured** (the sweep lacks N=16 and a larger N)."]
    n, p = big["peers"], _round_means(out_dir / f"{variant}-N{big['peers']}.jsonl")
    beyond = rows.get((variant, ns[-1])) if ns[-1] > target else None

    def ratio(key: str, row: dict | None = None) -> float:
        return (row or big)[key] / small[key] if small[key] else math.inf

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def also(key: str, unit: str = "", digits: int = 0) -> str:
        """The same figure at the largest N beyond the goal's, if one was run."""
        return f"; N={beyond['peers']}: {beyond[key]:.{digits}f}{unit}" if beyond else ""

    def kinds(row: dict) -> str:
        by_method = row.get("mean_busiest_peer_rpc_kinds") or {}
        names = {"Team": "stage-2 streams"}
        return ", ".join(f"{names.get(k, k)} {v:.0f}" for k, v in sorted(by_method.items(), key=lambda kv: -kv[1]) if v)

    dht = (big["mean_dht_reads_per_peer"] + big["mean_dht_writes_per_peer"]) / (
        small["mean_dht_reads_per_peer"] + small["mean_dht_writes_per_peer"])
    share_ok, rpc_ok = big["mean_share_averaged"] >= 0.95, ratio("mean_busiest_peer_rpcs") <= 2
    line = (f"- Scale (simulated, {variant}, N=16 → N={n}): **formation p95 within 2×: "
            f"{verdict(ratio('mean_form_p95_s') <= 2)}** ({small['mean_form_p95_s']:.1f} → {big['mean_form_p95_s']:.1f} s"
            f"{also('mean_form_p95_s', ' s', 1)}; a plan closes by its earliest member's matchmaking deadline, 30 s). "
            f"**≥95 % of live peers average: {verdict(share_ok)}** "
            f"({big['mean_share_averaged']:.2f}, min {big['min_share_averaged']:.2f}{also('mean_share_averaged', '', 2)})")
    if not share_ok and p:
        line += (f": per round {p['failed_matchmaking']:.0f} rounds failed in matchmaking (their bucket reached the "
                 f"step coordinator after the step's one plan closed; {p['hashes']:.1f} hashes per step) and "
                 f"{p['failed_behind']:.0f} of {p['live']:.0f} live peers found the swarm past their step (`behind`, "
                 f"then {p['downloads_behind']:.0f} downloads): the step's groups committed up to "
                 f"{p['commit_spread_max_s']:.0f} s apart (p5–p95), against a 30 s matchmaking window "
                 f"({p['skipped_shards']:.0f} shards skipped per round)")
    records = ratio('mean_dht_subkeys_read_per_peer')
    line += (f". **DHT operations per peer within 2×: {verdict(dht <= 2)}** in count ({dht:.2f}×). "
             f"**DHT records read per peer within 2×: {verdict(records <= 2)}** "
             f"({small['mean_dht_subkeys_read_per_peer']:.0f} → {big['mean_dht_subkeys_read_per_peer']:.0f} per round, "
             f"{records:.1f}×; the busiest DHT holder's requests {ratio('mean_dht_busiest_holder_requests'):.0f}×, "
             "not a per-peer figure: every peer reads `<run>/progress` at each beat, so the few peers that hold "
             "that key serve O(N) requests per beat)")
    if records > 2:
        line += (": what is left, measured at N=1024 by key (sim/README.md, \"The heartbeat's reads\"): reads of "
                 "the whole `<run>/peers` table, one record per live peer, by the heartbeat (periodic: 16 records "
                 "per beat on average; at every beat while a single-level step's quorum may cut our phase; at every "
                 "beat for a step coordinator), by a leader at its first look, and at a round start outside a plan "
                 "(members of the last step's split plan start from the heartbeat's view, protocol/buckets.py "
                 "`bucketed_by_plan`); the progress marks are a few records per beat since the open marks of a step "
                 "have a key of their own, read only by peers training at that step. At N=16 a peer reads the 16-record table at every beat, so any design that "
                 "polls more than about 32 records per beat at N=1024 misses 2×: the goal needs the swarm's news "
                 "pushed to peers rather than polled (not built)")
    line += (". **Busiest peer's RPCs within 2×: "
             f"{verdict(rpc_ok)}** ({small['mean_busiest_peer_rpcs']:.0f} → {big['mean_busiest_peer_rpcs']:.0f}, "
             f"{ratio('mean_busiest_peer_rpcs'):.2f}×; by method at N={n}: {kinds(big)}")
    if beyond:
        line += (f"; N={beyond['peers']}: {beyond['mean_busiest_peer_rpcs']:.0f}, "
                 f"{ratio('mean_busiest_peer_rpcs', beyond):.1f}×, {kinds(beyond)}")
    line += ")"
    if not rpc_ok:
        # Where N=16 cannot form the variant's groups, say how the figure moves from the first N
        # whose groups are as large as they get (the miss's profile: the group size, not N).
        first_full = next((rows[(variant, m)] for m in ns if m > 16 and m < n
                           and rows[(variant, m)].get("mean_group_size_median", 0) > small.get("mean_group_size_median", 0)), None)
        if first_full is not None:
            line += (f"; from N={first_full['peers']}, whose groups already hold "
                     f"{first_full['mean_group_size_median']:.0f} peers (N=16: {small['mean_group_size_median']:.0f}): "
                     f"{first_full['mean_busiest_peer_rpcs']:.0f} → {big['mean_busiest_peer_rpcs']:.0f}, "
                     f"{big['mean_busiest_peer_rpcs'] / first_full['mean_busiest_peer_rpcs']:.2f}×")
        line += (": a peer's calls grow with its group's size g (2·(g − 1) Reduce and ReportShards inside a group, "
                 "and about g JoinGroup calls at a bucket's leader), which at N=16 is at most 16, and with √n at "
                 "the step coordinator (n/B JoinGroup calls from its bucket and B − 1 from the other buckets' "
                 "leaders, B ≈ √n) and at a team's reducer (about 2·√G stage-2 streams for G groups, "
                 "crossgroup.py); profile in sim/README.md")
    line += (f". **Bytes per peer flat (≤1.25×): {verdict(ratio('mean_bytes_per_peer_mb') <= 1.25)}** "
             f"({ratio('mean_bytes_per_peer_mb'):.2f}×{also('mean_bytes_per_peer_mb', ' MB', 1)}).")
    return [line]


def _drop_rows(markdown: str, shown: set[str]) -> str:
    """The table's rows whose (variant, N) is in ``shown`` ("variant/N"), header kept."""
    out = []
    for row in markdown.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) < 2 or not cells[1].isdigit() or f"{cells[0]}/{cells[1]}" in shown:
            out.append(row)
    return "\n".join(out)


def scale_section(sweep: Path, goals: list[str], plot_dir: Path | None = None) -> list[str]:
    """Section "Scale": the simulator's sweep (sim/, `python -m sim sweep`) and the issue 15 goals."""
    import math

    lines = ["## 8. Scale (simulated: `python -m sim sweep --variants allreduce-g16 allreduce-g64 gossip-k2`)", ""]
    if not sweep.exists():
        goals.append("- Scale goals at N=1024 (issue 15): **not measured** (no bench/out/scale/sweep.jsonl).")
        return lines + ["Not run.", ""]
    sys.path.insert(0, str(BENCH.parent))
    from sim.plot import VARIANTS as PLOTTED, draw  # the simulator's own figure and table
    from sim.sweep import table as sweep_table

    before = sweep.parent / "single-level" / "sweep.jsonl"
    sources = [before, sweep] if before.exists() else [sweep]  # later rows win: a re-run replaces the old sweep's
    rows: dict[tuple[str, int], dict] = {}
    for path in sources:
        for r in read_jsonl(path):
            rows[(r["variant"], r["peers"])] = r
    # A current all-reduce row from before buckets (sim/sweep.py now records "matchmaking") is left out.
    stale = {(v, n) for v, n in rows if v.startswith("allreduce-") and rows[(v, n)].get("matchmaking") != "buckets"}
    for key in stale:
        del rows[key]
    shown = {f"{v}/{n}" for v, n in rows}
    lines += ["The real Matchmaker (with its buckets for large steps, protocol/buckets.py), layout, split-step "
              "plan, decisions and gossip partner choice on a virtual-time loop with simulated DHT, links (80 % "
              "residential 10–100 Mbit/s up, 20 % datacenter) and 5 %/hour churn; tensors replaced by sizes (25 M "
              "parameters, int8, H=50). Means over the rounds after the first; what each column means: "
              "sim/README.md. `single-level-*`: the protocol before buckets (one leader per step and hash, "
              "bench/out/scale/single-level/, the sweep of commit ce0badd; the `single-level-g16` rows with a "
              "*share in majority* were re-run on the current code with `--single-level`), for comparison. "
              "`allreduce-g16-catchup`: a what-if (sim/whatif.py), not the node's behaviour. The `allreduce-*` "
              "rows use buckets, as the node does by default (`[sync] matchmaking_buckets`; README, \"Matchmaking\"). "
              "Peers pace their heartbeat's reads of the peer table as the node does (node/swarmpace.py; rows "
              "whose config says `unpaced_heartbeat` or lacks it read it at every beat).", "",
              _drop_rows(sweep_table(*sources, variants=set(SCALE_CURRENT + SCALE_BEFORE + SCALE_WHATIF)), shown), ""]
    if stale:
        lines += ["Not re-run with buckets yet: " + ", ".join(f"{v} N={n}" for v, n in sorted(stale)) + ".", ""]
    if plot_dir is not None and (figure := draw(sources, PLOTTED, plot_dir / "scale.png")) is not None:
        lines += images([figure])
    lines += real_swarm_lines(sweep.parent.parent / "real_swarm.jsonl")
    goals += _scale_goals(rows, "allreduce-g16", sweep.parent)
    if any(v == "allreduce-g64" and n > 16 for v, n in rows):
        goals += _scale_goals(rows, "allreduce-g64", sweep.parent)
    n = max((n for v, n in rows if v == "gossip-k2"), default=0)
    gossip = rows.get(("gossip-k2", n))
    if gossip and gossip.get("rounds_to_halve_consensus") is not None:
        halve = gossip["rounds_to_halve_consensus"]
        goals.append(f"- Scale (simulated gossip, N={n}): **consensus distance halves within log₂N = "
                     f"{math.log2(n):.0f} rounds: {'met' if halve <= math.log2(n) else 'MISSED'}** ({halve} round(s)).")
    return lines


def slow_links_section(records: list[dict], plot_dir: Path, goals: list[str]) -> list[str]:
    lines = ["## 2. Slow links: wall-clock to the target loss", ""]
    if (skipped := skip_note(records, goals, "20 Mbit/s time to target")) is not None:
        return lines + skipped
    runs = [r for r in records if r.get("method") and r.get("role") != "reference"]
    if not runs:
        goals.append("- Time to target on slow links: not measured (no slow-links run in bench/out).")
        return lines + ["Not run.", ""]
    target = next((r["target_loss"] for r in runs if r.get("target_loss")), None)
    lines += [f"Target: eval loss {f(target, 4)} (ddp's final eval loss on unlimited links, same workload). Every "
              f"peer in its own network namespace ({max(r.get('peers') or 0 for r in runs)} peers on a bridge), "
              "capped in both directions "
              "with tc tbf. " + tcp_note(runs), ""]
    rows = []
    for cap in sorted({r["mbit"] for r in runs}, reverse=True):
        here = [r for r in runs if r["mbit"] == cap]
        ddp = next((r for r in here if r["method"] == "ddp"), None)
        ddp_t = (ddp.get("time_to_target") or {}).get("wall") if ddp else None
        for r in here:
            t = (r.get("time_to_target") or {})
            wall = t.get("wall")
            how = "estimated (see notes)" if t.get("estimated") else ("reached" if wall is not None else "not reached")
            last = r["curve"][-1] if r.get("curve") else {}
            rows.append([f"{cap:g}", r["method"], f(wall, 1), how, f(t.get("tokens") or last.get("tokens")),
                         "–" if not (ddp_t and wall) else f"{ddp_t / wall:.1f}×",
                         "–" if t.get("estimated") else f(last.get("eval_loss"), 4), f(r.get("step_seconds_median"), 3),
                         cell(r)])
    lines += table(["Mbit/s", "method", "time to target s", "how", "tokens then (or at the end)", "ddp time / this",
                    "last eval loss", "ddp s/step", "notes"], rows)
    lines += failures(runs)
    lines += images(plots.slow_links(runs, plot_dir))
    slow = [r for r in runs if r["mbit"] == min(r["mbit"] for r in runs)]
    dil = next((r for r in slow if r["method"].startswith("diloco")), None)
    ddp = next((r for r in slow if r["method"] == "ddp"), None)
    hm = next((r for r in slow if r["method"] == "hivemind"), None)
    t = lambda r: (r.get("time_to_target") or {}).get("wall") if r else None  # noqa: E731
    if dil and dil.get("error"):
        goals.append(f"- {slow[0]['mbit']:g} Mbit/s time to target: **not measured**, the DiLoCo run failed "
                     "(see section 2).")
    elif dil and t(dil):
        vs_ddp = t(ddp) / t(dil) if t(ddp) else None
        beats_hm = t(hm) is None or t(dil) < t(hm)
        goals.append(f"- **{slow[0]['mbit']:g} Mbit/s, time to target ≥10× shorter than ddp: "
                     f"{'met' if vs_ddp and vs_ddp >= GOAL_SPEEDUP else 'MISSED'}** ({dil['method']} {t(dil):.0f} s, "
                     f"ddp {f(t(ddp), 0)} s{' (estimated)' if _estimated(ddp) else ''}"
                     f", {f(vs_ddp, 1)}×). **Shorter than hivemind: {'met' if beats_hm else 'MISSED'}** "
                     + (f"(hivemind {t(hm):.0f} s)." if t(hm) else
                        "(hivemind failed, see section 2)." if hm and hm.get("error") else
                        "(hivemind did not reach the target within its steps)."))
    else:
        goals.append(f"- {slow[0]['mbit']:g} Mbit/s time to target: **MISSED**, the DiLoCo run did not reach the "
                     "target loss within its step budget (see the table).")
    return lines


GOAL_EFFICIENCY_MEDIAN = 0.9  # issue 17: median over the grid's configurations...
CPU_BOUND_MBIT = 1000  # rows at this cap and above are CPU-bound on the 2-core machine: their load is noted


def _spread(record: dict) -> str:
    spread = record.get("seconds_spread")
    if not spread or record.get("seconds") is None:
        return f(record.get("seconds"), 2)
    return f"{record['seconds']:.2f} ({spread['min']:.2f}–{spread['max']:.2f})"


def _phases(record: dict) -> str:
    """Medians of the rounds' reduce-scatter / all-gather / agreement seconds (lowcomm's traces)."""
    parts = [r["phases"] for r in record.get("rounds", []) if r.get("phases")]
    if not parts:
        return "–"
    return " / ".join(f"{statistics.median(p[key] for p in parts):.2f}"
                      for key in ("reduce_scatter_s", "all_gather_s", "agreement_s"))


def _transport_note(record: dict) -> str:
    notes = []
    if not record.get("ok"):
        notes.append("failed or partial round(s): " + str([{k: v for k, v in r.items() if k != "phases"}
                                                           for r in record.get("rounds", [])])[:200])
    if (record.get("mbit") or 0) >= CPU_BOUND_MBIT and record.get("load_avg") is not None:
        notes.append(f"measured under load avg {record['load_avg']:.1f}")
    return "; ".join(notes)


def tcp_note(runs: list[dict]) -> str:
    """Which TCP congestion control the namespaces ran (bench/common.py BENCH_TCP_CONGESTION)."""
    names = sorted({r.get("tcp_congestion") or "not recorded" for r in runs})
    return (f"TCP congestion control in the namespaces: {', '.join(names)} (`--tcp-congestion`; volunteers' "
            "machines run a loss-based default, cubic, which a namespace here cannot use; this host's own is bbr, "
            "which runs before 2026-12-03 inherited: bench/README.md).")


SCHEDULE_LABELS = {"staggered": "butterfly", "all": "butterfly, all at once", "ring": "ring", "auto": "auto"}


def impl_label(record: dict) -> str:
    """``lowcomm <schedule>`` for the project's rows (bench/transport.py --schedule), else the impl."""
    if record.get("impl") != "lowcomm":
        return record.get("impl", "")
    schedule = record.get("schedule") or "staggered"
    return f"lowcomm {SCHEDULE_LABELS.get(schedule, schedule)}"


def transport_section(records: list[dict], slow: list[dict], plot_dir: Path, goals: list[str]) -> list[str]:
    lines = ["## 3. Transport efficiency: one averaging round vs 2·(N−1)/N·S/B", ""]
    goal = "Transport ≥0.90 of the bound (median) and ≥0.80 in every configuration"
    if (skipped := skip_note(records, goals, goal)) is not None:
        return lines + skipped
    broken = [r for r in records if r.get("error")]
    runs = [dict(r, impl=impl_label(r)) for r in records if r.get("impl") and not r.get("error")]
    if not runs:
        goals.append(f"- {goal}: **not measured** (see section 3).")
        return lines + (failures(broken) or ["Not run.", ""])
    queue = runs[0].get("queue")
    lines += ["One agent per network namespace (bench/transport_agent.py), every peer capped at B in both "
              "directions (tc tbf, 50 ms queue" + (", MTU-sized packets (`--queue router`)" if queue == "router" else
                                                   ", 64 kB GSO packets" if queue == "gso" else "") + "). "
              "`lowcomm butterfly`: the node's default all-reduce (protocol/allreduce.py, gRPC streams, "
              f"codec {runs[0]['codec']}, staggered schedule, the leader's layout with its pieces: "
              "protocol/layout.py); `lowcomm ring`: `[sync] schedule = \"ring\"` (protocol/ring.py: one stream per "
              "member to the next, equal chunks in pieces, layout.py `ring_pieces`; plain mean only, for members "
              "that trust each other); group given by the harness, fresh agents for every cap and schedule. "
              "`hivemind`: "
              "DecentralizedAverager, NoCompression, matchmaking excluded. Time: from the last member's start to the "
              "last member's end; median of the measured rounds, with min–max. " + tcp_note(runs), ""]
    rows = []
    for r in sorted(runs, key=lambda r: (not r["impl"].startswith("lowcomm"), r["impl"], r["mbit"] or 0, r["peers"],
                                         r["payload_mb"])):
        rows.append([r["impl"], str(r["peers"]), f"{r['payload_mb']:g}", f"{r['mbit']:g}" if r["mbit"] else "none",
                     _spread(r), f(r.get("bound_seconds"), 2), f(r.get("efficiency"), 2), f(r.get("bus_mbit"), 0),
                     _phases(r), mb(r.get("bytes_sent_per_peer")), mb(r.get("wire_bytes_sent_per_peer")),
                     f(_cores(r), 2), f(r.get("cpu_seconds_per_mb"), 4), _retrans(r), f(_median(r, "tbf_drops"), 0),
                     str(len(r.get("rounds", []))), _transport_note(r)])
    node_rows = [r for r in slow if r.get("method", "").startswith("diloco") and r.get("allreduce_seconds_median")]
    for r in node_rows:
        n = r["peers"]
        bound = 2 * (n - 1) / n * r["payload_bytes"] / (r["mbit"] * 1e6 / 8)
        seconds = r["allreduce_seconds_median"]
        rows.append([f"node ({r['method']})", str(n), f"{r['payload_bytes'] / 1e6:.2f}", f"{r['mbit']:g}",
                     f(seconds, 2), f(bound, 2), f(bound / seconds, 2),
                     f(r["payload_bytes"] * 8 / 1e6 / seconds * 2 * (n - 1) / n, 0), "–", "–", "–", "–", "–", "–",
                     "–", str(len(r.get("curve", []))),
                     "real nodes in the slow-link run: allreduce_seconds of round_done, median"])
    lines += table(["impl", "N", "S MB", "cap Mbit/s", "round s (min–max)", "bound s", "efficiency", "bus bw Mbit/s",
                    "scatter / gather / agree s", "sent/peer", "wire/peer", "CPU cores busy", "CPU s/MB",
                    "TCP retrans.", "tbf drops", "rounds", "notes"], rows)
    lines += ["*bus bw*: S/t · 2(N−1)/N as nccl-tests reports it (equals the cap at the bound). *scatter / gather / "
              "agree*: medians of when the last part reached its owner, how long after that the last average "
              "reached its member, and the shard agreement after it (the agents' stage timestamps). *CPU cores "
              "busy*: CPU seconds of all agents during the round per second of the round (the machine has 2 cores; "
              "near 2 the round is CPU-bound, not link-bound); *CPU s/MB*: CPU seconds of all agents per MB they "
              "sent (hardly depends on other load, unlike the times). *TCP retrans.*: share of the TCP segments the "
              "members sent that were retransmissions (/proc/net/snmp of each namespace); *tbf drops*: packets the "
              "members' caps dropped (both directions, `tc -s qdisc`); medians over the rounds. Rows at "
              f"{CPU_BOUND_MBIT:g} Mbit/s are CPU-bound here, so their times depend on what else ran: the load "
              "average at the end of each is in its notes.", ""]
    lines += failures(broken)
    lines += images(plots.transport(runs, plot_dir))
    for label in sorted({r["impl"] for r in runs if r["impl"].startswith("lowcomm")}):
        transport_goals([r for r in runs if r["impl"] == label and r.get("efficiency") is not None],
                        [h for h in runs if h["impl"] == "hivemind" and h.get("seconds")], label, goal, goals)
    return lines


def heterogeneous_section(records: list[dict]) -> list[str]:
    """Section 3b: one slow volunteer among fast peers (``bench/transport.py --slow-mbit``), the
    butterfly with equal shares, with shares by the members' measured uplinks, and the ring."""
    newest_per_row: dict[tuple, dict] = {}  # the newest run of every configuration (runs may cover a few each)
    for r in sorted((r for r in records if r.get("slow_mbit") and r.get("seconds") and not r.get("error")),
                    key=lambda r: r.get("run_id", "")):
        newest_per_row[(r["peers"], r["payload_mb"], r["mbit"], r["slow_mbit"], r["schedule"], r.get("layout"))] = r
    runs = list(newest_per_row.values())
    if not runs:
        return []
    first = runs[0]
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", "") for r in runs))
    commits = ", ".join(dict.fromkeys((r.get("code") or {}).get("commit", "?") for r in runs))
    lines = ["## 3b. One slow volunteer: shares by measured uplink (`python bench/transport.py --slow-mbit ...`)", "",
             f"As section 3, with the last member of each group capped at {first['slow_mbit']:g} Mbit/s and the others "
             f"at {first['mbit']:g} ({commands}; commit {commits}; TCP "
             f"{', '.join(sorted({r.get('tcp_congestion') or 'not recorded' for r in runs}))}). *equal*: every owner the same share; *measured*: "
             "shares cut by the bandwidth each member measured of its uplink in the round before "
             "(`AllReduceResult.upload_bps`, what a node declares and its leader lays shards out by, protocol/layout.py), "
             "after one round that is not counted. *bound*: the lower of the two schedules' bounds on these links "
             "(bench/transport.py `heterogeneous_bound`): at least S over the slow cap, since every member sends S or more. "
             "*estimated uplink*: the members' estimates in the measured rounds (`upload_bps`; a member declares the "
             "median of its last five), median over rounds, fast members / the slow one "
             "(the caps' tbf counts what the uplink carries; an upload shares it with the member's result stages, "
             "so an estimate is below the cap).", ""]
    rows = []
    order = {"staggered": 0, "ring": 1, "auto": 2}
    for r in sorted(runs, key=lambda r: (r["peers"], r["payload_mb"], order.get(r["schedule"], 3), r.get("layout", ""))):
        rounds = r.get("rounds", [])
        slow_share = statistics.median(x["shares"][-1] for x in rounds) if rounds and rounds[0].get("shares") else None
        declared = "–"
        if r.get("layout") == "measured" and rounds and rounds[0].get("upload_bps"):
            fast = statistics.median(statistics.median(x["upload_bps"][:-1]) for x in rounds) * 8 / 1e6
            slow = statistics.median(x["upload_bps"][-1] for x in rounds) * 8 / 1e6
            declared = f"{fast:.0f} / {slow:.0f} Mbit/s"
        label = "ring" if r["schedule"] == "ring" else f"butterfly, {r.get('layout', 'equal')} shares"
        if r["schedule"] == "auto":
            rings = sum(x.get("ran") == "ring" for x in rounds)
            label = f"auto (ring in {rings} of {len(rounds)} rounds)"
        rows.append([label, str(r["peers"]), f"{r['payload_mb']:g}", f"{r['mbit']:g} / {r['slow_mbit']:g}", _spread(r),
                     f(r.get("bound_seconds"), 2), f(r.get("efficiency"), 2),
                     "–" if slow_share is None else f"{slow_share:.3f}", declared, str(len(rounds))])
    lines += table(["schedule", "N", "S MB", "caps Mbit/s (fast / slow)", "round s (min–max)", "bound s", "efficiency",
                    "slow member's share", "estimated uplink (fast / slow)", "rounds"], rows)
    return lines


def transport_goals(capped: list[dict], hivemind: list[dict], label: str, goal: str, goals: list[str]) -> None:
    """The goal lines of one lowcomm schedule: efficiency, and faster than hivemind where both ran."""
    if not capped:
        return
    below = [r for r in capped if r["efficiency"] < GOAL_EFFICIENCY]
    median = statistics.median(r["efficiency"] for r in capped)
    met = median >= GOAL_EFFICIENCY_MEDIAN and not below
    goals.append(f"- **{goal}, {label}: {'met' if met else 'MISSED'}** "
                 f"(median {median:.2f}, range {min(r['efficiency'] for r in capped):.2f}–"
                 f"{max(r['efficiency'] for r in capped):.2f} over {len(capped)} configurations"
                 + ("; below 0.8: " + ", ".join(f"N={r['peers']} S={r['payload_mb']:g} MB at {r['mbit']:g} Mbit/s "
                                               f"({r['efficiency']:.2f}{_cpu_profile(r)})" for r in below)
                    if below else "") + ").")
    both = [(r, h) for h in hivemind for r in capped
            if (r["peers"], r["payload_mb"], r["mbit"]) == (h["peers"], h["payload_mb"], h["mbit"])]
    if both:
        slower = [(r, h) for r, h in both if r["seconds"] >= h["seconds"]]
        goals.append(f"- **{label} faster than hivemind in every configuration both ran: "
                     f"{'met' if not slower else 'MISSED'}** ("
                     + ", ".join(f"{r['peers']}×{r['payload_mb']:g} MB at {r['mbit']:g} Mbit/s "
                                 f"{r['seconds']:.2f} s vs {h['seconds']:.2f} s" for r, h in both) + ").")


def overlap_section(records: list[dict], plot_dir: Path, goals: list[str],
                    others: dict[str, list[dict]] | None = None, sweep: list[dict] = ()) -> list[str]:
    """Section 5 from the newest run in overlap.jsonl; ``others``: the newest run of every other
    overlap-*.jsonl (other settings, e.g. a shorter H), summarized below it."""
    lines = ["## 5. Overlap on 20 Mbit/s links", ""]
    if (skipped := skip_note(records, goals, "Overlap utilization ≥0.95")) is not None:
        return lines + skipped
    runs = [r for r in records if r.get("mode")]
    if not runs:
        goals.append("- Overlap utilization ≥0.95: not measured (no `python bench/overlap.py` run in bench/out).")
        return lines + ["Not run (`python bench/overlap.py`, not part of `make bench`; see bench/README.md).", ""]
    if runs[0]["mbit"] != 20:
        lines[0] = f"## 5. Overlap on {runs[0]['mbit']:g} Mbit/s links"
    penalty, at_common, common_tokens = overlap_penalties(runs)
    lines += overlap_summary(runs, penalty)
    rows = []
    for r in runs:
        key = (r["mode"], r.get("seed", 0))
        p = penalty.get(key)
        rows.append([r["mode"], str(r.get("seed", 0)), f(r.get("utilization_window_median"), 3),
                     f(r.get("utilization_window_min"), 3), f(r.get("utilization_since_start_median"), 3),
                     f(r.get("eval_outer_step")), f(r.get("eval_loss"), 4), f(r.get("tokens_in_model")),
                     f(common_tokens.get(r.get("seed", 0))), f(at_common.get(key), 4),
                     "–" if p is None else f"{p * 100:+.2f} %", f(r.get("round_seconds_median"), 2),
                     str(sum(r.get("round_late") or [])), str(sum(r.get("rounds_without_result") or [])),
                     f(r.get("wall_seconds"), 1), cell(r)])
    lines += ["Every run:", ""]
    lines += table(["overlap", "seed", "compute util. (window, median)", "(window, min peer)", "since start (gauge)",
                    "outer step", "eval loss", "tokens in model", "equal tokens", "eval loss there", "vs none",
                    "round s (median)", "round_late", "rounds without result", "wall-clock s", "notes"], rows)
    lines += ["- *compute util. (window)*: per peer, seconds in inner steps (`round_done.train_seconds`) per "
              "second of wall-clock (`round_done.train_clock`) from its second to its last round, both taken by "
              "the node at the end of an inner phase; the first round (start-up, first matchmaking) is left out. "
              "*since start*: the node's `lowcomm_compute_utilization_ratio` at its last round "
              "(`round_done.compute_utilization`), which counts from the moment the node starts training (after "
              "start-up and its first catch-up), so its first matchmaking is in it.",
              "- *tokens/s, all peers*: tokens trained per wall-clock second, summed over the peers, over the "
              "same window as the utilization (`round_done.tokens_total` against `train_clock`).",
              "- *eval loss*: the global model after the last outer step; *tokens in model*: what the peers' Δs "
              "stood for (`round_done.tokens_averaged`, each peer's weight in its rounds), summed over peers and "
              "rounds. Overlapped peers end an inner phase early when the round of their step already started "
              "elsewhere, so their outer steps hold fewer tokens: the penalty (*vs none*) compares the eval loss "
              "at equal tokens (the most tokens every mode of that seed reached), linearly interpolated between "
              "outer steps, against blocking rounds with the same seed. *round_late*: times a node's training "
              "waited for a background round more than one step late (all peers together; blocking rounds never "
              "log it).", ""]
    lines += failures(runs)
    first_seed = min(r.get("seed", 0) for r in runs)
    lines += images(plots.overlap([r for r in runs if r.get("seed", 0) == first_seed], plot_dir))
    overlap_goals(runs, penalty, goals, sweep)
    for name, other in (others or {}).items():
        other_runs = [r for r in other if r.get("mode")]
        if not other_runs:
            continue
        other_penalty, _, _ = overlap_penalties(other_runs)
        lines += [f"### Other settings: bench/out/{name}", ""]
        lines += overlap_summary(other_runs, other_penalty)
        lines += failures(other_runs)
        overlap_goals(other_runs, other_penalty, goals, sweep)
    return lines


def overlap_summary(runs: list[dict], penalty: dict) -> list[str]:
    """The settings of an overlap run and one summary row per mode (means over its seeds)."""
    r0 = runs[0]
    seeds = sorted({r.get("seed", 0) for r in runs})
    sets = f"; node settings: `{' '.join(r0['node_sets'])}`" if r0.get("node_sets") else ""
    lines = [f"`lowcomm-node join` × {r0['peers']} in network namespaces, every peer capped at {r0['mbit']:g} "
             f"Mbit/s both ways; H={r0['inner_steps']}, {r0['batch_size']} × {r0['seq_len']} tokens per step, "
             f"codec {r0['codec']}, {r0['rounds']} outer rounds per mode, seeds {', '.join(map(str, seeds))} "
             f"(data order and initial weights; the same identities in every run). Only `[sync] overlap` "
             f"differs{sets}. Command: `{r0.get('command', 'python bench/overlap.py')}`. {tcp_note(runs)}", ""]
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine, utils, pens = mode_numbers(runs, mode, penalty)
        mins = [r["utilization_window_min"] for r in mine if r.get("utilization_window_min") is not None]
        shown = bool(pens) and mode != "none"
        rates = [rate for r in mine if (rate := swarm_tokens_per_second(r)) is not None]
        rows.append([mode, f(statistics.mean(utils) if utils else None, 3), f(min(mins) if mins else None, 3),
                     f(statistics.mean(rates) if rates else None, 0),
                     f"{statistics.mean(pens) * 100:+.2f} %" if shown else "–",
                     f"{min(pens) * 100:+.2f} … {max(pens) * 100:+.2f} %" if shown else "–",
                     str(sum(sum(r.get("round_late") or []) for r in mine)),
                     str(sum(sum(r.get("rounds_without_result") or []) for r in mine)),
                     matchmaking_quantiles(mine), str(len(mine))])
    return lines + table(["overlap", "compute util. (window, mean over seeds)", "(lowest peer, any seed)",
                          "tokens/s, all peers (window, mean)", "eval-loss penalty vs none (mean)", "(range over seeds)", "round_late",
                          "rounds without result", "matchmaking s p50 / p95", "runs"], rows) + [
        "*matchmaking s*: `round_done.matchmaking_seconds` of every round but each peer's first, all seeds "
        "pooled (nearest rank): how long a group that stays together takes to meet again (protocol/direct.py).", ""]


def matchmaking_quantiles(runs: list[dict]) -> str:
    """p50 / p95 of the matchmaking seconds of every peer's rounds after its first, over ``runs``."""
    meets = stable_meetings(runs)
    if not meets:
        return "–"
    return f"{nearest_rank(meets, 0.5):.3f} / {nearest_rank(meets, 0.95):.3f}"


def mode_numbers(runs: list[dict], mode: str, penalty: dict) -> tuple[list[dict], list[float], list[float]]:
    """The runs of ``mode``, their utilizations (window, median over peers) and their penalties."""
    mine = [r for r in runs if r["mode"] == mode]
    utils = [r["utilization_window_median"] for r in mine if r.get("utilization_window_median") is not None]
    pens = [penalty[(mode, r.get("seed", 0))] for r in mine if penalty.get((mode, r.get("seed", 0))) is not None]
    return mine, utils, pens


def swarm_tokens_per_second(record: dict) -> float | None:
    """Tokens trained per wall-clock second by all peers together, over the same window as the
    utilization (from each peer's 2nd to its last round, by its phase-end clock)."""
    rates = []
    for events in record.get("peer_rounds") or []:
        if len(events) >= 3 and events[-1].get("train_clock") is not None:
            first, last = events[1], events[-1]
            if last["train_clock"] > first["train_clock"]:
                rates.append((last["tokens_total"] - first["tokens_total"]) / (last["train_clock"] - first["train_clock"]))
    return sum(rates) if rates else None


def overlap_goals(runs: list[dict], penalty: dict, goals: list[str], sweep: list[dict] = ()) -> None:
    """The goal lines of one overlap run: utilization ≥0.95 and penalty ≤1 % per overlapped mode;
    ``sweep``: the emulator's records (outer_sweep.jsonl), for the profile of a missed penalty."""
    r0 = runs[0]
    _, none_u, _ = mode_numbers(runs, "none", penalty)
    for mode in dict.fromkeys(r["mode"] for r in runs):
        if mode == "none":
            continue
        _, utils, pens = mode_numbers(runs, mode, penalty)
        where = f"at {r0['mbit']:g} Mbit/s, H={r0['inner_steps']}" + (f" (`{' '.join(r0['node_sets'])}`)"
                                                                      if r0.get("node_sets") else "")
        if not utils:
            goals.append(f"- Overlap `{mode}` {where}: **not measured** (the runs failed; see section 5).")
            continue
        u = statistics.mean(utils)
        mean_pen = statistics.mean(pens) if pens else None
        goals.append(f"- **Overlap `{mode}` {where}, compute utilization ≥0.95: "
                     f"{'met' if u >= GOAL_UTILIZATION else 'MISSED'}** ({u:.3f}, mean of {len(utils)} seed(s); "
                     f"blocking rounds: {f(statistics.mean(none_u) if none_u else None, 3)}). "
                     f"**Eval-loss penalty at equal tokens ≤1 %: "
                     + ("not measured**" if mean_pen is None else
                        f"{'met' if mean_pen <= GOAL_OVERLAP_PENALTY else 'MISSED'}** ({mean_pen * 100:+.2f} % mean, "
                        f"{min(pens) * 100:+.2f} … {max(pens) * 100:+.2f} % over {len(pens)} seed(s)"
                        + (f"; {why}" if mode == "delayed" and mean_pen > GOAL_OVERLAP_PENALTY
                           and (why := overlap_delay_profile(sweep, r0["inner_steps"], GOAL_OVERLAP_PENALTY)) else "")
                        + ")") + ".")


def overlap_penalties(runs: list[dict]) -> tuple[dict, dict, dict]:
    """Per (mode, seed): the eval-loss penalty against blocking rounds of the same seed, at the
    most tokens every mode of that seed reached; also the losses there and those token counts."""
    penalty: dict[tuple[str, int], float | None] = {}
    at_common: dict[tuple[str, int], float | None] = {}
    common_tokens: dict[int, float | None] = {}
    for seed in sorted({r.get("seed", 0) for r in runs}):
        mine = [r for r in runs if r.get("seed", 0) == seed]
        curves = {r["mode"]: [(p["tokens_in_model"], p["eval_loss"]) for p in r.get("eval_curve") or []
                              if p.get("tokens_in_model")] for r in mine}
        common = min((max(t for t, _ in c) for c in curves.values() if c), default=None)
        common_tokens[seed] = common
        for mode, curve in curves.items():
            at_common[(mode, seed)] = loss_at(curve, common)
        base = at_common.get(("none", seed))
        for mode in curves:
            loss = at_common[(mode, seed)]
            penalty[(mode, seed)] = loss / base - 1 if loss is not None and base else None
    return penalty, at_common, common_tokens


def loss_at(curve: list[tuple[float, float]], tokens: float | None) -> float | None:
    """The eval loss at ``tokens`` on a (tokens, loss) curve, linearly interpolated; None outside it."""
    points = sorted(curve)
    if tokens is None or not points or not points[0][0] <= tokens <= points[-1][0]:
        return None
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return points[-1][1]


def _median(record: dict, key: str) -> float | None:
    values = [r[key] for r in record.get("rounds", []) if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cores(record: dict) -> float | None:
    return _median(record, "cpu_cores_busy")


def _cpu_profile(record: dict) -> str:
    """How far the agents' CPU alone lets a row get on this machine: their CPU seconds of a round
    spread over all its cores is a floor under the round's time, so bound / floor is a ceiling on
    the efficiency that no schedule can pass here (empty where the CPU is not near its limit)."""
    cores_busy, cores = _cores(record), (record.get("machine") or {}).get("cores")
    if not cores_busy or not cores or not record.get("bound_seconds") or cores_busy < CPU_BOUND_SHARE * cores:
        return ""
    floor = cores_busy * record["seconds"] / cores
    return f"; {cores_busy:.2f} of {cores} cores busy, CPU ceiling {min(1.0, record['bound_seconds'] / floor):.2f}"


def _retrans(record: dict) -> str:
    value = _median(record, "tcp_retrans_fraction")
    return "–" if value is None else f"{value * 100:.1f} %"


def codecs_section(records: list[dict]) -> list[str]:
    lines = ["## 4. Codecs", ""]
    if not records:
        return lines + ["Not run.", ""]
    lines += [f"`{records[0]['command']}`: one tensor of {records[0]['numel']:,} float32 values, one thread; "
              "MB/s of float32 input (median); see bench/README.md for the method.", ""]
    rows = [[r["codec"], f(r["encode_MBps"], 0), f(r["decode_MBps"], 0), f(r["ratio"], 3), f"{r['rel_error']:.3g}"]
            for r in records]
    return lines + table(["codec", "encode MB/s", "decode MB/s", "ratio", "rel. error"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-dir", type=Path, default=OUT)
    parser.add_argument("--out", type=Path, default=BENCH / "RESULTS.md")
    parser.add_argument("--plots", type=Path, default=None, help="default: plots/ next to --out")
    parser.add_argument("--analysis", type=Path, default=BENCH / "analysis.md")
    args = parser.parse_args(argv)
    plot_dir = args.plots or args.out.parent / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    conv = newest(read_jsonl(args.in_dir / "convergence.jsonl"))
    slow = newest(read_jsonl(args.in_dir / "slow_links.jsonl"))
    trans = newest(read_jsonl(args.in_dir / "transport.jsonl"))
    cod = newest(read_jsonl(args.in_dir / "codecs.jsonl"))
    over = newest(read_jsonl(args.in_dir / "overlap.jsonl"))
    other_overlap = {path.name: newest(read_jsonl(path)) for path in sorted(args.in_dir.glob("overlap-*.jsonl"))}
    standard = newest(read_jsonl(args.in_dir / "standard.jsonl"))
    soak_run = newest(read_jsonl(args.in_dir / "soak.jsonl"))  # summary and samples
    soak = [r for r in soak_run if r.get("kind") == "summary"]
    goals: list[str] = []
    # The long benchmark: every run combined (newest per row and seed), with the outer sweep's
    # real-node confirmation where it trained the same workload (bench/long_records.py).
    confirm = read_jsonl(args.in_dir / "outer_sweep_confirm.jsonl")
    long_all = read_jsonl(args.in_dir / "convergence_long.jsonl")
    reference = next((r for r in long_all if r.get("workload")), None)
    current = node_defaults()
    long_run = long_records.combine(
        long_all + [r for r in confirm if reference and long_records.same_workload(r, reference)], current)
    # Section 1c compares the emulator with the real node's records of the old defaults.
    old_default = [r for r in long_run if long_records.outer_settings(r) == long_records.OLD_OUTER]
    sweep = read_jsonl(args.in_dir / "outer_sweep.jsonl")
    body = (convergence_section(conv, plot_dir, goals)
            + long_convergence_section(long_run, goals, plot_dir, current, sweep)
            + outer_sweep_section(sweep, old_default, seed_summary(long_run)[1],
                                  [r for r in long_all if r.get("method") == LONG_DEFAULT_METHOD
                                   and long_records.outer_settings(r) == current] + confirm)
            + inner_lr_section(sweep)
            + slow_links_section(slow, plot_dir, goals)
            + transport_section(trans, slow, plot_dir, goals)
            + heterogeneous_section(read_jsonl(args.in_dir / "transport_heterogeneous.jsonl"))
            + codecs_section(cod)
            + overlap_section(over, plot_dir, goals, other_overlap, sweep)
            + overlap_delay_section(sweep) + soak_section(soak_run)
            + data_memory_section(read_jsonl(args.in_dir / "data_memory.jsonl"))
            + scale_section(args.in_dir / "scale" / "sweep.jsonl", goals, plot_dir))
    lines = ["# Benchmark results", "",
             "Generated from the JSON lines in bench/out/ by `python bench/results.py`; how each number is "
             "measured is in bench/README.md. Goals are reported, not asserted.", ""]
    lines += machine_section(conv + slow + trans + cod + over + soak, standard)
    lines += ["## Goals", "", *goals, ""]
    lines += body
    if args.analysis.exists():
        lines += ["## Analysis", "", args.analysis.read_text().strip(), ""]
    args.out.write_text("\n".join(lines).rstrip("\n") + "\n")
    print(f"wrote {args.out} and plots in {plot_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
