#!/usr/bin/env python
"""Soak: the memory of every node of a small swarm over hundreds of rounds with churn.

    nice -n 10 python bench/soak.py [--peers 3] [--rounds 200] [--churn-every 20] [--inner-steps 5]
                                    [--batch-size 4] [--seq-len 64] [--sample-every 5]
                                    [--env KEY=VALUE ...] [--set KEY=VALUE ...] [--time-limit 1800]
                                    [--json-out bench/out/soak.jsonl]

``--peers`` ``lowcomm-node join`` processes (the real CLI, ``tiny`` preset, one torch thread, short
inner phases) join a DHT peer of the harness on loopback and average until peer 0 has committed
``--rounds`` outer steps. Every ``--churn-every`` steps of the swarm one of the other peers
(in turn) is killed with SIGKILL (its whole session: node, DHT process, p2pd) and started again
on the same checkpoint directory and identity; peer 0 is never killed, so its curve shows
whether anything grows with the rounds.

Every ``--sample-every`` seconds the harness reads, for every live node, the memory of each of
its processes from /proc (psutil: RSS, and PSS from smaps_rollup, which splits the pages that
processes share, such as libtorch's, between them): ``main`` (the node), ``dht`` (hivemind's DHT
process, forked by the node), ``p2pd`` and ``torch_shm_manager`` (started by torch for the
shared-memory futures hivemind uses). One JSON line per node and sample (``kind: sample``), and
at the end one ``kind: summary`` line: per node the RSS and PSS at the first sample at or after
round 20 and at the end (samples of a process that has committed a round, not of one starting
up), and for peer 0 the slope of its total RSS after warm-up (MB per 100 rounds, least squares
over the samples from ``--warmup`` rounds on). ``python bench/results.py`` renders the newest
summary as the "Soak" section of RESULTS.md (``soak_section``).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from common import (OUT, Network, Proc, Workload, append_jsonl, bootstrap_dht, handle_signals, node_argv, processes,
                    record_base, say)

# Short timeouts: a round that fails while a peer is being killed costs seconds, not 30-60 s.
SETTINGS = ["sync.matchmaking_timeout=10", "sync.reduce_timeout=10", "node.heartbeat_interval=1",
            "sync.straggler_wait=0.5"]
ROLES = ("main", "dht", "p2pd", "torch_shm_manager")


def role(proc: psutil.Process, main_pid: int) -> str:
    if proc.pid == main_pid:
        return "main"
    name = proc.name()
    if name in ("p2pd", "torch_shm_manager"):
        return name
    return "dht" if name.startswith(("python", "lowcomm")) else name


def memory(main_pid: int) -> dict[str, dict[str, float]]:
    """MB of RSS, PSS and USS (pages of that process alone) per role of the node whose main process
    is ``main_pid`` (empty if gone)."""
    out: dict[str, dict[str, float]] = {}
    with contextlib.suppress(psutil.Error):
        main = psutil.Process(main_pid)
        for proc in [main, *main.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                info = proc.memory_full_info()
                entry = out.setdefault(role(proc, main_pid), {"rss_mb": 0.0, "pss_mb": 0.0, "uss_mb": 0.0, "threads": 0})
                entry["rss_mb"] += round(info.rss / 2**20, 1)
                entry["pss_mb"] += round(info.pss / 2**20, 1)
                entry["uss_mb"] += round(info.uss / 2**20, 1)
                entry["threads"] += proc.num_threads()
    return out


def slope_per_100_rounds(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (round, MB) points, in MB per 100 rounds."""
    if len(points) < 3 or len({x for x, _ in points}) < 2:
        return None
    return statistics.linear_regression([x for x, _ in points], [y for _, y in points]).slope * 100


class Peer:
    """One peer of the soak: its current process, its outer step and how often it was restarted."""

    def __init__(self, index: int, argv: list[str], env: dict[str, str], logdir: Path) -> None:
        self.index = index
        self.argv = argv
        self.env = env
        self.logdir = logdir
        self.step = 0
        self.lives = 0
        self.rounds_in_life = 0  # rounds committed by the current process (0: still starting)
        self.proc: Proc | None = None
        self.lock = threading.Lock()

    def on_event(self, _name: str, event: dict) -> None:
        if event.get("event") in ("round_done", "state_downloaded") and isinstance(event.get("outer_step"), int):
            with self.lock:
                self.step = max(self.step, event["outer_step"])
                self.rounds_in_life += event.get("event") == "round_done"

    def start(self, procs: list[Proc]) -> None:
        self.lives += 1
        self.rounds_in_life = 0
        self.proc = Proc(f"peer-{self.index}", self.argv, env=self.env, on_event=self.on_event,
                         log_path=self.logdir / f"peer-{self.index}-life{self.lives}.log")
        procs.append(self.proc)


def second_half_slope(samples: list[dict]) -> float | None:
    """Peer 0's total-RSS slope (MB per 100 rounds) over the second half of its rounds: warm-up
    (allocator pools, p2pd's connections) is long over there, so growth there would be a leak."""
    mine = [s for s in samples if s["node"] == 0 and s["processes"] and s.get("rounds_in_life", 1) > 0]
    if not mine:
        return None
    half = max(s["outer_step"] for s in mine) / 2
    return slope_per_100_rounds([(s["outer_step"], s["total_rss_mb"]) for s in mine if s["outer_step"] >= half])


def summarize(samples: list[dict], peers: int, warmup: int) -> dict[str, Any]:
    nodes = {}
    for index in range(peers):
        # Only samples of a process that trains (committed a round in this life), not of one starting.
        mine = [s for s in samples if s["node"] == index and s["processes"] and s["rounds_in_life"] > 0]
        at20 = next((s for s in mine if s["outer_step"] >= 20), None)
        last = mine[-1] if mine else None
        nodes[f"peer-{index}"] = {
            "at_round_20": None if at20 is None else {"outer_step": at20["outer_step"], "life": at20["life"],
                                                      "processes": at20["processes"], "total_rss_mb": at20["total_rss_mb"],
                                                      "total_pss_mb": at20["total_pss_mb"]},
            "at_end": None if last is None else {"outer_step": last["outer_step"], "life": last["life"],
                                                 "processes": last["processes"], "total_rss_mb": last["total_rss_mb"],
                                                 "total_pss_mb": last["total_pss_mb"]},
        }
    steady = [s for s in samples if s["node"] == 0 and s["processes"] and s["outer_step"] >= warmup
              and s["rounds_in_life"] > 0]
    return {
        "nodes": nodes,
        "peer0_rss_slope_mb_per_100_rounds": slope_per_100_rounds([(s["outer_step"], s["total_rss_mb"]) for s in steady]),
        "peer0_main_rss_slope_mb_per_100_rounds": slope_per_100_rounds(
            [(s["outer_step"], s["processes"]["main"]["rss_mb"]) for s in steady if "main" in s["processes"]]),
        "peer0_rss_slope_second_half_mb_per_100_rounds": second_half_slope(samples),
        "peer0_rss_after_warmup_mb": {"min": min((s["total_rss_mb"] for s in steady), default=None),
                                      "max": max((s["total_rss_mb"] for s in steady), default=None)},
    }


def _mb(entry: dict | None, role_name: str) -> str:
    if entry is None or role_name not in entry["processes"]:
        return "–"
    m = entry["processes"][role_name]
    return f"{m['rss_mb']:.0f} ({m['pss_mb']:.0f})"


def soak_section(records: list[dict]) -> list[str]:
    """The "Soak" section of RESULTS.md from the records of the newest run (its summary, and its
    samples where present; results.py calls it)."""
    lines = ["## 6. Soak: memory over hundreds of rounds with churn", ""]
    records = [r for r in records if r.get("bench") == "soak"]
    summary = next((r for r in reversed(records) if r.get("kind") == "summary"), None)
    if summary is None:
        return lines + ["Not run.", ""]
    samples = [r for r in records if r.get("kind") == "sample" and r.get("run_id") == summary["run_id"]]
    late = summary.get("peer0_rss_slope_second_half_mb_per_100_rounds")
    if late is None and samples:
        late = second_half_slope(samples)
    env = " ".join(f"{k}={v}" for k, v in summary.get("env", {}).items())
    lines += [f"`{summary['command']}`{' with ' + env if env else ''}: {summary['peers']} `lowcomm-node join` processes "
              f"(`tiny`, one torch thread, H={summary['inner_steps']}, {summary['batch_size']} sequences of "
              f"{summary['seq_len']} bytes) on loopback; every {summary['churn_every']} rounds one peer other than "
              f"peer 0 is killed (SIGKILL of its session) and restarted on its checkpoint directory. "
              f"**{summary['rounds']} rounds, {summary['restarts']} restarts**, {summary['wall_seconds'] / 60:.1f} min"
              + (f"; {'; '.join(summary['notes'])}" if summary.get("notes") else "")
              + (f"; on {m['cores']} cores (`{m['cpu_model']}`), load average {m['loadavg_at_start']} at the start"
                 if (m := summary.get("machine")) else "") + ".", "",
              "MB of RSS (PSS in brackets: shared pages split between the processes that map them) per process "
              "of each node, at its first sample at or after round 20 and at its last (samples of a process "
              "that has committed a round; `life`: how many times that peer was started):", ""]
    header = "| node | when | step | life | main | DHT process | p2pd | torch_shm_manager | total RSS (PSS) |"
    lines += [header, "|---|---|---|---|---|---|---|---|---|"]
    for name, node in summary["nodes"].items():
        for label, entry in (("round 20", node["at_round_20"]), ("end", node["at_end"])):
            if entry is None:
                lines.append(f"| {name} | {label} | – | – | – | – | – | – | – |")
                continue
            lines.append(f"| {name} | {label} | {entry['outer_step']} | {entry['life']} | {_mb(entry, 'main')} | "
                         f"{_mb(entry, 'dht')} | {_mb(entry, 'p2pd')} | {_mb(entry, 'torch_shm_manager')} | "
                         f"{entry['total_rss_mb']:.0f} ({entry['total_pss_mb']:.0f}) |")
    after = summary.get("peer0_rss_after_warmup_mb") or {}
    slope, main_slope = summary.get("peer0_rss_slope_mb_per_100_rounds"), summary.get("peer0_main_rss_slope_mb_per_100_rounds")
    if after.get("min") is not None:
        lines += ["", f"Peer 0 (never restarted) after warm-up (round ≥ {summary.get('warmup', 40)}): total RSS "
                  f"{after['min']:.0f}–{after['max']:.0f} MB, slope {slope:+.1f} MB per 100 rounds (main process "
                  f"{main_slope:+.1f}), least squares over every sample"
                  + (f"; over the second half of the run {late:+.1f} MB per 100 rounds" if late is not None else "")
                  + f". The samples are the `kind: sample` lines of run {summary['run_id']} in bench/out/soak.jsonl."]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=200, help="outer steps peer 0 must commit")
    parser.add_argument("--churn-every", type=int, default=20, help="swarm rounds between two kills (0: no churn)")
    parser.add_argument("--inner-steps", type=int, default=5, help="H")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between two memory samples")
    parser.add_argument("--warmup", type=int, default=40, help="rounds left out of peer 0's slope")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable of every node (e.g. MALLOC_ARENA_MAX=2; repeatable)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra node setting (the node's --set; repeatable)")
    parser.add_argument("--time-limit", type=float, default=1800, help="seconds before the soak is stopped")
    parser.add_argument("--json-out", type=Path, default=OUT / "soak.jsonl")
    args = parser.parse_args(argv)
    if args.peers < 2 and args.churn_every:
        raise SystemExit("churn needs at least 2 peers (peer 0 is never killed)")
    try:
        env = dict(item.split("=", 1) for item in args.env)
    except ValueError:
        raise SystemExit(f"--env takes KEY=VALUE, not {args.env}") from None
    handle_signals()
    run_id = time.strftime("%Y%m%dT%H%M%S")
    logdir = args.json_out.parent / "logs" / f"soak-{run_id}"
    logdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="lowcomm-bench-soak-"))
    net = Network()
    work = Workload(peers=args.peers, batch_size=args.batch_size, seq_len=args.seq_len)
    extra = [*work.node_sets([f"train.inner_steps={args.inner_steps}", *SETTINGS, *args.sets]), "--log-level", "info"]
    base = record_base("soak", run_id=run_id, peers=args.peers, rounds_target=args.rounds, churn_every=args.churn_every,
                       inner_steps=args.inner_steps, batch_size=args.batch_size, seq_len=args.seq_len, env=env,
                       warmup=args.warmup, sample_every=args.sample_every,
                       node_sets=args.sets, logs=str(logdir))
    samples: list[dict] = []
    restarts: list[dict] = []
    started = time.monotonic()
    notes: list[str] = []
    try:
        with processes() as procs, bootstrap_dht(net) as maddr:
            # TMPDIR: the run's folder, removed at the end, since a SIGKILLed node leaves p2pd's sockets there.
            node_env = {**env, "TMPDIR": str(workdir)}
            peers = [Peer(i, node_argv(net, i, workdir, [maddr], extra), node_env, logdir) for i in range(args.peers)]
            for peer in peers:
                peer.start(procs)
            say(f"soak: {args.peers} peers, {args.rounds} rounds, a kill every {args.churn_every} rounds; logs in {logdir}")
            next_kill = args.churn_every or None
            victim = 0
            next_sample = time.monotonic()
            while peers[0].step < args.rounds:
                if time.monotonic() - started > args.time_limit:
                    notes.append(f"stopped by the time limit of {args.time_limit:.0f} s at step {peers[0].step}")
                    break
                if peers[0].proc.proc.poll() is not None:
                    notes.append(f"peer 0 exited with {peers[0].proc.proc.returncode} at step {peers[0].step}")
                    break
                swarm_step = max(p.step for p in peers)
                if next_kill is not None and swarm_step >= next_kill:
                    target = peers[1 + victim % (args.peers - 1)]
                    victim += 1
                    target.proc.kill_all()  # SIGKILL of the session: node, DHT process, p2pd
                    restarts.append({"peer": target.index, "at_swarm_step": swarm_step, "its_step": target.step})
                    say(f"soak: step {swarm_step}: killed peer {target.index} (at step {target.step}); restarting it")
                    target.start(procs)
                    next_kill += args.churn_every
                for peer in peers:  # a node that exited by itself is restarted too (and counted)
                    if peer.index and peer.proc.proc.poll() is not None:
                        restarts.append({"peer": peer.index, "at_swarm_step": swarm_step, "its_step": peer.step,
                                         "exit_code": peer.proc.proc.returncode})
                        say(f"soak: peer {peer.index} exited with {peer.proc.proc.returncode}; restarting it")
                        peer.start(procs)
                if time.monotonic() >= next_sample:
                    next_sample += args.sample_every
                    t = round(time.monotonic() - started, 1)
                    for peer in peers:
                        mem = memory(peer.proc.proc.pid)
                        sample = {"kind": "sample", "run_id": run_id, "t": t, "node": peer.index, "life": peer.lives,
                                  "outer_step": peer.step, "rounds_in_life": peer.rounds_in_life, "processes": mem,
                                  "total_rss_mb": round(sum(m["rss_mb"] for m in mem.values()), 1),
                                  "total_pss_mb": round(sum(m["pss_mb"] for m in mem.values()), 1)}
                        samples.append(sample)
                        append_jsonl(args.json_out, {"bench": "soak", **sample})
                    say("soak: " + ", ".join(f"peer {s['node']} step {s['outer_step']} rss {s['total_rss_mb']:.0f} MB"
                                             for s in samples[-len(peers):]))
                time.sleep(0.2)  # polling /proc and the event counters: there is nothing to wait on
            for peer in peers:
                peer.proc.stop(30)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    record = {**base, "kind": "summary", "ok": not notes and peers[0].step >= args.rounds,
              "rounds": peers[0].step, "restarts": len(restarts), "restart_log": restarts, "notes": notes,
              "wall_seconds": round(time.monotonic() - started, 1), **summarize(samples, args.peers, args.warmup)}
    append_jsonl(args.json_out, record)
    say(f"soak: {record['rounds']} rounds, {len(restarts)} restarts in {record['wall_seconds']:.0f} s; peer 0 RSS slope "
        f"after round {args.warmup}: {record['peer0_rss_slope_mb_per_100_rounds']} MB per 100 rounds")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
