"""Butterfly all-reduce of encoded pseudo-gradient shards over gRPC streams (DESIGN §4).

The flat Δ is cut into one contiguous shard per owner (the group's ``shard_bounds``). Every
member streams its encoded part of shard j to the owner of j (``Reduce``, sender.py), one owner
after the other in the staggered order of schedule.py so that no owner's downlink is shared by
all senders at once; the owner decodes, accumulates in float32 weighted by tokens, and once
every member has sent (or its deadline has passed) encodes the average once, with its own
error-feedback residual, and streams the same bytes back to every sender. Every member, the owner included, uses the *decoded* average, so all
members end the round with bit-identical values.

Validation and robust aggregation (DESIGN §4 "Trust"): a contribution is checked for codec,
length and finite values as it arrives (a bad one is refused with INVALID_ARGUMENT before it
touches the accumulator). The accumulator (accumulator.py) keeps every accepted contribution of its shard, the
owner's own included, until the deadline; then ``aggregation.aggregate`` applies the norm bound
(relative to the round's other contributions of that shard) and the configured rule (mean,
clipped mean, trimmed mean). Memory: one float32 tensor per member per owned shard. Every
rejection is reported to the registry's ``on_reject`` with its reason and sender.

Failures: a sender that misses the owner's deadline, or whose contribution is rejected, is left
out (weights renormalised) but still receives the average, and keeps its own part in its
residual (the owner too, when its own part is rejected). An average that cannot be published
(it overflowed to a non-finite value, or nothing valid was left) makes the owner skip the shard
and refuse it to every sender. A shard whose owner fails (before, while or after streaming its
average) is skipped by every member alike: after the reduce phase the members exchange which
shards they hold and each applies only the shards that no member it heard from lacks
(agreement.py has the rule and its failure cases). A skipped shard leaves every member's exact
contribution x = Δ + residual in its residual, and the owner's error feedback as it was before
the round, so nothing of it is lost. Every wait has a deadline derived from the group's
``reduce_timeout_s`` (T): owners finalize T after receiving the group, a result transfer may
take T/4 more, and the exchange ends at 1.5 T, or EXCHANGE_MIN_SECONDS after this member's
reduce phase if that is later.

Seams (transport.py): the Reduce stream and ReportShards calls go through a
``ReduceTransport`` (gRPC by default, grpc_transport.py), the serving side refuses with
``Refused``, and every deadline is on the registry's ``Clock`` (the event loop's by default).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .agreement import AgreementBook, ReportFailed, ShardAgreement, agree
from .accumulator import MAX_WEIGHT_RATIO, RejectCallback, ShardAccumulator, bounded_weights
from .schedule import result_budget, stage_budget, upload_order
from .sender import CHUNK_BYTES, chunks, reduce_with_owner
from .aggregation import Aggregation
from .transport import CallFailed, Clock, Code, LoopClock, ReduceTransport, Refused
from .validate import ContributionRejected, check_contribution

__all__ = ["AllReduceResult", "CHUNK_BYTES", "MAX_WEIGHT_RATIO", "ReduceRegistry", "ShardAccumulator", "bounded_weights",
           "run_allreduce", "shard_slices"]
log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds a server waits for the first message of a Reduce stream
RESULT_MARGIN = 0.25  # fraction of the reduce timeout a sender allows for the average's transfer back
EXCHANGE_END = 1.5  # the shard-report exchange ends this many reduce timeouts after the group arrived...
EXCHANGE_MIN_SECONDS = 1.0  # ...or this long after this member's reduce phase, whichever is later

def shard_slices(group: averaging_pb2.Group) -> list[slice]:
    bounds = list(group.shard_bounds)
    return [slice(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


class ReduceRegistry:
    """Open accumulators of the current round, found by (group id, shard index) by the RPC handler."""

    def __init__(self, peer_id: str, on_reject: RejectCallback, executor: Executor,
                 aggregation: Aggregation | None = None, clock: Clock | None = None) -> None:
        """``clock``: the time base of this peer's rounds (transport.py; the event loop's by default)."""
        self.peer_id = peer_id
        self.clock = clock if clock is not None else LoopClock()
        self.on_reject = on_reject
        self.executor = executor
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        self._open: dict[tuple[bytes, int], ShardAccumulator] = {}
        self._changed = asyncio.Event()
        self.agreements = AgreementBook()  # which shards the members of recent rounds hold

    def open(self, accumulators: list[ShardAccumulator]) -> None:
        # Only one round's accumulators are kept: the previous round's late senders get NOT_FOUND.
        self._open = {(a.group.group_id, a.shard_index): a for a in accumulators}
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        self._open = {}

    async def _find(self, group_id: bytes, shard_index: int, timeout: float) -> ShardAccumulator | None:
        # A sender may be faster than the owner at processing the closed group: wait a little.
        try:
            async with asyncio.timeout(timeout):
                while (acc := self._open.get((group_id, shard_index))) is None:
                    await self._changed.wait()
        except TimeoutError:
            return None
        return acc

    async def handle_report(self, request: averaging_pb2.ShardReport, context: object = None) -> averaging_pb2.ShardReport:
        """Server side of ``ReportShards`` (agreement.py); raises Refused."""
        return await self.agreements.handle(request, context)

    async def handle(self, requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: object = None) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """Server side of ``Reduce``: validate, accumulate, then stream the average back; raises
        Refused. ``context`` is not used (the servicer and wrappers pass the call's context along)."""
        try:
            async with asyncio.timeout(HEADER_TIMEOUT):
                first = await anext(requests)
        except (StopAsyncIteration, TimeoutError):
            raise Refused(Code.INVALID_ARGUMENT, "Reduce stream must start with a header") from None
        if not first.HasField("header"):
            raise Refused(Code.INVALID_ARGUMENT, "Reduce stream must start with a header")
        header = first.header
        acc = await self._find(header.group_id, header.shard_index, timeout=HEADER_TIMEOUT)
        if acc is None:
            raise Refused(Code.NOT_FOUND, "no such group or shard on this peer")
        acc.stream_opened()
        try:
            async for message in self._serve(acc, header, requests, context):
                yield message
        finally:
            acc.stream_closed()

    async def _serve(self, acc: ShardAccumulator, header: averaging_pb2.ReduceHeader,
                     requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: object = None) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        sender = header.sender_peer_id
        problem = self._check_header(acc, header)
        if problem is not None:
            reason, detail = problem
            self.on_reject(reason, sender, detail)
            raise Refused(Code.INVALID_ARGUMENT, detail)

        # The header used up this sender's one try: if its contribution does not make it into the
        # accumulator, nothing more can come from it, and the owner stops waiting for it.
        decoded = None
        try:
            decoded = await self._receive(acc, sender, header, requests, context)
        finally:
            if decoded is None:
                acc.give_up(sender)
        if not await acc.add(sender, decoded):
            self.on_reject("late", sender, "arrived after the average was computed")
        acc.awaiting.add(sender)
        try:  # the owner finalizes by its deadline; the margin covers an owner that died in between
            async with asyncio.timeout(acc.group.reduce_timeout_s * 1.5):
                await acc.finalized.wait()
        except TimeoutError:
            raise Refused(Code.DEADLINE_EXCEEDED, "the shard's average was never computed") from None
        if acc.result is None:
            raise Refused(Code.ABORTED, f"no average for this shard this round: {acc.failure}")
        try:
            await acc.wait_turn(sender, result_budget(acc.group, len(acc.turns)))
            yield averaging_pb2.ReduceMessage(result=averaging_pb2.ReduceResult(
                codec=acc.codec.id, numel=acc.numel, payload_bytes=len(acc.result_payload),
                contributors=acc.contributors))
            for chunk in chunks(acc.result_payload):
                acc.bytes_out += len(chunk)
                yield averaging_pb2.ReduceMessage(chunk=chunk)
        finally:
            acc.served(sender)

    async def _receive(self, acc: ShardAccumulator, sender: str, header: averaging_pb2.ReduceHeader,
                       requests: AsyncIterator[averaging_pb2.ReduceMessage],
                       context: object = None) -> torch.Tensor:
        """The declared payload, decoded and checked (length, codec, finite values), or Refused."""
        payload = bytearray(header.payload_bytes)  # bounded: equals the codec's size for this shard
        filled = 0
        # A sender that declared its size and then stalls must not hold this buffer (nor the
        # stream) past the round: the same margin as for the owner's average below.
        limit = acc.group.reduce_timeout_s * 1.5
        try:
            async with asyncio.timeout(limit):
                async for message in requests:
                    if not message.HasField("chunk") or filled + len(message.chunk) > len(payload):
                        self.on_reject("length", sender, "unexpected message or more bytes than declared")
                        raise Refused(Code.INVALID_ARGUMENT, "unexpected message or more bytes than declared")
                    payload[filled:filled + len(message.chunk)] = message.chunk
                    filled += len(message.chunk)
        except TimeoutError:
            payload = bytearray()  # released now: the refusal's exception chain keeps this frame alive
            raise Refused(Code.DEADLINE_EXCEEDED,
                          f"{filled} of {header.payload_bytes} declared bytes arrived within {limit:.1f}s") from None
        if filled != len(payload):
            self.on_reject("length", sender, f"{filled} of {len(payload)} declared bytes arrived")
            raise Refused(Code.INVALID_ARGUMENT, f"{filled} of {len(payload)} declared bytes arrived")
        acc.bytes_in += filled

        loop = asyncio.get_running_loop()
        try:
            decoded = await loop.run_in_executor(self.executor, acc.codec.decode, payload, acc.numel)
            check_contribution(decoded)
        except codecs.CodecError as err:
            self.on_reject("codec", sender, str(err))
            raise Refused(Code.INVALID_ARGUMENT, f"undecodable payload: {err}") from None
        except ContributionRejected as err:
            self.on_reject(err.reason, sender, str(err))
            raise Refused(Code.INVALID_ARGUMENT, str(err)) from None
        return decoded

    @staticmethod
    def _check_header(acc: ShardAccumulator, header: averaging_pb2.ReduceHeader) -> tuple[str, str] | None:
        if header.sender_peer_id not in acc.weights or header.sender_peer_id == acc.owner_id:
            return "unknown_sender", f"{header.sender_peer_id or '?'} is not a member of this group"
        if header.sender_peer_id in acc.announced:
            return "unknown_sender", f"{header.sender_peer_id} already contributed to this shard"
        if header.codec != acc.codec.id:
            return "codec", f"codec {header.codec} differs from the group's {int(acc.codec.id)}"
        if header.numel != acc.numel:
            return "length", f"numel {header.numel} differs from the shard's {acc.numel}"
        if header.payload_bytes != acc.codec.encoded_size(acc.numel):
            return "length", f"payload_bytes {header.payload_bytes} differs from {acc.codec.encoded_size(acc.numel)}"
        acc.announced.add(header.sender_peer_id)
        return None


@dataclass
class AllReduceResult:
    averages: list[torch.Tensor | None]  # per shard: the decoded average, or None if skipped
    slices: list[slice]
    bytes_sent: int
    bytes_received: int
    payload_bytes: int  # encoded size of this peer's whole contribution (for the compression ratio)
    # Per shard: whether this peer held the average after its reduce phase. A shard held here
    # but None in ``averages`` was skipped because another member lacked it (agreement.py).
    held: list[bool] = field(default_factory=list)
    reports_heard: int = 0  # members whose shard report reached this peer


async def run_allreduce(
    group: averaging_pb2.Group,
    peer_id: str,
    delta: torch.Tensor,
    residual: torch.Tensor,
    owner_residual: torch.Tensor,
    registry: ReduceRegistry,
    channel_for: Callable[[str], Any] | None,
    executor: Executor,
    quorum: float = 1.0,
    staggered: bool = True,
    transport: ReduceTransport | None = None,
) -> AllReduceResult:
    """Average ``delta`` with the group; updates ``residual`` (and ``owner_residual``) in place.

    ``residual`` is this peer's sender-side error feedback over the flat parameters; after the
    call it holds everything that this peer's contribution did not deliver this round: for a
    skipped shard, all of x = Δ + residual. ``staggered``: upload to one owner after the other,
    and as an owner send the average to one member after the other (schedule.py), instead of
    to all at once. ``transport`` carries the calls to the other members (transport.py); by
    default gRPC over the channels of ``channel_for(address)``. Time is ``registry.clock``.
    """
    if transport is None:
        if channel_for is None:
            raise ValueError("run_allreduce needs channel_for (for gRPC) or a transport")
        from .grpc_transport import GrpcReduceTransport  # the adapter; the logic below never sees gRPC

        transport = GrpcReduceTransport(channel_for)
    clock = registry.clock
    codec = codecs.get_codec(group.codec)
    members = list(group.members)
    weights = bounded_weights(members)
    slices = shard_slices(group)
    owners = [members[i] for i in group.shard_owners]
    started = clock.monotonic()
    deadline = started + group.reduce_timeout_s
    margin = RESULT_MARGIN * group.reduce_timeout_s
    loop = asyncio.get_running_loop()
    stats = {"sent": 0, "received": 0, "payload": 0}
    # Per shard, until the agreement: this peer's exact contribution x (what a skipped shard
    # leaves in the residual) and, for shards it owns, its owner residual before the round.
    carried: list[torch.Tensor | None] = [None] * len(slices)
    owner_before: dict[int, torch.Tensor] = {}
    # Stage k's upload waits for stage k-1's (or its budget): each owner's downlink gets one sender at a time.
    order = upload_order(group, peer_id)
    after = {shard: order[k - 1] for k, shard in enumerate(order) if k > 0 and staggered}
    uploaded = {shard: asyncio.Event() for shard in order}
    budget = stage_budget(group, len(order))
    refused: set[int] = set()  # shards whose owner refused our contribution: our fault, we ask no skip

    # The agreement first: a member that is done before us may report to us at any moment.
    me = next(m for m in members if m.peer_id == peer_id)
    agreement = ShardAgreement(group.group_id, peer_id, [m.peer_id for m in members], len(slices),
                               started + EXCHANGE_END * group.reduce_timeout_s,
                               reachable=None if me.address else [m.peer_id for m in members if m.address],
                               clock=clock)
    registry.agreements.open(agreement)

    # Owner side next, so that fast senders find our accumulators open.
    def own_parts() -> list[tuple[int, torch.Tensor]]:
        parts = []
        for index, (owner, sl) in enumerate(zip(owners, slices)):
            if owner.peer_id == peer_id:
                parts.append((index, delta[sl].add(residual[sl])))
                residual[sl].zero_()  # our own part enters the average exactly: nothing left to carry
                owner_before[index] = owner_residual[sl].clone()
        return parts

    mine: list[ShardAccumulator] = []
    try:
        for index, own in await loop.run_in_executor(executor, own_parts):
            carried[index] = own
            mine.append(ShardAccumulator(
                group=group, shard_index=index, owner_id=peer_id, codec=codec, executor=executor,
                owner_residual=owner_residual[slices[index]], own=own,
                expected={m.peer_id for m in members} - {peer_id},
                weights=weights, aggregation=registry.aggregation, on_reject=registry.on_reject,
                staggered=staggered, clock=clock,
            ))
        registry.open(mine)
        for acc in mine:
            acc.idle.set()
            if not acc.expected:
                acc.all_arrived.set()

        async def own_shard(acc: ShardAccumulator) -> torch.Tensor | None:
            await acc.wait_for_senders(deadline, quorum)
            result = await acc.finalize()
            if peer_id not in acc.contributors:  # our own part was rejected (or the shard failed): carry it
                residual[slices[acc.shard_index]].copy_(acc.own)
            # Stay until every sender that is connected has its answer: the bytes are then counted,
            # and nothing of this round is still in flight when the caller moves on.
            try:
                async with asyncio.timeout(max(0.0, deadline - clock.monotonic()) + margin):
                    await acc.idle.wait()
            except TimeoutError:
                log.info("shard %d: a sender is still downloading the average; moving on", acc.shard_index)
            return result

        async def remote_shard(index: int, owner: averaging_pb2.Member, sl: slice) -> torch.Tensor | None:
            def encode() -> tuple[torch.Tensor, bytes]:
                x = delta[sl].add(residual[sl])
                payload, _ = codecs.encode_with_feedback(codec, delta[sl], residual[sl])
                return x, payload

            try:  # encoding runs while earlier stages upload
                x, payload = await loop.run_in_executor(executor, encode)
                carried[index] = x
                stats["payload"] += len(payload)
                if index in after:
                    try:
                        async with asyncio.timeout(budget):
                            await uploaded[after[index]].wait()
                    except TimeoutError:
                        pass  # a slow owner delays our later stages by the budget at most
            except BaseException:
                uploaded[index].set()
                raise
            # The owner answers by its own deadline; give it a margin for the transfer back.
            timeout = max(1.0, deadline - clock.monotonic()) + margin
            header = averaging_pb2.ReduceHeader(
                group_id=group.group_id, shard_index=index, sender_peer_id=peer_id, codec=codec.id,
                numel=sl.stop - sl.start, payload_bytes=len(payload))

            def count_sent(n: int) -> None:
                stats["sent"] += n

            try:
                result, received = await reduce_with_owner(
                    transport, owner.address, header, payload, codec.encoded_size(sl.stop - sl.start), timeout,
                    count_sent, uploaded[index].set)
                stats["received"] += len(received)
                average = await loop.run_in_executor(executor, codec.decode, received, result.numel)
                check_contribution(average)
            except (CallFailed, ValueError, codecs.CodecError, ContributionRejected) as err:
                detail = err.detail if isinstance(err, CallFailed) else str(err)
                log.warning("shard %d (owner %s) failed for this peer: %s", index, owner.peer_id, detail)
                if isinstance(err, CallFailed) and err.code == Code.INVALID_ARGUMENT:
                    refused.add(index)
                residual[sl].copy_(x)  # nothing of ours was delivered: carry all of it
                return None
            finally:
                uploaded[index].set()  # also when the stream failed before its upload ended
            if peer_id not in result.contributors:
                residual[sl].copy_(x)  # the average came without our part: carry all of it
            return average

        async with asyncio.TaskGroup() as tasks:
            jobs: list[asyncio.Task] = []
            for index, (owner, sl) in enumerate(zip(owners, slices)):
                if owner.peer_id == peer_id:
                    acc = next(a for a in mine if a.shard_index == index)
                    jobs.append(tasks.create_task(own_shard(acc)))
                else:
                    jobs.append(tasks.create_task(remote_shard(index, owner, sl)))
        averages: list[torch.Tensor | None] = [job.result() for job in jobs]

        # Which shards every member may apply: only those nobody lacks through no fault of its own.
        held = [average is not None for average in averages]
        skip = [not h and i not in refused for i, h in enumerate(held)]

        async def send_report(address: str, report: averaging_pb2.ShardReport,
                              timeout: float) -> averaging_pb2.ShardReport:
            try:
                return await transport.report_shards(address, report, max(0.1, timeout))
            except CallFailed as err:
                raise ReportFailed(f"{err.code.name}: {err.detail}") from None

        reachable = {m.peer_id: m.address for m in members if m.address and m.peer_id != peer_id}
        exchange_deadline = max(agreement.deadline, clock.monotonic() + EXCHANGE_MIN_SECONDS)
        agreed = await agree(agreement, held, skip, exchange_deadline, reachable, send_report, quorum)
    finally:
        agreement.abandon()  # no-op once decided; otherwise callers must not wait for us

    vetoed = [i for i, (h, a) in enumerate(zip(held, agreed)) if h and not a]
    if vetoed:
        log.warning("shard(s) %s skipped this round: another member of the group lacks them", vetoed,
                    extra={"event": "shards_vetoed", "shards": vetoed})

        def carry_vetoed() -> None:
            for i in vetoed:
                residual[slices[i]].copy_(carried[i])  # all of x goes to the next round
                if i in owner_before:  # the average nobody applies leaves no error feedback
                    owner_residual[slices[i]].copy_(owner_before[i])

        await loop.run_in_executor(executor, carry_vetoed)
        for i in vetoed:
            averages[i] = None
    return AllReduceResult(
        averages=averages, slices=slices,
        bytes_sent=stats["sent"] + sum(a.bytes_out for a in mine),
        bytes_received=stats["received"] + sum(a.bytes_in for a in mine),
        payload_bytes=stats["payload"] + sum(codec.encoded_size(a.numel) for a in mine),
        held=held, reports_heard=len(agreement.heard),
    )
