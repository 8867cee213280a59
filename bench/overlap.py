#!/usr/bin/env python
"""Blocking vs overlapped rounds on capped links: compute utilization and eval loss at equal tokens.

    python bench/overlap.py [--mbit 20] [--modes none,delayed,eager] [--rounds 8] [--inner-steps 50]
                            [--peers 4] [--batch-size 8] [--codec int8] [--seeds 0,1,2]
                            [--time-limit 600] [--json-out bench/out/overlap.jsonl] [--prefix lco]

The same swarm (``--peers`` ``lowcomm-node join`` processes, fixed identities, per seed the same
data and initial weights) runs once per ``[sync] overlap`` mode and seed inside network
namespaces capped at ``--mbit`` both ways, for ``--rounds`` outer rounds of ``--inner-steps``
steps, through the harness of the convergence benchmark (runners.run_diloco: held at start-up
and released together, every node joins a DHT peer of the harness). One JSON line per mode and
seed:

* ``utilization_window``: per peer, (train_seconds at its last round − at its second round) /
  (train_clock at its last round − at its second), from the nodes' ``round_done`` events:
  ``train_seconds`` is the node's own time in inner steps and ``train_clock`` its wall-clock
  time, both since it started training and both taken at the end of its latest inner phase
  (the event itself is logged later, once the eval and checkpoint are written). The first
  round is left out: start-up and the first matchmaking are the same in every mode and would
  hide the difference. Median and minimum over peers.
* ``utilization_since_start``: the node's ``compute_utilization`` at its last round, i.e. the
  value of its ``lowcomm_compute_utilization_ratio`` gauge then (median over peers).
* ``eval_curve``: per outer step, the eval loss of the global model (identical on every peer)
  and ``tokens_in_model``, the tokens in the global model: what each peer's Δ stood for (its
  weight, ``round_done.tokens_averaged``), summed over the peers and the rounds up to that step.
  Outer steps hold different tokens in different modes: an overlapped peer ends its inner phase
  when the round of its step started elsewhere (so phases are shorter), and a round a peer
  missed ("nobody averaged with us", counted in ``rounds_without_result``) leaves its progress
  for its next Δ; results.py therefore compares the modes at equal ``tokens_in_model``
  (interpolated), not at equal outer steps.
  ``eval_loss``: after outer step ``--rounds``.
* ``matchmaking_seconds_p50`` / ``_p95``: the nodes' ``round_done.matchmaking_seconds`` over
  every round but each peer's first (nearest rank): how long a group that stays together takes
  to meet again (the direct path of protocol/direct.py; the DHT path is its fallback).
* ``round_late``: how often a node's training waited for a background round that was more than
  one inner phase late (the node's ``round_late`` event), per peer.

Root only (network namespaces); otherwise one "skipped" record says why. ``python
bench/results.py`` turns the newest run into the section "Overlap on 20 Mbit/s links".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from common import (OUT, Workload, append_jsonl, handle_signals, nearest_rank, netns_unavailable, network, record_base,
                    say, tcp_congestion_arg)
from runners import run_diloco

MODES = ("none", "delayed", "eager")
# Timeouts short enough that a failed round costs seconds, not the node's 30 s / 60 s defaults.
SETTINGS = ["sync.matchmaking_timeout=20", "sync.reduce_timeout=20", "node.heartbeat_interval=1"]


def stable_meetings(records: list[dict]) -> list[float]:
    """Sorted ``matchmaking_seconds`` of every peer's rounds but its first, over ``records`` (run_diloco
    records or their summaries: both carry ``peer_rounds``). The first round meets through the DHT
    like any newcomer's; the others are a group that stays together (the direct path)."""
    return sorted(e["matchmaking_seconds"] for r in records for events in r.get("peer_rounds") or []
                  for e in events[1:] if e.get("matchmaking_seconds") is not None)


def summarize(record: dict, rounds: int) -> dict:
    """The overlap numbers of one run_diloco record (see the module docstring)."""
    peers = record.get("peer_rounds") or []
    windows = []
    for events in peers:
        if len(events) >= 3 and events[-1].get("train_clock") is not None:
            first, last = events[1], events[-1]
            if last["train_clock"] > first["train_clock"]:
                windows.append((last["train_seconds"] - first["train_seconds"])
                               / (last["train_clock"] - first["train_clock"]))
    since = [events[-1]["compute_utilization"] for events in peers if events]
    # Tokens in the global model after each outer step: what every peer's Δ stood for
    # (round_done.tokens_averaged, its weight in the round), summed over its rounds up to it.
    at_step: dict[int, float] = {}
    added: dict[int, float] = {}
    for events in peers:
        for e in events:
            at_step.setdefault(e["outer_step"], e["eval_loss"])
            added[e["outer_step"]] = added.get(e["outer_step"], 0) + (e.get("tokens_averaged") or 0)
    tokens: dict[int, int] = {}
    running = 0.0
    for step in sorted(added):
        running += added[step]
        tokens[step] = int(running)
    final_step = rounds if rounds in at_step else max(at_step, default=None)
    meets = stable_meetings([record])
    return {
        "matchmaking_seconds_p50": nearest_rank(meets, 0.5),
        "matchmaking_seconds_p95": nearest_rank(meets, 0.95),
        "matchmaking_rounds": len(meets),
        "utilization_window_median": statistics.median(windows) if windows else None,
        "utilization_window_min": min(windows) if windows else None,
        "utilization_window_per_peer": windows,
        "utilization_since_start_median": statistics.median(since) if since else None,
        "eval_outer_step": final_step,
        "eval_loss": at_step.get(final_step),
        "tokens_in_model": tokens.get(final_step),
        "eval_curve": [{"outer_step": s, "eval_loss": at_step[s], "tokens_in_model": tokens.get(s)}
                       for s in sorted(at_step)],
        "rounds_without_result": record.get("rounds_without_result"),
        "round_seconds_median": record.get("round_seconds_median"),
        "round_late": record.get("round_late"),
        "rounds_done_per_peer": [len(events) for events in peers],
        "group_sizes": sorted({e["group_size"] for events in peers for e in events}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbit", type=float, default=20.0, help="cap per peer, both directions")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=8,
                        help="outer rounds per mode (8 × H=50: the 400 steps per peer of the convergence benchmark)")
    parser.add_argument("--inner-steps", type=int, default=50, help="H (50: the node's default)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per peer per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seeds", default="0,1,2",
                        help="one run of every mode per seed (data order and initial weights); the penalty is "
                             "taken per seed against blocking rounds with the same seed, then averaged")
    parser.add_argument("--codec", default="int8")
    parser.add_argument("--time-limit", type=float, default=600, help="seconds per mode before it is stopped")
    parser.add_argument("--json-out", type=Path, default=OUT / "overlap.jsonl")
    parser.add_argument("--prefix", default="lco", help="netns cluster prefix")
    tcp_congestion_arg(parser)
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra node setting for every mode, e.g. sync.outer_momentum=0.5 (repeatable; "
                             "kept in the record as node_sets)")
    args = parser.parse_args(argv)
    handle_signals()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--seeds takes integers separated by commas, not {args.seeds!r}") from None
    if not seeds:
        raise SystemExit("--seeds needs at least one seed")
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if args.rounds < 3:
        raise SystemExit("--rounds must be at least 3 (the window runs from the second round to the last)")
    run_id = time.strftime("%Y%m%dT%H%M%S")
    reason = netns_unavailable()
    if reason is not None:
        say(f"overlap: skipped: {reason}")
        append_jsonl(args.json_out, record_base("overlap", run_id=run_id, skipped=reason))
        return 0
    logdir = args.json_out.parent / "logs" / f"overlap-{run_id}"
    started = time.monotonic()
    with network("netns", args.peers, mbit=args.mbit, prefix=args.prefix, tcp_congestion=args.tcp_congestion) as net:
        say(f"overlap: modes {modes}, seeds {seeds} on {net.describe()}; logs in {logdir}")
        for seed, mode in [(seed, mode) for seed in seeds for mode in modes]:
            work = Workload(peers=args.peers, steps=args.rounds * args.inner_steps, batch_size=args.batch_size,
                            seq_len=args.seq_len, seed=seed)
            t0 = time.monotonic()
            say(f"overlap={mode} seed={seed}: starting")
            base = {"mode": mode, "seed": seed, "mbit": args.mbit, "peers": work.peers, "rounds": args.rounds,
                    "inner_steps": args.inner_steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                    "codec": args.codec, "logs": str(logdir / f"{mode}-seed{seed}"), "node_sets": args.sets,
                    "tcp_congestion": net.tcp_congestion}
            try:
                run = run_diloco(work, net, logdir / f"{mode}-seed{seed}", args.codec, args.inner_steps, rounds=args.rounds,
                                 time_limit=args.time_limit, extra_sets=[f"sync.overlap={mode}", *SETTINGS, *args.sets])
                phase_tokens = args.inner_steps * args.batch_size * args.seq_len
                record = {**base, **summarize(run, args.rounds), "ok": run["ok"],
                          "notes": run["notes"], "wall_seconds": run["wall_seconds"],
                          "startup_seconds": run.get("startup_seconds"), "peer_rounds": run["peer_rounds"],
                          "tokens_planned": work.peers * args.rounds * phase_tokens}
            except Exception as err:  # one broken mode must not cost the others' results
                say(f"overlap={mode} seed={seed}: FAILED: {err}")
                record = {**base, "ok": False, "error": str(err)[-2000:]}
            record = record_base("overlap", run_id=run_id, elapsed_seconds=time.monotonic() - t0, **record)
            append_jsonl(args.json_out, record)
            say(f"overlap={mode} seed={seed}: utilization (window) {record.get('utilization_window_median')}, eval loss "
                f"{record.get('eval_loss')}, round_late {record.get('round_late')}, {time.monotonic() - t0:.0f} s")
    say(f"overlap: done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
