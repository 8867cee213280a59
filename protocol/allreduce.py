"""Butterfly all-reduce of encoded pseudo-gradient shards over gRPC streams (DESIGN §4).

The flat Δ is cut into contiguous shards (the group's ``shard_bounds``), each with an owner; a
single group's leader cuts each owner's share into a few pieces when it is large (layout.py
``piece_layout``), so that an owner averages and returns piece 0 while piece 1 still uploads.
Every member streams its encoded part of shard j to the owner of j (``Reduce``, sender.py), one
owner after the other in the staggered order of schedule.py (piece by piece) so that no owner's
downlink is shared by all senders at once; the owner decodes, accumulates in float32 weighted by tokens, and once
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

Split steps: when the leader split a step's peers into several groups, the owners of every shard
across groups reduce their groups' partial averages in a team, and every group ends the step
with the same bytes (crossgroup.py has the protocol, team.py the owners' side). The member's side
of a round (``run_allreduce``) is in member.py; this module is the serving side.

Seams (transport.py): the Reduce stream and ReportShards calls go through a
``ReduceTransport`` (gRPC by default, grpc_transport.py), the serving side refuses with
``Refused``, and every deadline is on the registry's ``Clock`` (the event loop's by default).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from typing import AsyncIterator

import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .agreement import AgreementBook
from .accumulator import MAX_WEIGHT_RATIO, RejectCallback, ShardAccumulator, bounded_weights
from .aggregation import Aggregation
from .crossgroup import TeamBook, stretch
from .member import EXCHANGE_END, EXCHANGE_MIN_SECONDS, RESULT_MARGIN, AllReduceResult, run_allreduce, shard_slices
from .ring import RingBook
from .sender import CHUNK_BYTES, Inbox
from .transport import Clock, Code, LoopClock, Refused
from .validate import ContributionRejected

__all__ = ["AllReduceResult", "CHUNK_BYTES", "EXCHANGE_END", "EXCHANGE_MIN_SECONDS", "MAX_WEIGHT_RATIO", "RESULT_MARGIN",
           "ReduceRegistry", "ShardAccumulator", "bounded_weights", "run_allreduce", "shard_slices"]
log = logging.getLogger(__name__)

HEADER_TIMEOUT = 10.0  # seconds a server waits for the first message of a Reduce stream


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
        self.teams = TeamBook()  # split steps: the teams of shard owners across groups (crossgroup.py)
        self.rings = RingBook()  # ring rounds: the stream from the member before this one (ring.py)

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
        header_at = self.clock.monotonic()  # the sender's upload starts here (before any wait of ours)
        if first.HasField("team_header"):  # a shard owner of another group of a split step
            async for message in self.teams.handle(first.team_header, requests, self.executor, HEADER_TIMEOUT):
                yield message
            return
        if first.HasField("ring_header"):  # the member before this one in a ring round (ring.py)
            async for message in self.rings.handle(first.ring_header, requests, HEADER_TIMEOUT):
                yield message
            return
        if not first.HasField("header"):
            raise Refused(Code.INVALID_ARGUMENT, "Reduce stream must start with a header")
        header = first.header
        acc = await self._find(header.group_id, header.shard_index, timeout=HEADER_TIMEOUT)
        if acc is None:
            raise Refused(Code.NOT_FOUND, "no such group or shard on this peer")
        acc.stream_opened()
        try:
            async for message in self._serve(acc, header, requests, header_at):
                yield message
        finally:
            acc.stream_closed()

    async def _serve(self, acc: ShardAccumulator, header: averaging_pb2.ReduceHeader,
                     requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     header_at: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        sender = header.sender_peer_id
        problem = self._check_header(acc, header)
        if problem is not None:
            reason, detail = problem
            self.on_reject(reason, sender, detail)
            raise Refused(Code.INVALID_ARGUMENT, detail)

        # The header used up this sender's one try: if its contribution does not make it into the
        # accumulator, nothing more can come from it, and the owner stops waiting for it.
        decoded, upload_seconds = None, 0.0
        try:
            decoded, upload_seconds = await self._receive(acc, sender, header, requests, header_at)
        finally:
            if decoded is None:
                acc.give_up(sender)
        if not await acc.add(sender, decoded):
            self.on_reject("late", sender, "arrived after the average was computed")
        acc.awaiting.add(sender)
        try:  # the owner finalizes by its deadline; the margin covers an owner that died in between
            async with asyncio.timeout(acc.group.reduce_timeout_s * 1.5 + stretch(acc.group)):
                await acc.finalized.wait()
        except TimeoutError:
            raise Refused(Code.DEADLINE_EXCEEDED, "the shard's average was never computed") from None
        if acc.result is None:
            raise Refused(Code.ABORTED, f"no average for this shard this round: {acc.failure}")
        try:
            await acc.wait_turn(sender)
            yield averaging_pb2.ReduceMessage(result=averaging_pb2.ReduceResult(
                codec=acc.codec.id, numel=acc.numel, payload_bytes=len(acc.result_payload),
                contributors=acc.contributors, upload_seconds=upload_seconds))
            for chunk in acc.result_chunks():  # framed once per shard, not once per sender
                acc.bytes_out += len(chunk.chunk)
                yield chunk
        finally:
            acc.served(sender)

    async def _receive(self, acc: ShardAccumulator, sender: str, header: averaging_pb2.ReduceHeader,
                       requests: AsyncIterator[averaging_pb2.ReduceMessage],
                       header_at: float) -> tuple[torch.Tensor, float]:
        """The declared payload, decoded and checked (length, codec, finite values), and the
        seconds from its header (read at ``header_at``) to its last byte; or Refused."""
        payload = Inbox(header.payload_bytes)  # bounded: equals the codec's size for this shard
        # A sender that declared its size and then stalls must not hold this buffer (nor the
        # stream) past the round: the same margin as for the owner's average below.
        limit = acc.group.reduce_timeout_s * 1.5
        try:
            async with asyncio.timeout(limit):
                async for message in requests:
                    if not message.HasField("chunk") or not payload.add(message.chunk):
                        payload.release()
                        self.on_reject("length", sender, "unexpected message or more bytes than declared")
                        raise Refused(Code.INVALID_ARGUMENT, "unexpected message or more bytes than declared")
        except TimeoutError:
            filled = payload.filled
            payload.release()  # released now: the refusal's exception chain keeps this frame alive
            raise Refused(Code.DEADLINE_EXCEEDED,
                          f"{filled} of {header.payload_bytes} declared bytes arrived within {limit:.1f}s") from None
        if not payload.complete:
            filled = payload.filled
            payload.release()
            self.on_reject("length", sender, f"{filled} of {header.payload_bytes} declared bytes arrived")
            raise Refused(Code.INVALID_ARGUMENT, f"{filled} of {header.payload_bytes} declared bytes arrived")
        acc.bytes_in += payload.filled
        upload_seconds = self.clock.monotonic() - header_at

        loop = asyncio.get_running_loop()
        try:  # decoded in place and checked for finite values off the event loop
            decoded = await loop.run_in_executor(self.executor, payload.decode, acc.codec, acc.numel)
        except codecs.CodecError as err:
            self.on_reject("codec", sender, str(err))
            raise Refused(Code.INVALID_ARGUMENT, f"undecodable payload: {err}") from None
        except ContributionRejected as err:
            self.on_reject(err.reason, sender, str(err))
            raise Refused(Code.INVALID_ARGUMENT, str(err)) from None
        return decoded, upload_seconds

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
