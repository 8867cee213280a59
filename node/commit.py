"""The local part of a round: the outer step on θ_global, the commit, and the round's report.

Once the network part of a round (node/averaging.py) brought its averages, ``Committer`` turns
them into the next step: ``apply_and_commit`` runs the outer step in the codec pool, then
commits (new step and hash, served to joiners, published in the DHT); the round driver
(node/driver.py) runs it shielded, because θ_global changed without its commit would be saved
with the old step and hash. ``finish`` then counts the round and hands its eval and checkpoint
to the report thread (node/reports.py), so that training goes on meanwhile.

In runs that sync the inner optimizer's state the snapshot of a step carries that state as it is
after the step's state round (node/state_sync.py), which runs between the two: ``finish`` takes
it, with the state-sync residuals the checkpoint needs, and only then serves the snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from typing import Any, Callable

import torch

from lowcomm.protocol import codecs
from lowcomm.protocol.missed_rounds import RoundRecord
from lowcomm.protocol.state import OptimizerStates, Snapshot, StateDonor, params_sha256

from .averaging import RoundOutcome, RoundReport
from .external_trainer import EvalFnFailed
from .globalstate import GlobalState, copy_payload
from .metrics import NodeMetrics
from .optimizers import capture_served
from .ports import SwarmPort, TrainerPort
from .reports import Report, ReportQueue, cpu_copy
from .runstats import RunStats
from .train_thread import TrainThread

log = logging.getLogger("lowcomm.node")

# Writes a checkpoint: (frozen global state, trainer's local state, tokens_total); report thread.
CheckpointWriter = Callable[[dict[str, Any], dict[str, Any], int], None]


class Committer:
    """Applies, commits and reports this peer's rounds (see the module docstring)."""

    def __init__(self, state: GlobalState, trainer: TrainerPort, *, swarm: SwarmPort, donor: StateDonor,
                 train_thread: TrainThread, codec_executor: Executor, reports: ReportQueue, metrics: NodeMetrics,
                 stats: RunStats, codec: codecs.Codec,
                 evaluate_global: Callable[[torch.Tensor, dict[str, torch.Tensor] | None], float],
                 write_checkpoint: CheckpointWriter) -> None:
        self.state = state
        self.trainer = trainer
        self.swarm = swarm
        self.donor = donor
        self.train_thread = train_thread
        self.codec_executor = codec_executor
        self.reports = reports
        self.metrics = metrics
        self.stats = stats
        self.codec = codec
        self.evaluate_global = evaluate_global  # report thread: eval loss of a flat θ_global with buffers
        self.write_checkpoint = write_checkpoint
        self.eval_failures = 0  # rounds whose eval the user's eval_fn failed (report thread)

    def frozen_trainer_state(self) -> dict[str, Any]:
        """Training thread only: a copy of the trainer's checkpointable state (it keeps training
        while the checkpoint is written in the report thread). Tensors are copied to the CPU: on
        CUDA the optimizer state (2x the parameters for AdamW) of a waiting report must not hold
        GPU memory, and torch.save would copy it to the CPU anyway."""
        return cpu_copy(self.trainer.local_state())

    async def apply_and_commit(self, outcome: RoundOutcome) -> dict:
        """The local part of a round: the outer step on θ_global, then the commit. The round's
        averages are kept for peers that missed it (protocol/missed_rounds.py)."""
        base_step, base_hash = self.state.published()
        if outcome.apply is not None:
            await asyncio.get_running_loop().run_in_executor(self.codec_executor, outcome.apply)
        frozen = await self.commit_global()
        if outcome.applied is not None:
            codec, shards = outcome.applied
            self.donor.rounds.add(RoundRecord(base_step, base_hash, frozen["params_sha256"], codec, shards))
        return frozen

    async def commit_global(self) -> dict:
        """The round's result becomes our state: new step and hash, served to joiners, published.
        Returns copies of the committed state (``GlobalState.frozen_checkpoint``) for the eval
        and the checkpoint, written in the report thread while the next round may already
        change θ_global.

        The record says "training": a committed peer is on to its next inner phase (or, when
        overlapped, already in it), and peers at the new step must not take it for a finished one.
        """
        step = self.state.step + 1

        def freeze() -> tuple[dict, Snapshot | None]:
            # One hash and one copy serve the commit, the donor snapshot and the checkpoint.
            frozen = self.state.frozen_checkpoint()
            digest = params_sha256(frozen["params"])
            frozen.update(step=step, params_sha256=digest)
            if self.state.optimizer_states is not None:
                return frozen, None  # served by ``finish``, once the state round is done
            return frozen, Snapshot.build(step, frozen["params"], frozen["momentum"], params_hash=digest)

        frozen, snapshot = await asyncio.get_running_loop().run_in_executor(self.codec_executor, freeze)
        self.state.commit(frozen["params_sha256"])
        if snapshot is not None:
            self.donor.publish(snapshot)
        self.stats.phase = "training"
        await self.swarm.publish_record()
        return frozen

    async def serve_with_optimizer_states(self, frozen: dict, optimizer_states: OptimizerStates) -> None:
        """State sync: serve the committed step with the optimizer state taken after its state
        round, and checkpoint the state-sync residuals as that round left them (``frozen`` was
        taken at the commit, before it)."""
        def build() -> Snapshot:
            self.state.optimizer_states = optimizer_states
            frozen.update(copy_payload(self.state.state_residuals_checkpoint()))
            return Snapshot.build(frozen["step"], frozen["params"], frozen["momentum"],
                                  params_hash=frozen["params_sha256"], optimizer=optimizer_states)

        self.donor.publish(await asyncio.get_running_loop().run_in_executor(self.codec_executor, build))

    async def finish(self, report: RoundReport, fragment: slice, frozen: dict, reset_local: bool) -> None:
        """After ``commit_global``: count the round, then evaluate, checkpoint and report it in
        the report thread (training goes on meanwhile). Blocking rounds restart the local model
        of the fragment from θ_global first; overlapped rounds shift it instead (node/overlap.py)."""
        serves = self.state.optimizer_states
        names = serves.names if serves is not None else ()

        def freeze_trainer() -> tuple[dict, OptimizerStates | None]:
            # The optimizer state served to joiners is taken with the checkpoint's, at the same
            # point: after the round (and its state round), before the next inner step.
            return self.frozen_trainer_state(), capture_served(self.trainer, names)

        if reset_local:
            def reset_and_freeze() -> tuple[dict, OptimizerStates | None]:
                self.trainer.set_params_slice(fragment, self.state.params[fragment])
                return freeze_trainer()

            trainer_state, optimizer_states = await self.train_thread.run(reset_and_freeze)
        else:
            trainer_state, optimizer_states = await self.train_thread.run_soon(freeze_trainer)
        if optimizer_states is not None:
            await self.serve_with_optimizer_states(frozen, optimizer_states)
        stats = self.stats
        stats.rounds_completed += 1
        m = self.metrics
        m.rounds.inc()
        m.round_group_size.set(report.group_size)
        m.round_duration.observe(report.seconds)
        m.last_sync_timestamp.set(time.time())
        m.set_outer_step(self.state.step)
        event = {"outer_step": self.state.step, "params_sha256": self.state.params_hash,
                 "loss": stats.last_loss, "group_size": report.group_size,
                 "round_seconds": report.seconds, "allreduce_seconds": report.allreduce_seconds,
                 "matchmaking_seconds": report.matchmaking_seconds, "round_start_read": report.round_start_read,
                 "bytes_sent": report.bytes_sent,
                 "payload_bytes": self.codec.encoded_size(fragment.stop - fragment.start),
                 "fragment": [fragment.start, fragment.stop],
                 "bytes_received": report.bytes_received, "skipped_shards": report.skipped_shards,
                 "schedule": report.schedule,
                 "owned_share": None if math.isnan(report.owned_share) else report.owned_share,
                 "bandwidth_bps": stats.bandwidth_bps,
                 "numel": self.trainer.numel, "codec": self.codec.name, "tokens_total": stats.tokens_total,
                 "tokens_averaged": report.tokens,
                 "compute_utilization": stats.compute_utilization,
                 "train_seconds": stats.train_seconds, "train_clock": stats.train_clock}
        tokens_per_second = stats.tokens_per_second

        def evaluate_and_save() -> float:
            try:
                # With the model's buffers as this round left them (BatchNorm's statistics: node/buffers.py)
                return self.evaluate_global(frozen["params"], trainer_state.get("buffers"))
            except EvalFnFailed as err:  # the user's bug costs the round its eval: none reported
                self.eval_failures += 1
                if self.eval_failures == 1:  # its traceback once, then one line a round
                    log.error("%s; this round has no eval, its checkpoint is written, training goes on", err,
                              exc_info=err.__cause__)
                else:
                    log.warning("%s (round of step %d; %d rounds so far)", err, frozen["step"], self.eval_failures)
                return math.nan
            finally:  # whatever the evaluation does, the round's checkpoint is written
                try:
                    self.write_checkpoint(frozen, trainer_state, event["tokens_total"])
                except OSError as err:  # the previous checkpoints stay intact (atomic writes; counted by the writer)
                    log.error("checkpoint of step %d not written: %s; training goes on (a restart resumes from "
                              "the last checkpoint written, or downloads the swarm's state)", frozen["step"], err,
                              extra={"event": "checkpoint_failed", "outer_step": frozen["step"]})

        def log_round(eval_loss: float, skipped: bool) -> None:
            log.info(
                "step %d | loss %.3f | eval %s | %.0f tok/s | round %.2fs | sent %s recv %s | group %d%s | %s",
                event["outer_step"], event["loss"], eval_text(eval_loss, skipped), tokens_per_second,
                report.seconds, human_bytes(report.bytes_sent), human_bytes(report.bytes_received),
                report.group_size, f" | {report.skipped_shards} shard(s) skipped" if report.skipped_shards else "",
                event["params_sha256"][:12],
                extra={"event": "round_done", "eval_loss": eval_loss, "eval_skipped": skipped, **event},
            )

        def evaluated(eval_loss: float) -> None:
            if event["outer_step"] >= self.state.step:  # not overtaken by a catch-up meanwhile
                stats.last_eval = eval_loss
                m.eval_loss.set(eval_loss)
            log_round(eval_loss, skipped=False)

        # Newest wins (node/reports.py): when the report thread is behind, this report replaces the
        # waiting one, whose eval is stale and whose checkpoint this one supersedes; its round line
        # then carries the last eval we have, marked skipped.
        self.reports.submit(Report(event["outer_step"], evaluate_and_save, evaluated,
                                   lambda: log_round(stats.last_eval, skipped=True)))


def eval_text(eval_loss: float, skipped: bool) -> str:
    """The round line's eval: "-" when there is none (a Swarm without eval_fn, an eval_fn that
    failed: its own line says why), as `lowcomm-node status` shows it."""
    if skipped:
        return "skipped"
    return "-" if math.isnan(eval_loss) else f"{eval_loss:.3f}"


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f}{unit}" if unit == "B" else f"{count:.1f}{unit}"
        count /= 1000
    return f"{count:.1f}GB"
