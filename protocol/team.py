"""The owners' and members' side of a split step's teams (crossgroup.py has the protocol): an
owner's part goes to its team's reducer, an owner that lacks the reducer's answer fetches the
result from the team's other owners, and so does a member whose own owner failed."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .crossgroup import (FETCH_END, TEAM_AGREE_END, TEAM_ANSWER, TEAM_CLOSE, TEAM_LEAF_ANSWER, TEAM_SUB_CLOSE, StepPlan,
                         TeamBook, TeamState)
from .sender import chunks
from .transport import CallFailed, Clock, Code, ReduceTransport
from .validate import ContributionRejected, check_contribution

log = logging.getLogger(__name__)


async def _team_call(transport: ReduceTransport, address: str, header: averaging_pb2.TeamHeader, payload: bytes,
                     codec: codecs.Codec, timeout: float) -> tuple[bytes, list[str]]:
    """One team stream: header and payload up, the team's result (bytes, contributors) back.
    Raises CallFailed or ValueError."""
    async def outgoing() -> AsyncIterator[averaging_pb2.ReduceMessage]:
        yield averaging_pb2.ReduceMessage(team_header=header)
        if payload:
            for chunk in chunks(payload):
                yield averaging_pb2.ReduceMessage(chunk=chunk)

    result, received = None, bytearray()
    answer = transport.reduce(address, outgoing(), timeout)
    try:
        async for message in answer:
            if result is None:
                if not message.HasField("result"):
                    raise ValueError("the team's answer does not start with a result header")
                result = message.result
                if result.numel != header.numel or result.payload_bytes != codec.encoded_size(header.numel):
                    raise ValueError("the team's result does not match the shard")
                continue
            if len(received) + len(message.chunk) > result.payload_bytes:
                raise ValueError("the team sent more bytes than declared")
            received += message.chunk
    finally:
        close = getattr(answer, "aclose", None)
        if close is not None:
            await close()
    if result is None or len(received) != result.payload_bytes:
        raise ValueError("the team's answer ended early")
    return bytes(received), list(result.contributors)


# What an owner's accumulator publishes: (payload, decoded average or None, failure, contributors).
Published = tuple[bytes, "torch.Tensor | None", str, list[str]]


@dataclass
class TeamRound:
    """Stage 2 for the shards this peer owns in a split step (one object per run_allreduce call)."""

    plan: StepPlan
    peer_id: str
    codec: codecs.Codec
    transport: ReduceTransport
    executor: Executor
    clock: Clock
    started: float  # when this member received the group (the clock)
    reduce_timeout: float
    quorum: float
    teams: dict[int, TeamState] = field(default_factory=dict)  # shard -> this peer's state

    def open(self, shards: dict[int, int], book: TeamBook) -> None:
        """``shards``: shard index -> numel, for the shards this peer owns."""
        for k, numel in shards.items():
            reducer = self.plan.reducer_group(k) == self.plan.index
            close = TEAM_CLOSE if reducer else TEAM_SUB_CLOSE  # a subreducer's sum goes on to the reducer
            self.teams[k] = TeamState(self.plan, k, numel, self.codec, reducer,
                                      close_at=self.started + close * self.reduce_timeout,
                                      ends_at=self.started + FETCH_END * self.reduce_timeout, clock=self.clock)
        book.open(list(self.teams.values()))

    @property
    def bytes(self) -> tuple[int, int]:
        return sum(t.bytes_in for t in self.teams.values()), sum(t.bytes_out for t in self.teams.values())

    def publisher(self, k: int, owner_residual: torch.Tensor) -> Callable[[torch.Tensor | None, list[str]],
                                                                          Awaitable[Published]]:
        """The hook of shard ``k``'s accumulator: from the group's partial average to the step's."""
        async def publish(average: torch.Tensor | None, used: list[str]) -> Published:
            return await self._publish(k, owner_residual, average, used)
        return publish

    async def _publish(self, k: int, owner_residual: torch.Tensor, average: torch.Tensor | None,
                       used: list[str]) -> Published:
        team, plan = self.teams[k], self.plan
        loop = asyncio.get_running_loop()
        me = plan.index
        payload, contributors, failure = b"", [], ""
        if team.reducer:
            if average is not None:
                team.add(me, plan.weight(me, used), average, used)
            else:
                team.give_up(me)
            await team.wait_for_parts(self.clock, self.started, self.quorum)
            # The encoding's error feedback counts only if the team applies the average.
            before = await loop.run_in_executor(self.executor, owner_residual.clone)
            await team.sum_and_encode(owner_residual, self.executor)
            payload, contributors = team.payload, team.contributors
            failure = "" if payload else "the team's average could not be made"
        else:
            if team.children:  # a subreducer: its subteam's parts and its own go up as one
                if average is not None:
                    team.add(me, plan.weight(me, used), average, used)
                else:
                    team.give_up(me)
                await team.wait_for_parts(self.clock, self.started, self.quorum)
                average, used = await team.subtotal(self.executor) or (None, [])
            parent = plan.parent(k, me)
            assert parent is not None
            reducer = plan.owner(parent, k)
            answer_by = TEAM_ANSWER if parent == plan.reducer_group(k) else TEAM_LEAF_ANSWER
            part = b"" if average is None else await loop.run_in_executor(
                self.executor, lambda: average.numpy().astype("<f4").tobytes())
            header = averaging_pb2.TeamHeader(  # without a part of our own (empty): the others' sum
                group_id=plan.team_key(k), shard_index=k, from_group=me, sender_peer_id=self.peer_id,
                numel=team.numel, contributors=used if average is not None else [], payload_bytes=len(part))
            timeout = max(0.1, self.started + answer_by * self.reduce_timeout - self.clock.monotonic())
            try:
                payload, contributors = await _team_call(self.transport, reducer.address, header, part, self.codec,
                                                         timeout)
                team.bytes_out += len(part)
                team.bytes_in += len(payload)
            except (CallFailed, ValueError) as err:
                failure = f"the team reducer {reducer.peer_id} gave no average: {err}"
                log.warning("shard %d: %s", k, failure)
            finally:
                if team.children:
                    team.relay(payload, contributors)  # the subteam's streams answer with it (or refuse)
        decoded, problem = await self._decoded(team, payload)
        failure = failure or problem
        team.answer(decoded is not None, payload, contributors)
        if decoded is None and not team.reducer:
            # We lack the team's average through no fault of ours. If the reducer died while it
            # answered, or its answer to us broke, other owners hold it: fetch it from them (the
            # reducer last: its answer already failed once). When no owner holds it, every owner
            # ends here without it, so every group skips the shard alike.
            others = [o for g, o in plan.team(k)[1:] if g > me] + [o for g, o in plan.team(k)[1:] if g < me]
            got = await fetch(plan, k, self.peer_id, team.numel, self.codec, self.transport,
                              self.started + TEAM_AGREE_END * self.reduce_timeout, self.clock,
                              candidates=[*others, plan.owner(plan.reducer_group(k), k)])
            if got is not None:
                fetched, problem = await self._decoded(team, got[0])
                if fetched is not None:
                    decoded, (payload, contributors) = fetched, got
                    team.answer(True, payload, contributors)
                    log.info("shard %d: fetched the team's average from another owner (%s)", k, failure)
        applied = decoded is not None
        team.decide(applied, payload, contributors)
        if not applied and team.reducer:  # nobody applies it: no error feedback of it either
            await loop.run_in_executor(self.executor, owner_residual.copy_, before)
        if not applied:
            return b"", None, failure or "no owner of the team holds its average", []
        return payload, decoded, "", contributors

    async def _decoded(self, team: TeamState, payload: bytes) -> tuple[torch.Tensor | None, str]:
        """The team's average decoded and checked, or (None, why not)."""
        if not payload:
            return None, ""
        try:
            decoded = await asyncio.get_running_loop().run_in_executor(self.executor, self.codec.decode, payload,
                                                                       team.numel)
            check_contribution(decoded)
        except (codecs.CodecError, ContributionRejected) as err:
            return None, f"the team's average is unusable: {err}"
        return decoded, ""


async def fetch(plan: StepPlan, k: int, peer_id: str, numel: int, codec: codecs.Codec, transport: ReduceTransport,
                deadline: float, clock: Clock, candidates: list[averaging_pb2.Member]) -> tuple[bytes, list[str]] | None:
    """Ask ``candidates`` (owners of team ``k``), one after the other, for the team's result:
    (payload, contributors) from the first that holds it, or None if none does by ``deadline``.
    An owner whose own owner failed (a member) or who lacks the reducer's answer (an owner) asks."""
    header = averaging_pb2.TeamHeader(group_id=plan.team_key(k), shard_index=k, from_group=plan.index,
                                      sender_peer_id=peer_id, numel=numel, fetch=True)
    for owner in candidates:
        remaining = deadline - clock.monotonic()
        if owner.peer_id == peer_id or not owner.address:
            continue
        if remaining <= 0:
            break
        try:
            return await _team_call(transport, owner.address, header, b"", codec, remaining)
        except (CallFailed, ValueError) as err:
            log.info("shard %d: no team result from %s: %s", k, owner.peer_id, err)
    return None
