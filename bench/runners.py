"""The methods of the convergence and slow-link benchmarks, each run as real processes.

Every runner returns one record (a dict, written as one JSON line by its caller) with the same
fields, so that tables and plots treat all methods alike:

    method, network, mbit, peers, curve, final_eval_loss, tokens, wall_seconds,
    app_bytes_sent_per_peer, wire_bytes_sent_per_peer, compute_utilization, ok, notes

``curve`` holds one point per evaluation of the global model: step (per peer), tokens (all
peers together), eval_loss (the node's fixed held-out batches), wall (seconds since all peers
started training), app_bytes_sent and wire_bytes_sent (per peer, cumulative, mean over peers).
``app`` bytes are what the method itself sends (the node's all-reduce payload counter, the ring
all-reduce volume of ddp, hivemind's 8-bit payload estimate); ``wire`` bytes are everything
the peer's network interface transmitted (TCP/IP, gRPC/libp2p framing, DHT traffic), measured
only inside network namespaces. With a ``target`` loss a run stops as soon as the global model
reaches it, and ``time_to_target`` says when.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from common import (BENCH, PY, Network, Proc, Workload, bootstrap_dht, free_port, node_argv, peer_key, processes, say,
                    wait_port)

DDP_SCRIPT = BENCH / "baselines" / "ddp.py"
HIVEMIND_SCRIPT = BENCH / "baselines" / "hivemind_opt.py"
READY_TIMEOUT = 240.0  # seconds for processes to start; 2 busy cores make imports slow
JOIN_ATTEMPTS = 3  # starts of a DiLoCo joiner whose DHT bootstrap failed
_DDP_PORTS = itertools.count()
_NODE_RUNS = itertools.count()
# The node's lines that end a round without round_done (daemon.py _round): training resumes.
ROUND_OVER_RE = re.compile(r"^round for step \d+ failed|^the swarm is past our state|^nobody averaged with us")
AVERAGED_RE = re.compile(r"Averaged parameters with (\d+) peers")
PARTIAL_RE = re.compile(r"received \d+(\.\d+)?% of input tensors")


class Evaluator:
    """The node's evaluation (Trainer.evaluate) of any flat parameter vector, in this process."""

    def __init__(self, work: Workload) -> None:
        from lowcomm.node.data import eval_batches, load_corpus
        from lowcomm.node.model import build_model, preset

        config = work.config()
        corpus = load_corpus(config.data.path, config.data.eval_fraction)
        self.model = build_model(preset(config.model.preset, config.data.seq_len, config.model.dropout), work.seed)
        self.model.eval()
        self.params = list(self.model.parameters())
        self.eval_set = eval_batches(corpus.eval, config.data.seq_len, config.train.batch_size,
                                     config.data.eval_batches)

    @torch.no_grad()
    def loss(self, flat: torch.Tensor) -> float:
        offset = 0
        for param in self.params:
            param.copy_(flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        total = 0.0
        for inputs, targets in self.eval_set:
            _, loss = self.model(inputs, targets)
            total += loss.item()
        return total / len(self.eval_set)


def _record(method: str, net: Network, work: Workload, curve: list[dict], **fields: Any) -> dict[str, Any]:
    final = curve[-1] if curve else {}
    record = {
        "method": method, "network": net.kind, "mbit": net.mbit, "link": net.describe(),
        "tcp_congestion": net.tcp_congestion, "peers": work.peers,
        "workload": {"steps": work.steps, "batch_size": work.batch_size, "seq_len": work.seq_len,
                     "preset": work.preset, "seed": work.seed, "global_batch": work.global_batch},
        "curve": curve, "final_eval_loss": final.get("eval_loss"), "tokens": final.get("tokens"),
        "wall_seconds": final.get("wall"), "app_bytes_sent_per_peer": final.get("app_bytes_sent"),
        "wire_bytes_sent_per_peer": final.get("wire_bytes_sent"), "ok": bool(curve), "notes": [],
    }
    record.update(fields)
    return record


def with_target(record: dict[str, Any], target: float | None) -> dict[str, Any]:
    """Add ``target`` and ``time_to_target`` (the first evaluation at or below it, or None)."""
    if target is None:
        return record
    hit = next((p for p in record["curve"] if p["eval_loss"] is not None and p["eval_loss"] <= target), None)
    record["target_loss"] = target
    record["time_to_target"] = None if hit is None else {"wall": hit["wall"], "tokens": hit["tokens"],
                                                          "step": hit["step"]}
    return record


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _wire_now(net: Network, peers: int) -> list[int | None]:
    return [net.wire_sent(i) for i in range(peers)]


def _wire_delta(now: list[int | None], start: list[int | None]) -> float | None:
    return _mean([None if a is None or b is None else a - b for a, b in zip(now, start)])


def _wait_all(procs: list[Proc], deadline: float, stop_when: threading.Event | None = None) -> bool:
    """Until every process exited (True), the deadline passed or ``stop_when`` is set (False)."""
    while time.monotonic() < deadline:
        if all(p.proc.poll() is not None for p in procs):
            return True
        if stop_when is not None and stop_when.wait(0.2):
            return False
        if stop_when is None:
            time.sleep(0.2)
    return False


# -- single and ddp ------------------------------------------------------------------------------


def run_single(work: Workload, logdir: Path, time_limit: float = 3600) -> dict[str, Any]:
    """One process, the global batch, the same total tokens (the node's AdamW, one thread)."""
    net = Network()
    argv = [PY, str(DDP_SCRIPT), "--world-size", "1", *work.cli(), "--batch-size", str(work.global_batch),
            "--eval-batch-size", str(work.batch_size)]
    logdir.mkdir(parents=True, exist_ok=True)
    with processes() as procs:
        proc = Proc("single", argv, log_path=logdir / "single.log")
        procs.append(proc)
        done = proc.wait_event("done", time_limit)
    curve = [{"step": e["step"], "tokens": e["tokens"], "eval_loss": e["eval_loss"], "wall": e["wall"],
              "app_bytes_sent": 0, "wire_bytes_sent": None} for e in proc.find("eval")]
    return _record("single", net, work, curve, peers=1, compute_utilization=done["compute_seconds"] / done["wall"],
                   threads=1)


def run_ddp(work: Workload, net: Network, logdir: Path, time_limit: float = 3600) -> dict[str, Any]:
    """``work.peers`` ranks, gradient all-reduce over gloo every step."""
    # In namespaces any port is free; a new one per run keeps clear of the last run's TIME_WAIT.
    port = 29500 + next(_DDP_PORTS) % 1000 if net.kind == "netns" else free_port()
    logdir.mkdir(parents=True, exist_ok=True)
    wire0: list[int | None] = []
    wire_at_eval: dict[int, float | None] = {}

    def on_event(name: str, event: dict) -> None:
        if name == "rank-0" and event.get("event") == "ready":
            wire0[:] = _wire_now(net, work.peers)
        elif name == "rank-0" and event.get("event") == "eval":
            wire_at_eval[event["step"]] = _wire_delta(_wire_now(net, work.peers), wire0)

    with processes() as procs:
        for rank in range(work.peers):
            argv = net.wrap(rank, [PY, str(DDP_SCRIPT), "--rank", str(rank), "--world-size", str(work.peers),
                                   "--master-addr", net.host(0), "--master-port", str(port), *work.cli(),
                                   "--peer-key", peer_key(rank)])
            procs.append(Proc(f"rank-{rank}", argv, env={"GLOO_SOCKET_IFNAME": net.ifname}, on_event=on_event,
                              log_path=logdir / f"rank-{rank}.log"))
        dones = [p.wait_event("done", time_limit) for p in procs]
        for p in procs:
            p.wait_exit(60)
    curve = [{"step": e["step"], "tokens": e["tokens"], "eval_loss": e["eval_loss"], "wall": e["wall"],
              "app_bytes_sent": e["app_bytes_sent"], "wire_bytes_sent": wire_at_eval.get(e["step"])}
             for e in procs[0].find("eval")]
    steps = [s for d in dones for s in d["step_seconds"][5:]] or [s for d in dones for s in d["step_seconds"]]
    return _record("ddp", net, work, curve,
                   compute_utilization=statistics.fmean(d["compute_seconds"] / d["wall"] for d in dones),
                   comm_fraction=statistics.fmean(d["comm_seconds"] / d["wall"] for d in dones),
                   step_seconds_median=statistics.median(steps), steps_run=dones[0]["steps"])


# -- diloco: the real node -----------------------------------------------------------------------


def run_diloco(work: Workload, net: Network, logdir: Path, codec: str, inner_steps: int,
               rounds: int | None = None, target: float | None = None, time_limit: float = 3600,
               extra_sets: list[str] = ()) -> dict[str, Any]:
    """``work.peers`` ``lowcomm-node join`` processes, ``rounds`` outer rounds of H inner steps.

    Each node is stopped (SIGSTOP, the main process only) when it logs that its gRPC server
    listens, and all are continued together once every one got there, so that all peers start
    their first inner phase at the same time (a lone first peer would otherwise take solo outer
    steps while the others start up; the node's own ``--wait-for-peers`` reads the swarm once a
    second, so starts could differ by up to a second, which this harness avoids). That line
    comes after the model, the corpus and the DHT are up and before the node's first DHT call
    from its main process. The nodes join a DHT peer of the harness, never a held node: joiners
    of a held node sometimes failed their DHT bootstrap, again and again until it was continued.
    """
    rounds = rounds or max(1, work.steps // inner_steps)
    method = f"diloco-{codec}-H{inner_steps}"
    logdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-bench-diloco-"))
    sets = work.node_sets([f"train.inner_steps={inner_steps}", f"sync.codec={codec}", *extra_sets])
    extra = [*sets, "--max-rounds", str(rounds), "--log-level", "debug"]
    by_name: dict[str, Proc] = {}
    wire0: list[int | None] = [None] * work.peers
    reached = threading.Event()

    def on_event(name: str, event: dict) -> None:
        index = int(name.rsplit("-", 1)[1])
        kind = event.get("event")
        if is_hold_point(event):
            while name not in by_name:
                time.sleep(0.001)
            by_name[name].pause()
        elif kind == "round_done":
            event["_wire"] = net.wire_sent(index)
            if target is not None and event.get("eval_loss", float("inf")) <= target:
                reached.set()

    peers: list[Proc] = []  # the running node of every peer (a restarted joiner replaces its first try)
    retries = 0
    try:
        with processes() as procs, contextlib.ExitStack() as stack:
            def start(index: int, initial: list[str], dht_port: int | None = None) -> Proc:
                proc = Proc(f"peer-{index}", node_argv(net, index, workdir, initial, extra, dht_port),
                            on_event=on_event, log_path=logdir / f"peer-{index}.log")
                by_name[proc.name] = proc
                procs.append(proc)
                return proc

            # Every node joins a plain DHT peer that the harness runs (never held), one after the
            # other as soon as the previous one's DHT listens: start-up overlaps, and no joiner
            # depends on a held node to answer its bootstrap.
            # In namespaces, a new DHT port per run: p2pd dials from its listening port (libp2p's
            # SO_REUSEPORT), so a fixed port would reuse the last run's TCP 4-tuples.
            base = 7700 + 10 * (next(_NODE_RUNS) % 100)
            ports = [base if net.kind == "netns" else free_port() for _ in range(work.peers)]
            maddr = stack.enter_context(bootstrap_dht(net))
            launched = time.monotonic()
            for index in range(work.peers):
                peers.append(start(index, [maddr], ports[index]))
                wait_port(net.host(index), ports[index], READY_TIMEOUT, lambda: peers[-1].proc.poll() is None)
            for index in range(work.peers):
                for attempt in range(1, JOIN_ATTEMPTS + 1):
                    try:
                        peers[index].wait_for(is_hold_point, READY_TIMEOUT)
                        break
                    except TimeoutError as err:
                        # A joiner whose DHT bootstrap failed exits: start it again (not seen
                        # since the hold point moved before the node's first DHT call).
                        if "bootstrap failed" not in str(err) or attempt == JOIN_ATTEMPTS:
                            raise
                        retries += 1
                        say(f"{method}: peer {index} failed its DHT bootstrap (attempt {attempt}); restarting it")
                        peers[index] = start(index, [maddr], ports[index])
            wire0[:] = _wire_now(net, work.peers)
            startup = time.monotonic() - launched
            t0 = time.time()
            for proc in peers:
                proc.resume()
            finished = _wait_all(peers, time.monotonic() + time_limit, reached if target is not None else None)
            notes = []
            if not finished and not reached.is_set():
                notes.append(f"stopped by the time limit of {time_limit:.0f} s")
            for proc in peers:
                proc.stop(30)
            codes = [p.proc.returncode for p in peers]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if any(code not in (0, None, -15) for code in codes):
        notes.append(f"exit codes {codes}")
    record = _diloco_record(method, net, work, peers, t0, wire0, inner_steps, codec, notes)
    record.update(startup_seconds=startup, startup_retries=retries)
    return record


def is_hold_point(event: dict) -> bool:
    """The node's log line at which the harness holds it (see run_diloco)."""
    return str(event.get("msg", "")).startswith("gRPC server on port")


def _phases(proc: Proc, t0: float, inner_steps: int) -> tuple[list[float], list[float], list[int]]:
    """(timestamps at which each inner phase ended, its duration, its steps) from the node's lines:
    a phase has H steps unless the node logged that it cut it short (``inner_phase_cut``: the
    swarm was already averaging, so a slower blocking peer joins with the steps it did)."""
    ends, durations, steps = [], [], []
    last_end = t0
    cut: int | None = None
    for event in proc.events:
        msg = str(event.get("msg", ""))
        ts = event.get("ts")
        if ts is None or ts < t0:
            continue
        if event.get("event") == "inner_phase_cut":
            cut = int(event["steps"])
        elif msg.startswith("round for step") and "failed" not in msg:
            ends.append(ts)
            durations.append(ts - last_end)
            steps.append(inner_steps if cut is None else cut)
            cut = None
        elif event.get("event") in ("round_done", "state_downloaded") or ROUND_OVER_RE.search(msg):
            last_end = ts  # a round (or a failed attempt) ended: the next inner phase starts here
    return ends, durations, steps


def _diloco_record(method: str, net: Network, work: Workload, procs: list[Proc], t0: float,
                   wire0: list[int | None], inner_steps: int, codec: str, notes: list[str]) -> dict[str, Any]:
    tokens_per_step = work.batch_size * work.seq_len
    rounds = [p.rounds() for p in procs]
    phases = [_phases(p, t0, inner_steps) for p in procs]
    by_step: dict[int, list[dict]] = {}
    for peer_rounds in rounds:
        for event in peer_rounds:
            by_step.setdefault(event["outer_step"], []).append(event)
    curve = []
    cumulative_app = [0.0] * len(procs)
    inconsistent, partial = [], []
    for step in sorted(by_step):
        events = by_step[step]
        for i, peer_rounds in enumerate(rounds):
            cumulative_app[i] = sum(e["bytes_sent"] for e in peer_rounds if e["outer_step"] <= step)
        if len({e["params_sha256"] for e in events}) != 1:
            inconsistent.append(step)
        if len(events) != len(procs) or any(e["group_size"] != len(procs) for e in events):
            partial.append(step)
        # Tokens: every inner phase any peer finished before this round's end (failed rounds too).
        done_ts = max(e["ts"] for e in events)
        steps_done = sum(n for ends, _, steps in phases for end, n in zip(ends, steps) if end <= done_ts)
        wires = [None if e.get("_wire") is None or wire0[i] is None else e["_wire"] - wire0[i]
                 for i, peer_rounds in enumerate(rounds) for e in peer_rounds if e["outer_step"] == step]
        curve.append({"step": step * inner_steps, "outer_step": step, "tokens": steps_done * tokens_per_step,
                      "eval_loss": events[0]["eval_loss"], "wall": done_ts - t0,
                      "app_bytes_sent": statistics.fmean(cumulative_app), "wire_bytes_sent": _mean(wires)})
    if inconsistent:
        notes.append(f"peers held different parameters after outer steps {inconsistent}")
    if partial:
        notes.append(f"outer steps {partial} were not averaged by all {len(procs)} peers together")
    utilization = []
    cuts = [sum(1 for e in p.events if e.get("event") == "inner_phase_cut") for p in procs]
    if any(cuts):
        notes.append(f"inner phases cut short (the swarm was already averaging), per peer: {cuts}; "
                     "fewer tokens than planned")
    for (ends, durations, _), peer_rounds in zip(phases, rounds):
        if peer_rounds:
            span = peer_rounds[-1]["ts"] - t0
            utilization.append(sum(durations) / span if span > 0 else None)
    all_rounds = [e for r in rounds for e in r]
    # What each node reported at the end of its rounds (the overlap benchmark's window and
    # losses); compute_utilization is the value of the node's lowcomm_compute_utilization_ratio
    # gauge then (same formula), train_seconds the node's seconds in inner steps since it started,
    # train_clock its wall-clock seconds since then, both taken at the end of its last inner phase.
    peer_rounds = [[{"outer_step": e["outer_step"], "wall": e["ts"] - t0, "eval_loss": e["eval_loss"],
                     "train_seconds": e.get("train_seconds"), "train_clock": e.get("train_clock"), "compute_utilization": e.get("compute_utilization"),
                     "round_seconds": e.get("round_seconds"), "matchmaking_seconds": e.get("matchmaking_seconds"),
                     "allreduce_seconds": e.get("allreduce_seconds"), "group_size": e.get("group_size"),
                     "schedule": e.get("schedule"), "tokens_total": e.get("tokens_total"), "tokens_averaged": e.get("tokens_averaged")}
                    for e in peer] for peer in rounds]
    late = [sum(1 for e in p.events if e.get("event") == "round_late") for p in procs]
    over = [sum(1 for e in p.events if ROUND_OVER_RE.search(str(e.get("msg", "")))) for p in procs]
    return _record(
        method, net, work, curve, codec=codec, inner_steps=inner_steps,
        compute_utilization=_mean(utilization),
        allreduce_seconds_median=statistics.median(e["allreduce_seconds"] for e in all_rounds) if all_rounds else None,
        round_seconds_median=statistics.median(e["round_seconds"] for e in all_rounds) if all_rounds else None,
        payload_bytes=all_rounds[0]["payload_bytes"] if all_rounds else None,
        numel=all_rounds[0]["numel"] if all_rounds else None, notes=notes, peer_rounds=peer_rounds,
        round_late=late, rounds_without_result=over, inner_phase_cuts=cuts,
        ok=bool(curve) and not inconsistent,
    )


# -- hivemind ------------------------------------------------------------------------------------


def run_hivemind(work: Workload, net: Network, logdir: Path, sync_every: int = 50, steps: int | None = None,
                 target: float | None = None, time_limit: float = 3600, compression: str = "int8",
                 matchmaking_time: float = 3.0, averaging_timeout: float = 60.0) -> dict[str, Any]:
    """``work.peers`` hivemind.Optimizer peers (local updates, 8-bit averaging every ``sync_every`` steps).

    The swarm's model at local step s is the mean of the peers' weights saved at step s (the
    peers never evaluate); it is evaluated here as soon as every peer saved it, so a run with a
    target stops when that model reaches the target.
    """
    steps = steps or work.steps
    logdir.mkdir(parents=True, exist_ok=True)
    params_dir = Path(tempfile.mkdtemp(prefix="lc-hm-"))  # short: p2pd's socket paths must fit in 107 bytes
    evaluator = Evaluator(work)
    saved: dict[int, dict[int, dict]] = {}  # step -> peer -> params event (with the wire counter then)
    changed = threading.Condition()
    wire0: list[int | None] = [None] * work.peers

    def on_event(name: str, event: dict) -> None:
        if event.get("event") == "params":
            index = int(name.rsplit("-", 1)[1])
            event["_wire"] = net.wire_sent(index)
            with changed:
                saved.setdefault(event["step"], {})[index] = event
                changed.notify_all()

    curve: list[dict] = []
    notes: list[str] = []
    epochs: list[int] = []
    try:
        with processes() as procs:
            def start(index: int, initial: list[str]) -> Proc:
                argv = net.wrap(index, [PY, str(HIVEMIND_SCRIPT), "--index", str(index), "--host", net.host(index),
                                        "--params-dir", str(params_dir), "--sync-every", str(sync_every),
                                        "--compression", compression, "--matchmaking-time", str(matchmaking_time),
                                        "--averaging-timeout", str(averaging_timeout),
                                        *work.cli(), "--steps", str(steps), "--peer-key", peer_key(index),
                                        *[arg for peer in initial for arg in ("--initial-peer", peer)]])
                # TMPDIR: the run's own folder, removed below, since hivemind leaves sockets and
                # multiprocessing folders there when its processes are ended by a signal.
                proc = Proc(f"peer-{index}", argv, env={"TMPDIR": str(params_dir)}, stdin=True, on_event=on_event,
                            log_path=logdir / f"peer-{index}.log")
                procs.append(proc)
                return proc

            first = start(0, [])
            maddrs = first.wait_event("dht_ready", READY_TIMEOUT)["maddrs"]
            maddr = next((m for m in maddrs if f"/{net.host(0)}/" in m), maddrs[0])
            for index in range(1, work.peers):
                start(index, [maddr])
            for proc in procs:
                proc.wait_event("ready", READY_TIMEOUT)
            wire0[:] = _wire_now(net, work.peers)
            for proc in procs:
                proc.send("go")
            deadline = time.monotonic() + time_limit
            evaluated: set[int] = set()
            stopping = False
            while True:  # evaluate the swarm's model at every step all peers saved, as they come
                with changed:
                    complete = sorted(s for s, got in saved.items() if len(got) == work.peers and s not in evaluated)
                    if not complete:
                        # Every "params" line of a peer comes before its "done" line.
                        if all(p.find("done") or p.proc.poll() is not None for p in procs):
                            break
                        if time.monotonic() > deadline:
                            notes.append(f"stopped by the time limit of {time_limit:.0f} s")
                            break
                        changed.wait(0.5)
                        continue
                for step in complete:
                    evaluated.add(step)
                    got = saved[step]
                    mean = torch.stack([torch.load(got[i]["path"]) for i in range(work.peers)]).mean(0)
                    point = {"step": step, "tokens": step * work.tokens_per_step, "eval_loss": evaluator.loss(mean),
                             "wall": max(e["wall"] for e in got.values()),
                             "app_bytes_sent": None, "epoch": max(e["epoch"] for e in got.values()),
                             "wire_bytes_sent": _mean([None if e["_wire"] is None or wire0[i] is None
                                                       else e["_wire"] - wire0[i] for i, e in got.items()]),
                             "sync_fraction": _mean([e["sync_seconds"] / e["wall"] for e in got.values() if e["wall"]])}
                    curve.append(point)
                    if not stopping and target is not None and point["eval_loss"] <= target:
                        stopping = True
                        for proc in procs:
                            if proc.proc.poll() is None:
                                proc.send("stop")
            for proc in procs:
                if proc.proc.poll() is None:
                    proc.send("exit")
            dones = [p.find("done") for p in procs]
            for proc in procs:
                proc.stop(30)
            averaged = [[int(m.group(1)) for line in p.raw_lines if (m := AVERAGED_RE.search(line))] for p in procs]
            partial = [sum(1 for line in p.raw_lines if PARTIAL_RE.search(line)) for p in procs]
            patched = any(e.get("patched_8bit_for_numpy2") for p in procs for e in p.find("ready"))
            failed = [sum(1 for line in p.raw_lines if "Averaging failed" in line) for p in procs]
            epochs = [d[-1]["epoch"] for d in dones if d]
            utilization = _mean([d[-1]["compute_seconds"] / d[-1]["wall"] for d in dones if d and d[-1]["wall"]])
            # The swarm's model after the last step every peer saved, and each peer's own model.
            local = []
            if saved:
                last = max(s for s, got in saved.items() if len(got) == work.peers) if curve else None
                if last is not None:
                    local = [evaluator.loss(torch.load(saved[last][i]["path"])) for i in range(work.peers)]
    finally:
        shutil.rmtree(params_dir, ignore_errors=True)
    curve.sort(key=lambda p: p["step"])
    # What hivemind's all-reduce sent (an estimate: hivemind counts nothing): for every round a peer
    # logged ("Averaged parameters with g peers"), the butterfly volume 2·(g−1)/g of the 8-bit
    # payload (1 byte per value plus a 256-entry float32 codebook per tensor), summed up to the
    # peer's "params" line of each step, mean over peers.
    payload = sum(p.numel() for p in evaluator.params) + 256 * 4 * len(evaluator.params)
    sent_at: dict[int, list[float]] = {}
    for proc in procs:
        total = 0.0
        for event in proc.events:
            if event.get("level") == "raw" and (m := AVERAGED_RE.search(event["msg"])):
                g = int(m.group(1))
                total += 2 * (g - 1) / g * payload
            elif event.get("event") == "params":
                sent_at.setdefault(event["step"], []).append(total)
    for point in curve:
        point["app_bytes_sent"] = _mean(sent_at.get(point["step"], []))
    if not any(averaged):
        notes.append("no averaging round succeeded on any peer")
    if any(partial):
        notes.append(f"rounds in which a reducer got only part of the tensors, per peer: {partial}")
    if patched:
        notes.append("hivemind's 8-bit decoder patched for NumPy 2 (bench/baselines/hivemind_opt.py)")
    return _record("hivemind", net, work, curve, compute_utilization=utilization, sync_every=sync_every,
                   compression=compression, epochs=epochs, local_model_eval_losses=local, notes=notes,
                   app_bytes_estimated=True, averaging_rounds=[len(a) for a in averaged],
                   averaging_group_sizes=averaged, averaging_failures=failed, averaging_partial=partial,
                   patched_8bit_for_numpy2=patched)
