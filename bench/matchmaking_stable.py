#!/usr/bin/env python
"""Matchmaking time of a stable group on loopback (issue 17: direct rounds without DHT reads).

    python bench/matchmaking_stable.py [--peers 3] [--rounds 12] [--overlap delayed]
                                       [--json-out bench/out/matchmaking_stable.jsonl] [--label TEXT]
                                       [-- extra join flags]

Starts N real `lowcomm-node join` processes on 127.0.0.1 with the tests' small settings (tiny
model, 20 inner steps), waits for ``--rounds`` rounds in which all N averaged together and
reads the ``matchmaking_seconds`` of their ``round_done`` events (from the start of the node's
round to its closed group, the view check before matchmaking included). The first two group
rounds are left out: they form through the DHT (no last group yet). Reported:

* ``matchmaking_seconds_p50/p95``: over every peer's rounds. A peer that reached its boundary
  early also waits there for the others, so this mixes waiting for peers with matchmaking.
* ``last_arrival_seconds_p50/p95``: per round, the smallest matchmaking time among the peers,
  i.e. that of the peer that arrived last, when everybody else was already waiting: the cost of
  matchmaking itself from the last boundary to the closed group.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from common import full_group_rounds, record_base, write_result

SMALL = ["--set", "train.inner_steps=20", "--set", "train.batch_size=8", "--set", "sync.matchmaking_timeout=15",
         "--set", "sync.reduce_timeout=8", "--set", "node.heartbeat_interval=1"]
SKIP_ROUNDS = 2  # group rounds left out at the start (formed through the DHT)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12, help="group rounds to measure (after the first two)")
    parser.add_argument("--overlap", default="delayed", help="sync.overlap: none, delayed or eager")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--label", default="", help="free text kept in the JSON line (e.g. which code ran)")
    parser.add_argument("extra", nargs="*", help="extra join flags (after --)")
    args = parser.parse_args(argv)
    extra = SMALL + ["--set", f"sync.overlap={args.overlap}"] + args.extra
    events = full_group_rounds(args.peers, args.rounds, extra, skip=SKIP_ROUNDS, seconds_per_round=30)
    by_step: dict[int, list[float]] = defaultdict(list)
    for e in events:
        by_step[e["outer_step"]].append(e["matchmaking_seconds"])
    everybody = [e["matchmaking_seconds"] for e in events]
    last = [min(times) for times in by_step.values() if len(times) == args.peers]
    result = record_base("matchmaking_stable", **{
        "label": args.label,
        "peers": args.peers,
        "overlap": args.overlap,
        "rounds_measured": len(last),
        "matchmaking_seconds_p50": statistics.median(everybody),
        "matchmaking_seconds_p95": percentile(everybody, 0.95),
        "last_arrival_seconds_p50": statistics.median(last),
        "last_arrival_seconds_p95": percentile(last, 0.95),
        "allreduce_seconds_median": statistics.median(e["allreduce_seconds"] for e in events),
    })
    write_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
