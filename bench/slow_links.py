#!/usr/bin/env python
"""Slow links: wall-clock to a fixed target eval loss for ddp, hivemind and the best DiLoCo setting.

    python bench/slow_links.py [--caps 100,20] [--diloco auto|int8-H50] [--target auto|LOSS]
                               [--ddp-steps 30] [--ddp-full] [--max-factor 2] [workload flags]
                               [--json-out bench/out/slow_links.jsonl]

Every peer sits in its own network namespace capped at C Mbit/s in both directions (tc tbf,
deploy/netns_cluster.py); root only, otherwise one "skipped" record says why. The target is
the final eval loss of ddp on unlimited links: ``auto`` takes it from the latest convergence
run with the same workload (bench/out/convergence.jsonl) and runs that ddp here if there is
none. Per cap:

* ``ddp``: synchronous and deterministic, so its loss after k steps does not depend on the link;
  only the time per step does. It runs ``--ddp-steps`` steps on the capped link, and its time to
  target is (steps ddp needed on unlimited links) × (median seconds per step measured here),
  marked ``estimated``. ``--ddp-full`` runs it to the target instead.
* ``hivemind`` and ``diloco-<codec>-H<h>``: timing changes what they compute, so they run for
  real until the global model reaches the target, or ``--max-factor`` × the workload's steps
  (more tokens than ddp used), or ``--time-limit``.

``--diloco auto`` takes the DiLoCo setting with the lowest final eval loss in the latest
convergence run (int8-H50 if there is none).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import (OUT, append_jsonl, handle_signals, netns_unavailable, network, read_jsonl, record_base, say,
                    tcp_congestion_arg, workload_args, workload_from)
from convergence import METHOD_RE, hivemind_args, hivemind_options, run_method
from runners import run_ddp, with_target


def same_workload(record: dict, work) -> bool:
    w = record.get("workload") or {}
    return (w.get("steps"), w.get("batch_size"), w.get("seq_len"), w.get("preset"), w.get("seed"),
            record.get("peers")) == (work.steps, work.batch_size, work.seq_len, work.preset, work.seed, work.peers)


def latest_convergence(path: Path, work) -> list[dict]:
    """The records of the newest convergence run with this workload (on uncapped links)."""
    records = [r for r in read_jsonl(path) if r.get("ok") and same_workload(r, work) and not r.get("mbit")]
    if not records:
        return []
    newest = max(r["run_id"] for r in records)
    return [r for r in records if r["run_id"] == newest]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="100,20", help="Mbit/s per peer, comma-separated")
    parser.add_argument("--diloco", default="auto", help="DiLoCo setting <codec>-H<h>, or auto")
    parser.add_argument("--methods", default="ddp,hivemind,diloco", help="subset of ddp,hivemind,diloco")
    parser.add_argument("--target", default="auto", help="target eval loss, or auto (ddp on unlimited links)")
    parser.add_argument("--ddp-steps", type=int, default=30, help="steps ddp runs on a capped link (timing only)")
    parser.add_argument("--ddp-full", action="store_true", help="run ddp on capped links until the target")
    parser.add_argument("--max-factor", type=float, default=2.0,
                        help="hivemind and diloco may run up to this × --steps steps per peer to reach the target")
    parser.add_argument("--time-limit", type=float, default=600, help="seconds per run before it is stopped")
    parser.add_argument("--convergence", type=Path, default=OUT / "convergence.jsonl")
    parser.add_argument("--json-out", type=Path, default=OUT / "slow_links.jsonl")
    parser.add_argument("--prefix", default="lcs")
    tcp_congestion_arg(parser)
    hivemind_args(parser)
    workload_args(parser)
    args = parser.parse_args(argv)
    handle_signals()
    work = workload_from(args)
    caps = [float(c) for c in args.caps.split(",") if c.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    run_id = time.strftime("%Y%m%dT%H%M%S")
    logdir = args.json_out.parent / "logs" / f"slow_links-{run_id}"
    reason = netns_unavailable()
    if reason is not None:
        say(f"slow_links: skipped: {reason}")
        append_jsonl(args.json_out, record_base("slow_links", run_id=run_id, skipped=reason))
        return 0

    previous = latest_convergence(args.convergence, work)
    ddp_free = next((r for r in previous if r["method"] == "ddp"), None)
    diloco = args.diloco
    if diloco == "auto":
        candidates = [r for r in previous if r["method"].startswith("diloco-") and r.get("final_eval_loss")]
        best = min(candidates, key=lambda r: (r["final_eval_loss"], -r.get("inner_steps", 0)), default=None)
        diloco = best["method"].removeprefix("diloco-") if best else "int8-H50"
    if not METHOD_RE.match(f"diloco-{diloco}"):
        raise SystemExit(f"--diloco {diloco!r}: expected <codec>-H<h>, e.g. int8-H50")

    started = time.monotonic()
    with network("netns", work.peers, prefix=args.prefix, tcp_congestion=args.tcp_congestion) as net:
        if args.target == "auto" and ddp_free is None:
            say("slow_links: no convergence run of ddp with this workload: running it on unlimited links")
            ddp_free = run_ddp(work, net, logdir / "ddp-unlimited")
            append_jsonl(args.json_out, record_base("slow_links", run_id=run_id, role="reference", **ddp_free))
        target = ddp_free["final_eval_loss"] if args.target == "auto" else float(args.target)
        ref_steps = None
        if ddp_free is not None:
            ref_steps = next((p["step"] for p in ddp_free["curve"] if p["eval_loss"] <= target), None)
        say(f"slow_links: target eval loss {target:.4f}; ddp needs {ref_steps} steps on unlimited links; "
            f"diloco setting {diloco}")
        max_steps = int(math.ceil(args.max_factor * work.steps))
        for mbit in caps:
            net.set_cap(mbit)
            for method in methods:
                name = {"ddp": "ddp", "hivemind": "hivemind", "diloco": f"diloco-{diloco}"}[method]
                t0 = time.monotonic()
                say(f"{name} at {mbit:g} Mbit/s: starting")
                try:
                    if name == "ddp" and not args.ddp_full:
                        short = replace(work, steps=args.ddp_steps, eval_every=args.ddp_steps)
                        record = run_ddp(short, net, logdir / f"ddp-{mbit:g}", args.time_limit)
                        record = with_target(record, target)
                        seconds = record["step_seconds_median"]
                        record["time_to_target"] = None if ref_steps is None else {
                            "wall": ref_steps * seconds, "tokens": ref_steps * work.tokens_per_step,
                            "step": ref_steps, "estimated": True}
                        if ddp_free is not None:  # where ddp would be: its unlimited curve, stretched
                            record["curve_estimated"] = [
                                {**p, "wall": p["step"] * seconds} for p in ddp_free["curve"]]
                        record["notes"].append(
                            f"time to target estimated: {ref_steps} steps (ddp on unlimited links) × median "
                            f"{seconds:.3f} s per step measured over {args.ddp_steps} steps at {mbit:g} Mbit/s")
                    else:
                        if name == "ddp":
                            long = replace(work, steps=max_steps)
                            record = run_ddp(long, net, logdir / f"ddp-{mbit:g}", args.time_limit)
                        else:
                            record = run_method(name, work, net, logdir / f"{mbit:g}", args.time_limit,
                                                target=target, max_steps=max_steps, hivemind=hivemind_options(args))
                        record = with_target(record, target)
                except Exception as err:
                    say(f"{name} at {mbit:g} Mbit/s: FAILED: {err}")
                    record = {"method": name, "mbit": mbit, "ok": False, "curve": [], "error": str(err)[-2000:],
                              "target_loss": target, "time_to_target": None, "peers": work.peers, "logs": str(logdir)}
                record = record_base("slow_links", run_id=run_id, elapsed_seconds=time.monotonic() - t0,
                                     ddp_reference_steps=ref_steps, **record)
                append_jsonl(args.json_out, record)
                ttt = record.get("time_to_target")
                say(f"{name} at {mbit:g} Mbit/s: time to target {ttt['wall'] if ttt else None} "
                    f"({time.monotonic() - t0:.0f} s)")
    say(f"slow_links: done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
