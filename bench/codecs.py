#!/usr/bin/env python
"""Throughput, compression ratio and error of the sync-protocol codecs.

    python bench/codecs.py [--numel N] [--codecs int8,int4] [--repeat R] [--threads T]
                           [--json-out PATH]

Prints one JSON line per codec:
    codec, numel, encode_MBps, decode_MBps, ratio, rel_error, threads
MB/s are megabytes (1e6 bytes) of float32 input processed per second (4 * numel / time),
the median of R repeats; each repeat times one encode and then one decode of its payload,
the pattern of a sync round. ratio = 4 * numel / len(payload); rel_error = ||x - decode(encode(x))||
/ ||x|| for one round trip without error feedback. Data: N(0, 1) float32, fixed seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from lowcomm.protocol import codecs


def bench_codec(codec: codecs.Codec, x: torch.Tensor, repeat: int) -> dict:
    n = x.numel()
    payload = codec.encode(x)  # warm-up (and the payload for the error and ratio)
    decoded = codec.decode(payload, n)
    enc_s, dec_s = [], []
    for _ in range(repeat):
        del payload, decoded  # free the previous round's buffers, as a node would
        t0 = time.perf_counter()
        payload = codec.encode(x)
        t1 = time.perf_counter()
        decoded = codec.decode(payload, n)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
    mb = 4 * n / 1e6
    norm = float(x.norm())
    return {
        "codec": codec.name,
        "numel": n,
        "encode_MBps": round(mb / statistics.median(enc_s), 1),
        "decode_MBps": round(mb / statistics.median(dec_s), 1),
        "ratio": round(4 * n / len(payload), 3) if len(payload) else None,
        "rel_error": float(x.sub(decoded).norm()) / norm if norm > 0 else 0.0,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=16 * 2**20, help="values per tensor (default 16*2**20)")
    ap.add_argument("--codecs", default=",".join(codecs.CODEC_NAMES), help="comma-separated codec names")
    ap.add_argument("--repeat", type=int, default=9, help="timed repeats; the median is reported (default 9)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    ap.add_argument("--json-out", metavar="PATH", help="also append the JSON lines to PATH")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeat < 1 or args.threads < 1:
        ap.error("--numel, --repeat and --threads must be >= 1")
    names = [c.strip() for c in args.codecs.split(",") if c.strip()]
    try:
        selected = [codecs.get_codec(name) for name in names]
    except ValueError as e:
        ap.error(str(e))

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.numel, generator=gen, dtype=torch.float32)

    lines = []
    for codec in selected:
        line = json.dumps(bench_codec(codec, x, args.repeat))
        print(line, flush=True)
        lines.append(line)
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
