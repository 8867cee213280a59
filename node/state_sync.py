"""Averaging the inner optimizer's state across the group, each state on its own period.

DES-LOC and MT-DAO (``[sync] state_sync``, node/config.py) average not only the parameters but
also moments of the inner optimizer. ``StateSync.run`` does it right after a round's commit, in
the same group: one more all-reduce per due state (protocol/member.py's ``run_allreduce``, the
group's codec and shard layout, the members' token weights), under a group id derived from the
round's, so that its streams and shard reports never mix with the Δ round's, and encoded with
``[sync] state_codec`` (bf16 by default: an int8 second moment loses its small entries). Every
member decodes the same bytes, so every member loads the same averaged state: bit-identical.

The state is averaged as a value, not as a change: the contribution is the state itself plus
this state's own sender residual (error feedback), and every member overwrites its state with the
average. A shard skipped in the state round keeps the local state there; there, and where our
part was refused, the residual keeps its value from before the round (a state is not consumed as
a Δ is: carrying all of it into the residual would add it twice next time). A split step's state round stays inside each group.

The residuals belong to the node's ``GlobalState`` (node/globalstate.py) and are checkpointed
with it, so a restart keeps them. Joiners receive the optimizer state with the swarm's snapshot
(node/optimizers.py ``capture_states``: taken at the round boundary, after the state round, so
its synced states are the group's averages; node/catchup.py loads it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, runtime_checkable

import torch

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import ReduceRegistry, run_allreduce
from lowcomm.protocol.state import params_sha256

from .optimizers import NON_NEGATIVE

log = logging.getLogger("lowcomm.node")
# Runs a function in the training thread (node/train_thread.py ``TrainThread.run``).
InTrainThread = Callable[..., Awaitable[Any]]


@runtime_checkable
class OptimizerStateHolding(Protocol):
    """What a trainer offers for the state sync (the daemon's ``Trainer`` does; an API user's
    optimizer is their own, so ``[sync] state_sync`` is daemon-only)."""

    def optimizer_state(self, name: str) -> torch.Tensor:
        """The state ``name`` as a flat float32 CPU vector (training thread)."""

    def load_optimizer_state(self, name: str, flat: torch.Tensor) -> None:
        """Overwrite the state ``name`` with ``flat`` (training thread)."""


def due(periods: dict[str, int], produced_step: int) -> list[str]:
    """The states synced by the round that produces ``produced_step``, in a fixed order."""
    return sorted(name for name, period in periods.items() if produced_step % period == 0)


def derived_group(group: averaging_pb2.Group, name: str, codec: str) -> averaging_pb2.Group:
    """``group`` with its own id for the round of state ``name``, the state codec, and without
    the split step's plan (the state round stays in the group). Every member derives the same one."""
    derived = averaging_pb2.Group()
    derived.CopyFrom(group)
    derived.codec = int(codecs.get_codec(codec).id)
    derived.group_id = hashlib.sha256(b"lowcomm-state-sync\0" + name.encode() + b"\0" + group.group_id).digest()[:16]
    del derived.step_groups[:]
    derived.group_index = 0
    return derived


@dataclass
class StateSyncReport:
    synced: list[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    skipped_shards: int = 0
    # sha256 of each averaged state as loaded: equal on every member of the group (the logs show it).
    hashes: dict[str, str] = field(default_factory=dict)


class StateSync:
    """One peer's optimizer-state rounds (see the module docstring)."""

    def __init__(self, periods: dict[str, int], peer_id: str, numel: int, trainer: OptimizerStateHolding, *,
                 registry: ReduceRegistry, channels: Callable[[str], Any] | None, executor: Executor,
                 in_train_thread: InTrainThread, codec: str = "bf16", quorum: float = 1.0,
                 transport: Any = None, residuals: dict[str, torch.Tensor] | None = None,
                 owner_residuals: dict[str, torch.Tensor] | None = None) -> None:
        """``residuals``, ``owner_residuals``: the node's state-sync residuals per state
        (``GlobalState.state_residuals``, checkpointed), updated in place; zeros of our own when
        not given."""
        if periods and not isinstance(trainer, OptimizerStateHolding):
            raise TypeError("[sync] state_sync needs a trainer that exposes its optimizer state (the daemon's)")
        self.periods = dict(periods)
        self.peer_id = peer_id
        self.trainer = trainer
        self.registry = registry
        self.channels = channels
        self.executor = executor
        self.in_train_thread = in_train_thread
        self.codec = codec
        self.quorum = quorum
        self.transport = transport  # tests: a fake ReduceTransport instead of gRPC
        self.residuals = residuals if residuals is not None else {}
        self.owner_residuals = owner_residuals if owner_residuals is not None else {}
        for held in (self.residuals, self.owner_residuals):
            for name in self.periods:  # shared dicts: a state without a residual yet gets zeros there
                if held.setdefault(name, torch.zeros(numel)).numel() != numel:
                    raise ValueError(f"the state-sync residual of {name} has {held[name].numel()} values, "
                                     f"the model {numel}")
        # While a state round runs: (name, residual, owner residual before it), for ``rollback``.
        self.undo: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def due(self, group: averaging_pb2.Group) -> list[str]:
        return due(self.periods, group.step + 1) if len(group.members) > 1 else []

    async def run(self, group: averaging_pb2.Group) -> StateSyncReport:
        """Average the states due at the round of ``group`` (already committed) and load them."""
        report = StateSyncReport(self.due(group))
        for name in report.synced:
            await self._sync_one(group, name, report)
        return report

    async def _sync_one(self, group: averaging_pb2.Group, name: str, report: StateSyncReport) -> None:
        local = await self.in_train_thread(self.trainer.optimizer_state, name)
        residual, owner_residual = self.residuals[name], self.owner_residuals[name]
        self.undo = (name, residual.clone(), owner_residual.clone())
        result = await run_allreduce(derived_group(group, name, self.codec), self.peer_id, local, residual, owner_residual,
                                     self.registry, self.channels, self.executor, quorum=self.quorum,
                                     transport=self.transport)
        residual_before = self.undo[1]
        self.undo = None
        report.bytes_sent += result.bytes_sent
        report.bytes_received += result.bytes_received
        averaged = local.clone()
        for sl, average in zip(result.slices, result.averages):
            # run_allreduce leaves all of x = state + residual in the residual where our part was
            # not delivered (a skipped shard, or our contribution refused by the norm bound): right
            # for a Δ, which is consumed, but a state is sent whole again next time, so there the
            # residual keeps its value from before. The copy is exact, so equality detects it.
            if average is None or torch.equal(residual[sl], local[sl].add(residual_before[sl])):
                residual[sl].copy_(residual_before[sl])
            if average is None:
                report.skipped_shards += 1  # the local state stays there
            else:
                averaged[sl] = average
        if name in NON_NEGATIVE:
            averaged.clamp_(min=0.0)  # a lossy mean of squares may dip below zero; the same on every member
        await self.in_train_thread(self.trainer.load_optimizer_state, name, averaged)
        report.hashes[name] = await asyncio.get_running_loop().run_in_executor(self.executor, params_sha256, averaged)
        log.debug("optimizer state %s averaged with the group of step %d", name, group.step,
                  extra={"event": "state_synced", "state": name, "outer_step": group.step + 1})

    def rollback(self) -> None:
        """After an abandoned state round (its codec jobs done): the residuals as before it."""
        undo, self.undo = self.undo, None
        if undo is not None:
            name, residual, owner_residual = undo
            self.residuals[name].copy_(residual)
            self.owner_residuals[name].copy_(owner_residual)
