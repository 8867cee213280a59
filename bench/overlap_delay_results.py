"""RESULTS.md section 5b: delayed overlap on the emulator, the eval-loss penalty against how many
inner steps of the next phase train before the round's result lands (bench/outer_sweep.py
``--overlap-delay``).

The real overlap benchmark (section 5) measures the penalty of ``[sync] overlap = "delayed"``
with everything a real swarm adds: rounds whose length varies, phases cut short when the swarm is
already averaging, four processes sharing two cores. The emulator keeps only the arithmetic:
every round's result merges into each replica exactly D steps into the next phase. So the
penalty at a D tells how much of the real one staleness alone explains, and which D a round
must reach to meet a penalty goal.
"""

from __future__ import annotations

import statistics
from typing import Any

Workload = tuple  # (codec, H, steps, inner lr, preset)
Outer = tuple  # (outer lr, momentum)
Overlap = tuple  # (delay D or None for blocking rounds, stand-in: bench/outer_sweep.py STAND_INS)
BLOCKING: Overlap = (None, "none")
# How the stand-ins read in the table (bench/outer_sweep.py STAND_INS), in the table's order.
STAND_IN_NAMES = {"none": "own end point (`delayed`)", "own": "step with own Δ (`eager`)",
                  "paper": "own Δ / P + last average", "last": "step with last average"}


def group(records: list[dict[str, Any]]) -> dict[Workload, dict[Outer, dict[Overlap, dict[int, dict[str, Any]]]]]:
    """Workload -> outer settings -> (delay, stand-in) (``BLOCKING``: blocking) -> seed -> record,
    over workloads with at least one delayed run and outer settings with a blocking run; the last
    record wins."""
    runs: dict[Workload, dict[Outer, dict[Overlap, dict[int, dict[str, Any]]]]] = {}
    for r in records:
        c = r.get("config") or {}
        if r.get("bench") != "outer_sweep" or not r.get("ok") or c.get("method", "diloco") != "diloco":
            continue
        work = (c["codec"], int(c["inner_steps"]), int(c["steps"]), float(c.get("inner_lr", 1e-3)), c["preset"])
        outer = (float(c["lr"]), float(c["momentum"]))
        delay = c.get("overlap_delay")
        overlap = (delay, c.get("overlap_stand_in", "none") if delay is not None else "none")
        runs.setdefault(work, {}).setdefault(outer, {}).setdefault(overlap, {})[int(c["seed"])] = r
    kept = {}
    for work, by_outer in runs.items():
        by_outer = {o: d for o, d in by_outer.items() if BLOCKING in d and any(k != BLOCKING for k in d)}
        if by_outer:
            kept[work] = by_outer
    return kept


def _penalties(by_seed: dict[int, dict[str, Any]], blocking: dict[int, dict[str, Any]]) -> list[float]:
    return [by_seed[s]["final_eval_loss"] / blocking[s]["final_eval_loss"] - 1 for s in sorted(by_seed) if s in blocking]


def _defaults() -> Outer:
    from outer_sweep_results import node_defaults

    return node_defaults()


def results_section(records: list[dict[str, Any]]) -> list[str]:
    groups = group(records)
    if not groups:
        return []
    default = _defaults()
    lines = ["## 5b. Delayed overlap on the emulator: the penalty against how late the result lands "
             "(`python bench/outer_sweep.py --overlap-delay ...`)", "",
             "bench/outer_sweep.py `--overlap-delay D`: the rounds of the blocking emulator (section 1c), but the "
             "replicas train on past each boundary and every round's result merges into them D inner steps into "
             "the next phase, as the node's `overlap_apply = \"arrival\"` does (node/overlap.py); D = 0 is the "
             "blocking run up to float rounding (tests/test_outer_sweep.py). No phase is cut short, every round "
             "has all 4 peers, the same D every round. Eval loss of θ_global at the end (equal tokens); *penalty*: "
             "against the blocking run with the same outer settings and seed, mean and range over the seeds; "
             f"*vs default blocking*: against the blocking run with the node's outer settings ({default[0]:g} / "
             f"{default[1]:g}) on the same seeds. *trains on from* (`--overlap-stand-in`): where a replica trains "
             "until the result lands: its own end point θ_global − Δ_own, as the node's `delayed`; an outer step "
             "previewed with its own Δ, as the node's `eager`; one previewed with own Δ / P + the last round's "
             "average · (P − 1) / P (the eager-updates paper's stand-in); or one previewed with the last average. "
             "The result then shifts the replica by θ_global − that start, as node/overlap.py merges.", ""]
    for (codec, h, steps, ilr, preset), by_outer in sorted(groups.items()):
        base = by_outer.get(default, {}).get(BLOCKING, {})
        lines += [f"{preset}, 4 peers, {steps} steps per peer, {codec}, H = {h}, inner lr {ilr:g}:", "",
                  "| outer lr / momentum | D (inner steps) | D / H | trains on from | seeds | eval loss (mean) "
                  "| penalty (mean) | range | vs default blocking |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|"]
        for outer in sorted(by_outer, key=lambda o: (o != default, o)):
            by_delay = by_outer[outer]
            for overlap in sorted(by_delay, key=_row_order):
                delay, by_seed = overlap[0], by_delay[overlap]
                seeds = sorted(by_seed)
                mean = statistics.fmean(by_seed[s]["final_eval_loss"] for s in seeds)
                own = _penalties(by_seed, by_delay[BLOCKING]) if delay is not None else []
                vs_default = _penalties(by_seed, base) if outer != default or delay is not None else []
                lines.append(
                    f"| {outer[0]:g} / {outer[1]:g}{' (node default)' if outer == default else ''} | "
                    f"{'blocking' if delay is None else delay} | {'–' if delay is None else f'{delay / h:.2f}'} | "
                    f"{'–' if delay is None else STAND_IN_NAMES.get(overlap[1], overlap[1])} | "
                    f"{', '.join(map(str, seeds))} | {mean:.4f} | "
                    + (f"{statistics.fmean(own) * 100:+.2f} % | {min(own) * 100:+.2f} … {max(own) * 100:+.2f} %"
                       if own else "– | –")
                    + (f" | {statistics.fmean(vs_default) * 100:+.2f} % |" if vs_default else " | – |"))
        lines.append("")
    return lines


def _row_order(overlap: Overlap) -> tuple:
    delay, stand_in = overlap
    names = list(STAND_IN_NAMES)
    return (-1 if delay is None else delay, names.index(stand_in) if stand_in in names else len(names), stand_in)


def penalties(records: list[dict[str, Any]], h: int) -> list[tuple[int, float]]:
    """(D, mean penalty) of ``delayed`` (no stand-in) at H = ``h`` with the node's outer settings,
    in the workload with the most delayed runs of them."""
    default = _defaults()
    candidates = [by_outer[default] for work, by_outer in group(records).items() if work[1] == h and default in by_outer]
    if not candidates:
        return []
    by_delay = max(candidates, key=lambda d: sum(len(v) for k, v in d.items() if k != BLOCKING))
    delayed = sorted((k[0], v) for k, v in by_delay.items() if k[0] is not None and k[1] == "none")
    return [(delay, statistics.fmean(pens)) for delay, by_seed in delayed
            if (pens := _penalties(by_seed, by_delay[BLOCKING]))]


def profile_text(records: list[dict[str, Any]], h: int, goal: float) -> str | None:
    """The profile of a missed overlap-penalty goal at H = ``h``: up to which delay the emulator
    stays within ``goal`` (a fraction), and the first delay beyond it."""
    points = penalties(records, h)
    if not points:
        return None
    within = [d for d, p in points if p <= goal]
    beyond = next(((d, p) for d, p in points if p > goal), None)
    return (f"profile: on the emulator (section 5b) staleness alone keeps the penalty within {goal * 100:g} % "
            + (f"only while the round's result lands within {max(within)} of the {h} inner steps"
               if within else "at none of the delays run")
            + (f" ({beyond[1] * 100:+.2f} % at {beyond[0]})" if beyond else ""))
