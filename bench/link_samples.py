"""How busy each peer's capped link is over time, in steps of a few milliseconds: the profile
behind bench/analysis.md's reading of the transport rows (section 3).

    python bench/link_samples.py record --prefix lct --out /tmp/links.jsonl   # until Ctrl-C
    python bench/transport.py --peers 4 --sizes-mb 64 --caps 100 ...            # meanwhile, prefix lct
    python bench/link_samples.py show /tmp/links.jsonl --mbit 100 [--bin 0.25]

``record`` reads the byte counters of the root-side veth of every namespace ``<prefix>-<i>``
(deploy/netns_cluster.py's ``<prefix>-h<i>``): what it receives is what the peer uploads, what it
sends is what the peer downloads. Only sysfs reads, in the root namespace. ``show`` prints, per
time bin with traffic, every peer's upload and download as a fraction of the cap, then the means.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def record(prefix: str, out: Path, every: float) -> None:
    with out.open("w") as fh:
        while True:
            links = sorted(Path("/sys/class/net").glob(f"{prefix}-h*"))
            sample: list = [time.monotonic()]
            for link in links:
                try:
                    up = int((link / "statistics" / "rx_bytes").read_text())
                    down = int((link / "statistics" / "tx_bytes").read_text())
                except (OSError, ValueError):  # the link went away between glob and read
                    continue
                sample.append([link.name, up, down])
            fh.write(json.dumps(sample) + "\n")
            time.sleep(every)


def show(path: Path, mbit: float, bin_seconds: float) -> None:
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    names = sorted({name for sample in samples for name, _, _ in sample[1:]})
    samples = [s for s in samples if len(s) == len(names) + 1]  # every link present
    if len(samples) < 2:
        raise SystemExit(f"{path}: fewer than two samples with all {len(names)} links")
    cap = mbit * 1e6 / 8
    # The counters at every bin boundary (the last sample at or before it): a bin's traffic is
    # the difference between its two boundaries.
    start, bins, k, j = samples[0][0], [], 0, 0
    while (t := start + j * bin_seconds) <= samples[-1][0] + 1e-9:
        while k + 1 < len(samples) and samples[k + 1][0] <= t + 1e-9:
            k += 1
        bins.append((t - start, samples[k]))
        j += 1
    print("t s    " + "  ".join(f"up {n[-3:]}" for n in names) + "   " + "  ".join(f"dn {n[-3:]}" for n in names))
    used = []
    for (t0, a), (_, b) in zip(bins, bins[1:]):
        up = [(y[1] - x[1]) / bin_seconds / cap for x, y in zip(a[1:], b[1:])]
        down = [(y[2] - x[2]) / bin_seconds / cap for x, y in zip(a[1:], b[1:])]
        if max(up) < 0.05:  # no round in this bin
            continue
        used.append((up, down))
        print(f"{t0:6.2f} " + "  ".join(f"{u:6.2f}" for u in up) + "   " + "  ".join(f"{d:6.2f}" for d in down))
    if used:
        print(f"mean upload {sum(sum(u) for u, _ in used) / len(used) / len(names):.2f} of the cap, "
              f"download {sum(sum(d) for _, d in used) / len(used) / len(names):.2f}, over {len(used)} bins with traffic")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="sample the links until interrupted")
    rec.add_argument("--prefix", default="lct", help="the benchmark's namespace prefix (transport.py: lct)")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--every", type=float, default=0.01, help="seconds between samples")
    sh = sub.add_parser("show", help="print the samples as fractions of the cap")
    sh.add_argument("path", type=Path)
    sh.add_argument("--mbit", type=float, required=True, help="the cap the links ran at")
    sh.add_argument("--bin", type=float, default=0.25, help="seconds per row")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        try:
            record(args.prefix, args.out, args.every)
        except KeyboardInterrupt:
            pass
        return 0
    show(args.path, args.mbit, args.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
