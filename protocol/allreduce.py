"""Butterfly all-reduce of encoded pseudo-gradient shards over gRPC streams (DESIGN §4).

The flat Δ is cut into one contiguous shard per owner (the group's ``shard_bounds``). Every
member streams its encoded part of shard j to the owner of j (``Reduce``); the owner decodes,
accumulates in float32 weighted by tokens, and once every member has sent (or its deadline has
passed) encodes the average once, with its own error-feedback residual, and streams the same
bytes back to every sender. Every member, the owner included, uses the *decoded* average, so all
members end the round with bit-identical values.

Validation and robust aggregation (DESIGN §4 "Trust"): a contribution is checked for codec,
length and finite values as it arrives (a bad one is refused with INVALID_ARGUMENT before it
touches the accumulator). The accumulator keeps every accepted contribution of its shard, the
owner's own included, until the deadline; then ``aggregation.aggregate`` applies the norm bound
(relative to the round's other contributions of that shard) and the configured rule (mean,
clipped mean, trimmed mean). Memory: one float32 tensor per member per owned shard. Every
rejection is reported to the registry's ``on_reject`` with its reason and sender.

Failures: a sender that misses the owner's deadline, or whose contribution is rejected, is left
out (weights renormalised) but still receives the average, and keeps its own part in its
residual (the owner too, when its own part is rejected). A shard whose owner fails is skipped by
the member that lost it: ``None`` in the result, its part kept in the residual. An average that
cannot be published (it overflowed to a non-finite value, or nothing valid was left) makes the
owner skip the shard and refuse it to every sender, so that all members still agree.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import grpc
import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2, averaging_pb2_grpc
from .aggregation import Aggregated, Aggregation, aggregate
from .validate import ContributionRejected, check_contribution

log = logging.getLogger(__name__)

CHUNK_BYTES = 2 * 2**20  # DESIGN: stream in 1-4 MiB messages
MIN_STRAGGLER_GRACE = 1.0  # seconds an owner with a quorum of contributions still waits for the rest
HEADER_TIMEOUT = 10.0  # seconds a server waits for the first message of a Reduce stream

RejectCallback = Callable[[str, str, str], None]  # (reason, sender peer id, detail)


def shard_slices(group: averaging_pb2.Group) -> list[slice]:
    bounds = list(group.shard_bounds)
    return [slice(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _chunks(payload: bytes) -> list[bytes]:
    view = memoryview(payload)
    return [bytes(view[i:i + CHUNK_BYTES]) for i in range(0, len(payload), CHUNK_BYTES)] or [b""]


@dataclass
class ShardAccumulator:
    """The owner's side of one shard in one round."""

    group: averaging_pb2.Group
    shard_index: int
    owner_id: str
    codec: codecs.Codec
    executor: Executor
    owner_residual: torch.Tensor  # view into the owner's full-size residual, updated in place
    own: torch.Tensor  # the owner's own exact contribution to this shard
    expected: set[str]
    weights: dict[str, float]
    aggregation: Aggregation = field(default_factory=Aggregation)
    on_reject: RejectCallback | None = None
    contributions: dict[str, torch.Tensor] = field(default_factory=dict)  # sender -> decoded, until finalize
    contributors: list[str] = field(default_factory=list)  # after finalize: who entered the average
    finalized: asyncio.Event = field(default_factory=asyncio.Event)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a sender arrived or was given up on
    result_payload: bytes = b""
    result: torch.Tensor | None = None  # after finalize: the decoded average, None if it could not be made
    failure: str = ""  # after finalize, when result is None: why
    bytes_in: int = 0  # contribution payload bytes received for this shard
    bytes_out: int = 0  # average payload bytes streamed back to senders
    active_streams: int = 0
    announced: set[str] = field(default_factory=set)  # senders whose header was accepted (no duplicates)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # no Reduce stream is open
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        self.contributions.setdefault(self.owner_id, self.own)

    def stream_opened(self) -> None:
        self.active_streams += 1
        self.idle.clear()

    def stream_closed(self) -> None:
        self.active_streams -= 1
        if self.active_streams == 0:
            self.idle.set()

    @property
    def numel(self) -> int:
        return self.own.numel()

    async def add(self, sender: str, decoded: torch.Tensor) -> bool:
        """Keep a validated contribution until finalize; False if it came after the average was computed."""
        async with self._lock:
            if self.finalized.is_set():
                return False
            self.contributions[sender] = decoded
            self.expected.discard(sender)
            self.progress.set()
            if not self.expected:
                self.all_arrived.set()
            return True

    def give_up(self, sender: str) -> None:
        """Nothing (more) will come from ``sender`` this round: do not wait for it."""
        self.expected.discard(sender)
        self.progress.set()
        if not self.expected:
            self.all_arrived.set()

    async def wait_for_senders(self, deadline: float, quorum: float) -> None:
        """Wait until every sender is in, or the deadline, or an adaptive grace after a quorum.

        Once ``quorum`` of the expected senders have contributed, the rest get twice the time the
        quorum took (at least MIN_STRAGGLER_GRACE): the round follows observed transfer times
        instead of always waiting for the worst case."""
        started = time.monotonic()
        senders = len(self.expected)
        needed = max(1, int(quorum * senders))
        quorum_at: float | None = None
        while not self.all_arrived.is_set():
            now = time.monotonic()
            if quorum_at is None and senders - len(self.expected) >= needed:
                quorum_at = now
            limit = deadline if quorum_at is None else min(
                deadline, quorum_at + max(MIN_STRAGGLER_GRACE, 2 * (quorum_at - started)))
            if now >= limit:
                log.info("shard %d: %d member(s) missed the %s and are left out", self.shard_index,
                         len(self.expected), "deadline" if quorum_at is None else "grace after the quorum")
                return
            self.progress.clear()
            try:
                await asyncio.wait_for(self.progress.wait(), limit - now)
            except asyncio.TimeoutError:
                pass

    async def finalize(self) -> torch.Tensor | None:
        """Aggregate what arrived, encode the average once; None if no average can be published."""
        async with self._lock:
            if not self.finalized.is_set():
                loop = asyncio.get_running_loop()
                contributions = [(s, self.weights[s], x) for s, x in self.contributions.items()]

                def aggregate_and_encode() -> tuple[Aggregated, bytes, torch.Tensor | None, str]:
                    try:
                        outcome = aggregate(contributions, self.aggregation)
                    except ValueError as err:  # malformed weights or lengths: no average rather than a crash
                        return Aggregated(None, []), b"", None, f"the contributions cannot be aggregated: {err}"
                    if outcome.average is None:
                        return outcome, b"", None, "no valid contribution was left"
                    if not bool(torch.isfinite(outcome.average).all()):
                        return outcome, b"", None, "the average overflowed to non-finite values"
                    try:
                        payload, decoded = codecs.encode_with_feedback(self.codec, outcome.average, self.owner_residual)
                    except codecs.CodecError as err:
                        return outcome, b"", None, f"the average cannot be encoded: {err}"
                    return outcome, payload, decoded, ""

                try:
                    outcome, self.result_payload, self.result, self.failure = await loop.run_in_executor(
                        self.executor, aggregate_and_encode)
                finally:
                    self.contributions = {}  # the memory goes back as soon as the average exists
                    self.finalized.set()
                self.contributors = outcome.used if self.result is not None else []
                for rejection in outcome.rejected:
                    self._reject(rejection.reason, rejection.sender, rejection.detail)
                if self.result is None:
                    log.warning("shard %d: %s; every member skips it this round", self.shard_index, self.failure)
        return self.result

    def _reject(self, reason: str, sender: str, detail: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reason, sender, detail)
        else:
            log.warning("rejected a contribution from %s (%s): %s", sender, reason, detail)


class ReduceRegistry:
    """Open accumulators of the current round, found by (group id, shard index) by the RPC handler."""

    def __init__(self, peer_id: str, on_reject: RejectCallback, executor: Executor,
                 aggregation: Aggregation | None = None) -> None:
        self.peer_id = peer_id
        self.on_reject = on_reject
        self.executor = executor
        self.aggregation = aggregation if aggregation is not None else Aggregation()
        self._open: dict[tuple[bytes, int], ShardAccumulator] = {}
        self._changed = asyncio.Event()

    def open(self, accumulators: list[ShardAccumulator]) -> None:
        # Only one round's accumulators are kept: the previous round's late senders get NOT_FOUND.
        self._open = {(a.group.group_id, a.shard_index): a for a in accumulators}
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        self._open = {}

    async def _find(self, group_id: bytes, shard_index: int, timeout: float) -> ShardAccumulator | None:
        # A sender may be faster than the owner at processing the closed group: wait a little.
        deadline = time.monotonic() + timeout
        while (acc := self._open.get((group_id, shard_index))) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return None
        return acc

    async def handle(self, requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """Server side of ``Reduce``: validate, accumulate, then stream the average back."""
        try:
            first = await asyncio.wait_for(anext(requests), HEADER_TIMEOUT)
        except (StopAsyncIteration, asyncio.TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Reduce stream must start with a header")
        if not first.HasField("header"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Reduce stream must start with a header")
        header = first.header
        acc = await self._find(header.group_id, header.shard_index, timeout=HEADER_TIMEOUT)
        if acc is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such group or shard on this peer")
        acc.stream_opened()
        try:
            async for message in self._serve(acc, header, requests, context):
                yield message
        finally:
            acc.stream_closed()

    async def _serve(self, acc: ShardAccumulator, header: averaging_pb2.ReduceHeader,
                     requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        sender = header.sender_peer_id
        problem = self._check_header(acc, header)
        if problem is not None:
            reason, detail = problem
            self.on_reject(reason, sender, detail)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)

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
        try:  # the owner finalizes by its deadline; the margin covers an owner that died in between
            await asyncio.wait_for(acc.finalized.wait(), acc.group.reduce_timeout_s * 1.5)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the shard's average was never computed")
        if acc.result is None:
            await context.abort(grpc.StatusCode.ABORTED, f"no average for this shard this round: {acc.failure}")
        yield averaging_pb2.ReduceMessage(result=averaging_pb2.ReduceResult(
            codec=acc.codec.id, numel=acc.numel, payload_bytes=len(acc.result_payload), contributors=acc.contributors,
        ))
        for chunk in _chunks(acc.result_payload):
            acc.bytes_out += len(chunk)
            yield averaging_pb2.ReduceMessage(chunk=chunk)

    async def _receive(self, acc: ShardAccumulator, sender: str, header: averaging_pb2.ReduceHeader,
                       requests: AsyncIterator[averaging_pb2.ReduceMessage],
                       context: grpc.aio.ServicerContext) -> torch.Tensor:
        """The declared payload, decoded and checked (length, codec, finite values), or an abort."""
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
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            "unexpected message or more bytes than declared")
                    payload[filled:filled + len(message.chunk)] = message.chunk
                    filled += len(message.chunk)
        except TimeoutError:
            payload = bytearray()  # released now: the abort's exception chain keeps this frame alive
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{filled} of {header.payload_bytes} declared bytes arrived within {limit:.1f}s")
        if filled != len(payload):
            self.on_reject("length", sender, f"{filled} of {len(payload)} declared bytes arrived")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{filled} of {len(payload)} declared bytes arrived")
        acc.bytes_in += filled

        loop = asyncio.get_running_loop()
        try:
            decoded = await loop.run_in_executor(self.executor, acc.codec.decode, payload, acc.numel)
            check_contribution(decoded)
        except codecs.CodecError as err:
            self.on_reject("codec", sender, str(err))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable payload: {err}")
        except ContributionRejected as err:
            self.on_reject(err.reason, sender, str(err))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
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


MAX_WEIGHT_RATIO = 4.0


def bounded_weights(members) -> dict[str, float]:
    """Each member's averaging weight: its self-reported tokens, capped at MAX_WEIGHT_RATIO times
    the group's lower median.

    Weights are claims nobody can check, so one peer claiming 10¹² tokens would otherwise own
    every average. Honest weights differ by small factors (a peer whose last round failed brings
    two inner phases' worth), which the cap leaves alone. The lower median makes a lone liar in
    a group of two capped by the honest member. Every member computes this from the same group
    message, so all use the same weights.
    """
    claimed = {m.peer_id: (m.weight if m.weight > 0 and math.isfinite(m.weight) else 1.0) for m in members}
    if not claimed:
        return {}
    ordered = sorted(claimed.values())
    cap = MAX_WEIGHT_RATIO * ordered[(len(ordered) - 1) // 2]
    return {peer: min(weight, cap) for peer, weight in claimed.items()}


async def run_allreduce(
    group: averaging_pb2.Group,
    peer_id: str,
    delta: torch.Tensor,
    residual: torch.Tensor,
    owner_residual: torch.Tensor,
    registry: ReduceRegistry,
    channel_for: Callable[[str], grpc.aio.Channel],
    executor: Executor,
    quorum: float = 1.0,
) -> AllReduceResult:
    """Average ``delta`` with the group; updates ``residual`` (and ``owner_residual``) in place.

    ``residual`` is this peer's sender-side error feedback over the flat parameters; after the
    call it holds everything that this peer's contribution did not deliver this round.
    """
    codec = codecs.get_codec(group.codec)
    members = list(group.members)
    weights = bounded_weights(members)
    slices = shard_slices(group)
    owners = [members[i] for i in group.shard_owners]
    deadline = time.monotonic() + group.reduce_timeout_s
    loop = asyncio.get_running_loop()
    stats = {"sent": 0, "received": 0, "payload": 0}

    # Owner side first, so that fast senders find our accumulators open.
    mine: list[ShardAccumulator] = []
    for index, (owner, sl) in enumerate(zip(owners, slices)):
        if owner.peer_id != peer_id:
            continue
        own = delta[sl].add(residual[sl])
        residual[sl].zero_()  # our own part enters the average exactly: nothing left to carry
        mine.append(ShardAccumulator(
            group=group, shard_index=index, owner_id=peer_id, codec=codec, executor=executor,
            owner_residual=owner_residual[sl], own=own, expected={m.peer_id for m in members} - {peer_id},
            weights=weights, aggregation=registry.aggregation, on_reject=registry.on_reject,
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
            await asyncio.wait_for(acc.idle.wait(), max(0.0, deadline - time.monotonic()) + 0.25 * group.reduce_timeout_s)
        except asyncio.TimeoutError:
            log.info("shard %d: a sender is still downloading the average; moving on", acc.shard_index)
        return result

    async def remote_shard(index: int, owner: averaging_pb2.Member, sl: slice) -> torch.Tensor | None:
        x = delta[sl].add(residual[sl])
        payload, _ = await loop.run_in_executor(executor, codecs.encode_with_feedback, codec, delta[sl], residual[sl])
        stats["payload"] += len(payload)
        stub = averaging_pb2_grpc.AveragingStub(channel_for(owner.address))
        # The owner answers by its own deadline; give it a margin for the transfer back.
        timeout = max(1.0, deadline - time.monotonic()) + 0.25 * group.reduce_timeout_s

        async def outgoing() -> AsyncIterator[averaging_pb2.ReduceMessage]:
            yield averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                group_id=group.group_id, shard_index=index, sender_peer_id=peer_id, codec=codec.id,
                numel=sl.stop - sl.start, payload_bytes=len(payload)))
            for chunk in _chunks(payload):
                stats["sent"] += len(chunk)
                yield averaging_pb2.ReduceMessage(chunk=chunk)

        try:
            call = stub.Reduce(outgoing(), timeout=timeout)
            header = None
            received = bytearray()
            async for message in call:
                if header is None:
                    if not message.HasField("result"):
                        raise ValueError("owner's answer does not start with a result header")
                    header = message.result
                    if header.numel != sl.stop - sl.start or header.payload_bytes != codec.encoded_size(header.numel):
                        raise ValueError("owner's result does not match the shard")
                    continue
                if len(received) + len(message.chunk) > header.payload_bytes:
                    raise ValueError("owner sent more bytes than declared")
                received += message.chunk
            if header is None or len(received) != header.payload_bytes:
                raise ValueError("owner's answer ended early")
            stats["received"] += len(received)
            average = await loop.run_in_executor(executor, codec.decode, received, header.numel)
            check_contribution(average)
        except (grpc.aio.AioRpcError, ValueError, codecs.CodecError, ContributionRejected) as err:
            detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
            log.warning("shard %d (owner %s) skipped this round: %s", index, owner.peer_id, detail)
            residual[sl].copy_(x)  # nothing of ours was delivered: carry all of it
            return None
        if peer_id not in header.contributors:
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
    return AllReduceResult(
        averages=[job.result() for job in jobs], slices=slices,
        bytes_sent=stats["sent"] + sum(a.bytes_out for a in mine),
        bytes_received=stats["received"] + sum(a.bytes_in for a in mine),
        payload_bytes=stats["payload"] + sum(codec.encoded_size(a.numel) for a in mine),
    )
