#!/usr/bin/env python
"""A member gone before the all-reduce: how long the rest of its group takes to end the round.

    python bench/dead_member.py [--peers 3,5] [--numel 100003] [--reduce-timeout 60] [--rounds 3]
                                [--schedule staggered,ring] [--json-out bench/out/dead_member.jsonl]
                                [--label TEXT]

A peer that crashes between matchmaking and the all-reduce is still a member of its group. N
agents of the transport benchmark (bench/transport_agent.py: the project's all-reduce over gRPC,
on loopback) run a warm-up round together; then the last one quits, and the other N − 1 run
``--rounds`` rounds of a group that still lists it. Every round skips the shards the dead member
owned (butterfly) or every shard (ring: a ring needs every member, protocol/ring.py); what this
measures is how soon the survivors know it and end the round, against the deadline a round that
waits for the member would take, reduce_timeout · (1 + RESULT_MARGIN).

Each record (one per schedule and N): the rounds' times from the last survivor's start to the last
one's end (median, min, max), the shards skipped, and the deadline. The first round after the death
also holds the survivors' one more connection attempt to a peer they had a connection to
(protocol/channels.py ``wait_for_reconnect``: a peer that restarted gets back in).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from common import OUT, PY, Proc, append_jsonl, handle_signals, network, processes, record_base, say
from transport import AGENT, _ask, lowcomm_round, schedules

from lowcomm.protocol import codecs
from lowcomm.protocol.member import RESULT_MARGIN


def ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated group sizes of 2 or more")
    return values


def measure(schedule: str, peers: int, numel: int, reduce_timeout: float, rounds: int, logdir: Path) -> dict:
    codec = codecs.get_codec("fp32")
    net = network("loopback", peers)
    with net as loopback, processes() as agents:
        for i in range(peers):
            agents.append(Proc(f"agent-{i}", loopback.wrap(i, [PY, str(AGENT), "lowcomm", "--index", str(i),
                                                               "--host", "127.0.0.1", "--port", "0"]),
                               stdin=True, log_path=logdir / f"agent-{i}-{schedule}-{peers}.log"))
        addresses = [a.wait_event("ready", 120)["address"] for a in agents]
        _ask(agents, {"cmd": "setup", "numel": numel}, "setup_done", 120)
        warmup = lowcomm_round(agents, addresses, numel, int(codec.id), reduce_timeout, 1, schedule)
        if warmup["skipped_shards"]:
            raise RuntimeError(f"the warm-up round of all {peers} agents skipped {warmup['skipped_shards']} shards")
        agents[-1].send('{"cmd": "quit"}')  # dies after matchmaking: the group below still lists it
        agents[-1].wait_exit(60)
        survivors = agents[:-1]
        results = [lowcomm_round(survivors, addresses, numel, int(codec.id), reduce_timeout, step, schedule,
                                 absent=1) for step in range(2, rounds + 2)]
        for agent in survivors:
            agent.send('{"cmd": "quit"}')
    seconds = [r["seconds"] for r in results]
    return record_base(
        "dead_member", schedule=schedule, peers=peers, numel=numel, codec=codec.name, network="loopback",
        reduce_timeout=reduce_timeout, deadline_seconds=reduce_timeout * (1 + RESULT_MARGIN),
        rounds=len(results), seconds=statistics.median(seconds), seconds_min=min(seconds), seconds_max=max(seconds),
        skipped_shards_per_survivor=statistics.median(r["skipped_shards"] for r in results) / (peers - 1),
        load_avg=os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=ints, default=[3, 5], help="group sizes, the dead member included")
    parser.add_argument("--numel", type=int, default=100_003, help="float32 values each member averages")
    parser.add_argument("--reduce-timeout", type=float, default=60.0,
                        help="the group's reduce_timeout in seconds ([sync] reduce_timeout, 60 by default)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds with the dead member per configuration")
    parser.add_argument("--schedule", type=schedules, default=["staggered", "ring"],
                        help="comma-separated: staggered (the butterfly), all, ring")
    parser.add_argument("--json-out", type=Path, default=OUT / "dead_member.jsonl")
    parser.add_argument("--label", default="", help="what the code measured differs in from its commit (records say "
                                                    "whether it was dirty, not how)")
    args = parser.parse_args(argv)
    handle_signals()
    logdir = args.json_out.parent / "logs" / f"dead_member-{time.strftime('%Y%m%dT%H%M%S')}"
    logdir.mkdir(parents=True, exist_ok=True)
    for schedule in args.schedule:
        for peers in args.peers:
            record = measure(schedule, peers, args.numel, args.reduce_timeout, args.rounds, logdir)
            record["label"] = args.label
            append_jsonl(args.json_out, record)
            say(f"dead_member {schedule} N={peers}: {record['seconds']:.2f} s "
                f"({record['seconds_min']:.2f}–{record['seconds_max']:.2f}), deadline {record['deadline_seconds']:.0f} s, "
                f"{record['skipped_shards_per_survivor']:.0f} shards skipped per survivor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
