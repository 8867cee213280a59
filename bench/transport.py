#!/usr/bin/env python
"""Transport efficiency: one averaging round of S MB among N peers on capped links, vs the bound.

    python bench/transport.py [--peers 2,4,8] [--sizes-mb 4,64] [--caps 20,100,1000] [--rounds 5]
                              [--large-rounds 3] [--hivemind 4x4@20,4x4@100,4x4@1000,4x64@100] [--codec fp32]
                              [--queue router|gso] [--schedule staggered,ring]
                              [--network netns|loopback] [--json-out bench/out/transport.jsonl]

One agent (bench/transport_agent.py) per network namespace; every peer is capped at C Mbit/s in
both directions (tc tbf, as deploy/netns_cluster.py sets it). For every (C, N, S) the first N
agents average a random float32 vector whose encoded size is S MB (10⁶ bytes) with the
project's butterfly all-reduce (protocol/allreduce.py over gRPC, the codec of the node's
``sync.codec``, fp32 by default so that S is also the size on the wire). A round's time is from
the moment the last member started to the moment the last one finished; it is compared with
the bound of a butterfly all-reduce, where every peer sends and receives 2·(N−1)/N·S:

    bound = 2·(N−1)/N · S / B,  B = C·10⁶/8 bytes/s,   efficiency = bound / time
    bus bandwidth = S / time · 2·(N−1)/N   (as nccl-tests reports it; at the bound it equals C)

Every configuration runs --rounds rounds (--large-rounds for S ≥ --large-mb); a record keeps their
median, min and max, each round's phases (reduce-scatter, all-gather, agreement: from the agents'
stage timestamps, whose full traces go to the run's log folder) and the CPU seconds the agents
spent per MB they sent (nearly independent of other load on the machine, unlike the times).

``--slow-mbit X`` caps the last member of every group at X Mbit/s instead (a slow volunteer among
fast ones), and ``--layout equal,measured`` says how the butterfly's shards are cut: equal, or
by what each member declares after the rounds before, as a node does (the median of its last few
``AllReduceResult.upload_bps``: node/decisions.py; a leader lays out shards by it: protocol/layout.py),
after one unmeasured round for the first estimates. The bound is then the lower of the two schedules' own bounds on those
links: a ring's 2·(N−1)/N·S over the slowest cap, and a butterfly's best layout, where member i
sends S + (N−2)·s_i for its share s_i (see ``heterogeneous_bound``).

``--hivemind`` lists NxS@C configurations for which hivemind's DecentralizedAverager moves the
same payload (NoCompression) on the same links (matchmaking excluded, the all-reduce timed).
Without root (no namespaces) use ``--network loopback``: no caps, no bound, times only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (BENCH, OUT, PY, Proc, append_jsonl, handle_signals, netns_unavailable, network, processes,
                    record_base, say, tcp_congestion_arg)

from lowcomm.node.decisions import declared_bandwidth
from lowcomm.protocol._pb.lowcomm.v1.averaging_pb2 import ALL_REDUCE_SCHEDULE_BUTTERFLY as BUTTERFLY
from lowcomm.protocol.layout import (choose_schedule, encoded_size, owner_shares, piece_layout, pieces_per_owner,
                                     ring_pieces)
from lowcomm.protocol.ring import RING

AGENT = BENCH / "transport_agent.py"
WARMUP_NUMEL = 2**16


def bound_seconds(peers: int, payload_bytes: float, mbit: float | None) -> float | None:
    if not mbit:
        return None
    return 2 * (peers - 1) / peers * payload_bytes / (mbit * 1e6 / 8)


def link_counters(net, peers: int) -> list[dict[str, int]] | None:
    """TCP and tbf counters of the first ``peers`` namespaces (None on loopback)."""
    return [net.link_counters(i) for i in range(peers)] if hasattr(net, "link_counters") else None


def link_delta(after: list[dict] | None, before: list[dict] | None) -> dict:
    """Retransmitted share of the TCP segments the members sent, and packets the caps dropped."""
    if not after or not before:
        return {}
    total = {key: sum(a[key] - b[key] for a, b in zip(after, before)) for key in after[0]}
    return {"tcp_retrans_fraction": total["retrans_segs"] / total["out_segs"] if total["out_segs"] else None,
            "tbf_drops": total["tbf_drops"]}


SEGMENT_BELOW_MBIT = 1000.0  # caps below this get wire-sized packets with --queue router


def set_cap(net, mbit: float | None, queue: str, slow: tuple[int, float] | None = None) -> None:
    """Cap every peer at ``mbit`` both ways (tbf as netns_cluster sets it: 50 ms queue, a burst
    of at least 64 kB); ``queue`` says what packets reach the caps.

    ``gso``: a veth hands tbf whole GSO super-packets of up to 64 kB, so the 50 ms queue at
    20 Mbit/s (125 kB + the burst) holds three of them and one overflow drops ~44 segments at
    once: a queue of a few packets, which punishes any burst far more than a home router's (it
    queues the same bytes as ~130 packets of 1.5 kB, the NIC having cut them). ``router``: below
    SEGMENT_BELOW_MBIT the peers' TCP builds wire-sized packets (gso_max_size 1500), which the
    caps queue and drop one by one; at 1 Gbit/s no queue builds (no drops, no retransmissions in
    any run) and segmenting in the stack would only cost CPU that a real NIC saves.

    ``gso`` stays the default: ``router`` cuts the retransmissions (4×4 MB at 20 Mbit/s: 10 % →
    2 %) but is slower here, even at N=2 where nothing is lost (bench/analysis.md). Probably
    because the upload cap sits in the sender's own qdisc, where TCP Small Queues let a socket
    keep only ~2 small packets queued, so a sender descheduled on a loaded machine leaves the
    link idle; a router's queue is not limited that way, and neither mode emulates it exactly."""
    if net.kind != "netns":
        net.set_cap(mbit)
        return
    net.set_cap(mbit, slow)
    size = 1500 if queue == "router" and mbit is not None and mbit < SEGMENT_BELOW_MBIT else 65536
    for peer in net.state.peers:
        subprocess.run(["ip", "-n", peer.netns, "link", "set", "dev", "eth0", "gso_max_size", str(size)],
                       check=True, capture_output=True)


def heterogeneous_bound(peers: int, payload_bytes: float, mbit: float, slow_mbit: float) -> float:
    """Seconds of the faster schedule at its bound, with the last of ``peers`` capped at
    ``slow_mbit``. Ring: every link carries 2·(N−1)/N·S, so the slowest sets the pace. Butterfly:
    member i uploads S − s_i and sends its average of s_i to N − 1 members (and receives as much),
    S + (N−2)·s_i each way, with the shares a leader cuts for these links (protocol/layout.py
    ``owner_shares``: the slow one owning nothing when even S alone takes it longer)."""
    caps = [mbit * 1e6 / 8] * (peers - 1) + [slow_mbit * 1e6 / 8]
    ring = 2 * (peers - 1) / peers * payload_bytes / min(caps)
    if peers <= 2:
        return ring  # every member sends S whatever the shares
    butterfly = max(payload_bytes * (1 + (peers - 2) * share) / cap for share, cap in zip(owner_shares(caps), caps))
    return min(ring, butterfly)


def declare(samples: list[list[float]], upload_bps: list[float]) -> list[float]:
    """What every member declares after a round, as a node does (node/decisions.py): the median
    of its last few estimates; ``samples`` (per member) grows by this round's."""
    for mine, estimate in zip(samples, upload_bps):
        if estimate > 0:
            mine.append(estimate)
    return [declared_bandwidth(mine) for mine in samples]


def auto_pieces(numel: int, codec_id: int, peers: int, mbit: float | None, schedule: str = "staggered") -> int:
    """Pieces per owner as the leader cuts them for this schedule (protocol/layout.py)."""
    cut = ring_pieces if schedule == "ring" else pieces_per_owner
    return cut(encoded_size(codec_id, numel), peers, (mbit or 0.0) * 1e6 / 8)


def _ask(agents: list[Proc], cmd: dict, reply: str, timeout: float) -> list[dict]:
    starts = [len(a.events) for a in agents]
    line = json.dumps(cmd)
    for agent in agents:
        agent.send(line)
    return [a.wait_event(reply, timeout, start=s) for a, s in zip(agents, starts)]


def lowcomm_round(agents: list[Proc], addresses: list[str], numel: int, codec_id: int, timeout: float,
                  step: int, schedule: str = "staggered", pieces: int | None = None, mbit: float | None = None,
                  declared: list[float] | None = None, absent: int = 0) -> dict:
    """One round of the project's all-reduce; ``pieces`` per owner as the leader cuts them
    (protocol/layout.py) unless given, for members that declared the link's cap as their
    bandwidth (a node declares its last round's measured rate, somewhat less). ``schedule``:
    the butterfly ``staggered`` or ``all`` at once (protocol/schedule.py), ``ring`` (protocol/ring.py), or
    ``auto``: either, as a leader with ``[sync] schedule = "auto"`` picks it (the result's ``ran``).
    ``declared``: the members' bandwidths (bytes/s) the shares are cut by; equal shares without.
    ``absent``: members after ``agents`` (their addresses follow) that are in the group but do not
    take part, as peers that died after matchmaking (bench/dead_member.py)."""
    n = len(agents) + absent
    if schedule == "auto":  # as a leader with [sync] schedule = "auto" picks it (protocol/layout.py)
        picked = choose_schedule(step, encoded_size(codec_id, numel), declared or [0.0] * n)
        schedule = "ring" if picked == RING else "staggered"
    if pieces is None:
        pieces = auto_pieces(numel, codec_id, n, mbit, schedule)
    bounds, owners = piece_layout(numel, declared if declared and schedule != "ring" else [0.0] * n, pieces,
                                  drop_empty=schedule != "ring")
    shares = [0] * n
    for k, owner in enumerate(owners):
        shares[owner] += bounds[k + 1] - bounds[k]
    group = {"group_id": os.urandom(8).hex(), "step": step,
             "members": [{"peer_id": f"agent-{i}", "address": addresses[i], "weight": 1.0} for i in range(n)],
             "shard_bounds": bounds, "shard_owners": owners, "codec": codec_id,
             "reduce_timeout_s": timeout, "schedule": RING if schedule == "ring" else BUTTERFLY}
    done = _ask(agents, {"cmd": "round", "group": group, "staggered": schedule != "all"}, "round_done",
                timeout * 2 + 30)
    start = max(d["t_start"] for d in done)
    seconds = max(d["t_end"] for d in done) - start
    # Per member: its stage timestamps (transport_agent.Trace), counted from the round's start.
    trace = {f"agent-{i}": [[round(d["t_start"] - start + t, 4), *rest] for t, *rest in d.get("trace", [])]
             for i, d in enumerate(done)}
    # The phases are the butterfly's stages; a ring's one stream per member has none of them.
    return {"seconds": seconds, "trace": trace, "phases": phases(trace, seconds) if schedule != "ring" else None,
            "bytes_sent": statistics.fmean(d["bytes_sent"] for d in done),
            # What each member measured of its uplink (bytes/s; 0 in a ring) and the share it owned.
            "upload_bps": [d.get("upload_bps", 0.0) for d in done], "shares": [x / numel for x in shares],
            "upload_rates": [d.get("upload_rates", []) for d in done], "ran": schedule,
            "skipped_shards": sum(d["skipped"] for d in done),
            # CPU seconds all agents spent in the round per second of it: 2.0 = both cores busy.
            "cpu_cores_busy": sum(d["cpu_seconds"] for d in done) / seconds if seconds > 0 else None,
            # CPU seconds of all agents per MB (10⁶ bytes) they sent: the transport's cost, nearly
            # independent of what else runs on the machine (unlike the round's wall-clock time).
            "cpu_seconds_per_mb": (sum(d["cpu_seconds"] for d in done) / (sent / 1e6)
                                   if (sent := sum(d["bytes_sent"] for d in done)) else None)}


def phases(trace: dict[str, list], seconds: float) -> dict[str, float] | None:
    """Where a round's time went, from the members' stage timestamps: until the last part reached
    its owner (reduce-scatter), until the last average reached its member (all-gather), and the
    shard agreement after it."""
    parts = [t for events in trace.values() for t, what, *_ in events if what == "in_done"]
    averages = [t for events in trace.values() for t, what, *_ in events if what == "result_end"]
    if not parts or not averages:
        return None
    scatter, gather = max(parts), max(averages)
    return {"reduce_scatter_s": round(scatter, 4), "all_gather_s": round(gather - scatter, 4),
            "agreement_s": round(seconds - gather, 4)}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "max": max(values), "median": statistics.median(values)}


def bus_mbit(peers: int, payload_bytes: float, seconds: float | None) -> float | None:
    """Bus bandwidth as nccl-tests reports it, in Mbit/s: S/t · 2(N−1)/N (at the bound, the cap)."""
    return payload_bytes * 8 / 1e6 / seconds * 2 * (peers - 1) / peers if seconds else None


def rounds_for(args, payload_mb: float) -> int:
    return args.large_rounds if payload_mb >= args.large_mb else args.rounds


def save_traces(logdir: Path, record: dict) -> None:
    """The full stage timestamps go to the run's log folder; the record keeps the phases."""
    traces = [r.pop("trace") for r in record["rounds"] if "trace" in r]
    append_jsonl(logdir / "traces.jsonl", {key: record[key] for key in ("impl", "peers", "payload_mb", "mbit")}
                 | {"traces": traces})


def sweep_lowcomm(net, args, out: Path, run_id: str, logdir: Path) -> None:
    """Every cap with agents (hence TCP connections) of its own: a connection carried over from
    a slower cap would start the faster one from the slower one's window (measured: 4×64 MB at
    100 Mbit/s took 10.9–11.0 s after the 20 Mbit/s rows, 9.2–10.2 s on its own)."""
    from lowcomm.protocol import codecs

    codec = codecs.get_codec(args.codec)
    peers_max = max(args.peers)
    step = 0
    for mbit, schedule in itertools.product(args.caps, args.schedule):
        if net.kind == "netns" and not args.slow_mbit:
            set_cap(net, mbit, args.queue)
        with processes() as agents:  # fresh agents for every schedule too: the ring uses other connections
            for i in range(peers_max):
                port = "7701" if net.kind == "netns" else "0"
                agents.append(Proc(f"agent-{i}", net.wrap(i, [PY, str(AGENT), "lowcomm", "--index", str(i),
                                                              "--host", net.host(i), "--port", port]),
                                   stdin=True, log_path=logdir / f"agent-{i}-{mbit}-{schedule}.log"))
            addresses = [a.wait_event("ready", 120)["address"] for a in agents]
            for n in args.peers:
                members = agents[:n]
                if net.kind == "netns" and args.slow_mbit:  # the last member of this group is the slow one
                    set_cap(net, mbit, args.queue, (n - 1, args.slow_mbit))
                _ask(members, {"cmd": "setup", "numel": WARMUP_NUMEL}, "setup_done", 60)
                step += 1
                lowcomm_round(members, addresses, WARMUP_NUMEL, int(codec.id), 30, step, schedule)  # channels up
                layouts = {"ring": ["equal"], "auto": ["measured"]}.get(schedule, args.layout)
                for size, layout in itertools.product(args.sizes_mb, layouts):
                    numel = _numel_for(codec, size * 1e6)
                    payload = codec.encoded_size(numel)
                    bound = (heterogeneous_bound(n, payload, mbit, args.slow_mbit) if args.slow_mbit and mbit
                             else bound_seconds(n, payload, mbit))
                    timeout = max(60.0, 4 * (bound or 0))
                    _ask(members, {"cmd": "setup", "numel": numel}, "setup_done", 120)
                    declared, samples = None, [[] for _ in members]
                    if layout == "measured":  # a first round for the members' first estimates, not counted
                        step += 1
                        first = lowcomm_round(members, addresses, numel, int(codec.id), timeout, step,
                                              schedule, args.pieces, mbit)
                        declared = declare(samples, first["upload_bps"])
                    results = []
                    for _ in range(rounds_for(args, size)):
                        wire0, links0 = [net.wire_sent(i) for i in range(n)], link_counters(net, n)
                        step += 1
                        result = lowcomm_round(members, addresses, numel, int(codec.id), timeout, step,
                                               schedule, args.pieces, mbit, declared)
                        if layout == "measured":
                            declared = declare(samples, result["upload_bps"])
                        wire = [None if a is None or b is None else b - a
                                for a, b in zip(wire0, [net.wire_sent(i) for i in range(n)])]
                        result["wire_bytes_sent"] = statistics.fmean(wire) if None not in wire else None
                        result.update(link_delta(link_counters(net, n), links0))
                        results.append(result)
                    seconds = statistics.median(r["seconds"] for r in results)
                    record = record_base(
                        "transport", run_id=run_id, impl="lowcomm", peers=n, payload_mb=size, payload_bytes=payload,
                        numel=numel, codec=codec.name, mbit=mbit, network=net.kind, link=net.describe(),
                        tcp_congestion=net.tcp_congestion,
                        queue=args.queue, schedule=schedule, layout=layout, slow_mbit=args.slow_mbit,
                        pieces=(auto_pieces(numel, int(codec.id), n, mbit, schedule) if args.pieces is None
                                else args.pieces),
                        load_avg=os.getloadavg()[0],
                        rounds=results, seconds=seconds, seconds_spread=spread([r["seconds"] for r in results]),
                        bound_seconds=bound, efficiency=bound / seconds if bound else None,
                        bus_mbit=bus_mbit(n, payload, seconds),
                        cpu_seconds_per_mb=statistics.median(r["cpu_seconds_per_mb"] for r in results),
                        bytes_sent_per_peer=statistics.fmean(r["bytes_sent"] for r in results),
                        bytes_bound_per_peer=2 * (n - 1) / n * payload,
                        wire_bytes_sent_per_peer=results[-1]["wire_bytes_sent"],
                        ok=all(r["skipped_shards"] == 0 for r in results))
                    save_traces(logdir, record)
                    append_jsonl(out, record)
                    eff = f"{record['efficiency']:.2f}" if bound else "n/a"
                    slow_note = f" (last peer {args.slow_mbit:g}), {layout} shares" if args.slow_mbit else ""
                    say(f"lowcomm {schedule} N={n} S={size}MB cap={mbit}{slow_note}: {seconds:.2f} s, "
                        f"bound {bound or 0:.2f} s, efficiency {eff}")
            for agent in agents:
                agent.send('{"cmd": "quit"}')


def _numel_for(codec, payload_bytes: float) -> int:
    """Largest numel whose encoded size is at most ``payload_bytes`` (bisection on the codec's size)."""
    lo, hi = 1, int(payload_bytes)  # no codec takes less than one byte... per 8 values; fp32 is 4
    hi = max(hi, 8 * int(payload_bytes))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if codec.encoded_size(mid) <= payload_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


HIVEMIND_RE = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)@(\d+(?:\.\d+)?)$")


def sweep_hivemind(net, args, out: Path, run_id: str, logdir: Path) -> None:
    configs = []
    for item in filter(None, (s.strip() for s in args.hivemind.split(","))):
        match = HIVEMIND_RE.match(item)
        if not match:
            raise SystemExit(f"--hivemind {item!r}: expected NxS@C, e.g. 4x4@20")
        configs.append((int(match.group(1)), float(match.group(2)), float(match.group(3))))
    if not configs:
        return
    number = 0
    for cap in sorted({c[2] for c in configs}):  # agents of its own per cap, as sweep_lowcomm's
        at_cap = sorted((c for c in configs if c[2] == cap), key=lambda c: (c[0], c[1]))
        _hivemind_configs(net, args, out, run_id, logdir, at_cap, number)
        number += len(at_cap)


def _hivemind_configs(net, args, out: Path, run_id: str, logdir: Path, configs: list, first_number: int) -> None:
    # hivemind's averager leaves its p2pd client socket in TMPDIR even when it shuts down cleanly
    # (and a killed agent everything): the agents get a TMPDIR of their own, removed after them.
    with tempfile.TemporaryDirectory(prefix="lc-hm-") as tmp:  # short: socket paths must fit in 107 bytes
        _hivemind_agents(net, args, out, run_id, logdir, configs, first_number, {"TMPDIR": tmp})


def _hivemind_agents(net, args, out: Path, run_id: str, logdir: Path, configs: list, first_number: int,
                     env: dict[str, str]) -> None:
    peers_max = max(n for n, _, _ in configs)
    with processes() as agents:
        first = Proc("hm-0", net.wrap(0, [PY, str(AGENT), "hivemind", "--index", "0", "--host", net.host(0)]),
                     env=env, stdin=True, log_path=logdir / f"hm-0-{configs[0][2]}.log")
        agents.append(first)
        maddrs = first.wait_event("ready", 120)["maddrs"]
        maddr = next((m for m in maddrs if f"/{net.host(0)}/" in m), maddrs[0])
        for i in range(1, peers_max):
            agents.append(Proc(f"hm-{i}", net.wrap(i, [PY, str(AGENT), "hivemind", "--index", str(i), "--host",
                                                      net.host(i), "--initial-peer", maddr]), env=env, stdin=True,
                               log_path=logdir / f"hm-{i}-{configs[0][2]}.log"))
        for agent in agents:
            agent.wait_event("ready", 120)
        for number, (n, size, mbit) in enumerate(configs, start=first_number):
            if net.kind == "netns":
                set_cap(net, mbit, args.queue)
            else:
                mbit = None  # loopback: no cap, no bound
            members = agents[:n]
            numel = int(size * 1e6 // 4)
            payload = numel * 4
            bound = bound_seconds(n, payload, mbit)
            timeout = max(60.0, 4 * (bound or 0))
            _ask(members, {"cmd": "setup", "numel": numel, "group_size": n, "prefix": f"bench{number}",
                           "timeout": timeout}, "setup_done", 120)
            results = []
            for _ in range(rounds_for(args, size)):
                wire0, links0 = [net.wire_sent(i) for i in range(n)], link_counters(net, n)
                done = _ask(members, {"cmd": "round", "timeout": timeout}, "round_done", timeout * 3 + 60)
                wire = [None if a is None or b is None else b - a
                        for a, b in zip(wire0, [net.wire_sent(i) for i in range(n)])]
                results.append({"seconds": max(d["t_end"] for d in done) - max(d["t_start"] for d in done),
                                "group_sizes": [d["group_size"] for d in done],
                                "errors": [d["error"] for d in done if d.get("error")],
                                "wire_bytes_sent": statistics.fmean(wire) if None not in wire else None,
                                **link_delta(link_counters(net, n), links0)})
            ok = [r for r in results if not r["errors"] and all(g == n for g in r["group_sizes"])]
            seconds = statistics.median(r["seconds"] for r in ok) if ok else None
            record = record_base(
                "transport", run_id=run_id, impl="hivemind", peers=n, payload_mb=size, payload_bytes=payload,
                numel=numel, codec="none (fp32)", mbit=mbit, network=net.kind, link=net.describe(),
                tcp_congestion=net.tcp_congestion, rounds=results,
                queue=args.queue, load_avg=os.getloadavg()[0], seconds=seconds,
                seconds_spread=spread([r["seconds"] for r in ok]) if ok else None, bound_seconds=bound,
                efficiency=bound / seconds if bound and seconds else None, bus_mbit=bus_mbit(n, payload, seconds),
                bytes_bound_per_peer=2 * (n - 1) / n * payload,
                wire_bytes_sent_per_peer=results[-1]["wire_bytes_sent"], ok=bool(ok))
            append_jsonl(out, record)
            say(f"hivemind N={n} S={size}MB cap={mbit}: {seconds} s, bound {bound or 0:.2f} s, "
                f"efficiency {record['efficiency']}")
        for agent in agents:
            agent.send('{"cmd": "quit"}')
        for agent in agents:  # their own shutdowns stop the DHT and p2pd, before processes() sends SIGTERM
            try:
                agent.wait_exit(30)
            except subprocess.TimeoutExpired:
                pass  # processes() ends it


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


SCHEDULES = ("staggered", "all", "ring", "auto")


def schedules(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown schedule(s) {', '.join(unknown) or '(none)'}; "
                                         f"choose from {', '.join(SCHEDULES)}")
    return list(dict.fromkeys(names))


def layouts(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in ("equal", "measured") for n in names):
        raise argparse.ArgumentTypeError(f"--layout {text!r}: choose from equal, measured")
    return list(dict.fromkeys(names))


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=ints, default=[2, 4, 8])
    parser.add_argument("--sizes-mb", type=floats, default=[4, 64])
    parser.add_argument("--caps", type=floats, default=[20, 100, 1000], help="Mbit/s per peer, both directions")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per configuration (median)")
    parser.add_argument("--large-rounds", type=int, default=3, help="measured rounds where S >= --large-mb")
    parser.add_argument("--large-mb", type=float, default=32.0)
    parser.add_argument("--codec", default="fp32")
    parser.add_argument("--hivemind", default="4x4@20,4x4@100,4x4@1000,4x64@100",
                        help="NxS@C configurations for hivemind's DecentralizedAverager ('' for none)")
    parser.add_argument("--network", choices=["netns", "loopback"], default="netns")
    parser.add_argument("--pieces", type=int, default=None,
                        help="pieces per owner (default: as the leader cuts them, protocol/layout.py)")
    parser.add_argument("--schedule", type=schedules, default=["staggered", "ring"],
                        help="comma-separated: lowcomm's butterfly with its staggered upload/result order "
                             "(protocol/schedule.py), the butterfly with everything at once (all), the ring "
                             "(protocol/ring.py, [sync] schedule = \"ring\"), or either one round by round as a "
                             "leader picks it from the declared bandwidths ([sync] schedule = \"auto\"; shares "
                             "measured); each is measured on every cap")
    parser.add_argument("--queue", choices=["router", "gso"], default="gso",
                        help="gso: the caps queue whole 64 kB GSO packets (netns_cluster's tbf); router: below "
                             "1 Gbit/s wire-sized packets, as a home router sees them (see set_cap)")
    parser.add_argument("--slow-mbit", type=float, default=None,
                        help="cap the last member of every group at this many Mbit/s (a slow volunteer)")
    parser.add_argument("--layout", type=layouts, default=["equal"],
                        help="comma-separated: the butterfly's shards equal, or by the bandwidths the members "
                             "measured in the round before (measured), as a node's leader cuts them")
    tcp_congestion_arg(parser)
    parser.add_argument("--prefix", default="lct")
    parser.add_argument("--json-out", type=Path, default=OUT / "transport.jsonl")
    args = parser.parse_args(argv)
    handle_signals()
    run_id = time.strftime("%Y%m%dT%H%M%S")
    if args.network == "netns" and (reason := netns_unavailable()) is not None:
        say(f"transport: skipped: {reason}")
        append_jsonl(args.json_out, record_base("transport", run_id=run_id, skipped=reason))
        return 0
    if args.network == "loopback":
        args.caps = [None]
        if args.slow_mbit:
            parser.error("--slow-mbit needs caps, hence network namespaces (--network netns)")
    if args.slow_mbit is not None and (args.slow_mbit <= 0 or any(args.slow_mbit >= c for c in args.caps)):
        parser.error(f"--slow-mbit {args.slow_mbit:g} must be above 0 and below every cap ({args.caps})")
    peers_max = max([*args.peers, *(int(c.split("x")[0]) for c in args.hivemind.split(",") if c.strip())])
    started = time.monotonic()
    with network(args.network, peers_max, prefix=args.prefix, tcp_congestion=args.tcp_congestion) as net:
        logdir = args.json_out.parent / "logs" / f"transport-{run_id}"
        logdir.mkdir(parents=True, exist_ok=True)
        sweeps = [("lowcomm", sweep_lowcomm)] if args.peers and args.sizes_mb else []
        for impl, sweep in [*sweeps, ("hivemind", sweep_hivemind)]:
            try:
                sweep(net, args, args.json_out, run_id, logdir)
            except Exception as err:  # the configurations measured so far are written; go on with the next
                say(f"transport: {impl} sweep FAILED: {err}")
                append_jsonl(args.json_out, record_base("transport", run_id=run_id, impl=impl, ok=False,
                                                        error=str(err)[-2000:], logs=str(logdir)))
    say(f"transport: done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
