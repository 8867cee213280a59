"""``python -m sim sweep``: the scale sweep of issue 15 item 4 (simulated part).

For every N and every variant (all-reduce with group_size 16 and 64 — the current protocol,
whose large steps matchmake in buckets —, gossip, and labelled what-ifs: one leader per step as
before protocol/buckets.py, the lag-tolerant ``behind`` of sim/whatif.py) one run with heterogeneous links (``mixed``), compute-speed spread
and 5 %/hour churn. Each run's round lines go to ``<out>/<variant>-N<n>.jsonl`` and its summary
is appended to ``<out>/sweep.jsonl``; ``--table`` prints the Markdown table of sim/README.md from
what ``<out>/sweep.jsonl`` holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .engine import SimConfig, simulate

VARIANTS: dict[str, dict] = {
    "allreduce-g16": dict(mode="allreduce", group_size=16),
    "allreduce-g64": dict(mode="allreduce", group_size=64),
    "gossip-k2": dict(mode="gossip", gossip_partners=2),
    "single-level-g16": dict(mode="allreduce", group_size=16, single_level=True),
    "allreduce-g16-lag": dict(mode="allreduce", group_size=16, lag_tolerant=True),
    "allreduce-g16-catchup": dict(mode="allreduce", group_size=16, catch_up_missed_plan=True),
}


def rounds_for(n: int, rounds: int | None) -> int:
    """Fewer rounds for the largest swarms (the simulator's cost grows as N² per round)."""
    if rounds is not None:
        return rounds
    return 20 if n <= 64 else 10 if n <= 256 else 5


def one(args: tuple[str, int, int, float, int, str]) -> dict:
    variant, n, rounds, churn, seed, out = args
    config = SimConfig(peers=n, rounds=rounds, churn=churn, seed=seed, links="mixed", **VARIANTS[variant])
    lines, summary = simulate(config)
    path = Path(out) / f"{variant}-N{n}.jsonl"
    path.write_text("".join(json.dumps({"variant": variant, "peers": n, **line}) + "\n" for line in lines))
    matchmaking = {"matchmaking": "single-level" if config.single_level else "buckets"} if config.mode == "allreduce" else {}
    return {"variant": variant, "peers": n, "rounds": rounds, **matchmaking, **summary}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim sweep")
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: 20, 10 or 5 by N)")
    parser.add_argument("--churn", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    parser.add_argument("--out", type=Path, default=Path("bench/out/scale"))
    parser.add_argument("--table", action="store_true", help="print the table of <out>/sweep.jsonl and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.out / "sweep.jsonl"))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(v, n, rounds_for(n, args.rounds), args.churn, args.seed, str(args.out))
            for n in sorted(args.peers) for v in args.variants]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool, (args.out / "sweep.jsonl").open("a") as sink:
        for summary in pool.map(one, jobs):
            sink.write(json.dumps(summary) + "\n")
            sink.flush()
            print(json.dumps({k: summary.get(k) for k in ("variant", "peers", "rounds", "wall_seconds",
                                                          "mean_share_averaged", "mean_form_p95_s")}), flush=True)
    return 0


COLUMNS = [("share avg", "mean_share_averaged", 2), ("min share", "min_share_averaged", 2),
           ("share in majority", "mean_share_majority", 2),
           ("form p50 s", "mean_form_p50_s", 1), ("form p95 s", "mean_form_p95_s", 1),
           ("commit spread s", "mean_commit_spread_s", 1),
           ("groups", "mean_groups", 1), ("size", "mean_group_size_median", 0),
           ("DHT r/peer", "mean_dht_reads_per_peer", 1), ("DHT w/peer", "mean_dht_writes_per_peer", 1),
           ("records read/peer", "mean_dht_subkeys_read_per_peer", 0),
           ("busiest DHT holder", "mean_dht_busiest_holder_requests", 0),
           ("busiest RPCs", "mean_busiest_peer_rpcs", 0), ("busiest joins", "mean_busiest_peer_joins", 0),
           ("MB/peer", "mean_bytes_per_peer_mb", 1), ("skipped", "mean_skipped_shards", 1),
           ("dl minority", "mean_downloads_minority", 1), ("dl behind", "mean_downloads_behind", 1),
           ("missed rounds applied", "mean_missed_rounds_applied", 1),
           ("hashes", "mean_hashes", 1), ("consensus", "mean_consensus_distance", 3),
           ("rounds to ½", "rounds_to_halve_consensus", 0)]


def newest(paths: list[Path] | tuple[Path, ...], variants: set[str] | None = None) -> dict[tuple[str, int], dict]:
    """The newest summary of every (variant, N) in ``paths`` (of ``variants``, default all): later
    lines and later files win; a missing file holds none."""
    latest: dict[tuple[str, int], dict] = {}
    for path in paths:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.strip():
                row = json.loads(line)
                if variants is None or row["variant"] in variants:
                    latest[(row["variant"], row["peers"])] = row
    return latest


def table(*paths: Path, variants: set[str] | None = None) -> str:
    """The newest summary of every (variant, N) in ``paths`` (of ``variants``, default all), as a
    Markdown table."""
    latest = newest(paths, variants)
    head = ["variant", "N", "rounds", *(name for name, _, _ in COLUMNS)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (variant, n), row in sorted(latest.items(), key=lambda item: (item[0][0], item[0][1])):
        cells = [variant, str(n), str(row["rounds"])]
        for _, key, digits in COLUMNS:
            value = row.get(key)
            cells.append("–" if value is None else f"{value:.{digits}f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
