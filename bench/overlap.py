"""Blocking vs overlapped rounds on capped links: compute utilization and eval loss at equal tokens.

    sudo .venv/bin/python bench/overlap.py [--mbit 20] [--peers 3] [--rounds 8] [--json-out FILE]

Runs the same swarm three times inside the network-namespace cluster (deploy/netns_cluster.py),
each peer capped at --mbit both ways, with `[sync] overlap` = none, delayed and eager. For each
mode it reports the compute utilization (share of wall time in inner steps, measured by every
node since its start) after --rounds outer steps, and the eval loss of the global model at that
step (equal tokens per peer across modes). Needs root (ip netns, tc).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from netns_cluster import netns_cluster, unavailable_reason  # noqa: E402

SETTINGS = ["--torch-threads", "1", "--set", "train.inner_steps=20", "--set", "train.batch_size=8",
            "--set", "sync.matchmaking_timeout=20", "--set", "sync.reduce_timeout=20",
            "--set", "node.heartbeat_interval=1"]


def run_mode(mode: str, peers: int, mbit: float, rounds: int, timeout: float) -> dict:
    prefix = {"none": "lovn", "delayed": "lovd", "eager": "love"}[mode]
    with netns_cluster(peers, mbit, prefix=prefix, join_args=[*SETTINGS, "--set", f"sync.overlap={mode}"]) as state:
        deadline = time.monotonic() + timeout
        while True:
            done = [[e for e in state.events(i) if e.get("event") == "round_done"] for i in range(peers)]
            if all(len(d) >= rounds for d in done) or time.monotonic() > deadline:
                break
            time.sleep(1.0)  # a benchmark poll of the nodes' log files
    at = [d[rounds - 1] for d in done if len(d) >= rounds]
    if len(at) < peers:
        raise RuntimeError(f"{mode}: only {len(at)} of {peers} peers reached {rounds} rounds in {timeout:.0f}s")
    # Utilization over the measured window (2nd to last round), not since start-up: start-up and
    # the first catch-up are the same in every mode and would hide the difference.
    windowed = [(d[rounds - 1]["train_seconds"] - d[1]["train_seconds"]) / (d[rounds - 1]["ts"] - d[1]["ts"])
                for d in done]
    return {
        "bench": "overlap", "mode": mode, "peers": peers, "mbit": mbit, "rounds": rounds,
        "compute_utilization_window_median": statistics.median(windowed),
        "compute_utilization_since_start_median": statistics.median(e["compute_utilization"] for e in at),
        "eval_loss_median": statistics.median(e["eval_loss"] for e in at),
        "outer_step_median": statistics.median(e["outer_step"] for e in at),
        "tokens_per_peer": statistics.median(e["tokens_total"] for e in at),
        "round_seconds_median": statistics.median(e["round_seconds"] for d in done for e in d[1:rounds]),
        "group_sizes": sorted({e["group_size"] for d in done for e in d[:rounds]}),
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbit", type=float, default=20.0)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--modes", default="none,delayed,eager")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}", file=sys.stderr)
        return 2
    for mode in args.modes.split(","):
        line = json.dumps(run_mode(mode, args.peers, args.mbit, args.rounds, args.timeout))
        print(line, flush=True)
        if args.json_out:
            with args.json_out.open("a") as fh:
                fh.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
