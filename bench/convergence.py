#!/usr/bin/env python
"""Convergence at equal tokens: single, ddp, diloco-<codec>-H<h> (the real node), hivemind.

    python bench/convergence.py [--methods single,ddp,diloco-int8-H50,hivemind,...]
                                [--network auto|loopback|netns] [workload flags] [--seeds 0,1,2]
                                [--json-out bench/out/convergence.jsonl] [--time-limit S]
    python bench/convergence.py --long     # the long, fair benchmark: 1,000 steps, seeds 0, 1, 2

Every method trains the `tiny` preset on the default corpus with ``--peers`` processes (one torch
thread each), ``--steps`` optimizer steps per peer of ``--batch-size`` sequences, so all of them
see the same tokens per peer and the same global batch (``single``: one process, the global
batch). The global model is evaluated on the node's fixed held-out batches. Methods:

    single                 one process, AdamW (bench/baselines/ddp.py --world-size 1)
    ddp                    gradient all-reduce every step over gloo (bench/baselines/ddp.py)
    diloco-<codec>-H<h>    `lowcomm-node join` processes, codec fp32|fp16|bf16|int8|int4|topk|sparseloco
                           (with `--set sync.method=sparseloco`: SparseLoCo's outer rule too),
                           h inner steps per round, steps/h rounds (--max-rounds)
    sparseloco-H<h>        the node's `[sync] method = "sparseloco"` (codec and outer rule), h inner steps
    desloc-H<h>, mtdao-H<h>  the node's `[sync] method = "desloc"` / `"mtdao"` (optimizer-state sync,
                           the int8 codec, the outer defaults), h inner steps
    hivemind[-H<h>]        hivemind.Optimizer, local updates, 8-bit averaging every h steps (50)

``--seeds`` repeats every method for each seed (initial weights and data order; every method of
one seed starts from the same weights and reads the same batches). ``--long`` is the benchmark
of issue 16: ``--steps 1000`` (20 outer steps at H=50), seeds 0, 1, 2, the LONG methods, records
to bench/out/convergence_long.jsonl; bench/results.py reports the mean and range over seeds at
equal tokens.

``--network auto`` runs the multi-peer methods in network namespaces without a cap when this
machine can (root), which adds the bytes each peer put on the wire; otherwise on loopback.
One JSON line per method goes to ``--json-out``; ``python bench/results.py`` turns the latest
run into bench/RESULTS.md and the plots in bench/plots/.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from common import (OUT, append_jsonl, handle_signals, network, record_base, say, tcp_congestion_arg, workload_args,
                    workload_from)
from runners import run_ddp, run_diloco, run_hivemind, run_single

STANDARD = ("single,ddp,diloco-fp32-H50,diloco-int8-H50,diloco-int4-H50,diloco-topk-H50,"
            "diloco-int8-H10,diloco-int8-H200,hivemind")
LONG = "ddp,single,diloco-int8-H50,diloco-int4-H50,sparseloco-H20,desloc-H50,mtdao-H50,hivemind"
LONG_STEPS = 1000
LONG_SEEDS = "0,1,2"
METHOD_RE = re.compile(r"^(single|ddp|hivemind(?:-H(\d+))?|diloco-(fp32|fp16|bf16|int8|int4|topk|sparseloco)-H(\d+)"
                       r"|(sparseloco|desloc|mtdao)-H(\d+))$")
# The named node methods ([sync] method) and the codec each runs with: sparseloco's is its own,
# desloc and mtdao change the inner optimizer and its state sync, not the parameters' codec.
NAMED_CODEC = {"sparseloco": "sparseloco", "desloc": "int8", "mtdao": "int8"}


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if not METHOD_RE.match(m)]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; expected single, ddp, hivemind[-H<h>], diloco-<codec>-H<h>, "
                         "sparseloco-H<h>, desloc-H<h>, mtdao-H<h>")
    return methods


def run_method(method: str, work, net, logdir: Path, time_limit: float, target: float | None = None,
               max_steps: int | None = None, hivemind: dict | None = None, node_sets: list[str] = ()) -> dict:
    """One method on ``net``; ``max_steps`` (per peer) lets a run with a target go past work.steps;
    ``hivemind``: keyword arguments of run_hivemind (matchmaking_time, averaging_timeout)."""
    match = METHOD_RE.match(method)
    if method == "single":
        return run_single(work, logdir / method, time_limit)
    if method == "ddp":
        return run_ddp(work, net, logdir / method, time_limit)
    if method.startswith("hivemind"):
        sync_every = int(match.group(2) or 50)
        return run_hivemind(work, net, logdir / method, sync_every=sync_every, steps=max_steps, target=target,
                            time_limit=time_limit, **(hivemind or {}))
    if match.group(5):  # a named method: [sync] method sets its codec, outer rule and state sync together
        name = match.group(5)
        codec, h, node_sets = NAMED_CODEC[name], int(match.group(6)), [f"sync.method={name}", *node_sets]
    else:
        codec, h = match.group(3), int(match.group(4))
    if work.steps % h:
        raise SystemExit(f"{method}: --steps {work.steps} is not a multiple of H={h} (tokens would differ)")
    outer = node_outer(work, codec, h, list(node_sets))  # before the run: a bad --set fails at once
    record = run_diloco(work, net, logdir / method, codec, h, rounds=(max_steps or work.steps) // h, target=target,
                        time_limit=time_limit, extra_sets=list(node_sets))
    record["method"] = method
    record.update(outer)
    return record


def node_outer(work, codec: str, h: int, node_sets: list[str]) -> dict:
    """The sync method and outer optimizer the nodes run with, as the node's own config resolves
    them from the workload and ``--set`` flags (so a record says which defaults it had: they
    changed from 0.7 / 0.9 to 1.0 / 0.5 on 2026-12-01, bench/results.py labels the rows by them)."""
    sync = work.config(extra=[f"train.inner_steps={h}", f"sync.codec={codec}", *node_sets]).sync
    return {"sync_method": sync.method, "outer_lr": sync.outer_lr, "outer_momentum": sync.outer_momentum}


def hivemind_args(parser) -> None:
    parser.add_argument("--hivemind-matchmaking-time", type=float, default=3.0,
                        help="hivemind.Optimizer matchmaking_time in seconds (default 3)")
    parser.add_argument("--hivemind-averaging-timeout", type=float, default=60.0,
                        help="hivemind.Optimizer averaging_timeout in seconds (default 60)")


def hivemind_options(args) -> dict:
    return {"matchmaking_time": args.hivemind_matchmaking_time, "averaging_timeout": args.hivemind_averaging_timeout}


def run_one(method: str, seed: int, work, net, logdir: Path, run_id: str, args) -> None:
    """One method of one seed; its record (or its failure) goes to --json-out."""
    t0 = time.monotonic()
    say(f"{method} (seed {seed}): starting")
    try:
        record = run_method(method, work, net, logdir, args.time_limit, hivemind=hivemind_options(args),
                            node_sets=args.sets)
        if args.sets and ("diloco" in method or "sparseloco" in method):
            record["node_sets"] = args.sets
    except Exception as err:  # one broken method must not cost the others' results
        say(f"{method}: FAILED: {err}")
        record = {"method": method, "network": net.kind, "ok": False, "curve": [], "error": str(err)[-2000:],
                  "logs": str(logdir / method)}
    record = record_base("convergence", run_id=run_id, seed=seed, elapsed_seconds=time.monotonic() - t0, **record)
    append_jsonl(args.json_out, record)
    say(f"{method} (seed {seed}): final eval loss {record.get('final_eval_loss')}, wall {record.get('wall_seconds')}, "
        f"{time.monotonic() - t0:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", help=f"comma-separated (default: {STANDARD}; --long: {LONG})")
    parser.add_argument("--network", choices=["auto", "loopback", "netns"], default="auto")
    parser.add_argument("--json-out", type=Path, help="default: bench/out/convergence.jsonl "
                        "(--long: bench/out/convergence_long.jsonl)")
    parser.add_argument("--seeds", help="comma-separated seeds; every method runs once per seed (default: --seed)")
    parser.add_argument("--long", action="store_true",
                        help=f"the long benchmark: --steps {LONG_STEPS}, --seeds {LONG_SEEDS}, --methods {LONG} "
                             "unless given")
    parser.add_argument("--time-limit", type=float, default=900, help="seconds per method before it is stopped")
    parser.add_argument("--prefix", default="lcb", help="netns cluster prefix (namespaces <prefix>-<i>)")
    tcp_congestion_arg(parser)
    parser.add_argument("--run-id", help="add the records to this earlier run (to repeat a method that failed); "
                        "default: a new run")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra node setting for the diloco methods, e.g. sync.outer_momentum=0.5 (repeatable; "
                             "kept in the record as node_sets; use another --json-out for such sweeps)")
    hivemind_args(parser)
    workload_args(parser)
    args = parser.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.long and not any(a == "--steps" or a.startswith("--steps=") for a in given):
        args.steps = LONG_STEPS
    args.methods = args.methods or (LONG if args.long else STANDARD)
    args.json_out = args.json_out or OUT / ("convergence_long.jsonl" if args.long else "convergence.jsonl")
    try:
        seeds = [int(x) for x in (args.seeds or (LONG_SEEDS if args.long else str(args.seed))).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {args.seeds!r}: expected comma-separated integers such as 0,1,2") from None
    handle_signals()
    methods = parse_methods(args.methods)
    run_id = args.run_id or time.strftime("%Y%m%dT%H%M%S")
    logdir = args.json_out.parent / "logs" / f"convergence-{run_id}"
    started = time.monotonic()
    with network(args.network, args.peers, prefix=args.prefix, tcp_congestion=args.tcp_congestion) as net:
        say(f"convergence: {len(methods)} method(s) on {net.describe()}; logs in {logdir}")
        for seed in seeds:
            args.seed = seed
            work = workload_from(args)
            for method in methods:
                run_one(method, seed, work, net, logdir / (f"seed{seed}" if len(seeds) > 1 else ""), run_id, args)
    say(f"convergence: done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
