"""Which records of the long convergence benchmark form its table (bench/RESULTS.md section 1b).

The long benchmark grows by runs: a later run adds methods or seeds (or the same method under
other settings) to the earlier ones. The table therefore combines every run of
bench/out/convergence_long.jsonl (and the real-node confirmation of the outer sweep, which ran the
same workload) and keeps, per row and seed, the newest complete record. A row is a method under
its settings: a node method is labelled with the outer optimizer it ran with, because the node's
defaults changed (outer lr 0.7 / momentum 0.9 until commit 2519153, 1.0 / 0.5 since), and the
same method name under both must not be averaged together.
"""

from __future__ import annotations

from typing import Any

# Commit 2519153 (2026-12-01 15:54:43 UTC) changed the node's outer defaults from 0.7 / 0.9 to
# 1.0 / 0.5. Records written before it carry no outer settings (convergence.py did not record
# them then); unless their --set flags say otherwise, they ran with the defaults of that time.
DEFAULTS_CHANGED = "2026-12-01T15:54:43+00:00"
OLD_OUTER = (0.7, 0.9)
# SparseLoCo's step size α ([sync] outer_lr under method = "sparseloco") was 1.5 until the long
# benchmark's sweep of it (bench/analysis.md); records that do not say theirs ran with it.
OLD_SPARSELOCO_ALPHA = 1.5
OUTER_KEYS = ("sync.outer_lr", "sync.outer_momentum")
BASELINES = ("single", "ddp", "hivemind")
Outer = tuple[float, float]


def _sets(record: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in record.get("node_sets") or [] if "=" in item)


def _is_node(record: dict[str, Any]) -> bool:
    return not str(record.get("method", "")).startswith(BASELINES)


def _is_sparseloco(record: dict[str, Any]) -> bool:
    """SparseLoCo has its own outer rule (method-fixed momentum 0): no outer defaults to label."""
    return (str(record.get("method", "")).startswith("sparseloco") or record.get("sync_method") == "sparseloco"
            or _sets(record).get("sync.method") == "sparseloco")


def outer_settings(record: dict[str, Any]) -> Outer | None:
    """(outer lr, outer momentum) a node-method record ran with; None for the baselines and for a
    record that neither says it nor predates the change of defaults."""
    if not _is_node(record):
        return None
    if record.get("outer_lr") is not None and record.get("outer_momentum") is not None:
        return float(record["outer_lr"]), float(record["outer_momentum"])
    if _is_sparseloco(record):
        return None  # its outer rule is the method's own, not the defaults that changed
    sets = _sets(record)
    if str(record.get("date", "")) and str(record.get("date")) < DEFAULTS_CHANGED:
        return float(sets.get(OUTER_KEYS[0], OLD_OUTER[0])), float(sets.get(OUTER_KEYS[1], OLD_OUTER[1]))
    if all(key in sets for key in OUTER_KEYS):
        return float(sets[OUTER_KEYS[0]]), float(sets[OUTER_KEYS[1]])
    return None


def sparseloco_alpha(record: dict[str, Any]) -> float:
    """The α a SparseLoCo record ran with: recorded, else its --set flag, else the old default."""
    if record.get("outer_lr") is not None:
        return float(record["outer_lr"])
    return float(_sets(record).get(OUTER_KEYS[0], OLD_SPARSELOCO_ALPHA))


def current_sparseloco_alpha() -> float:
    from lowcomm.node.config_sections import METHOD_DEFAULTS

    return float(METHOD_DEFAULTS["sparseloco"]["outer_lr"])


def outer_text(outer: Outer) -> str:
    """``1.0/0.5``: the outer lr and momentum as the README and the config write them."""
    return "/".join(f"{v:.1f}" if v == round(v, 1) else f"{v:g}" for v in outer)


def label(record: dict[str, Any], current: Outer) -> str:
    """The table row of a record: its method, the outer settings of a node method (against the
    node's ``current`` defaults and the old ones), and any other --set flags it ran with."""
    method = str(record.get("method"))
    named = method.split("-H")[0] if not method.startswith("diloco") else None
    extra = sorted(f"{k}={v}" for k, v in _sets(record).items()
                   if k not in OUTER_KEYS and not (k == "sync.method" and v == named))
    text = method
    if _is_sparseloco(record):
        alpha = sparseloco_alpha(record)
        text += f" (default α {alpha:g})" if alpha == current_sparseloco_alpha() else f" (α {alpha:g})"
    elif _is_node(record):
        outer = outer_settings(record)
        if outer is None:
            text += " (outer settings not recorded)"
        elif outer == current:
            text += f" (default {outer_text(outer)})"
        elif outer == OLD_OUTER:
            text += f" (old defaults {outer_text(outer)})"
        else:
            text += f" (outer lr {outer[0]:g} / momentum {outer[1]:g})"
    return text + (f" [{', '.join(extra)}]" if extra else "")


def _complete(record: dict[str, Any]) -> bool:
    return bool(record.get("ok", True) and record.get("curve"))


def _seed(record: dict[str, Any]) -> Any:
    return record.get("seed", (record.get("workload") or {}).get("seed"))


def combine(records: list[dict[str, Any]], current: Outer) -> list[dict[str, Any]]:
    """Per (row, seed) the newest complete record (else the newest failed one, to be listed), each
    with its row in ``label``; in the order of the records."""
    chosen: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in records:
        if not r.get("method"):
            continue
        key = (label(r, current), _seed(r))
        mine = (_complete(r), str(r.get("run_id", "")), str(r.get("date", "")))
        old = chosen.get(key)
        if old is None or mine >= (_complete(old), str(old.get("run_id", "")), str(old.get("date", ""))):
            chosen[key] = r
    picked = {id(r) for r in chosen.values()}
    return [{**r, "label": label(r, current)} for r in records if id(r) in picked]


def same_workload(record: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether ``record`` trained what ``reference`` (a long-benchmark record) did: peers, network
    and workload apart from the seed."""
    def shape(r: dict[str, Any]) -> tuple:
        w = {k: v for k, v in (r.get("workload") or {}).items() if k != "seed"}
        return r.get("peers"), r.get("network"), tuple(sorted(w.items()))
    return shape(record) == shape(reference)


def row_order(text: str) -> tuple[int, str]:
    """The table's order: references, the default method, the other methods, the old defaults last."""
    base = text.split(" ")[0]
    prefixes = ("ddp", "single", "hivemind", "diloco-int8", "diloco-int4", "diloco-", "sparseloco", "mtdao",
                "desloc")
    rank = next((i for i, p in enumerate(prefixes) if base.startswith(p)), len(prefixes))
    return rank + (100 if "(old defaults" in text else 0), text
