"""One averaging round of the default model on loopback: time and bytes per peer vs the bound.

    python bench/round_loopback.py [--peers 3] [--rounds 6] [--json-out FILE] [-- extra join flags]

Starts N real `lowcomm-node join` processes on 127.0.0.1, lets them train and average, and
reads their `round_done` events. For rounds in which all N peers averaged together it reports
the median all-reduce time, the median whole-round time (including matchmaking, which waits for
the slowest peer's inner phase), and the bytes each peer sent next to the butterfly bound
2·(N−1)/N·S, where S is the encoded size of the whole pseudo-gradient.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import full_group_rounds, record_base, write_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6, help="group rounds to measure")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("extra", nargs="*", help="extra join flags (after --)")
    args = parser.parse_args(argv)
    events = full_group_rounds(args.peers, args.rounds, args.extra)
    n = args.peers
    payload = events[0]["payload_bytes"]
    bound = 2 * (n - 1) / n * payload
    sent = [e["bytes_sent"] for e in events]
    result = record_base("round_loopback", **{
        "peers": n,
        "numel": events[0]["numel"],
        "codec": events[0]["codec"],
        "payload_bytes": payload,
        "rounds_measured": len(events) // n,
        "allreduce_seconds_median": statistics.median(e["allreduce_seconds"] for e in events),
        "round_seconds_median": statistics.median(e["round_seconds"] for e in events),
        "bytes_sent_per_peer_median": statistics.median(sent),
        "bytes_sent_per_peer_max": max(sent),
        "bound_bytes": bound,
        "sent_over_bound": statistics.median(sent) / bound,
    })
    write_result(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
