"""One member's side of a round of the butterfly all-reduce (allreduce.py has the protocol):
it owns its shards' accumulators, uploads its parts to the other owners in the staggered order,
and agrees with the group on which shards to apply; in a split step its owned shards go through
their teams across groups (crossgroup.py) and a shard whose owner failed is fetched from the team.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .accumulator import ShardAccumulator, bounded_weights
from .agreement import ShardAgreement, agree, report_sender
from .crossgroup import FETCH_END, StepPlan, answer_delay, stretch
from .team import TeamRound, fetch
from .ring import RING, run_ring_allreduce
from .schedule import StageChain, stage_budget, upload_order
from .sender import reduce_with_owner
from .transport import CallFailed, Code, ReduceTransport
from .validate import ContributionRejected, check_contribution

if TYPE_CHECKING:
    from .allreduce import ReduceRegistry

log = logging.getLogger(__name__)

RESULT_MARGIN = 0.25  # fraction of the reduce timeout a sender allows for the average's transfer back
EXCHANGE_END = 1.5  # the shard-report exchange ends this many reduce timeouts after the group arrived...
EXCHANGE_MIN_SECONDS = 1.0  # ...or this long after this member's reduce phase, whichever is later
# An upload quicker than this is timed at the pace of the two peers' event loops, not of the link:
# a 3-peer `make demo` on loopback (150 kB parts) had its uploads timed at 0.3-1.7 ms, so members
# on equal links declared bandwidths up to 6x apart and the leader gave one of them no shard in
# 6 of 12 rounds (1-2 of 10 while the clock counted whole milliseconds). Such an upload only says
# that the uplink carries at least its bytes in this time; members whose uploads all beat it
# declare that much, alike, and get equal shares (and `schedule = "auto"` its ring). Parts that
# take longer, as on a thin uplink, are timed as they are.
MIN_TIMED_UPLOAD_SECONDS = 0.02


def decode_checked(codec: codecs.Codec, payload: bytes, numel: int) -> torch.Tensor:
    """Decoded and checked for finite values in one executor job (neither on the event loop)."""
    decoded = codec.decode(payload, numel)
    check_contribution(decoded)
    return decoded


def shard_slices(group: averaging_pb2.Group) -> list[slice]:
    bounds = list(group.shard_bounds)
    return [slice(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


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
    # Per shard: the encoded bytes of the average in ``averages`` (None where that is None), kept
    # for peers that missed the round (missed_rounds.py).
    payloads: list[bytes | None] = field(default_factory=list)
    # How fast this peer's uplink carried its parts: the fastest of its uploads as the owners
    # timed them (``ReduceResult.upload_seconds``), bytes/s; 0 when no owner timed one. An
    # upload to an owner with a slower downlink is slower than our uplink, so the fastest
    # one is the estimate (what a leader lays shards out by: layout.py). An upload quicker than
    # MIN_TIMED_UPLOAD_SECONDS counts as taking that long.
    upload_rates: list[float] = field(default_factory=list)  # bytes/s of each upload an owner timed

    @property
    def upload_bps(self) -> float:
        """How fast this peer's uplink carries its parts, bytes/s (0: no owner timed one): the
        upper quartile of its uploads' rates. Not the mean: an upload to an owner with a slower
        downlink runs at that owner's pace, and now and then an owner reads a header after
        much of the part already waited in its buffers, which times it far too fast (up to
        10× a 100 Mbit/s cap in bench/transport.py --slow-mbit runs); the upper quartile
        passes over both as long as they are under a quarter of the uploads."""
        if not self.upload_rates:
            return 0.0
        ranked = sorted(self.upload_rates)
        return ranked[math.ceil(0.75 * len(ranked)) - 1]


def own_link_at_fault(owners: list[averaging_pb2.Member], peer_id: str, timed_out: set[int], held: list[bool]) -> set[int]:
    """The shards this member lacks through its own slow link: all the other owners' shards,
    when there are at least two and every one of their calls ran out of time here (the owners
    are not at fault all at once; this member's link is, e.g. a volunteer on a far slower line
    than the round's deadline allows). It then asks nobody to skip them: the others apply what
    they hold, and this member alone ends with other parameters (and downloads the state), as
    after a refused contribution. Its veto used to cost the whole group those shards round
    after round."""
    remote = {i for i, owner in enumerate(owners) if owner.peer_id != peer_id}
    lacking = {i for i in remote if not held[i]}
    if len(remote) < 2 or not remote <= timed_out or not lacking:
        return set()
    log.warning("no other owner's average of this round reached this peer in time (shards %s), so its own link is "
                "the likely cause: it asks nobody to skip them and will take the swarm's state instead (on a "
                "slow line raise [sync] reduce_timeout, or use a smaller codec such as int4)",
                sorted(lacking), extra={"event": "own_link_too_slow", "shards": sorted(lacking)})
    return lacking


async def run_allreduce(
    group: averaging_pb2.Group,
    peer_id: str,
    delta: torch.Tensor,
    residual: torch.Tensor,
    owner_residual: torch.Tensor,
    registry: "ReduceRegistry",
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
    if group.schedule == RING:
        return await run_ring_allreduce(group, peer_id, delta, residual, owner_residual, registry, executor, transport,
                                        RESULT_MARGIN, EXCHANGE_END, EXCHANGE_MIN_SECONDS, quorum)
    clock = registry.clock
    codec = codecs.get_codec(group.codec)
    members = list(group.members)
    weights = bounded_weights(members)
    slices = shard_slices(group)
    owners = [members[i] for i in group.shard_owners]
    started = clock.monotonic()
    deadline = started + group.reduce_timeout_s
    # A split step's owners reduce across groups after the deadline: every later wait is longer.
    plan, extra = StepPlan.of(group), stretch(group)
    margin = RESULT_MARGIN * group.reduce_timeout_s + answer_delay(group)
    team = None if plan is None else TeamRound(plan, peer_id, codec, transport, executor, clock,
                                               started, group.reduce_timeout_s, quorum)
    loop = asyncio.get_running_loop()
    stats = {"sent": 0, "received": 0, "payload": 0}
    upload_rates: list[float] = []  # bytes/s of each upload an owner timed
    # Per shard, until the agreement: this peer's exact contribution x (what a skipped shard
    # leaves in the residual) and, for shards it owns, its owner residual before the round.
    carried: list[torch.Tensor | None] = [None] * len(slices)
    encoded: list[bytes | None] = [None] * len(slices)  # per shard: the average's bytes, once held
    owner_before: dict[int, torch.Tensor] = {}
    # Stage k's upload waits for stage k-1's (or its budget): each owner's downlink gets one sender at a time.
    order = upload_order(group, peer_id)
    stages = StageChain(order if staggered else [], stage_budget(group, len(order)), clock)
    # Shards we lack through our own fault, for which we ask no skip: the owner refused our
    # contribution, or (own_link_at_fault) every other owner's call ran out of time here.
    refused: set[int] = set()
    timed_out: set[int] = set()  # other owners' shards whose call ran out of time here

    # The agreement first: a member that is done before us may report to us at any moment.
    me = next(m for m in members if m.peer_id == peer_id)
    agreement = ShardAgreement(group.group_id, peer_id, [m.peer_id for m in members], len(slices),
                               started + EXCHANGE_END * group.reduce_timeout_s + extra,
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
                publish=None if team is None else team.publisher(index, owner_residual[slices[index]]),
            ))
        if team is not None:  # before the group's accumulators: other groups' owners may be faster
            team.open({a.shard_index: a.numel for a in mine}, registry.teams)
        registry.open(mine)
        for acc in mine:
            acc.idle.set()
            if not acc.expected:
                acc.all_arrived.set()

        async def own_shard(acc: ShardAccumulator) -> torch.Tensor | None:
            await acc.wait_for_senders(deadline, quorum)
            result = await acc.finalize()
            encoded[acc.shard_index] = acc.result_payload if result is not None else None
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
                await stages.turn(index)  # a slow owner delays our later stages by the budget at most
            except BaseException:
                stages.done(index)
                raise
            # The owner answers by its own deadline; give it a margin for the transfer back.
            timeout = max(1.0, deadline - clock.monotonic()) + margin
            header = averaging_pb2.ReduceHeader(
                group_id=group.group_id, shard_index=index, sender_peer_id=peer_id, codec=codec.id,
                numel=sl.stop - sl.start, payload_bytes=len(payload))

            def count_sent(n: int) -> None:
                stats["sent"] += n

            average: torch.Tensor | None = None
            try:
                result, received = await reduce_with_owner(
                    transport, owner.address, header, payload, codec.encoded_size(sl.stop - sl.start), timeout,
                    count_sent, lambda: stages.done(index))
                stats["received"] += received.size
                if result.upload_seconds > 0:
                    upload_rates.append(len(payload) / max(result.upload_seconds, MIN_TIMED_UPLOAD_SECONDS))

                def keep_and_decode() -> tuple[bytes, torch.Tensor]:  # the copy too stays off the event loop
                    return received.payload(), received.decode(codec, result.numel)

                encoded[index], average = await loop.run_in_executor(executor, keep_and_decode)
                contributors = list(result.contributors)
            except (CallFailed, ValueError, codecs.CodecError, ContributionRejected) as err:
                detail = err.detail if isinstance(err, CallFailed) else str(err)
                log.warning("shard %d (owner %s) failed for this peer: %s", index, owner.peer_id, detail)
                if isinstance(err, CallFailed) and err.code == Code.INVALID_ARGUMENT:
                    refused.add(index)
                if isinstance(err, CallFailed) and err.code == Code.DEADLINE_EXCEEDED:
                    timed_out.add(index)
                if isinstance(err, CallFailed) and err.code == Code.UNAVAILABLE:
                    for acc in mine:  # an owner we cannot reach will not send us its part either
                        acc.unreachable(owner.peer_id)
                average = None
            finally:
                stages.done(index)  # also when the stream failed before its upload ended
            if average is None and plan is not None:
                # A split step: the other groups' owners of this shard hold the same bytes.
                average, contributors = await fetch_from_team(index, sl, owner.peer_id)
            if average is None:
                residual[sl].copy_(x)  # nothing of ours was delivered: carry all of it
                return None
            if peer_id not in contributors:
                residual[sl].copy_(x)  # the average came without our part: carry all of it
            return average

        async def fetch_from_team(index: int, sl: slice, exclude: str) -> tuple[torch.Tensor | None, list[str]]:
            assert plan is not None
            numel = sl.stop - sl.start
            got = await fetch(plan, index, peer_id, numel, codec, transport, started + FETCH_END * group.reduce_timeout_s,
                              clock, candidates=[o for _, o in plan.team(index) if o.peer_id != exclude])
            if got is None:
                return None, []
            received, contributors = got
            try:
                average = await loop.run_in_executor(executor, decode_checked, codec, received, numel)
            except (codecs.CodecError, ContributionRejected) as err:
                log.warning("shard %d: the team's result is unusable: %s", index, err)
                return None, []
            encoded[index] = received
            stats["received"] += len(received)
            log.info("shard %d: its owner failed; fetched the step's average from its team", index)
            return average, contributors

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
        refused |= own_link_at_fault(owners, peer_id, timed_out, held)
        skip = [not h and i not in refused for i, h in enumerate(held)]

        reachable = {m.peer_id: m.address for m in members if m.address and m.peer_id != peer_id}
        exchange_deadline = max(agreement.deadline, clock.monotonic() + EXCHANGE_MIN_SECONDS)
        agreed = await agree(agreement, held, skip, exchange_deadline, reachable, report_sender(transport), quorum)
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
        bytes_sent=stats["sent"] + sum(a.bytes_out for a in mine) + (team.bytes[1] if team else 0),
        bytes_received=stats["received"] + sum(a.bytes_in for a in mine) + (team.bytes[0] if team else 0),
        payload_bytes=stats["payload"] + sum(codec.encoded_size(a.numel) for a in mine),
        held=held, reports_heard=len(agreement.heard),
        payloads=[payload if average is not None else None for payload, average in zip(encoded, averages)],
        upload_rates=upload_rates,
    )
