"""RESULTS.md section 1c: the outer-optimizer sweep of bench/outer_sweep.py, and the default it picks.

bench/results.py calls ``results_section`` with the emulator's records (bench/out/outer_sweep.jsonl),
the newest long-benchmark run and that run's per-method summary (results.seed_summary), so that
the emulator is shown next to the real node for the same seeds and every row next to ddp.

The rule that may change the node's defaults (issue 16 item 5, as the lead's brief states it): a
configuration measured on the default's seeds (at least 3) replaces the default (H=50, outer lr
and momentum of node/config_sections.py) only if it beats the default's mean over those seeds by
more than the overlap of the two seed ranges. Otherwise the defaults stay.
"""

from __future__ import annotations

import statistics
from typing import Any

from long_records import outer_settings

DEFAULT_H = 50  # the node's [train] inner_steps
# The node's outer lr and momentum before this sweep: the long benchmark's run used them, and the
# sweep compares every configuration with them.
BASELINE = (0.7, 0.9)
GRID_LR = (0.4, 0.7, 1.0)  # issue 16 item 5's grid at H=50
GRID_MOMENTUM = (0.0, 0.5, 0.9)
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
        if c.get("method", "diloco") != "diloco" or c.get("inner_lr", 1e-3) != 1e-3:
            continue  # the inner-lr study (its own table): this sweep holds the workload's inner lr
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


def range_overlap(mine: dict[str, Any], ref: dict[str, Any]) -> float:
    """The length of the interval both seed ranges cover (0 when they are apart)."""
    return max(0.0, min(mine["max"], ref["max"]) - max(mine["min"], ref["min"]))


def beats(runs: dict[Key, dict[int, dict[str, Any]]], key: Key, ref_key: Key) -> tuple[bool, float, float]:
    """Whether ``key`` beats ``ref_key`` by the rule on ``ref_key``'s seeds: (beats, how much lower
    its mean is, the overlap of the two seed ranges)."""
    seeds = sorted(runs[ref_key])
    mine, ref = summary(runs[key], seeds), summary(runs[ref_key], seeds)
    overlap = range_overlap(mine, ref)
    return ref["mean"] - mine["mean"] > overlap, ref["mean"] - mine["mean"], overlap


def choose(runs: dict[Key, dict[int, dict[str, Any]]], default: Key,
           current: Key | None = None) -> tuple[str, Key | None]:
    """The module docstring's rule: (the sentence that says what it decided, the key to adopt or None).

    Compared on the default's seeds S (at least MIN_SEEDS): a configuration measured on all of S
    beats the default when its mean is lower by more than the overlap of the two seed ranges
    (the length of the interval both ranges cover; 0 when they are apart). Of those that beat
    it, the lowest mean is adopted. Configurations with fewer seeds are not candidates.

    ``current``: the node's default now, when the rule already changed it once. A later
    configuration replaces it only by beating it the same way (not merely by a lower mean),
    so that the default does not follow the noise between close configurations."""
    base = runs.get(default, {})
    if len(base) < MIN_SEEDS:
        return f"not decided: the default has {len(base)} seed(s), the rule needs {MIN_SEEDS}.", None
    seeds = sorted(base)
    ref = summary(base, seeds)
    scored, partial = [], []
    for key, by_seed in runs.items():
        if key == default or key[:2] != default[:2]:
            continue
        if not set(seeds) <= set(by_seed):
            partial.append(key)
            continue
        mine = summary(by_seed, seeds)
        overlap = range_overlap(mine, ref)
        scored.append((mine["mean"], key, mine, overlap))

    def name(key: Key) -> str:
        return f"outer lr {key[2]:g}, momentum {key[3]:g}"

    fewer = (f" Measured on fewer seeds, so not candidates: {'; '.join(name(k) for k in sorted(partial))}."
             if partial else "")
    if not scored:
        return "**kept**: no other configuration has the default's seeds." + fewer, None
    mean, key, mine, overlap = min(scored)
    by_seed_of = runs
    numbers = (f"{name(key)}: mean {mine['mean']:.4f} (range {mine['min']:.4f}–{mine['max']:.4f}) against the "
               f"default's {ref['mean']:.4f} ({ref['min']:.4f}–{ref['max']:.4f}) on seeds {', '.join(map(str, seeds))}, "
               f"{ref['mean'] - mine['mean']:.4f} lower on the mean, ranges overlapping by {overlap:.4f}"
               + (", lower on every seed" if all(by_seed_of[key][s]["final_eval_loss"] < base[s]["final_eval_loss"]
                                                 for s in seeds) else ""))
    if ref["mean"] - mine["mean"] <= overlap:
        return f"**kept**: the best other configuration is {numbers}." + fewer, None
    if current is not None and current != key and current != default and set(seeds) <= set(runs.get(current, {})):
        better, lower, over = beats(runs, key, current)
        both = sorted(set(runs[current]) & set(runs[key]))
        if not better:
            return (f"**changed** to {name(current)} earlier, and **kept** there: the lowest mean is now {numbers}; "
                    f"against {name(current)} it is {lower:.4f} lower on the mean, within the {over:.4f} overlap of "
                    f"their seed ranges" + (f", lower on each of the {len(both)} seeds (the rule compares "
                                            f"ranges, not pairs)"
                                            if all(runs[key][s]["final_eval_loss"] < runs[current][s]["final_eval_loss"]
                                                   for s in both) else "") + "." + fewer), current
    return f"**changed** to {numbers}." + fewer, key


def _outer_sets(record: dict[str, Any]) -> tuple[float, float]:
    """(outer lr, momentum) a real-node record ran with: its --set flags, else BASELINE (the defaults
    the long benchmark's run had)."""
    sets = dict(item.split("=", 1) for item in record.get("node_sets") or [] if "=" in item)
    return float(sets.get("sync.outer_lr", BASELINE[0])), float(sets.get("sync.outer_momentum", BASELINE[1]))


def results_section(records: list[dict[str, Any]], long_records: list[dict[str, Any]],
                    long_methods: dict[str, dict], confirm_records: list[dict[str, Any]] = ()) -> list[str]:
    """``confirm_records``: real-node runs of the long benchmark with the chosen default and its
    closest challengers (bench/out/outer_sweep_confirm.jsonl, after the long benchmark's own
    records of the default), shown next to the emulator's numbers."""
    lines = ["## 1c. Outer optimizer sweep on the in-process emulator (`python bench/outer_sweep.py`)", ""]
    runs = group_runs(records)
    if not runs:
        return lines + ["Not run.", ""]
    lr, momentum = node_defaults()
    codec = "int8"
    default = (codec, DEFAULT_H, *BASELINE)
    current = (codec, DEFAULT_H, lr, momentum)
    ours = [r for by_seed in runs.values() for r in by_seed.values()]
    commands = sorted({r["command"].replace("python bench/outer_sweep.py", "").strip() for r in ours})
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
        "`python bench/outer_sweep.py` with " + ", ".join(f"`{c}`" for c in commands) + ".", ""]
    # Validation: the emulator against the real node, same seed and configuration.
    real = {r.get("seed"): r for r in long_records
            if r.get("method") == f"diloco-{codec}-H{DEFAULT_H}" and r.get("ok", True) and _outer_sets(r) == BASELINE}
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
        lines += [f"**Emulator vs the real node** (diloco-{codec}-H{DEFAULT_H}, outer lr {BASELINE[0]:g}, momentum "
                  f"{BASELINE[1]:g}, final eval loss; real: the long benchmark's run "
                  f"{next(iter(real.values())).get('run_id')}, whose seeds span {min(spread):.4f}–{max(spread):.4f}):",
                  "", "| seed | emulator | real node | difference | largest difference at any outer step (steps compared) |",
                  "|---|---:|---:|---:|---:|",
                  *("| " + " | ".join(row) + " |" for row in rows), ""]
    ddp = (long_methods.get("ddp") or {}).get("mean")
    base = runs.get(default, {})
    rows = []
    for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], k[3])):
        s = summary(runs[key])
        ref = summary(base, s["seeds"]) if base else None
        same = ref is not None and ref["seeds"] == s["seeds"]
        mark = " (old default)" if key == default else " (node default)" if key == current else ""
        rows.append([f"{key[0]}-H{key[1]}", f"{key[2]:g}", f"{key[3]:g}" + mark,
                     ", ".join(map(str, s["seeds"])), f"{s['mean']:.4f}", f"{s['min']:.4f} – {s['max']:.4f}",
                     f"{(s['mean'] / ref['mean'] - 1) * 100:+.1f} %" if same and key != default else "–",
                     f"{(s['mean'] / ddp - 1) * 100:+.1f} %" if ddp else "–"])
    missing = [f"{g_lr:g} / {g_m:g}" for g_lr in GRID_LR for g_m in GRID_MOMENTUM
               if (codec, DEFAULT_H, g_lr, g_m) not in runs]
    tokens = next(iter(next(iter(runs.values())).values()))["tokens"]
    lines += [f"Final eval loss at {tokens:,} tokens (every run ends there), mean and range over the seeds; "
              f"*vs old default*: against int8-H{DEFAULT_H} with outer lr {BASELINE[0]:g} and momentum {BASELINE[1]:g} "
              "(the defaults before this sweep) on the same seeds; *vs ddp*: against ddp's mean in the long "
              "benchmark (section 1b).", ""]
    lines += ["| codec, H | outer lr | momentum | seeds | eval loss (mean) | range | vs old default | vs ddp |",
              "|---|---:|---:|---|---:|---:|---:|---:|", *("| " + " | ".join(row) + " |" for row in rows), ""]
    if missing:
        lines += [f"Not run (the issue's H={DEFAULT_H} grid, outer lr / momentum): {', '.join(missing)}.", ""]
    decision, adopted = choose(runs, default, current)
    verdict = adopted or default
    agrees = (verdict[2], verdict[3]) == (lr, momentum)
    lines += [f"**Default outer optimizer** (rule: a configuration must beat the old default's mean over the same "
              f"≥{MIN_SEEDS} seeds by more than the overlap of their seed ranges, and, once the default changed, the "
              f"current default's the same way): {decision} node/config_sections.py "
              f"has outer_lr {lr:g}, outer_momentum {momentum:g}"
              + ("." if agrees else f": **it does not match the rule's outcome ({verdict[2]:g}, {verdict[3]:g})**."), ""]
    confirm = [r for r in confirm_records if r.get("ok") and r.get("final_eval_loss") is not None]
    if confirm:
        lines += ["**On the real node** (`python bench/convergence.py --long --methods diloco-int8-H50 --seeds ... "
                  "--set sync.outer_lr=L --set sync.outer_momentum=M --json-out bench/out/outer_sweep_confirm.jsonl`; "
                  "the chosen default and the emulator's closest challengers, newest run per seed):", ""]
        newest: dict[tuple[float, float], dict[Any, dict[str, Any]]] = {}
        for r in confirm:  # in file order: a later run of a seed replaces an earlier one
            newest.setdefault(outer_settings(r) or _outer_sets(r), {})[r.get("seed")] = r
        for (olr, om), by_seed in sorted(newest.items(), key=lambda item: item[0] != (lr, momentum)):
            finals = [by_seed[seed]["final_eval_loss"] for seed in sorted(by_seed)]
            loads = [by_seed[seed]["machine"]["loadavg_at_start"][0] for seed in sorted(by_seed)]
            mark = " (node default)" if (olr, om) == (lr, momentum) else ""
            text = (f"- outer lr {olr:g}, momentum {om:g}{mark}: seeds {', '.join(map(str, sorted(by_seed)))}: "
                    + ", ".join(f"{v:.4f}" for v in finals) + f" (mean {statistics.fmean(finals):.4f}"
                    + (f", {(statistics.fmean(finals) / ddp - 1) * 100:+.1f} % vs ddp" if ddp else "")
                    + f"; load average {min(loads):.1f}–{max(loads):.1f} at the starts)")
            emu = [runs.get((codec, DEFAULT_H, olr, om), {}).get(seed) for seed in sorted(by_seed)]
            if all(emu):
                text += "; emulator " + ", ".join(f"{e['final_eval_loss']:.4f}" for e in emu)
            olds = [real[seed]["final_eval_loss"] for seed in sorted(by_seed) if seed in real]
            if len(olds) == len(by_seed):
                text += "; the old default on the real node " + ", ".join(f"{v:.4f}" for v in olds)
            base = newest.get((lr, momentum), {})
            if (olr, om) != (lr, momentum) and set(by_seed) <= set(base):
                diffs = [by_seed[seed]["final_eval_loss"] - base[seed]["final_eval_loss"] for seed in sorted(by_seed)]
                lower = sum(d < 0 for d in diffs)
                text += (f"; against the node default on the same seeds: " + ", ".join(f"{d:+.4f}" for d in diffs)
                         + f" ({lower} of {len(diffs)} lower, mean {statistics.fmean(diffs):+.4f})")
            lines.append(text + ".")
        lines.append("")
    return lines
