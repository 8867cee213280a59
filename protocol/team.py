"""The owners' and members' side of a split step's teams (crossgroup.py has the protocol): an
owner's part goes to its team's reducer, the team agrees on the result, and a member whose own
owner failed fetches the result from the team's other owners."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .agreement import AgreementBook, ReportFailed, ShardAgreement, agree
from .crossgroup import FETCH_END, TEAM_AGREE_END, TEAM_ANSWER, TEAM_CLOSE, StepPlan, TeamBook, TeamState, team_id
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
    """Stage 2 and the team agreement for the shards this peer owns in a split step (one object
    per run_allreduce call)."""

    plan: StepPlan
    peer_id: str
    codec: codecs.Codec
    transport: ReduceTransport
    agreements: AgreementBook
    executor: Executor
    clock: Clock
    started: float  # when this member received the group (the clock)
    reduce_timeout: float
    quorum: float
    teams: dict[int, TeamState] = field(default_factory=dict)  # shard -> this peer's state

    def open(self, shards: dict[int, int], book: TeamBook) -> None:
        """``shards``: shard index -> numel, for the shards this peer owns."""
        for k, numel in shards.items():
            reducer = self.plan.owner(self.plan.reducer_group(k), k).peer_id == self.peer_id
            self.teams[k] = TeamState(self.plan, k, numel, self.codec, reducer,
                                      close_at=self.started + TEAM_CLOSE * self.reduce_timeout,
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
            g = plan.reducer_group(k)
            reducer = plan.owner(g, k)
            part = b"" if average is None else await loop.run_in_executor(
                self.executor, lambda: average.numpy().astype("<f4").tobytes())
            header = averaging_pb2.TeamHeader(  # without a part of our own (empty): the others' sum
                group_id=plan.team_key(k), shard_index=k, from_group=me, sender_peer_id=self.peer_id,
                numel=team.numel, contributors=used if average is not None else [], payload_bytes=len(part))
            timeout = max(0.1, self.started + TEAM_ANSWER * self.reduce_timeout - self.clock.monotonic())
            try:
                payload, contributors = await _team_call(self.transport, reducer.address, header, part, self.codec,
                                                         timeout)
                team.bytes_out += len(part)
                team.bytes_in += len(payload)
            except (CallFailed, ValueError) as err:
                failure = f"the team reducer {reducer.peer_id} gave no average: {err}"
                log.warning("shard %d: %s", k, failure)
        decoded = None
        if payload:
            try:
                decoded = await loop.run_in_executor(self.executor, self.codec.decode, payload, team.numel)
                check_contribution(decoded)
            except (codecs.CodecError, ContributionRejected) as err:
                decoded, failure = None, f"the team's average is unusable: {err}"
        applied = await self._agree(k, decoded is not None)
        team.decide(applied, payload, contributors)
        if not applied and team.reducer:  # nobody applies it: no error feedback of it either
            await loop.run_in_executor(self.executor, owner_residual.copy_, before)
        if not applied:
            return b"", None, failure or "another owner of the team lacks its average", []
        return payload, decoded, "", contributors

    async def _agree(self, k: int, held: bool) -> bool:
        """The team's shard agreement (agreement.py, one shard): apply only if no owner lacks it."""
        team = self.plan.team(k)
        deadline = self.started + TEAM_AGREE_END * self.reduce_timeout
        agreement = ShardAgreement(team_id(self.plan.team_key(k), k), self.peer_id, [o.peer_id for _, o in team], 1,
                                   deadline, clock=self.clock)
        self.agreements.open(agreement)

        async def send(address: str, report: averaging_pb2.ShardReport, timeout: float) -> averaging_pb2.ShardReport:
            try:
                return await self.transport.report_shards(address, report, max(0.1, timeout))
            except CallFailed as err:
                raise ReportFailed(f"{err.code.name}: {err.detail}") from None

        reachable = {o.peer_id: o.address for _, o in team if o.peer_id != self.peer_id and o.address}
        try:
            decision = await agree(agreement, [held], [not held], max(deadline, self.clock.monotonic() + 0.5),
                                   reachable, send, self.quorum)
        finally:
            agreement.abandon()
        return decision[0]


async def fetch(plan: StepPlan, k: int, peer_id: str, numel: int, codec: codecs.Codec, transport: ReduceTransport,
                exclude: str, deadline: float, clock: Clock) -> tuple[bytes, list[str]] | None:
    """A member whose owner of shard ``k`` failed asks the team's other owners for the result:
    (payload, contributors), or None if none of them has it (or the team skips the shard)."""
    header = averaging_pb2.TeamHeader(group_id=plan.team_key(k), shard_index=k, from_group=plan.index,
                                      sender_peer_id=peer_id, numel=numel, fetch=True)
    for _, owner in plan.team(k):
        remaining = deadline - clock.monotonic()
        if owner.peer_id in (exclude, peer_id) or not owner.address:
            continue
        if remaining <= 0:
            break
        try:
            return await _team_call(transport, owner.address, header, b"", codec, remaining)
        except CallFailed as err:
            if err.code == Code.ABORTED:  # the team decided to skip it: every owner says the same
                return None
            log.info("shard %d: no team result from %s: %s", k, owner.peer_id, err)
        except ValueError as err:
            log.info("shard %d: no team result from %s: %s", k, owner.peer_id, err)
    return None
