#!/usr/bin/env python
"""Peak memory of writing and reading one checkpoint (node/checkpoint.py).

    python bench/checkpoint_memory.py [--numel 50000000]

Saves a state of ``--numel`` float32 values, drops it, reads it back, and prints one JSON line
with how far each step raised the process's peak RSS above the state's own size. Run it in a
fresh process: the peak RSS of a process only ever grows.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

import torch

from lowcomm.node import checkpoint


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=50_000_000)
    args = parser.parse_args(argv)
    payload = {"step": 1, "params": torch.randn(args.numel)}
    state_mb = args.numel * 4 / 2**20
    base = peak_mb()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.save(Path(tmp), 1, payload)
        after_save = peak_mb()
        del payload
        checkpoint.read(path)
        after_read = peak_mb()
    print(json.dumps({"bench": "checkpoint_memory", "state_mb": round(state_mb),
                      "save_extra_mb": round(after_save - base), "read_extra_mb": round(after_read - base)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
