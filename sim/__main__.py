"""``python -m sim``: one simulated run (one JSON line per round, a summary file), or ``sweep``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from .engine import SimConfig, simulate

DEFAULT_SUMMARY = Path("bench/out/scale/last_run.json")


def config_parser() -> argparse.ArgumentParser:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(prog="python -m sim", description="Simulate a lowcomm swarm on virtual time "
                                     "with the real protocol classes (sim/README.md).")
    parser.add_argument("--peers", type=int, default=defaults.peers, help="peers at the start")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="outer steps to report")
    parser.add_argument("--churn", type=float, default=defaults.churn,
                        help="share of the swarm leaving per hour (as many join); default %(default)s")
    parser.add_argument("--crash-share", type=float, default=defaults.crash_share)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--mode", choices=["allreduce", "gossip"], default=defaults.mode)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--gossip-partners", type=int, default=defaults.gossip_partners)
    parser.add_argument("--links", choices=["mixed", "residential", "datacenter"], default=defaults.links)
    parser.add_argument("--speed-spread", type=float, default=defaults.speed_spread)
    parser.add_argument("--numel", type=int, default=defaults.numel, help="parameters averaged per round")
    parser.add_argument("--codec", default=defaults.codec)
    parser.add_argument("--inner-steps", type=int, default=defaults.inner_steps)
    parser.add_argument("--step-seconds", type=float, default=defaults.step_seconds)
    parser.add_argument("--heartbeat", type=float, default=defaults.heartbeat)
    parser.add_argument("--matchmaking-timeout", type=float, default=defaults.matchmaking_timeout)
    parser.add_argument("--reduce-timeout", type=float, default=defaults.reduce_timeout)
    parser.add_argument("--single-level", action="store_true",
                        help="what-if: matchmaking without buckets (one leader per step, as before protocol/buckets.py)")
    parser.add_argument("--unpaced-heartbeat", action="store_true",
                        help="the heartbeat reads the whole peer table at every beat (the node before "
                             "node/swarmpace.py; the sweeps before 2026-12-03), instead of the node's pace")
    parser.add_argument("--lag-tolerant", action="store_true",
                        help="what-if (sim/whatif.py): a peer one step behind averages at its step instead of downloading")
    parser.add_argument("--no-missed-rounds", action="store_true",
                        help="what-if: the protocol before protocol/missed_rounds.py (a peer behind always downloads)")
    parser.add_argument("--catch-up-missed-plan", action="store_true",
                        help="what-if (sim/whatif.py): a peer whose bucket missed the step's plan waits for the "
                             "step to commit and downloads, instead of training at the stale step")
    parser.add_argument("--ideal-global", action="store_true",
                        help="what-if: every group of a step ends with the same parameters (item 3), at no cost")
    parser.add_argument("--summary", type=Path, default=DEFAULT_SUMMARY, help="where the summary JSON goes")
    return parser


def config_from(args: argparse.Namespace) -> SimConfig:
    names = {f.name for f in fields(SimConfig)}
    return SimConfig(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:
        from .sweep import main as sweep_main

        return sweep_main(argv[1:])
    parser = config_parser()
    args = parser.parse_args(argv)
    config = config_from(args)
    try:
        config.check()
    except ValueError as err:
        parser.exit(2, f"python -m sim: error: {err}\n")
    lines, summary = simulate(config)
    for line in lines:
        print(json.dumps(line), flush=True)
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"summary: {args.summary}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
