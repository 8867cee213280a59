"""Ring all-reduce of one group's round (Group.schedule RING; issue 17 item 1).

Why a ring: in the butterfly (allreduce.py) every member's uplink carries an upload stage and a
result stage at once, each to a receiver that may be busy with another sender, so an uplink idles
whenever both of its receivers are shared (bench/analysis.md "Transport, 2026-12-03"). In a ring
each member sends to one peer and receives from one peer for the whole round: every link carries
one flow, and no downlink is ever shared. The bytes per link are the butterfly's,
2·(N−1)/N·S.

The members form a ring in member order (member i sends to i+1, receives from i−1, modulo N)
over one Reduce stream per member (RingHeader, then chunks). Member c owns a chunk: its shards
of the group's layout, in shard order, usually a few pieces of equal size so that a hop forwards
piece 0 while piece 1 still arrives. On its stream, member i sends, in this order:

- reduce-scatter, steps s = 0 … N−2: the running sum of every shard of chunk (i−1−s) mod N. At
  step 0 that is w_i·x_i (its own weighted part); at step s ≥ 1 it is the sum it received at step
  s−1 from member i−1 plus w_i·x_i. A chunk's sum starts at its owner's successor and, after N−1
  hops, reaches its owner with every member's part but the owner's;
- all-gather, steps s = 0 … N−2: at step 0 the encoded average of its own chunk (the sum
  received plus its own part, divided by the group's total weight, encoded once with the owner's
  error feedback as in the butterfly); at step s ≥ 1 the bytes of chunk (i−s) mod N that it
  received at step s−1, as they came.

Each output item depends on the input item one step earlier in the same order, so a member
reads its input in order, and its output follows in order (``_Plan``). Every member ends with
the owners' encoded averages, the same bytes, so all members apply bit-identical values, as with
the butterfly. The weights are the group's bounded weights (accumulator.py), known to all.

Error feedback: x_i = Δ + residual. A lossy codec re-encodes the running sum at every hop; the
error of that encoding, divided by the member's weight, goes into the member's residual, so
what the group's average misses this round enters it in a later one (a lossless codec has no
error: the residual becomes zero). The owner's encoding of the average keeps its error in the
owner residual, as the butterfly's owner does.

Failure and deadlines: the ring needs every member. If a member dies, refuses, sends a malformed or
non-finite sum, or the round passes its deadline (T·(1 + RESULT_MARGIN) after the group arrived,
T = reduce_timeout_s), this member cancels its own stream and, unless all of its input came, answers
the stream from the member before it, which ends that member's round too (an answer to a ring
stream always means "stop": ``RingBook.handle``). So the failure travels both ways round the ring
within a hop's time instead of each member waiting for the deadline, also when a member died before
it ever opened its stream: the member after it would wait for that stream until the deadline, but
the member before it fails to reach it, and the break comes round the other way. What each member
holds then (averages of the all-gather that came through) goes to the same shard agreement as the
butterfly's (agreement.py): a shard that any member lacks is skipped by all, leaving every member's
exact x in its residual and the owner's error feedback as before the round. Nothing is lost; the
next round carries it.

Trust: no member sees another's contribution on its own, only running sums, so a ring applies no
norm bound, no clipping or trimming, and cannot tell who sent a bad value. It is for swarms whose
members trust each other; the node allows it only with ``aggregation = "mean"`` and a dense codec
(layout.py ``RING_CODECS``: a sparse codec's running sums would lose most of their mass at every hop).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, TypeVar

import torch

from . import codecs, wire
from ._pb.lowcomm.v1 import averaging_pb2
from .accumulator import bounded_weights
from .agreement import ShardAgreement, agree, report_sender
from .layout import ring_problem_of_members
from .sender import CHUNK_BYTES, Inbox
from .transport import CallFailed, Code, ReduceTransport, Refused
from .validate import ContributionRejected

if TYPE_CHECKING:
    from .allreduce import ReduceRegistry
    from .member import AllReduceResult

log = logging.getLogger(__name__)
T = TypeVar("T")

RING = averaging_pb2.ALL_REDUCE_SCHEDULE_RING


class RingBroken(Exception):
    """This member's ring round cannot go on (the reason is the message)."""


def ring_problem(group: averaging_pb2.Group, numel: int | None = None) -> str:
    """Why ``group`` cannot run as a ring ("" when it can) over ``numel`` values (when given)."""
    members = len(group.members)
    if problem := ring_problem_of_members(list(group.members), group.codec):
        return problem
    if group.step_groups:
        return "a split step averages across groups, which only the butterfly does"
    bounds = list(group.shard_bounds)
    if (len(bounds) != len(group.shard_owners) + 1 or bounds[0] != 0 or any(b > c for b, c in zip(bounds, bounds[1:]))
            or (numel is not None and bounds[-1] != numel)):
        return "the shard layout is malformed"
    if set(group.shard_owners) != set(range(members)):
        return "every member of a ring must own a shard"
    return ""


@dataclass(frozen=True)
class Item:
    """One payload of a ring stream: the running sum ("sum") or the encoded average ("average")
    of ``shard``, at ``step`` of its phase."""

    kind: str
    step: int
    shard: int


class _Plan:
    """The order of the items on the streams of one member (module docstring)."""

    def __init__(self, group: averaging_pb2.Group, position: int) -> None:
        self.size = len(group.members)
        self.position = position
        self.chunks = [[j for j, owner in enumerate(group.shard_owners) if owner == c] for c in range(self.size)]

    def stream_of(self, position: int) -> list[Item]:
        """The items member ``position`` sends, in order."""
        n = self.size
        out = [Item("sum", s, j) for s in range(n - 1) for j in self.chunks[(position - 1 - s) % n]]
        out += [Item("average", s, j) for s in range(n - 1) for j in self.chunks[(position - s) % n]]
        return out

    @property
    def outgoing(self) -> list[Item]:
        return self.stream_of(self.position)

    @property
    def incoming(self) -> list[Item]:
        return self.stream_of((self.position - 1) % self.size)


_END, _BROKEN = "end", "broken"  # markers a stream's handler puts after its last chunk


class RingInbox:
    """What the member before this one streams to it in one round: its chunks, in order, queued
    by the Reduce handler (``RingBook.handle``) for the round (``run_ring_allreduce``)."""

    def __init__(self, group_id: bytes, sender: str, expected_bytes: int) -> None:
        self.group_id = group_id
        self.sender = sender
        self.expected_bytes = expected_bytes  # what the sender's whole stream must carry
        self.received_bytes = 0
        self.messages: asyncio.Queue = asyncio.Queue()  # not bounded: the round always reads (no cycle of waits)
        self.claimed = False
        self.closed = False
        # Set when the round here ends before the whole stream came (RingBook.close): the
        # handler then stops the stream at once, even while the sender has nothing to send.
        self.cut_off = asyncio.Event()

    async def read(self, size: int) -> Inbox:
        """The next ``size`` bytes as one Inbox; raises RingBroken if the stream ends first."""
        box = Inbox(size)
        while not box.complete:
            message = await self.messages.get()
            if message is _END or message is _BROKEN:
                raise RingBroken(f"the stream from {self.sender} {'ended early' if message is _END else 'broke'}")
            if not box.add(message):
                raise RingBroken(f"{self.sender} sent a chunk across the end of a payload")
        return box


class RingBook:
    """The ring inbox of this peer's current round, for the Reduce handler to find."""

    def __init__(self) -> None:
        self._inbox: RingInbox | None = None
        self._ended: bytes | None = None  # the group of the last round that ended here
        self._changed = asyncio.Event()

    def open(self, inbox: RingInbox) -> None:
        self._inbox = inbox
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self, inbox: RingInbox) -> None:
        """The round is over here: its stream is stopped from now on, and one still open that has
        not brought all its bytes is stopped at once (``handle``). That is how a break travels
        backwards round the ring: the member before this one may be waiting for its own
        input with nothing to send, and would otherwise learn of the break only at its deadline,
        and the whole group with it, in the shard agreement."""
        inbox.closed = True
        if inbox.received_bytes < inbox.expected_bytes:
            inbox.cut_off.set()
        self._ended = inbox.group_id
        if self._inbox is inbox:
            self._inbox = None

    async def _find(self, group_id: bytes, timeout: float) -> RingInbox | None:
        try:  # the sender may have the group before this member does: wait a little
            async with asyncio.timeout(timeout):
                while (inbox := self._inbox) is None or inbox.group_id != group_id:
                    if group_id == self._ended:
                        return None
                    await self._changed.wait()
        except TimeoutError:
            return None
        return inbox

    async def handle(self, header: averaging_pb2.RingHeader, requests: AsyncIterator[wire.Message],
                     timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """Serve a ring stream: queue its chunks for the round; the answer is empty. Raises Refused."""
        inbox = await self._find(header.group_id, timeout)
        if inbox is None and header.group_id == self._ended:
            async for message in _stop_the_sender(timeout):
                yield message
            return
        if inbox is None:
            raise Refused(Code.NOT_FOUND, "no ring round of that group on this peer")
        if header.sender_peer_id != inbox.sender:
            raise Refused(Code.INVALID_ARGUMENT,
                          f"{header.sender_peer_id} is not the member before this one in the ring")
        if inbox.claimed:
            raise Refused(Code.ALREADY_EXISTS, "the ring stream of this round is already open")
        inbox.claimed = True
        queueing = asyncio.ensure_future(_queue_chunks(inbox, requests))
        cut_off = asyncio.ensure_future(inbox.cut_off.wait())
        try:
            await asyncio.wait({queueing, cut_off}, return_when=asyncio.FIRST_COMPLETED)
            if not inbox.cut_off.is_set():
                queueing.result()  # raises its Refused
                return
            async for message in _stop_the_sender(timeout):  # also when a chunk after the cut was refused
                yield message
        finally:
            cut_off.cancel()
            queueing.cancel()  # a no-op once it ended; else this call was cut off or cancelled
            if queueing.done() and not queueing.cancelled():
                queueing.exception()  # how the read ended once cut off: nothing more to say


async def _stop_the_sender(timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
    """Stop a ring stream whose round is over here: an answer tells the sender (any answer breaks
    its ring: _Exchange.send), which then ends the call, cancelling this one. A refusal instead
    would end the call from this side while the sender may still be writing, which its gRPC
    often reports as nothing but "Internal error from Core"."""
    yield averaging_pb2.ReduceMessage()
    await asyncio.sleep(timeout)  # the sender hangs up long before
    raise Refused(Code.ABORTED, "the ring round is over on this peer")


async def _queue_chunks(inbox: RingInbox, requests: AsyncIterator[wire.Message]) -> None:
    """Put a ring stream's chunks in the round's inbox, then a marker of how it ended."""
    try:
        async for message in requests:
            if inbox.closed:
                raise Refused(Code.ABORTED, "the ring round is over on this peer")
            if not message.HasField("chunk"):
                raise Refused(Code.INVALID_ARGUMENT, "a ring stream carries only chunks after its header")
            inbox.received_bytes += len(message.chunk)
            if inbox.received_bytes > inbox.expected_bytes:
                raise Refused(Code.INVALID_ARGUMENT, "the ring stream carries more bytes than the round needs")
            inbox.messages.put_nowait(message.chunk)
    except BaseException:
        inbox.messages.put_nowait(_BROKEN)
        raise
    inbox.messages.put_nowait(_END)


async def run_ring_allreduce(
    group: averaging_pb2.Group,
    peer_id: str,
    delta: torch.Tensor,
    residual: torch.Tensor,
    owner_residual: torch.Tensor,
    registry: "ReduceRegistry",
    executor: Executor,
    transport: ReduceTransport,
    result_margin: float,
    exchange_end: float,
    exchange_min_seconds: float,
    quorum: float = 1.0,
) -> "AllReduceResult":
    """``run_allreduce`` for a group whose schedule is RING (same arguments and result; the
    margins are member.py's). Updates ``residual`` and ``owner_residual`` in place."""
    from .member import AllReduceResult, shard_slices

    clock = registry.clock
    loop = asyncio.get_running_loop()
    started = clock.monotonic()
    ring_end = started + group.reduce_timeout_s * (1.0 + result_margin)
    codec = codecs.get_codec(group.codec)
    members = list(group.members)
    slices = shard_slices(group)
    position = next(i for i, m in enumerate(members) if m.peer_id == peer_id)
    weights = bounded_weights(members)
    weight, total = weights[peer_id], sum(weights.values())
    sizes = [codec.encoded_size(sl.stop - sl.start) for sl in slices]
    averages: list[torch.Tensor | None] = [None] * len(slices)
    encoded: list[bytes | None] = [None] * len(slices)
    sent = received = 0

    agreement = ShardAgreement(group.group_id, peer_id, [m.peer_id for m in members], len(slices),
                               started + exchange_end * group.reduce_timeout_s, clock=clock)
    registry.agreements.open(agreement)
    problem = ring_problem(group, delta.numel())
    plan = _Plan(group, position)
    inbox = RingInbox(group.group_id, members[(position - 1) % len(members)].peer_id,
                      sum(sizes[item.shard] for item in plan.incoming) if not problem else 0)
    registry.rings.open(inbox)
    try:
        # Until the agreement: this member's exact contribution x per shard (what a skipped shard
        # leaves in the residual), and the owner residual of its own chunk before the round.
        carried, owner_before = await loop.run_in_executor(executor, lambda: (
            [delta[sl].add(residual[sl]) for sl in slices],
            {j: owner_residual[slices[j]].clone() for j in plan.chunks[position]}))
        if problem:
            log.warning("this ring group cannot run (%s); every shard is skipped this round", problem)
        else:
            exchange = _Exchange(group, peer_id, plan, inbox, transport, executor, codec, slices, sizes, carried,
                                 weight, total, residual, owner_residual, averages, encoded)
            await exchange.run(clock, ring_end)
            sent, received = exchange.sent, exchange.received
    finally:
        registry.rings.close(inbox)

    held = [average is not None for average in averages]

    try:
        reachable = {m.peer_id: m.address for m in members if m.address and m.peer_id != peer_id}
        exchange_deadline = max(agreement.deadline, clock.monotonic() + exchange_min_seconds)
        agreed = await agree(agreement, held, [not h for h in held], exchange_deadline, reachable,
                             report_sender(transport), quorum)
    finally:
        agreement.abandon()

    def carry_skipped() -> None:
        for j, applied in enumerate(agreed):
            if not applied:
                residual[slices[j]].copy_(carried[j])  # all of x goes to the next round
                if j in owner_before:
                    owner_residual[slices[j]].copy_(owner_before[j])

    skipped = [j for j, applied in enumerate(agreed) if not applied]
    if skipped:
        await loop.run_in_executor(executor, carry_skipped)
        vetoed = [j for j in skipped if held[j]]
        if vetoed:
            log.warning("shard(s) %s skipped this round: another member of the ring lacks them", vetoed,
                        extra={"event": "shards_vetoed", "shards": vetoed})
        for j in skipped:
            averages[j] = None
    return AllReduceResult(
        averages=averages, slices=slices, bytes_sent=sent, bytes_received=received,
        payload_bytes=sum(sizes), held=held, reports_heard=len(agreement.heard),
        payloads=[payload if average is not None else None for payload, average in zip(encoded, averages)],
    )


@dataclass
class _Exchange:
    """One member's side of the ring's traffic in one round: what it adds, where results go."""

    group: averaging_pb2.Group
    peer_id: str
    plan: _Plan
    inbox: RingInbox
    transport: ReduceTransport
    executor: Executor
    codec: codecs.Codec
    slices: list[slice]
    sizes: list[int]  # per shard: its encoded bytes
    carried: list[torch.Tensor]  # per shard: this member's exact contribution x
    weight: float  # this member's bounded weight
    total: float  # the group's total weight
    residual: torch.Tensor
    owner_residual: torch.Tensor
    averages: list[torch.Tensor | None]  # filled in: the decoded averages that came through
    encoded: list[bytes | None]  # filled in: their bytes
    sent: int = 0
    received: int = 0
    # The codec jobs not yet ended (each leaves when it ends, with its result). A job that a
    # thread has begun cannot be cancelled, and each writes into the residual (or the owner
    # residual): ``run`` waits for those still running, or one could overwrite the x that a
    # skipped shard carries after the round has put it back.
    jobs: set[Future] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.successor = self.group.members[(self.plan.position + 1) % self.plan.size]
        self.outgoing: asyncio.Queue[bytes | None] = asyncio.Queue()  # payloads in stream order; None ends it
        self.last = self.plan.size - 2  # the last step of either phase

    def _numel(self, shard: int) -> int:
        return self.slices[shard].stop - self.slices[shard].start

    def running_sum(self, shard: int, received: Inbox | None) -> bytes:
        """The sum to pass on: what came in plus this member's weighted part; its encoding error
        (divided by the weight) stays in the residual."""
        sl, numel, x = self.slices[shard], self._numel(shard), self.carried[shard]
        part = x.mul(self.weight) if received is None else torch.add(received.decode(self.codec, numel), x,
                                                                      alpha=self.weight)
        payload = self.codec.encode(part)
        if self.codec.lossy:
            torch.sub(part, self.codec.decode(payload, numel), out=self.residual[sl]).div_(self.weight)
        else:
            self.residual[sl].zero_()
        return payload

    def average(self, shard: int, received: Inbox) -> tuple[bytes, torch.Tensor]:
        """The owner's step: the whole sum divided by the total weight, encoded once."""
        sl = self.slices[shard]
        mean = torch.add(received.decode(self.codec, self._numel(shard)), self.carried[shard],
                         alpha=self.weight).div_(self.total)
        payload, decoded = codecs.encode_with_feedback(self.codec, mean, self.owner_residual[sl])
        self.residual[sl].zero_()  # this member's part is inside, exactly
        return payload, decoded

    def keep(self, shard: int, received: Inbox) -> tuple[bytes, torch.Tensor]:
        """An owner's average passing by: its bytes (to forward and keep) and its values."""
        return received.payload(), received.decode(self.codec, self._numel(shard))

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the executor, remembered in ``jobs``."""
        job = self.executor.submit(fn, *args)
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        return await asyncio.wrap_future(job)

    async def process(self) -> None:
        """Read the input in order, queue the output in order (the codec work in the executor)."""
        for item in self.plan.outgoing:
            if item.kind == "sum" and item.step == 0:  # needs nothing from the ring
                self.outgoing.put_nowait(await self.off_loop(self.running_sum, item.shard, None))
        for item in self.plan.incoming:
            j = item.shard
            received = await self.inbox.read(self.sizes[j])
            self.received += received.size
            if item.kind == "sum" and item.step < self.last:
                self.outgoing.put_nowait(await self.off_loop(self.running_sum, j, received))
            elif item.kind == "sum":  # the sum of our own chunk is complete but for our part
                self.encoded[j], self.averages[j] = await self.off_loop(self.average, j, received)
                self.outgoing.put_nowait(self.encoded[j])
            else:
                self.encoded[j], self.averages[j] = await self.off_loop(self.keep, j, received)
                if item.step < self.last:
                    self.outgoing.put_nowait(self.encoded[j])
        self.outgoing.put_nowait(None)

    async def stream(self) -> AsyncIterator[wire.Message]:
        """This member's Reduce stream to the next: the header, then the queued payloads' chunks."""
        yield averaging_pb2.ReduceMessage(ring_header=averaging_pb2.RingHeader(group_id=self.group.group_id,
                                                                                sender_peer_id=self.peer_id))
        while (payload := await self.outgoing.get()) is not None:
            for chunk in wire.chunks(payload, CHUNK_BYTES) if payload else []:
                self.sent += len(chunk.chunk)
                yield chunk

    async def send(self, timeout: float) -> None:
        answer = self.transport.reduce(self.successor.address, self.stream(), timeout)
        try:
            async for _ in answer:  # the successor's round ended before this stream was through
                raise RingBroken(f"{self.successor.peer_id} stopped this ring round (it ended there)")
        finally:
            close: Callable | None = getattr(answer, "aclose", None)
            if close is not None:
                await close()

    async def run(self, clock, ring_end: float) -> None:
        """Both halves until both are done, the round fails (logged) or ``ring_end`` passes."""
        step = self.group.step
        try:
            async with asyncio.timeout(max(0.0, ring_end - clock.monotonic())):
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(self.process())
                    tasks.create_task(self.send(max(0.1, ring_end - clock.monotonic())))
        except* TimeoutError:
            log.warning("ring round of step %d passed its deadline; shards it lacks are skipped", step)
        except* CallFailed as failed:
            err = failed.exceptions[0]
            log.warning("ring round of step %d: the stream to %s failed (%s: %s)", step, self.successor.peer_id,
                        err.code.name, err.detail)
        except* (RingBroken, codecs.CodecError, ContributionRejected, ValueError) as failed:
            log.warning("ring round of step %d failed: %s", step, failed.exceptions[0])
        finally:
            # A failed call leaves gRPC's task that reads ``stream`` waiting for the next payload:
            # the end marker lets it finish instead of being destroyed while pending.
            self.outgoing.put_nowait(None)
            # Cancelling ``process`` cancelled its queued codec jobs, not one a thread was running.
            if running := [asyncio.wrap_future(job) for job in list(self.jobs)]:
                await asyncio.wait(running)
