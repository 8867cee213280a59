"""RESULTS.md section 1c: the outer-optimizer sweep of bench/outer_sweep.py, and the default it picks.

bench/results.py calls ``results_section`` with the emulator's records (bench/out/outer_sweep.jsonl),
the newest long-benchmark run and that run's per-method summary (results.seed_summary), so that
the emulator is shown next to the real node for the same seeds and every row next to ddp.

The rule that may change the node's defaults (issue 16 item 5, as the lead's brief states it): a
configuration measured on at least 3 seeds replaces the default (H=50, outer lr and momentum of
node/config_sections.py) only if its mean over the same seeds is lower *and* its whole range lies
below the default's (the seed ranges do not overlap). Otherwise the defaults stay.
"""

from __future__ import annotations

import statistics
from typing import Any

DEFAULT_H = 50  # the node's [train] inner_steps
MIN_SEEDS = 3


def node_defaults() -> tuple[float, float]:
    """(outer_lr, outer_momentum) as node/config_sections.py has them now."""
    from lowcomm.node.config_sections import SyncSection

    fields = SyncSection.model_fields
    return float(fields["outer_lr"].default), float(fields["outer_momentum"].default)


Key = tuple[str, int, float, float]  # (codec, H, outer lr, momentum)


def _key(record: dict[str, Any]) -> Key:
    c = record["config"]
    return c["codec"], int(c["inner_steps"]), float(c["lr"]), float(c["momentum"])


def group_runs(records: list[dict[str, Any]]) -> dict[Key, dict[int, dict[str, Any]]]:
    """Configuration -> seed -> record, over complete runs of the long benchmark's workload (4 peers,
    1,000 steps, 8 × 128 tokens, tiny); the last record of a (configuration, seed) wins."""
    runs: dict[Key, dict[int, dict[str, Any]]] = {}
    for r in records:
        c = r.get("config") or {}
        if r.get("bench") != "outer_sweep" or not r.get("ok") or (c.get("peers"), c.get("steps"), c.get("batch_size"),
                                                                   c.get("seq_len"), c.get("preset")) != (4, 1000, 8, 128, "tiny"):
            continue
        runs.setdefault(_key(r), {})[int(c["seed"])] = r
    return runs


def summary(by_seed: dict[int, dict[str, Any]], seeds: list[int] | None = None) -> dict[str, Any] | None:
    """Mean, min and max of the final eval loss (all runs end at the same tokens) over ``seeds``."""
    seeds = sorted(by_seed) if seeds is None else [s for s in seeds if s in by_seed]
    losses = [by_seed[s]["final_eval_loss"] for s in seeds]
    if not losses:
        return None
    return {"seeds": seeds, "mean": statistics.fmean(losses), "min": min(losses), "max": max(losses),
            "tokens": by_seed[seeds[0]]["tokens"]}


def choose(runs: dict[Key, dict[int, dict[str, Any]]], default: Key) -> tuple[str, Key | None]:
    """The module docstring's rule: (the sentence that says what it decided, the key to adopt or None).

    The default's seeds S (at least MIN_SEEDS) are the comparison set. A configuration with a loss
    at or above the default's lowest on S can never have its range below the default's, whatever
    its other seeds give: it is out without them. One measured on all of S replaces the default if
    it passes the rule; any other one is pending (it needs the rest of S)."""
    base = runs.get(default, {})
    if len(base) < MIN_SEEDS:
        return f"not decided: the default has {len(base)} seed(s), the rule needs {MIN_SEEDS}.", None
    seeds = sorted(base)
    ref = summary(base, seeds)
    passed, pending, nearest = [], [], None
    for key, by_seed in runs.items():
        if key == default or key[:2] != default[:2]:
            continue
        common = [s for s in seeds if s in by_seed]
        mine = summary(by_seed, common)
        if mine is None:
            continue
        theirs = summary(base, common)
        if nearest is None or mine["mean"] / theirs["mean"] < nearest[1]["mean"] / nearest[2]["mean"]:
            nearest = (key, mine, theirs)
        if mine["max"] >= ref["min"]:
            continue  # out: its range cannot end below the default's
        if len(common) == len(seeds):
            passed.append((mine["mean"], key, mine))
        else:
            pending.append(key)

    def name(key: Key) -> str:
        return f"outer lr {key[2]:g}, momentum {key[3]:g}"

    if passed:
        _, key, mine = min(passed)
        return (f"**changed** to {name(key)}: mean {mine['mean']:.4f} (range {mine['min']:.4f}–{mine['max']:.4f}) "
                f"against the default's {ref['mean']:.4f} ({ref['min']:.4f}–{ref['max']:.4f}) on seeds "
                f"{', '.join(map(str, seeds))}; the ranges do not overlap.", key)
    if pending:
        return ("not decided: " + "; ".join(name(k) for k in pending) + f" stay below the default's lowest seed "
                f"({ref['min']:.4f}) on the seeds measured so far and need the others.", None)
    near = ""
    if nearest is not None:
        key, mine, theirs = nearest
        near = (f" The nearest is {name(key)}: {mine['mean']:.4f} against the default's {theirs['mean']:.4f} on "
                f"seed(s) {', '.join(map(str, mine['seeds']))} ({(mine['mean'] / theirs['mean'] - 1) * 100:+.1f} %).")
    return (f"**kept**: every other configuration has a seed at or above the default's lowest ({ref['min']:.4f}, "
            f"seeds {', '.join(map(str, seeds))}: mean {ref['mean']:.4f}), so none can have its range below the "
            f"default's whatever its other seeds give." + near, None)


def results_section(records: list[dict[str, Any]], long_records: list[dict[str, Any]],
                    long_methods: dict[str, dict]) -> list[str]:
    lines = ["## 1c. Outer optimizer sweep on the in-process emulator (`python bench/outer_sweep.py`)", ""]
    runs = group_runs(records)
    if not runs:
        return lines + ["Not run.", ""]
    lr, momentum = node_defaults()
    codec = "int8"
    default = (codec, DEFAULT_H, lr, momentum)
    ours = [r for by_seed in runs.values() for r in by_seed.values()]
    commands = sorted({r["command"] for r in ours})
    loads = [r["machine"]["loadavg_at_start"][0] for r in ours if r.get("machine")]
    lines += [
        "The node's round arithmetic in one process (bench/outer_sweep.py): 4 replicas of the node's `Trainer` "
        "(tiny preset, 8 × 128 tokens per step, the peers' own data shards and seed), H inner AdamW steps each, "
        "Δ = θ_global − θ_local, the butterfly all-reduce's int8 encoding with sender and owner error feedback on "
        "equal shards, the token-weighted mean, the real `NesterovOuter` step; 1,000 steps per peer as the long "
        "benchmark; eval on the node's held-out batches after every outer step. Time is left out (no cut inner "
        "phases, no failed rounds, no bandwidth-sized shards). One torch thread, runs one after the other with "
        f"`nice -n 19` ({len(ours)} runs, {statistics.fmean(r['wall_seconds'] for r in ours) / 60:.1f} min each on "
        f"average, 1-minute load average {min(loads):.1f}–{max(loads):.1f} when they started). Commands: "
        + ", ".join(f"`{c}`" for c in commands) + ".", ""]
    # Validation: the emulator against the real node, same seed and configuration.
    real = {r.get("seed"): r for r in long_records
            if r.get("method") == f"diloco-{codec}-H{DEFAULT_H}" and r.get("ok", True) and not r.get("node_sets")}
    rows = []
    for seed, r in sorted(runs.get(default, {}).items()):
        if seed in real:
            diff = r["final_eval_loss"] - real[seed]["final_eval_loss"]
            theirs = {p["outer_step"]: p["eval_loss"] for p in real[seed]["curve"]}
            steps = [abs(p["eval_loss"] - theirs[p["outer_step"]]) for p in r["curve"] if p["outer_step"] in theirs]
            rows.append([str(seed), f"{r['final_eval_loss']:.4f}", f"{real[seed]['final_eval_loss']:.4f}",
                         f"{diff:+.4f}", f"{max(steps):.4f} ({len(steps)})" if steps else "–"])
    if rows:
        spread = [real[s]["final_eval_loss"] for s in real]
        lines += [f"**Emulator vs the real node** (diloco-{codec}-H{DEFAULT_H}, outer lr {lr:g}, momentum {momentum:g}, "
                  f"final eval loss; real: the long benchmark's run {next(iter(real.values())).get('run_id')}, whose "
                  f"seeds span {min(spread):.4f}–{max(spread):.4f}):", "",
                  "| seed | emulator | real node | difference | largest difference at any outer step (steps compared) |",
                  "|---|---:|---:|---:|---:|",
                  *("| " + " | ".join(row) + " |" for row in rows), ""]
    ddp = (long_methods.get("ddp") or {}).get("mean")
    base = runs.get(default, {})
    rows = []
    for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], k[3])):
        s = summary(runs[key])
        ref = summary(base, s["seeds"]) if base else None
        same = ref is not None and ref["seeds"] == s["seeds"]
        rows.append([f"{key[0]}-H{key[1]}", f"{key[2]:g}", f"{key[3]:g}" + (" (default)" if key == default else ""),
                     ", ".join(map(str, s["seeds"])), f"{s['mean']:.4f}", f"{s['min']:.4f} – {s['max']:.4f}",
                     f"{(s['mean'] / ref['mean'] - 1) * 100:+.1f} %" if same and key != default else "–",
                     f"{(s['mean'] / ddp - 1) * 100:+.1f} %" if ddp else "–"])
    tokens = next(iter(next(iter(runs.values())).values()))["tokens"]
    lines += [f"Final eval loss at {tokens:,} tokens (every run ends there), mean and range over the seeds; "
              "*vs default*: against the default (H=50, the node's outer lr and momentum) on the same seeds; "
              "*vs ddp*: against ddp's mean in the long benchmark (section 1b).", ""]
    lines += ["| codec, H | outer lr | momentum | seeds | eval loss (mean) | range | vs default | vs ddp |",
              "|---|---:|---:|---|---:|---:|---:|---:|", *("| " + " | ".join(row) + " |" for row in rows), ""]
    decision, adopted = choose(runs, default)
    lines += [f"**Default outer optimizer** (node/config_sections.py: outer_lr {lr:g}, outer_momentum {momentum:g}; "
              f"rule: another configuration must be lower on the mean of ≥{MIN_SEEDS} seeds with its range entirely "
              f"below the default's): {decision}", ""]
    return lines
