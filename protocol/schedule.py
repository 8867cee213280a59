"""In which order members upload their parts and owners send their averages back: the
staggered butterfly (issue 17).

If every member uploads to every owner at once, N−1 flows share each owner's downlink and its
small queue drops packets (incast); the same happens to every member's downlink when all owners
send their averages back at once. Staggered, member i uploads at stage k to the owner k shards
after its own (shard index modulo the number of shards), and owner j sends its average at stage
k to the member k places after itself: when the group has as many owners as members, each
downlink has one sender per stage, and every uplink one receiver. A client-mode member (no
shard of its own) counts from its index in the member list. When the leader cut each owner's
share into pieces (layout.py ``piece_layout``), members upload piece by piece, in that order
within each piece: an owner's piece-0 average is ready, and goes back, while the members upload
their piece-1 parts, so the two halves of the round overlap on the links.

Stages are not a barrier: a member's stage k starts when its own stage k−1 upload is done (or
failed), or a budget (``stage_budget``) after stage k−1 started even if it is not done (an
owner's stage k likewise after its stage k−1 average is sent, or ``result_budget``), so that one
slow or dead owner delays a member's later uploads by at most that budget, never past the
owners' deadlines (``StageChain``; the simulator's model in sim/allreduce.py counts the same
way). The budget counts from the previous stage's start, not from the round's: counted from the
round's start, every stage of a long round started by one budget, all at once (found with
pieces, whose 28 stages of a 64 MB round at 20 Mbit/s all started within 3.4 s). The
results come back over the same streams whenever the owners finalize, and skip-on-failure,
deadlines and the shard agreement are the same as without stages. Owners aggregate in the order
of sender ids (aggregation.py), not of arrival, so the schedule never changes a bit of the
result.
"""

from __future__ import annotations

import asyncio
from typing import Hashable, Sequence

from ._pb.lowcomm.v1 import averaging_pb2
from .transport import Clock, LoopClock

STAGES_WITHIN = 0.5  # every upload stage has started by this fraction of the reduce timeout at the latest
RESULTS_WITHIN = 0.125  # every result stage by this fraction of it after the owner's average exists


def _owners(group: averaging_pb2.Group) -> tuple[list[str], list[str], list[str]]:
    """(members, the owner of every shard, the distinct owners in the order of their first shard)."""
    members = [m.peer_id for m in group.members]
    owners = [members[i] for i in group.shard_owners]
    return members, owners, list(dict.fromkeys(owners))


def pieces_of(group: averaging_pb2.Group) -> list[int]:
    """Per shard, its piece index: how many earlier shards have the same owner (0 when every
    owner has one shard; see ``layout.piece_layout`` for owners with several)."""
    _, owners, _ = _owners(group)
    seen: dict[str, int] = {}
    pieces = []
    for owner in owners:
        pieces.append(seen.get(owner, 0))
        seen[owner] = pieces[-1] + 1
    return pieces


def upload_order(group: averaging_pb2.Group, peer_id: str) -> list[int]:
    """The indices of the shards ``peer_id`` does not own, in the order it uploads to them:
    piece by piece, and within a piece to the owner k places after itself at stage k."""
    _, owners, distinct = _owners(group)
    rank, count = _rank(group, peer_id), len(distinct)
    pieces = pieces_of(group)
    remote = [s for s in range(len(owners)) if owners[s] != peer_id]
    return sorted(remote, key=lambda s: (pieces[s], (distinct.index(owners[s]) - rank) % count))


def stage_budget(group: averaging_pb2.Group, stages: int) -> float:
    """Seconds a stage waits for the previous one's upload before it starts anyway."""
    return STAGES_WITHIN * group.reduce_timeout_s / max(1, stages)


def _rank(group: averaging_pb2.Group, peer_id: str) -> int:
    members, _, distinct = _owners(group)
    return distinct.index(peer_id) if peer_id in distinct else members.index(peer_id)


def result_order(group: averaging_pb2.Group, owner_id: str) -> list[str]:
    """The members other than ``owner_id``, in the order that owner sends them its average."""
    size = len(group.members)
    own = _rank(group, owner_id)
    others = [m.peer_id for m in group.members if m.peer_id != owner_id]
    return sorted(others, key=lambda p: ((_rank(group, p) - own) % size, p))


def result_budget(group: averaging_pb2.Group, stages: int) -> float:
    """Seconds an owner's result stage waits for the previous one before it starts anyway."""
    return RESULTS_WITHIN * group.reduce_timeout_s / max(1, stages)


class StageChain:
    """Stages in a fixed order: stage k starts when stage k−1 is done, or ``budget`` seconds after
    stage k−1 started, whichever comes first, so stage k has started k budgets after the first
    at the latest. A stage that is not in ``order`` has no turn to wait for."""

    def __init__(self, order: Sequence[Hashable], budget: float, clock: Clock | None = None) -> None:
        self.budget = budget
        self.clock = clock if clock is not None else LoopClock()
        self._before = {stage: order[k - 1] for k, stage in enumerate(order) if k > 0}
        self._started: dict[Hashable, float] = {}
        self._began = {stage: asyncio.Event() for stage in order}
        self._done = {stage: asyncio.Event() for stage in order}

    async def turn(self, stage: Hashable) -> None:
        """Wait for ``stage``'s turn; it counts as started when this returns."""
        before = self._before.get(stage)
        if before is not None:
            await self._began[before].wait()
            remaining = self._started[before] + self.budget - self.clock.monotonic()
            if remaining > 0 and not self._done[before].is_set():
                try:  # not wait_for: on Python 3.11 it can swallow a cancel that comes with the event
                    async with asyncio.timeout(remaining):
                        await self._done[before].wait()
                except TimeoutError:
                    pass  # a slow stage delays the next by the budget at most
        self._start(stage)

    def done(self, stage: Hashable) -> None:
        """``stage`` is over (done, failed or cancelled, started or not): the next may start."""
        self._start(stage)
        if (event := self._done.get(stage)) is not None:
            event.set()

    def _start(self, stage: Hashable) -> None:
        event = self._began.get(stage)
        if event is not None and not event.is_set():
            self._started[stage] = self.clock.monotonic()
            event.set()
