"""PNG plots of the benchmark records (matplotlib, no display needed). Called by bench/results.py."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

STYLE = {"single": ("black", ":"), "ddp": ("tab:blue", "-"), "hivemind": ("tab:red", "-")}
DILOCO_COLORS = ["tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]


def _save(fig, path: Path) -> Path:
    """Lay out, write and close one figure (every plot here ends this way)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _style(method: str, index: int) -> dict:
    color, line = STYLE.get(method, (DILOCO_COLORS[index % len(DILOCO_COLORS)], "--"))
    return {"color": color, "linestyle": line, "marker": "o", "markersize": 3, "linewidth": 1.4}


def _bytes(point: dict) -> float | None:
    return point.get("wire_bytes_sent") if point.get("wire_bytes_sent") is not None else point.get("app_bytes_sent")


def convergence(records: list[dict], outdir: Path) -> list[Path]:
    """Eval loss vs tokens, vs bytes sent per peer (log x), vs wall-clock: one PNG each."""
    outdir.mkdir(parents=True, exist_ok=True)
    runs = [r for r in records if r.get("curve")]
    wire = any(p.get("wire_bytes_sent") is not None for r in runs for p in r["curve"])
    specs = [
        ("convergence_tokens.png", "tokens (all peers)", lambda p: p["tokens"], "linear"),
        ("convergence_bytes.png", f"bytes sent per peer ({'on the wire' if wire else 'payload'}), log scale", _bytes,
         "log"),
        ("convergence_wall.png", "wall-clock (s)", lambda p: p["wall"], "linear"),
    ]
    paths = []
    for name, xlabel, x_of, scale in specs:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for index, record in enumerate(runs):
            points = [(x_of(p), p["eval_loss"]) for p in record["curve"]]
            points = [(x, y) for x, y in points if x is not None and (scale != "log" or x > 0)]
            if points:
                ax.plot(*zip(*points), label=record["method"], **_style(record["method"], index))
        ax.set_xscale(scale)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss of the global model")
        peers = max((r.get("peers") or 0 for r in runs), default=0)  # not single's 1
        ax.set_title(f"tiny preset, {peers or '?'} peers, equal tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, outdir / name))
    return paths


def slow_links(records: list[dict], outdir: Path) -> list[Path]:
    """Eval loss vs wall-clock per cap, with the target line."""
    runs = [r for r in records if r.get("curve") and r.get("role") != "reference"]
    caps = sorted({r["mbit"] for r in runs if r.get("mbit")}, reverse=True)
    if not caps:
        return []
    fig, axes = plt.subplots(1, len(caps), figsize=(6 * len(caps), 4.5), squeeze=False)
    for ax, cap in zip(axes[0], caps):
        for index, record in enumerate(r for r in runs if r.get("mbit") == cap):
            label = record["method"]
            curve = record["curve"]
            if record.get("curve_estimated"):
                curve = record["curve_estimated"]
                label += " (unlimited-link curve x measured s/step)"
            points = [(p["wall"], p["eval_loss"]) for p in curve if p["wall"] > 0]
            ax.plot(*zip(*points), label=label, **_style(record["method"], index))
            ttt = record.get("time_to_target")
            if ttt:
                ax.axvline(ttt["wall"], color=_style(record["method"], index)["color"], alpha=0.5, linewidth=1)
        target = next((r.get("target_loss") for r in runs if r.get("target_loss")), None)
        if target:
            ax.axhline(target, color="gray", linestyle=":", label=f"target {target:.3f}")
        ax.set_xscale("log")
        ax.set_xlabel("wall-clock (s), log scale; vertical lines: time to target")
        ax.set_ylabel("eval loss of the global model")
        ax.set_title(f"{cap:g} Mbit/s per peer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = outdir / "slow_links.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def transport(records: list[dict], outdir: Path) -> list[Path]:
    """Efficiency (bound / measured) per configuration, one group of bars per cap."""
    runs = [r for r in records if r.get("efficiency") is not None]
    if not runs:
        return []
    labels = sorted({(r["impl"], r["peers"], r["payload_mb"]) for r in runs})
    caps = sorted({r["mbit"] for r in runs})
    fig, ax = plt.subplots(figsize=(max(7, 0.7 * len(labels) * len(caps)), 4.5))
    width = 0.8 / len(caps)
    for ci, cap in enumerate(caps):
        values = []
        for impl, peers, size in labels:
            match = next((r for r in runs if (r["impl"], r["peers"], r["payload_mb"], r["mbit"]) ==
                          (impl, peers, size, cap)), None)
            values.append(match["efficiency"] if match else 0)
        ax.bar([i + ci * width for i in range(len(labels))], values, width, label=f"{cap:g} Mbit/s")
    ax.axhline(0.8, color="gray", linestyle=":", label="goal 0.8")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
    ax.set_xticklabels([f"{impl}\nN={n} S={s:g}MB" for impl, n, s in labels], fontsize=7)
    ax.set_ylabel("bound / measured round time")
    ax.set_title("one averaging round vs 2(N-1)/N*S/B")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = outdir / "transport.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def overlap(records: list[dict], outdir: Path) -> list[Path]:
    """Compute utilization per overlap mode (bars) and eval loss per outer step (lines)."""
    runs = [r for r in records if r.get("mode") and r.get("eval_curve")]
    if not runs:
        return []
    outdir.mkdir(parents=True, exist_ok=True)
    colors = {"none": "tab:blue", "delayed": "tab:green", "eager": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [r["mode"] for r in runs]
    window = [r.get("utilization_window_median") or 0 for r in runs]
    since = [r.get("utilization_since_start_median") or 0 for r in runs]
    xs = range(len(runs))
    left.bar([x - 0.2 for x in xs], window, 0.4, label="measured window (2nd to last round)",
             color=[colors.get(n, "gray") for n in names])
    left.bar([x + 0.2 for x in xs], since, 0.4, label="since start (node's gauge)", color="lightgray")
    left.axhline(0.95, color="gray", linestyle=":", label="goal 0.95")
    left.set_xticks(list(xs))
    left.set_xticklabels([f"overlap={n}" for n in names])
    left.set_ylim(0, 1.3)  # room for the legend above the bars
    left.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    left.set_ylabel("compute utilization (median over peers)")
    left.legend(fontsize=8, loc="upper left")
    left.grid(True, axis="y", alpha=0.3)
    for r in runs:
        points = [(p["tokens_in_model"], p["eval_loss"]) for p in r["eval_curve"] if p.get("tokens_in_model")]
        if points:
            right.plot(*zip(*points), label=f"overlap={r['mode']}", color=colors.get(r["mode"], "gray"),
                       marker="o", markersize=3, linewidth=1.4)
    right.set_xlabel("tokens in the global model (all peers), one point per outer step")
    right.set_ylabel("eval loss of the global model")
    right.grid(True, alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"{runs[0]['peers']} peers, {runs[0]['mbit']:g} Mbit/s per peer, H={runs[0]['inner_steps']}")
    fig.tight_layout()
    path = outdir / "overlap.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _seed_band(records: list[dict], x_of) -> tuple[list[float], list[float], list[float], list[float]] | None:
    """(x, mean, min, max) of eval loss over the seeds' curves: each curve interpolated on the union
    of their token points where all of them have data; x is ``x_of`` (tokens or payload bytes per
    peer) averaged over the seeds at those tokens."""
    curves = []
    for record in records:
        points = sorted((p["tokens"], p["eval_loss"], x_of(p)) for p in record["curve"]
                        if p.get("eval_loss") is not None and x_of(p) is not None)
        if len(points) >= 2:
            curves.append(np.array(points, dtype=float))
    if not curves:
        return None
    low, high = max(c[0, 0] for c in curves), min(c[-1, 0] for c in curves)
    grid = np.unique(np.concatenate([c[:, 0] for c in curves]))
    grid = grid[(grid >= low) & (grid <= high)]
    if grid.size < 2:
        return None
    losses = np.stack([np.interp(grid, c[:, 0], c[:, 1]) for c in curves])
    xs = np.stack([np.interp(grid, c[:, 0], c[:, 2]) for c in curves]).mean(axis=0)
    return list(xs), list(losses.mean(axis=0)), list(losses.min(axis=0)), list(losses.max(axis=0))


def long_convergence(groups: dict[str, list[dict]], outdir: Path) -> list[Path]:
    """The long benchmark (bench/RESULTS.md section 1b): eval loss vs tokens and vs payload bytes
    per peer (log x), one colour per row of the table (``groups``: row -> its seeds' records),
    the mean over the seeds as a line and their range as a band."""
    outdir.mkdir(parents=True, exist_ok=True)
    specs = [("long_convergence_tokens.png", "tokens (all peers)", lambda p: p["tokens"], "linear"),
             ("long_convergence_bytes.png", "payload bytes sent per peer, log scale",
              lambda p: p.get("app_bytes_sent") or None, "log")]  # single sends nothing: not on a log axis
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors  # 18 distinct colours
    peers = max((r.get("peers") or 0 for rs in groups.values() for r in rs), default=0)
    paths = []
    for name, xlabel, x_of, scale in specs:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for index, (row, records) in enumerate(groups.items()):
            band = _seed_band(records, x_of)
            if band is None:
                continue
            xs, mean, low, high = band
            color = colors[index % len(colors)]
            seeds = f"{len(records)} seed" + ("" if len(records) == 1 else "s")
            ax.plot(xs, mean, color=color, linewidth=1.4, label=f"{row} ({seeds})")
            ax.fill_between(xs, low, high, color=color, alpha=0.2, linewidth=0)
        ax.set_xscale(scale)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss of the global model")
        ax.set_title(f"long benchmark: tiny preset, {peers or '?'} peers; mean over seeds, band = range")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a plot without any curve keeps its axes, no empty legend
            ax.legend(fontsize=7)
        paths.append(_save(fig, outdir / name))
    return paths
