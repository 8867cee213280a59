#!/usr/bin/env python
"""Outer-optimizer sweep on an in-process DiLoCo emulator (issue 16 item 5), and the studies it serves.

    nice -n 19 python bench/outer_sweep.py [--lr 0.4,0.7,1.0] [--momentum 0,0.5,0.9] [--H 50]
                                           [--seeds 0] [--inner-lr 1e-3] [--codec int8|...|sparseloco]
                                           [--overlap-delay none,3,9] [--overlap-stand-in none,own,paper,last]
                                           [--steps 1000] [--reference single]
                                           [--json-out bench/out/outer_sweep.jsonl] [--eval-every 1] [--validate]

The long benchmark (bench/convergence.py --long) runs 4 real ``lowcomm-node`` processes for
3–6 minutes per run on a shared 2-core machine; a grid of outer lr × momentum × H × seeds is
out of reach that way. This emulator does the same arithmetic in one process, without sockets:

* P replicas of the node's own ``Trainer`` (node/trainer.py) built from the long benchmark's
  Config (bench/common.Workload: tiny preset, 8 × 128 tokens per step, the same seed), each with
  the peer id of bench identity i as its data-shard key, so peer i draws exactly the batches
  that peer i of the real run draws, with the same AdamW, warm-up and gradient clip.
* Every round: H inner steps per replica, Δ_i = θ_global − θ_i, then the node's butterfly
  all-reduce done by hand with the same functions (protocol/member.py's arithmetic): the members
  sorted by peer id own one shard each (``shard_layout`` without bandwidth figures: equal
  shards), a member's part of its own shard enters exactly (its residual there is cleared), its
  parts of the others' shards go through ``encode_with_feedback`` with its sender residual and
  are decoded from the payload; the owner aggregates them with ``aggregate`` (the node's
  Aggregation from [sync], token weights bounded by ``bounded_weights``) and encodes the average
  once with its owner residual; every member applies the decoded average with
  ``apply_averages`` (node/apply.py: the real ``NesterovOuter`` step on ``GlobalState``), and the
  replicas restart from θ_global (blocking rounds).
* Eval: the node's replica evaluator (``Trainer.replica_evaluator``: its fixed held-out batches)
  on θ_global after every ``--eval-every``-th outer step and after the last one.

``--inner-lr`` sweeps the inner AdamW's lr too, and ``--reference single`` trains the `single`
baseline (one process with the global batch, as bench/baselines/ddp.py does) at those lrs, so
that a DiLoCo configuration is compared with the reference at its own best lr: the inner lr
moves both (RESULTS.md section 1d). ``--overlap-delay D`` emulates ``[sync] overlap = "delayed"``
with each round's result landing D inner steps into the next phase (section 5b), and
``--overlap-stand-in`` what the replicas train on from meanwhile (``own``: the node's ``eager``).
``--codec sparseloco`` is the node's ``[sync] method = "sparseloco"`` (``--momentum 0``, α as
``--lr``).

What it leaves out, on purpose: time. A real round can cut a slow peer's inner phase short, fail
under load, or size shards by measured bandwidth (which moves int8's block boundaries); the
emulator's rounds always have all P members and H steps each. ``--validate`` compares it with
the real long benchmark's records of the same seeds (bench/out/convergence_long.jsonl).

One JSON line per run goes to ``--json-out`` (bench/out/outer_sweep.jsonl); a run whose
configuration is already there is skipped, so an interrupted sweep resumes where it stopped.
Runs are sequential, one torch thread each (run it with ``nice -n 19`` on a shared machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from common import OUT, Workload, append_jsonl, machine, read_jsonl, record_base, say

DEFAULT_JSON = OUT / "outer_sweep.jsonl"
LONG_JSON = OUT / "convergence_long.jsonl"
# The plain DiLoCo codecs (Nesterov outer rule), and sparseloco: the node's [sync] method = "sparseloco"
# (its codec with decayed error feedback, clipped-mean aggregation; --momentum must be 0, --lr is α).
CODEC_CHOICES = ("fp32", "fp16", "bf16", "int8", "int4", "sparseloco")
# Where an overlapped replica trains on from at a boundary, until its round's result lands
# (``--overlap-stand-in``): what stands in for the average that is still on the wire.
#   none:  its own end point, θ_global − Δ_own (the node's ``overlap = "delayed"``);
#   own:   the outer step previewed with its own Δ (the node's ``eager``);
#   paper: the eager-updates paper's mix, Δ_own / P + the last average · (P − 1) / P;
#   last:  the outer step previewed with the last round's average.
# Each then gets θ_global − (where it started) when the result lands, as node/overlap.py merges.
# paper and last use Δ_own in the first round, which has no last average.
STAND_INS = ("none", "own", "paper", "last")


class UsageError(Exception):
    """A bad flag value: main() prints one ``outer_sweep: error:`` line for it."""


@dataclass(frozen=True)
class RunConfig:
    """One emulated run: what makes two records the same run (the resume key)."""

    lr: float
    momentum: float
    inner_steps: int
    seed: int
    steps: int = 1000
    peers: int = 4
    batch_size: int = 8
    seq_len: int = 128
    preset: str = "tiny"
    codec: str = "int8"
    inner_lr: float = 1e-3
    """The inner AdamW's peak lr ([train] lr; the workload's and the node's default is 1e-3)."""
    method: str = "diloco"
    """diloco: the emulated rounds. single: the reference, one Trainer with the global batch
    (peers × batch_size) for ``steps`` steps, as bench/baselines/ddp.py's `single` trains."""
    overlap_delay: int | None = None
    """None: blocking rounds. D: ``[sync] overlap = "delayed"`` with the round's result landing
    after D inner steps of the next phase (0 ≤ D ≤ H; the real node's D is the round's duration
    in inner steps)."""
    overlap_stand_in: str = "none"
    """With an overlap delay: where a replica trains on from while its round is on the wire
    (``STAND_INS``); "none" is ``delayed``, "own" the node's ``eager``."""

    def key(self) -> tuple:
        return (round(self.lr, 6), round(self.momentum, 6), self.inner_steps, self.seed, self.steps, self.peers,
                self.batch_size, self.seq_len, self.preset, self.codec, round(self.inner_lr, 9), self.method,
                self.overlap_delay, self.overlap_stand_in)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "RunConfig":
        # Records written before inner_lr, method, overlap_delay and overlap_stand_in existed ran their defaults.
        return cls(**{name: record["config"][name] for name in cls.__dataclass_fields__
                      if name in record["config"]})

    def workload(self) -> Workload:
        return Workload(peers=self.peers, steps=self.steps, batch_size=self.batch_size, seq_len=self.seq_len,
                        preset=self.preset, seed=self.seed)

    def node_sets(self) -> list[str]:
        """The node settings of this run on top of the workload's (``--set`` syntax)."""
        method = ["sync.method=sparseloco"] if self.codec == "sparseloco" else []
        return [*method, f"train.inner_steps={self.inner_steps}", f"sync.codec={self.codec}", f"sync.outer_lr={self.lr}",
                f"sync.outer_momentum={self.momentum}", f"train.lr={self.inner_lr}", "node.torch_threads=1"]

    def name(self) -> str:
        if self.method == "single":
            return f"emu-single-ilr{self.inner_lr:g}"
        inner = "" if self.inner_lr == RunConfig.inner_lr else f"-ilr{self.inner_lr:g}"
        overlap = "" if self.overlap_delay is None else f"-delayed{self.overlap_delay}"
        if self.overlap_delay is not None and self.overlap_stand_in != "none":
            overlap += f"-{self.overlap_stand_in}"
        return f"emu-{self.codec}-H{self.inner_steps}-lr{self.lr:g}-m{self.momentum:g}{inner}{overlap}"


def default_peer_ids(peers: int) -> list[str]:
    """The peer ids of bench identities 0..peers-1: the data-shard keys of the real runs' peers."""
    from common import peer_key

    return [peer_key(i) for i in range(peers)]


class Emulator:
    """P trainers and one θ_global doing the node's rounds in one process (module docstring)."""

    def __init__(self, run: RunConfig, peer_ids: list[str], corpus=None) -> None:
        from lowcomm.node.data import load_data
        from lowcomm.node.globalstate import GlobalState
        from lowcomm.node.trainer import Trainer
        from lowcomm.protocol import codecs
        from lowcomm.protocol.aggregation import Aggregation

        if len(peer_ids) != run.peers:
            raise ValueError(f"{run.peers} peers need {run.peers} peer ids, got {len(peer_ids)}")
        self.run = run
        self.config = run.workload().config(extra=run.node_sets())
        corpus = corpus if corpus is not None else load_data(self.config.data)
        # Members in the leader's order (layout.split_into_groups sorts a group by peer id).
        self.peer_ids = sorted(peer_ids)
        self.trainers = [Trainer(self.config, peer, corpus) for peer in self.peer_ids]
        self.numel = self.trainers[0].numel
        self.codec = codecs.get_codec(self.config.sync.codec)
        self.aggregation = Aggregation.from_config(self.config.sync)
        # θ_global and the outer momentum, shared (identical on every real member); residuals per peer.
        self.state = GlobalState.fresh(self.trainers[0].get_params(), self.config.sync.outer_lr,
                                       self.config.sync.outer_momentum)
        self.residuals = [torch.zeros(self.numel) for _ in self.peer_ids]
        self.owner_residuals = [torch.zeros(self.numel) for _ in self.peer_ids]
        self.evaluate = self.trainers[0].replica_evaluator()
        self.tokens = 0
        self.shifts: list[torch.Tensor | None] = [None] * len(self.peer_ids)  # delayed overlap's pending merges
        self.last_average: torch.Tensor | None = None  # the last round's decoded average (stand-ins)

    def slices(self) -> list[slice]:
        from lowcomm.protocol.layout import shard_layout

        bounds = shard_layout(self.numel, [0.0] * len(self.peer_ids))  # no bandwidth figures: equal shards
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def inner_phases(self) -> tuple[list[torch.Tensor], list[float]]:
        """H inner steps on every replica; (Δ_i = θ_global − θ_i, tokens_i). With an overlap delay
        D, the last round's result reaches replica i after D steps of this phase, as the node's
        ``overlap_apply = "arrival"`` merges it (node/overlap.py ``_merge``): the local model is
        shifted by θ_global − (the local model when its Δ was taken)."""
        deltas, weights = [], []
        for i, trainer in enumerate(self.trainers):
            steps, tokens = self.run.inner_steps, 0
            shift, self.shifts[i] = self.shifts[i], None
            if shift is not None:  # delayed overlap: D steps on the stale model, then the merge
                early = trainer.train_phase(self.run.overlap_delay, lambda: False)
                trainer.add_to_slice(slice(0, self.numel), shift)
                steps, tokens = steps - early.steps, early.tokens
            stats = trainer.train_phase(steps, lambda: False)
            deltas.append(self.state.params - trainer.get_params())
            weights.append(float(tokens + stats.tokens))
            self.tokens += tokens + stats.tokens
        return deltas, weights

    def allreduce(self, deltas: list[torch.Tensor], tokens: list[float]) -> list[torch.Tensor | None]:
        """The decoded average of every shard, as protocol/member.py and accumulator.py make it."""
        from lowcomm.protocol import codecs
        from lowcomm.protocol.accumulator import bounded_weights
        from lowcomm.protocol.aggregation import aggregate

        weights = bounded_weights([SimpleNamespace(peer_id=p, weight=w) for p, w in zip(self.peer_ids, tokens)])
        averages: list[torch.Tensor | None] = []
        for owner, sl in enumerate(self.slices()):
            numel = sl.stop - sl.start
            contributions, exact = [], {}
            for i, peer in enumerate(self.peer_ids):
                x = deltas[i][sl].add(self.residuals[i][sl])  # what a skipped shard would carry
                exact[peer] = x
                if i == owner:  # the owner's own part enters exactly: nothing left to carry
                    self.residuals[i][sl].zero_()
                    contributions.append((peer, weights[peer], x))
                else:
                    payload, _ = codecs.encode_with_feedback(self.codec, deltas[i][sl], self.residuals[i][sl])
                    contributions.append((peer, weights[peer], self.codec.decode(payload, numel)))
            outcome = aggregate(contributions, self.aggregation)
            if outcome.average is None or not bool(torch.isfinite(outcome.average).all()):
                # The owner cannot publish: every member skips the shard and carries all of x.
                for i, peer in enumerate(self.peer_ids):
                    self.residuals[i][sl].copy_(exact[peer])
                averages.append(None)
                continue
            _, decoded = codecs.encode_with_feedback(self.codec, outcome.average, self.owner_residuals[owner][sl])
            for i, peer in enumerate(self.peer_ids):
                if peer not in outcome.used:  # rejected (norm bound): the average came without it
                    self.residuals[i][sl].copy_(exact[peer])
            averages.append(decoded)
        return averages

    def round(self) -> None:
        """One outer step: inner phases, all-reduce, outer step, replicas restart from θ_global."""
        from lowcomm.node.apply import apply_averages
        from lowcomm.protocol.allreduce import AllReduceResult

        deltas, tokens = self.inner_phases()
        delayed = self.run.overlap_delay is not None
        # Where each replica trains on from until the result lands (before the outer step moves θ_global).
        starts = [self.stand_in_start(i, deltas[i]) for i in range(len(self.trainers))] if delayed else []
        averages = self.allreduce(deltas, tokens)
        apply_averages(self.state, slice(0, self.numel),
                       AllReduceResult(averages=averages, slices=self.slices(), bytes_sent=0, bytes_received=0,
                                       payload_bytes=0))
        self.state.commit()
        if None not in averages:
            self.last_average = torch.cat(averages)
        if delayed:  # the replicas train on; the result lands overlap_delay steps into the next phase
            for trainer, start in zip(self.trainers, starts):
                trainer.set_params(start)
            self.shifts = [self.state.params - start for start in starts]
        else:  # blocking rounds: every replica restarts from θ_global
            for trainer in self.trainers:
                trainer.set_params(self.state.params)

    def stand_in_start(self, i: int, delta: torch.Tensor) -> torch.Tensor:
        """Where replica i trains on from at this boundary (``STAND_INS``), from θ_global and the
        momentum before this round's outer step; the delta is Δ_i before the residual."""
        stand_in, local = self.run.overlap_stand_in, self.trainers[i].get_params()
        if stand_in == "none":
            return local
        own = delta + self.residuals[i]  # what the node's eager previews (node/overlap.py)
        if stand_in == "own" or self.last_average is None:
            average = own
        elif stand_in == "paper":
            peers = len(self.trainers)
            average = own / peers + self.last_average * ((peers - 1) / peers)
        else:  # last
            average = self.last_average
        start = self.state.params.clone()
        self.state.outer.preview_slice(start, 0, average)
        return start

    def train(self, eval_every: int = 1, on_point: Callable[[dict], None] | None = None) -> list[dict]:
        """All rounds of the run; the curve (outer step, tokens, eval loss) at the evaluated steps."""
        rounds = self.run.steps // self.run.inner_steps
        curve = []
        for step in range(1, rounds + 1):
            self.round()
            if step % eval_every == 0 or step == rounds:
                point = {"outer_step": step, "step": step * self.run.inner_steps, "tokens": self.tokens,
                         "eval_loss": self.evaluate(self.state.params)}
                curve.append(point)
                if on_point is not None:
                    on_point(point)
        return curve


class SingleReference:
    """The `single` baseline in this process: one ``Trainer`` with the global batch (peers ×
    batch_size sequences per step) under the data-shard key "single", as bench/baselines/ddp.py
    trains it with ``--world-size 1``, evaluated on the same held-out batches as the emulated
    θ_global (a Trainer of the per-peer batch size builds them). With the same inner lr it gives
    the real `single` run's numbers; its point here is the reference at other inner lrs."""

    def __init__(self, run: RunConfig, corpus=None) -> None:
        from lowcomm.node.data import load_data
        from lowcomm.node.trainer import Trainer

        self.run = run
        work = run.workload()
        config = work.config(batch_size=work.global_batch, extra=run.node_sets())
        corpus = corpus if corpus is not None else load_data(config.data)
        self.trainer = Trainer(config, "single", corpus)
        self.numel = self.trainer.numel
        self.evaluate = Trainer(work.config(extra=run.node_sets()), "single", corpus).replica_evaluator()
        self.tokens = 0

    def train(self, eval_every: int = 1, on_point: Callable[[dict], None] | None = None) -> list[dict]:
        """``steps`` steps, evaluated every ``inner_steps`` × ``eval_every`` steps (the emulator's points)."""
        every = self.run.inner_steps * eval_every
        curve, done = [], 0
        while done < self.run.steps:
            stats = self.trainer.train_phase(min(every, self.run.steps - done), lambda: False)
            done += stats.steps
            self.tokens += stats.tokens
            point = {"outer_step": done // self.run.inner_steps, "step": done, "tokens": self.tokens,
                     "eval_loss": self.evaluate(self.trainer.get_params())}
            curve.append(point)
            if on_point is not None:
                on_point(point)
        return curve


def run_one(run: RunConfig, eval_every: int, peer_ids: list[str], corpus=None) -> dict[str, Any]:
    """One emulated run as a bench record (without the common record_base fields)."""
    started = time.monotonic()
    trainer = SingleReference(run, corpus) if run.method == "single" else Emulator(run, peer_ids, corpus)
    curve = trainer.train(eval_every, lambda p: say(f"  step {p['step']}: eval {p['eval_loss']:.4f}"))
    final = curve[-1]
    return {"config": {name: getattr(run, name) for name in RunConfig.__dataclass_fields__},
            "method": run.name(), "seed": run.seed,
            "curve": curve, "final_eval_loss": final["eval_loss"], "tokens": final["tokens"],
            "numel": trainer.numel, "eval_every": eval_every, "ok": bool(torch.isfinite(torch.tensor(
                final["eval_loss"]))), "wall_seconds": time.monotonic() - started}


def done_keys(path: Path) -> set[tuple]:
    """Resume: the configurations that already have a record in ``path``."""
    keys = set()
    for record in read_jsonl(path):
        if record.get("bench") == "outer_sweep" and isinstance(record.get("config"), dict):
            try:
                keys.add(RunConfig.from_record(record).key())
            except (KeyError, TypeError):
                continue  # a record of another layout: not one of ours to skip
    return keys


def plan(args: argparse.Namespace) -> list[RunConfig]:
    """The grid of the flags, in the order it runs (seed outermost: a stage's first seed completes first)."""
    if args.reference == "single":  # the outer settings do not apply: one run per inner lr and seed
        return [RunConfig(lr=1.0, momentum=0.0, inner_steps=args.H[0], seed=seed, steps=args.steps,
                          peers=args.peers, batch_size=args.batch_size, seq_len=args.seq_len, preset=args.preset,
                          codec="fp32", inner_lr=ilr, method="single")
                for seed in args.seeds for ilr in args.inner_lr]
    return [RunConfig(lr=lr, momentum=m, inner_steps=h, seed=seed, steps=args.steps, peers=args.peers,
                      batch_size=args.batch_size, seq_len=args.seq_len, preset=args.preset, codec=args.codec,
                      inner_lr=ilr, overlap_delay=delay, overlap_stand_in=stand_in)
            for seed in args.seeds for h in args.H for ilr in args.inner_lr for lr in args.lr for m in args.momentum
            for delay in args.overlap_delay for stand_in in (args.overlap_stand_in if delay is not None else ["none"])]


def validation_lines(records: list[dict], long_records: list[dict]) -> list[str]:
    """The emulator next to the real long benchmark (diloco-<codec>-H<h>, node defaults) per seed."""
    lines = []
    for record in records:
        c = record["config"]
        real = [r for r in long_records if r.get("method") == f"diloco-{c['codec']}-H{c['inner_steps']}"
                and r.get("seed") == c["seed"] and r.get("ok", True) and not r.get("node_sets")
                and (r.get("workload") or {}).get("steps") == c["steps"]]
        for r in real:
            lines.append(f"seed {c['seed']}: emulator {record['final_eval_loss']:.4f}, real node "
                         f"{r['final_eval_loss']:.4f} (run {r.get('run_id')}), difference "
                         f"{record['final_eval_loss'] - r['final_eval_loss']:+.4f}")
    return lines


def _floats(text: str, name: str, low: float, high: float, high_open: bool = False) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} {text!r}: expected comma-separated numbers such as 0.4,0.7,1.0") from None
    bad = [v for v in values if not (low <= v < high if high_open else low < v <= high)]
    if not values or bad:
        bounds = f"[{low}, {high})" if high_open else f"({low}, {high}]"
        raise UsageError(f"--{name} {text!r}: every value must lie in {bounds}")
    return values


def _ints(text: str, name: str, low: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} {text!r}: expected comma-separated integers such as 20,50,100") from None
    if not values or any(v < low for v in values):
        raise UsageError(f"--{name} {text!r}: every value must be an integer >= {low}")
    return values


def _delays(text: str | None, hs: list[int]) -> list[int | None]:
    if text is None:
        return [None]
    values: list[int | None] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "none":
            values.append(None)
            continue
        try:
            delay = int(item)
        except ValueError:
            raise UsageError(f"--overlap-delay {text!r}: expected comma-separated integers or 'none'") from None
        if not 0 <= delay <= min(hs):
            raise UsageError(f"--overlap-delay {text!r}: every delay must lie in [0, H={min(hs)}]")
        values.append(delay)
    if not values:
        raise UsageError(f"--overlap-delay {text!r}: expected comma-separated integers or 'none'")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", default="0.7", help="comma-separated outer learning rates (default 0.7)")
    parser.add_argument("--momentum", default="0.9", help="comma-separated outer momenta in [0, 1) (default 0.9)")
    parser.add_argument("--H", default="50", help="comma-separated inner steps per round (default 50)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--inner-lr", default="1e-3",
                        help="comma-separated peak lrs of the inner AdamW ([train] lr; default 1e-3, the workload's)")
    parser.add_argument("--overlap-delay", default=None,
                        help="comma-separated D: emulate [sync] overlap = \"delayed\" with each round's result "
                             "landing D inner steps into the next phase ('none': blocking rounds; default none)")
    parser.add_argument("--overlap-stand-in", default="none",
                        help="comma-separated, with --overlap-delay: where a replica trains on from while its round "
                             "is on the wire: none (delayed), own (the node's eager: its own Δ), paper (the "
                             "eager-updates paper: own Δ / P + the last average · (P−1)/P), last (the last average); "
                             "default none")
    parser.add_argument("--reference", choices=["single"],
                        help="run the `single` baseline (one process, the global batch) at each --inner-lr and "
                             "seed instead of emulated rounds; evaluated every H steps")
    parser.add_argument("--codec", default="int8", choices=CODEC_CHOICES)
    parser.add_argument("--steps", type=int, default=1000, help="inner steps per peer (default 1000: the long benchmark)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=Workload.batch_size)
    parser.add_argument("--seq-len", type=int, default=Workload.seq_len)
    parser.add_argument("--preset", default=Workload.preset, choices=["tiny", "small", "medium", "gpt2"])
    parser.add_argument("--eval-every", type=int, default=1, help="outer steps between evaluations (the last is always)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--validate", action="store_true",
                        help=f"after the runs, print the emulator next to the real runs of the same seeds in {LONG_JSON}")
    args = parser.parse_args(argv)
    args.lr = _floats(args.lr, "lr", 0.0, 10.0)
    args.momentum = _floats(args.momentum, "momentum", 0.0, 1.0, high_open=True)
    args.H = _ints(args.H, "H", 1)
    args.seeds = _ints(args.seeds, "seeds", 0)
    args.inner_lr = _floats(args.inner_lr, "inner-lr", 0.0, 1.0)
    args.overlap_delay = _delays(args.overlap_delay, args.H)
    args.overlap_stand_in = [x.strip() for x in args.overlap_stand_in.split(",") if x.strip()]
    if not args.overlap_stand_in or any(x not in STAND_INS for x in args.overlap_stand_in):
        raise UsageError(f"--overlap-stand-in: expected comma-separated values of {', '.join(STAND_INS)}")
    if args.overlap_stand_in != ["none"] and all(d is None for d in args.overlap_delay):
        raise UsageError("--overlap-stand-in applies to overlapped rounds: give --overlap-delay D as well")
    if args.peers < 2:
        raise UsageError(f"--peers {args.peers}: an all-reduce needs at least 2 peers")
    if args.steps < 1 or args.eval_every < 1:
        raise UsageError("--steps and --eval-every must be >= 1")
    if args.codec == "sparseloco" and args.momentum != [0.0] and not args.reference:
        raise UsageError("--codec sparseloco has no outer momentum (its decayed error feedback plays that part): "
                         "pass --momentum 0, and its step size α as --lr (the node's default 1.5)")
    bad = [h for h in args.H if args.steps % h]
    if bad:
        raise UsageError(f"--steps {args.steps} is not a multiple of H={bad[0]} (the tokens would differ)")
    return args


def main(argv: list[str] | None = None, peer_ids: Callable[[int], list[str]] = default_peer_ids,
         corpus=None) -> int:
    """``peer_ids`` and ``corpus``: the tests' stand-ins for the bench identities and the default corpus."""
    try:
        args = parse_args(argv)
    except UsageError as err:
        print(f"outer_sweep: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # one thread per run, as each real node runs (--torch-threads 1)
    done = done_keys(args.json_out)
    todo = [run for run in plan(args) if run.key() not in done]
    say(f"outer_sweep: {len(todo)} run(s) to do, {len(plan(args)) - len(todo)} already in {args.json_out}")
    ids = peer_ids(args.peers) if todo else []
    for index, run in enumerate(todo, 1):
        say(f"[{index}/{len(todo)}] {run}")
        if corpus is None:  # read once: every run trains on the same corpus
            from lowcomm.node.data import load_data

            corpus = load_data(run.workload().config().data)
        at_start = machine()  # the load average when the run started, as the other benchmarks record it
        record = record_base("outer_sweep", **run_one(run, args.eval_every, ids, corpus), machine=at_start)
        append_jsonl(args.json_out, record)
        say(f"[{index}/{len(todo)}] final eval {record['final_eval_loss']:.4f} in {record['wall_seconds']:.0f} s")
    if args.validate:
        mine = [r for r in read_jsonl(args.json_out) if r.get("bench") == "outer_sweep"
                and RunConfig.from_record(r).key() in {run.key() for run in plan(args)}]
        for line in validation_lines(mine, read_jsonl(LONG_JSON)) or ["no real run of these seeds to compare with"]:
            say(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
