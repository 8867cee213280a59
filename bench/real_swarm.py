"""A real large swarm on this machine: N `lowcomm-node join` processes on loopback, split steps.

    nice -n 10 python bench/real_swarm.py [--peers 16] [--group-size 8] [--rounds 10]
        [--inner-steps 10] [--time-limit 1500] [--set KEY=VALUE ...] [--json-out FILE]

Issue 15, item 5. Starts N real nodes (tiny model, one torch thread each, ``[sync] group_size``
smaller than N so the leader splits every step into several groups; with a group size of N or
more every step has one group, the stable group's direct path included), waits until every node has
committed ``--rounds`` rounds in a group (or the time limit passes), reads each node's Prometheus metrics,
stops them and writes, for every committed outer step, one JSON line (``kind: "step"``) and then
one ``kind: "summary"`` line to ``--json-out`` (default bench/out/real_swarm.jsonl):

- the groups of the step and their sizes: ``round_done`` carries the size of the node's group but
  not its id, so the groups are counted from the sizes (c nodes that report a group of k make
  c/k groups of k; a fraction means a group whose other members did not commit this step);
- the share of the N peers that committed the step from a group of more than one peer;
- distinct ``params_sha256`` committed at the step (one θ_global per step: must be 1);
- ``state_downloaded`` events after a node's first committed round (must be 0), per step and total,
  and ``missed_rounds_applied`` events (a node that caught up by the averages of the rounds it
  missed, protocol/missed_rounds.py, instead of downloading);
- ``matchmaking_seconds`` (time to form the group) p50/p95, ``bytes_sent``/``bytes_received``
  per peer, skipped shards;
- per peer from the metrics endpoint: gRPC calls handled (the busiest peer's too, per round),
  round failures by reason, and the node's own DHT gets and stores per round
  (``lowcomm_dht_requests``; the whole run, start-up included, over the rounds in a group).

The process itself runs at nice 10 (its nodes inherit it) so that it yields to other work.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from common import OUT, append_jsonl, machine, now_iso, say, stop_nodes

from lowcomm.node.localswarm import NodeProcess, peer_args

Event = dict[str, Any]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def scrape(port: int) -> dict[str, float]:
    """Sum of every sample of each lowcomm_* metric family (and of grpc_server_handled) on the
    node's metrics endpoint, the labelled ones also kept per label set (``name{labels}``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = re.match(r"^(lowcomm_\w+?|grpc_server_handled)(_total)?(\{[^}]*\})? ([-+0-9.eEinfNa]+)$", line)
        if not match or match.group(1).endswith("_created"):
            continue
        name, labels, value = match.group(1), match.group(3), float(match.group(4))
        totals[name] += value
        if labels:
            totals[name + labels] += value
    return dict(totals)


def later_downloads(node: NodeProcess) -> list[Event]:
    """``state_downloaded`` events after the node's first committed round (its first catch-up,
    if any, comes before that round)."""
    first = next((i for i, e in enumerate(node.events) if e.get("event") == "round_done"), len(node.events))
    return [e for e in node.events[first:] if e.get("event") == "state_downloaded"]


def group_rounds(node: NodeProcess) -> int:
    """Rounds the node committed from a group of more than one peer (the first node's solo
    steps while the others start do not count)."""
    return sum(e["group_size"] > 1 for e in node.rounds())


def step_records(nodes: list[NodeProcess], peers: int) -> list[dict[str, Any]]:
    by_step: dict[int, list[Event]] = defaultdict(list)
    for node in nodes:
        for event in node.rounds():
            by_step[event["outer_step"]].append({**event, "node": node.name})
    downloads: Counter[int] = Counter(e.get("outer_step") for node in nodes for e in later_downloads(node))
    records = []
    for step in sorted(by_step):
        events = by_step[step]
        sizes = Counter(e["group_size"] for e in events)
        groups = {str(size): round(count / size, 2) for size, count in sorted(sizes.items()) if size > 1}
        mm = [e["matchmaking_seconds"] for e in events if e["group_size"] > 1]
        records.append({
            "kind": "step", "outer_step": step, "committed": len(events),
            "groups": groups, "groups_total": round(sum(groups.values()), 2), "solo": sizes.get(1, 0),
            "share_averaged": round(sum(e["group_size"] > 1 for e in events) / peers, 3),
            "hashes": len({e["params_sha256"] for e in events}),
            "hash_counts": sorted(Counter(e["params_sha256"][:12] for e in events).values(), reverse=True),
            "downloads_after_first_round": downloads.get(step, 0),
            "matchmaking_p50_s": percentile(mm, 0.5), "matchmaking_p95_s": percentile(mm, 0.95),
            "round_p50_s": percentile([e["round_seconds"] for e in events], 0.5),
            "bytes_sent_median": statistics.median(e["bytes_sent"] for e in events),
            "bytes_received_median": statistics.median(e["bytes_received"] for e in events),
            "bytes_total_median": statistics.median(e["bytes_sent"] + e["bytes_received"] for e in events),
            "skipped_shards": sum(e["skipped_shards"] for e in events),
        })
    return records


def buckets_on(settings: list[str]) -> bool:
    """Whether the nodes matchmade in buckets: the last ``sync.matchmaking_buckets`` setting, read
    as the node reads ``--set``, else the node's default (on since commit 90f09ea: records before
    it lack this field)."""
    from lowcomm.node.config import parse_override
    from lowcomm.node.config_sections import TEXT_KEYS, SyncSection

    chosen: dict[str, object] = {}
    for item in settings:
        section, key, value = parse_override(item)
        if (section, key) == ("sync", "matchmaking_buckets"):
            chosen = {key: value}
    # --set text converts as the node converts it ("True" is a boolean there, not a file's string).
    text_keys = {TEXT_KEYS: {SyncSection: set(chosen)}}
    return SyncSection.model_validate(chosen, context=text_keys).matchmaking_buckets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10, help="rounds in a group every node must reach")
    parser.add_argument("--inner-steps", type=int, default=10, help="H")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=1500.0, help="seconds for the whole run")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="more node settings (e.g. sync.matchmaking_timeout=60)")
    parser.add_argument("--json-out", type=Path, default=OUT / "real_swarm.jsonl")
    parser.add_argument("--logs", type=Path, default=OUT / "logs" / "real_swarm", help="raw node logs")
    args = parser.parse_args(argv)
    if args.group_size < 2:
        parser.error("--group-size must be at least 2")
    os.nice(10)
    settings = [f"model.preset=tiny", f"sync.group_size={args.group_size}", f"train.inner_steps={args.inner_steps}",
                f"train.batch_size={args.batch_size}", f"data.seq_len={args.seq_len}", *args.sets]
    extra = [arg for item in settings for arg in ("--set", item)]
    run_id = now_iso()
    host = machine()  # its load average is the one at the start
    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-real-swarm-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    nodes: list[NodeProcess] = []
    metrics: list[dict[str, float]] = []
    started = time.monotonic()
    deadline = started + args.time_limit
    reached = False
    try:
        def start(index: int, peers: list[str]) -> NodeProcess:
            return NodeProcess(f"peer-{index}", peer_args(workdir, index, peers, extra),
                               log_path=args.logs / f"peer-{index}.log")

        nodes.append(start(0, []))
        maddr = nodes[0].multiaddr
        nodes += [start(i, [maddr]) for i in range(1, args.peers)]
        say(f"real_swarm: {args.peers} nodes started; waiting for {args.rounds} rounds each")
        try:
            for node in nodes:
                node.wait_for(lambda _e, node=node: group_rounds(node) >= args.rounds,
                              timeout=max(1.0, deadline - time.monotonic()))
            reached = True
        except TimeoutError as err:
            say(f"real_swarm: time limit: {str(err).splitlines()[0]}")
        for node in nodes:
            try:
                port = node.ready(1)["metrics_port"]
                metrics.append(scrape(port) if node.proc.poll() is None else {})
            except (OSError, TimeoutError) as err:
                say(f"real_swarm: no metrics from {node.name}: {err}")
                metrics.append({})
    finally:
        stop_nodes(nodes, workdir)
    wall = time.monotonic() - started

    steps = step_records(nodes, args.peers)
    for record in steps:
        append_jsonl(args.json_out, {"run": run_id, **record})
    # Figures over the steps from the first to the last one that every node committed: before,
    # the first node steps alone while the others start and catch up; after, the nodes were
    # stopped before all of them committed.
    full = [s["outer_step"] for s in steps if s["committed"] == args.peers]
    first_full, last_full = (min(full), max(full)) if full else (math.inf, -math.inf)
    steps_measured = [s for s in steps if first_full <= s["outer_step"] <= last_full]
    rounds = [e for node in nodes for e in node.rounds() if first_full <= e["outer_step"] <= last_full]
    grouped = [e for e in rounds if e["group_size"] > 1]
    mm = [e["matchmaking_seconds"] for e in grouped]
    split = [s for s in steps if s["groups_total"] > 1]
    handled = [m.get("grpc_server_handled", 0.0) for m in metrics]
    by_method: list[Counter[str]] = []
    for m in metrics:
        methods: Counter[str] = Counter()
        for key, value in m.items():
            found = re.match(r'grpc_server_handled\{.*grpc_method="(\w+)"', key)
            if found:
                methods[found.group(1)] += int(value)
        by_method.append(methods)
    failures: Counter[str] = Counter()
    for m in metrics:
        for key, value in m.items():
            found = re.match(r'lowcomm_round_failures\{reason="(\w+)"\}', key)
            if found:
                failures[found.group(1)] += int(value)
    summary = {
        "run": run_id, "kind": "summary", "bench": "real_swarm", "machine": host,
        "command": "python bench/real_swarm.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "peers": args.peers, "group_size": args.group_size, "settings": settings,
        "matchmaking": "buckets" if buckets_on(settings) else "single level",
        "reached_rounds": reached, "wall_seconds": round(wall, 1),
        "group_rounds_per_node": sorted(group_rounds(node) for node in nodes),
        "steps": len(steps), "steps_all_committed": [first_full, last_full] if full else None,
        "steps_measured": len(steps_measured), "split_steps": len(split),
        "steps_with_more_than_one_hash": [s["outer_step"] for s in steps if s["hashes"] > 1],
        "downloads_after_first_round": sum(len(later_downloads(node)) for node in nodes),
        "first_catchup_downloads": sum(
            sum(e.get("event") == "state_downloaded" for e in node.events) - len(later_downloads(node)) for node in nodes),
        "missed_rounds_applied": sum(e.get("event") == "missed_rounds_applied" for node in nodes for e in node.events),
        "share_averaged_mean": round(statistics.mean(s["share_averaged"] for s in steps_measured), 3)
        if steps_measured else None,
        "share_averaged_min": min((s["share_averaged"] for s in steps_measured), default=None),
        "matchmaking_p50_s": percentile(mm, 0.5), "matchmaking_p95_s": percentile(mm, 0.95),
        "bytes_sent_per_round_median": statistics.median(e["bytes_sent"] for e in grouped) if grouped else None,
        "bytes_received_per_round_median": statistics.median(e["bytes_received"] for e in grouped) if grouped else None,
        "bytes_total_per_round_median": statistics.median(e["bytes_sent"] + e["bytes_received"] for e in grouped)
        if grouped else None,
        # The mean too: a split step's team reducers receive (G-1) float32 parts more than the
        # median peer (protocol/crossgroup.py), and sim/ reports the mean.
        "bytes_total_per_round_mean": statistics.mean(e["bytes_sent"] + e["bytes_received"] for e in grouped)
        if grouped else None,
        "payload_bytes": grouped[0]["payload_bytes"] if grouped else None,
        "numel": grouped[0]["numel"] if grouped else None,
        "skipped_shards": sum(e["skipped_shards"] for e in rounds),
        "warnings_per_node": sorted(sum(e.get("level") == "warning" for e in node.events) for node in nodes),
        "grpc_handled_per_peer_median": statistics.median(handled) if handled else None,
        "grpc_handled_busiest_peer": max(handled) if handled else None,
        # Per round: a node's calls served over the rounds it was in a group (sim/ reports the
        # busiest peer's RPCs per round).
        "grpc_handled_per_round_busiest": round(max(
            (h / max(1, group_rounds(node)) for h, node in zip(handled, nodes)), default=0.0), 1),
        "join_group_per_round_busiest": round(max(
            (m.get("JoinGroup", 0) / max(1, group_rounds(node)) for m, node in zip(by_method, nodes)), default=0.0), 1),
        "grpc_handled_by_method_busiest": {
            method: max(m.get(method, 0) for m in by_method) for method in sorted(set().union(*by_method))},
        "round_failures": dict(failures),
        # lowcomm_dht_requests: the node's own DHT calls (its peers-table heartbeat and reads,
        # matchmaking registrations and polls), per round it spent in a group; not the requests
        # hivemind's DHT process serves for others.
        **{f"dht_{op}s_per_peer_round_median": statistics.median(
            m.get(f'lowcomm_dht_requests{{op="{op}"}}', math.nan) / max(1, group_rounds(node))
            for m, node in zip(metrics, nodes)) if metrics else None for op in ("get", "store")},
    }
    append_jsonl(args.json_out, summary)
    for record in steps:
        print(record)
    print(summary)
    ok = reached and not summary["steps_with_more_than_one_hash"] and not summary["downloads_after_first_round"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
