"""The Scale figures vs N from bench/out/scale/sweep.jsonl and the protocol before buckets
(bench/out/scale/single-level/sweep.jsonl) (needs matplotlib, the ``bench`` extra): formation
p95, share averaged, DHT records read per peer, busiest peer's RPCs, bytes per peer and gossip
consensus distance, one line per variant. ``python bench/results.py`` draws them into
bench/plots/scale.png with the rest of bench/RESULTS.md; ``python -m sim.plot`` draws them alone."""

from __future__ import annotations

import argparse
from pathlib import Path

PANELS = [("mean_form_p95_s", "group formation p95 (s)"), ("mean_share_averaged", "share of live peers averaged"),
          ("mean_dht_subkeys_read_per_peer", "DHT records read per peer per round"),
          ("mean_busiest_peer_rpcs", "RPCs received by the busiest peer"),
          ("mean_bytes_per_peer_mb", "MB per peer per round"), ("mean_consensus_distance", "consensus distance")]
SWEEPS = [Path("bench/out/scale/single-level/sweep.jsonl"), Path("bench/out/scale/sweep.jsonl")]
VARIANTS = ["allreduce-g16", "allreduce-g64", "gossip-k2", "single-level-g16", "single-level-g64", "allreduce-g16-catchup"]


def draw(sweeps: list[Path], variants: list[str], out: Path) -> Path | None:
    """The figure of the newest summary of every (variant, N) in ``sweeps`` (later files win), or
    None when they hold none of ``variants``."""
    from .sweep import newest

    latest = newest(sweeps, set(variants))
    if not latest:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = sorted({v for v, _ in latest})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for variant in shown:
            points = sorted((n, row[key]) for (v, n), row in latest.items() if v == variant and row.get(key) is not None)
            if points:
                ax.plot([n for n, _ in points], [y for _, y in points], marker="o", label=variant)
        ax.set_xscale("log", base=2)
        if key in ("mean_dht_subkeys_read_per_peer", "mean_busiest_peer_rpcs"):
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("peers (N)")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("lowcomm simulated scale sweep (python -m sim sweep)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sim.plot")
    parser.add_argument("--sweep", type=Path, nargs="+", default=SWEEPS,
                        help="later files win for the same variant and N")
    parser.add_argument("--variants", nargs="+", default=VARIANTS,
                        help="variants drawn (the prototype rows of the first sweep are left out by default)")
    parser.add_argument("--out", type=Path, default=Path("bench/plots/scale.png"))
    args = parser.parse_args()
    print(draw(args.sweep, args.variants, args.out) or "nothing to draw")


if __name__ == "__main__":
    main()
