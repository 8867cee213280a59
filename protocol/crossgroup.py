"""One average per step across the groups of a split step (issue 15, item 3).

When more peers came to a step than ``group_size`` allows, the leader splits them into groups
(layout.py) and gives every group the same *step plan* (``Group.step_groups``): all groups'
members and owners, this group's index, and one shard layout used by every group (K shards,
K = the smallest group's number of reachable members; a member beyond the K owners of its
group owns nothing and only sends). The round is then a hierarchical reduce:

1. **Stage 1** (allreduce.py, as in a single group): the owner of shard k in group g collects
   its group's contributions and aggregates them (accumulator.py, the configured rule) into the
   group's partial average A_g[k], with weight W_g = the sum of the bounded weights of the
   members inside it. It does not encode it. (A robust rule, such as the trimmed mean, thus
   acts within each group; across groups the partial averages are weighed by W_g.)
2. **Stage 2** (this module): the owners of shard k across groups form *team k*; its reducer is
   the team's owner with the highest declared bandwidth (``Group.team_reducers``, chosen by the
   leader in layout.py: a reducer's link carries G − 1 parts and G − 1 answers). Each owner
   streams (A_g[k], its contributors) to the reducer in float32 (a Reduce stream that starts
   with a ``TeamHeader``); the reducer recomputes W_g
   from the plan (the weights of the listed members: a sender cannot claim more), sums
   Σ W_g·A_g / Σ W_g in group order (aggregation.weighted_mean), encodes that once with its
   own error feedback, as an owner of a single group does, and answers every owner with the
   same bytes and the union of the contributors inside. float32 rather than the round's codec:
   the partial averages reach the reducer exactly, so the step's average is the token-weighted
   global mean up to the one encoding at the reducer, and no owner needs a second
   error-feedback state that a skipped shard would have to roll back. The cost is 4 bytes per
   value of shard k from each owner to the reducer (the reducer receives (G−1)·4·numel/K).
   **A tree for many groups.** From TREE_FROM_GROUPS groups on (layout.py ``team_fanin``) a
   team is a tree of two levels: its groups form subteams of F = ⌈√G⌉ consecutive groups, each
   with a *subreducer* (its fastest declared owner, ``Group.team_subreducers``; the reducer is
   its own subteam's). An owner streams its part to its subreducer, which closes its subteam
   by TEAM_SUB_CLOSE·T (all parts, or a grace after a quorum), streams the subteam's weighted
   mean to the reducer as one part (the reducer weighs it by the listed contributors, which
   must be members of that subteam's groups), and answers its subteam with the reducer's bytes.
   The reducer receives F − 1 parts and ⌈G/F⌉ − 1 subteam means instead of G − 1 parts: about
   2·√G streams and parts at the busiest owner, for one more hop up and down. The step's
   average is the same weighted global mean (one more float32 rounding of the subteam means),
   still encoded once, so every group decodes the same bytes.
3. **Stage 3** (allreduce.py, today's all-gather): each owner streams the reducer's bytes to its
   group. Every member of every group decodes the same bytes: one θ_global per step.

**Faults.** The reducer closes on all parts, or a grace after a quorum of them, or at
TEAM_CLOSE reduce timeouts after the group arrived; a group whose part is missing is left out of
shard k (its members keep their part in their residuals, since they are not among the
contributors) but receives the result like everybody else. An owner that lacks the result
through no fault of its own (the reducer died, or died mid-reply, or its answer to this owner
broke) *fetches* it from the team's other owners (a Reduce stream with ``TeamHeader.fetch``,
answered once the callee knows whether it holds the result; the reducer is asked last) before it
answers its group. So when one owner holds the result every owner that reaches it applies it,
and when none holds it (the reducer died before any answer) every owner finds so and all groups
skip the shard alike (each owner refuses the shard to its group, whose members skip it and keep
all of x). No all-to-all exchange among the G owners is needed for that (it cost each owner G − 1
calls per round, in every round), only calls where an answer is missing. An owner that dies
after that leaves its group without the bytes: its members fetch the result from the team's
other owners the same way (each owner keeps its team's outcome for a few rounds), so one dead
owner costs its group nothing more than its own members' parts that it did not pass on. Only two
failures together (an owner and every holder of the result unreachable to it or its group) can
still leave a group without a shard the others applied; the params-hash vote then sends that
group to catch up, as before.

**Time.** A split step's waits after the owners' deadline T (the reduce timeout) are CROSS_EXTRA·T
longer (``stretch``): stage 2 closes by TEAM_SUB_CLOSE·T in the subteams and TEAM_CLOSE·T at
the reducer, an owner waits for the reducer until TEAM_ANSWER·T (for its subreducer until
TEAM_LEAF_ANSWER·T) and fetches from the other owners until TEAM_AGREE_END·T; a member waits for its owner's
answer until TEAM_AGREE_END·T plus the usual transfer margin (``answer_delay``), fetches from
the team until FETCH_END·T, and its group's exchange ends at 1.5 T + stretch. So a split step
takes at most one reduce timeout longer than a single group's, in the worst case.

**Traffic.** Per round, on top of a single group's 2·(n−1)/n·S per member (S = the encoded Δ):
a non-reducer owner uploads 4·numel/K bytes and downloads its shard's encoded result once; a
reducer downloads (G−1)·4·numel/K and uploads (G−1) encoded results (in a tree, a reducer or
subreducer as many as it has children: about 2·√G and √G). Measured with six
peers, two groups of three, int8, 445,952 values (tests/test_crossgroup_cli.py; K = 3, every
member owns a shard): a team reducer sent 746 KB and received 1.19 MB per round, an owner that
only sends to its team the reverse; one group of six would move about 746 KB each way. An encoded stage 2 would cut
the 4 bytes per value to the codec's size, but its error feedback lives at the scale of a
group's partial average, which enters the step's average with weight W_g / ΣW: kept unscaled
in the owner's residual (which the same peer also uses when it reduces) it would be counted
ΣW / W_g times. Not done yet.

**Simulating it (sim/).** ``StepPlan.of(group)`` says whether a group is one of a split step's;
then every group of the step commits the same hash, and a round's transfers are the group's
own (shard_bounds, shard_owners) plus, per shard k, the team's parts up its tree (or into its
flat reducer) and the answers back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np
import torch

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2
from .accumulator import MIN_STRAGGLER_GRACE, bounded_weights
from .aggregation import weighted_mean
from .layout import team_fanin
from .sender import chunks
from .transport import Clock, Code, Refused
from .validate import ContributionRejected, check_contribution

log = logging.getLogger(__name__)

CROSS_EXTRA = 1.0  # a split step's waits after the owners' deadline are this many reduce timeouts longer
TEAM_CLOSE = 1.4  # the reducer closes the team's sum this many reduce timeouts after the group arrived
TEAM_ANSWER = 1.55  # an owner waits for the reducer's answer until then
TEAM_AGREE_END = 1.75  # an owner without the team's result stops fetching it from the others then
FETCH_END = 2.4  # a member stops fetching a team's result then (its group's exchange ends at 2.5)
KEPT_TEAMS = 16  # team outcomes a peer keeps for fetches: this round's and a few before
TEAM_SUB_CLOSE = 1.3  # a subreducer closes its subteam's sum this many reduce timeouts after the group arrived
TEAM_LEAF_ANSWER = 1.65  # an owner below a subreducer waits for the team's answer until then


def is_split(group: averaging_pb2.Group) -> bool:
    """Whether ``group`` is one of several groups of its step (then its average is the step's)."""
    return len(group.step_groups) > 1


def stretch(group: averaging_pb2.Group) -> float:
    """Seconds a split step's waits after the owners' deadline are longer (0 for one group)."""
    return CROSS_EXTRA * group.reduce_timeout_s if is_split(group) else 0.0


def answer_delay(group: averaging_pb2.Group) -> float:
    """Seconds a split step's owners answer their members later than a single group's (they
    decide with their team first, by TEAM_AGREE_END reduce timeouts after the group arrived)."""
    return (TEAM_AGREE_END - 1.0) * group.reduce_timeout_s if is_split(group) else 0.0


@dataclass(frozen=True)
class StepPlan:
    """The groups of a split step as every member's Group message lists them."""

    groups: tuple[averaging_pb2.StepGroup, ...]
    index: int  # this group's
    reducers: tuple[int, ...]  # per shard: the group whose owner reduces the team (Group.team_reducers)
    subreducers: tuple[int, ...] = ()  # per shard and subteam (Group.team_subreducers); () for flat teams

    @classmethod
    def of(cls, group: averaging_pb2.Group) -> StepPlan | None:
        if not is_split(group):
            return None
        if not 0 <= group.group_index < len(group.step_groups):
            raise ValueError(f"group_index {group.group_index} outside the {len(group.step_groups)} step groups")
        mine, shards = group.step_groups[group.group_index], len(group.shard_bounds) - 1
        if list(mine.members) != list(group.members) or list(mine.shard_owners) != list(group.shard_owners):
            raise ValueError("the step plan's entry for this group differs from the group")
        for index, step_group in enumerate(group.step_groups):
            owners = list(step_group.shard_owners)
            if len(owners) != shards or not all(0 <= i < len(step_group.members) for i in owners) or \
                    not all(step_group.members[i].address for i in owners):
                raise ValueError(f"step group {index} has no reachable owner for every one of the {shards} shards")
        reducers = tuple(group.team_reducers)
        if len(reducers) != shards or not all(0 <= g < len(group.step_groups) for g in reducers):
            raise ValueError(f"team_reducers must name one of the {len(group.step_groups)} step groups for each of the "
                             f"{shards} shards, not {list(reducers)}")
        subreducers = tuple(group.team_subreducers)
        fanin = team_fanin(len(group.step_groups))
        if subreducers:
            subteams = -(-len(group.step_groups) // fanin) if fanin else 0
            if not fanin or len(subreducers) != shards * subteams or \
                    any(g // fanin != i % subteams for i, g in enumerate(subreducers)) or \
                    any(subreducers[k * subteams + reducers[k] // fanin] != reducers[k] for k in range(shards)):
                raise ValueError(f"team_subreducers must name, for each of the {shards} shards, one group of each "
                                 f"of its subteams (its reducer's for the reducer's subteam), not {list(subreducers)}")
        return cls(tuple(group.step_groups), group.group_index, reducers, subreducers)

    def owner(self, g: int, k: int) -> averaging_pb2.Member:
        step_group = self.groups[g]
        return step_group.members[step_group.shard_owners[k]]

    def reducer_group(self, k: int) -> int:
        return self.reducers[k]

    def team(self, k: int) -> list[tuple[int, averaging_pb2.Member]]:
        """(group index, owner) of every owner of shard ``k``, reducer's group first."""
        first = self.reducer_group(k)
        order = [first, *(g for g in range(len(self.groups)) if g != first)]
        return [(g, self.owner(g, k)) for g in order]

    def team_key(self, k: int) -> bytes:
        return self.groups[self.reducer_group(k)].group_id

    @property
    def fanin(self) -> int:
        """Groups per subteam (0: flat teams)."""
        return team_fanin(len(self.groups)) if self.subreducers else 0

    def _subreducer(self, k: int, g: int) -> int:
        """The group of group ``g``'s subteam whose owner of shard ``k`` reduces the subteam."""
        subteams = len(self.subreducers) // len(self.reducers)
        return self.subreducers[k * subteams + g // self.fanin]

    def parent(self, k: int, g: int) -> int | None:
        """The group whose owner of shard ``k`` receives group ``g``'s part (None: the top reducer)."""
        top = self.reducer_group(k)
        if g == top:
            return None
        if not self.fanin:
            return top
        sub = self._subreducer(k, g)
        return top if sub == g else sub

    def children(self, k: int, g: int) -> set[int]:
        """The groups whose parts group ``g``'s owner of shard ``k`` receives (empty: it only sends)."""
        return {c for c in range(len(self.groups)) if self.parent(k, c) == g}

    def covered(self, k: int, g: int) -> set[int]:
        """The groups whose members' parts are inside what group ``g``'s owner of shard ``k``
        sends up: its own, and those of the groups below it."""
        out, todo = {g}, [g]
        while todo:
            below = self.children(k, todo.pop())
            todo.extend(below - out)
            out |= below
        return out

    def weight(self, g: int, contributors: list[str]) -> float:
        """Group ``g``'s weight for a part made of ``contributors``: their bounded weights."""
        weights = bounded_weights(self.groups[g].members)
        return sum(weights[p] for p in sorted(set(contributors)) if p in weights)

    def weight_of(self, groups: set[int], contributors: list[str]) -> float:
        """The weight of a part made of ``contributors`` from ``groups`` (a subteam's partial average)."""
        return sum(self.weight(g, contributors) for g in sorted(groups))


@dataclass
class TeamState:
    """One peer's side of team k in one step: on the reducer (and a subreducer) the sum of the
    parts it receives, on every owner the team's outcome (kept for members that fetch it)."""

    plan: StepPlan
    shard_index: int
    numel: int
    codec: codecs.Codec
    reducer: bool  # the team's top reducer: it encodes the team's average
    close_at: float  # on the clock: when the reducer (or subreducer) closes the sum
    ends_at: float  # on the clock: when the round's last fetch is over
    clock: Clock
    parts: dict[int, tuple[float, torch.Tensor, list[str]]] = field(default_factory=dict)  # g -> (W, A, who)
    announced: set[int] = field(default_factory=set)  # groups whose part stream began (one try each)
    expected: set[int] = field(default_factory=set)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
    summed: asyncio.Event = field(default_factory=asyncio.Event)  # reducer: the result exists (or failed)
    payload: bytes = b""
    contributors: list[str] = field(default_factory=list)
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # this owner knows whether it holds the result
    held: bool = False  # this owner holds the team's result (from the reducer, its own sum, or another owner)
    decided: asyncio.Event = field(default_factory=asyncio.Event)  # this owner applies the result or skips it
    applied: bool = False
    bytes_in: int = 0
    bytes_out: int = 0

    def __post_init__(self) -> None:
        self.children = self.plan.children(self.shard_index, self.plan.index)  # whose parts come to us
        self.expected = set(self.children)
        self._senders = len(self.expected)

    def add(self, g: int, weight: float, part: torch.Tensor, contributors: list[str]) -> bool:
        """Keep group ``g``'s part; False if it came after the sum was closed."""
        if self.closed:
            return False
        self.parts[g] = (weight, part, contributors)
        self.expected.discard(g)
        self.progress.set()
        return True

    def give_up(self, g: int) -> None:
        self.expected.discard(g)
        self.progress.set()

    async def wait_for_parts(self, clock: Clock, started: float, quorum: float) -> None:
        """The accumulator's wait (accumulator.wait_for_senders), over groups: all parts, a grace
        of twice the quorum's time (at least MIN_STRAGGLER_GRACE) after a quorum, or close_at."""
        needed = max(1, math.ceil(quorum * self._senders))
        quorum_at: float | None = None
        while self.expected:
            now = clock.monotonic()
            if quorum_at is None and self._senders - len(self.expected) >= needed:
                quorum_at = now
            limit = self.close_at if quorum_at is None else min(
                self.close_at, quorum_at + max(MIN_STRAGGLER_GRACE, 2 * (quorum_at - started)))
            if now >= limit:
                log.info("team %d: group(s) %s missed the team's close and are left out of it",
                         self.shard_index, sorted(self.expected))
                return
            self.progress.clear()
            try:
                async with asyncio.timeout(limit - now):
                    await self.progress.wait()
            except TimeoutError:
                pass

    async def sum_and_encode(self, owner_residual: torch.Tensor, executor: Executor) -> None:
        """Reducer: Σ W_g·A_g / Σ W_g in group order, encoded once with the reducer's feedback
        (the arithmetic in ``executor``; the state changes here, on the event loop)."""
        self.closed = True  # parts that come from now on are late
        parts, self.parts = self.parts, {}

        def compute() -> tuple[bytes, str]:
            terms = [(f"{g:08d}", w, a) for g, (w, a, _) in sorted(parts.items()) if w > 0]
            if not terms:
                return b"", "no part with a positive weight"
            mean = weighted_mean(terms)
            if not bool(torch.isfinite(mean).all()):
                return b"", "the team's average overflowed to non-finite values"
            try:
                return codecs.encode_with_feedback(self.codec, mean, owner_residual)[0], ""
            except codecs.CodecError as err:
                return b"", f"the team's average cannot be encoded: {err}"

        try:
            self.payload, problem = await asyncio.get_running_loop().run_in_executor(executor, compute)
            if problem:
                log.warning("team %d: no average this round: %s", self.shard_index, problem)
            self.contributors = sorted({p for w, _, who in parts.values() if w > 0 for p in who}) if self.payload else []
        finally:
            self.summed.set()

    async def subtotal(self, executor: Executor) -> tuple[torch.Tensor, list[str]] | None:
        """Subreducer: the weighted mean of the subteam's parts in group order (not encoded: it
        goes on to the top reducer as one part, weighed there by its contributors), or None."""
        self.closed = True
        parts, self.parts = self.parts, {}
        terms = [(f"{g:08d}", w, a) for g, (w, a, _) in sorted(parts.items()) if w > 0]
        if not terms:
            return None
        mean = await asyncio.get_running_loop().run_in_executor(executor, weighted_mean, terms)
        return mean, sorted({p for w, _, who in parts.values() if w > 0 for p in who})

    def relay(self, payload: bytes, contributors: list[str]) -> None:
        """Subreducer: the top reducer's answer (empty: none), for the subteam's waiting streams."""
        self.payload, self.contributors = payload, contributors if payload else []
        self.summed.set()

    def answer(self, held: bool, payload: bytes, contributors: list[str]) -> None:
        """Whether this owner holds the team's result now; fetches are answered from here on."""
        self.held = held
        if held:
            self.payload, self.contributors = payload, contributors
        self.answered.set()

    def decide(self, applied: bool, payload: bytes, contributors: list[str]) -> None:
        self.applied = applied
        if applied:
            self.payload, self.contributors = payload, contributors
        self.decided.set()


class TeamBook:
    """The team states of this peer's recent steps, by (reducer group id, shard index)."""

    def __init__(self) -> None:
        self._teams: OrderedDict[tuple[bytes, int], TeamState] = OrderedDict()
        self._changed = asyncio.Event()

    def open(self, teams: list[TeamState]) -> None:
        for team in teams:
            self._teams[(team.plan.team_key(team.shard_index), team.shard_index)] = team
        while len(self._teams) > KEPT_TEAMS:
            self._teams.popitem(last=False)
        self._changed.set()
        self._changed = asyncio.Event()

    async def find(self, key: bytes, shard_index: int, timeout: float) -> TeamState | None:
        try:
            async with asyncio.timeout(timeout):
                while (team := self._teams.get((key, shard_index))) is None:
                    await self._changed.wait()
        except TimeoutError:
            return None
        return team

    async def handle(self, header: averaging_pb2.TeamHeader, requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     executor: Executor, find_timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """Server side of a team stream: a part for the reducer, or a fetch; raises Refused."""
        team = await self.find(header.group_id, header.shard_index, find_timeout)
        if team is None:
            raise Refused(Code.NOT_FOUND, "no such team on this peer")
        plan, k = team.plan, team.shard_index
        if not 0 <= header.from_group < len(plan.groups) or header.numel != team.numel:
            raise Refused(Code.INVALID_ARGUMENT, "the team header does not match this step's plan")
        # Every wait below ends with the round (a stalled or early caller holds nothing longer).
        bound = max(0.0, team.ends_at - team.clock.monotonic()) + 1.0
        if header.fetch:
            if header.sender_peer_id not in {m.peer_id for m in plan.groups[header.from_group].members}:
                raise Refused(Code.INVALID_ARGUMENT, f"{header.sender_peer_id or '?'} is not in group {header.from_group}")
            try:
                async with asyncio.timeout(bound):
                    await team.answered.wait()
            except TimeoutError:
                raise Refused(Code.DEADLINE_EXCEEDED, "the reducer's answer never came to this owner") from None
            if not team.held:  # the caller asks the team's other owners
                raise Refused(Code.NOT_FOUND, "this owner does not hold the team's average")
        else:
            if header.from_group not in team.children:
                raise Refused(Code.INVALID_ARGUMENT, "this peer does not reduce that shard for that group")
            if header.sender_peer_id != plan.owner(header.from_group, k).peer_id:
                raise Refused(Code.INVALID_ARGUMENT, f"{header.sender_peer_id or '?'} does not own shard {k} "
                                                     f"in group {header.from_group}")
            empty = header.payload_bytes == 0 and not header.contributors  # the group has no part this round
            if (header.payload_bytes != 4 * team.numel and not empty) or header.from_group in team.announced:
                raise Refused(Code.INVALID_ARGUMENT, "unexpected size, or that group's part already came")
            covered = plan.covered(k, header.from_group)  # a subreducer's part carries its subteam's
            members = {m.peer_id for g in covered for m in plan.groups[g].members}
            if not set(header.contributors) <= members:
                raise Refused(Code.INVALID_ARGUMENT, "a contributor is not a member of the groups the sender reduces")
            team.announced.add(header.from_group)  # one try per group, whatever happens to this stream
            added = False
            try:
                part = None if empty else await _receive_part(team, header, requests, bound, executor)
                if part is not None:
                    added = team.add(header.from_group, plan.weight_of(covered, list(header.contributors)),
                                     part, list(header.contributors))
            finally:
                if not added:
                    team.give_up(header.from_group)
            try:
                async with asyncio.timeout(bound):
                    await team.summed.wait()
            except TimeoutError:
                raise Refused(Code.DEADLINE_EXCEEDED, "the team's average was never computed") from None
            if not team.payload:
                raise Refused(Code.ABORTED, "no team average for this shard this round")
        yield averaging_pb2.ReduceMessage(result=averaging_pb2.ReduceResult(
            codec=team.codec.id, numel=team.numel, payload_bytes=len(team.payload), contributors=team.contributors))
        for chunk in chunks(team.payload):
            team.bytes_out += len(chunk)
            yield averaging_pb2.ReduceMessage(chunk=chunk)


async def _receive_part(team: TeamState, header: averaging_pb2.TeamHeader,
                        requests: AsyncIterator[averaging_pb2.ReduceMessage], bound: float,
                        executor: Executor) -> torch.Tensor:
    """The float32 partial average that follows a team header, checked (finite), or Refused."""
    payload = bytearray()
    try:
        async with asyncio.timeout(bound):
            async for message in requests:
                if not message.HasField("chunk") or len(payload) + len(message.chunk) > header.payload_bytes:
                    raise Refused(Code.INVALID_ARGUMENT, "unexpected message or more bytes than declared")
                payload += message.chunk
    except TimeoutError:
        raise Refused(Code.DEADLINE_EXCEEDED, "the part did not arrive in time") from None
    if len(payload) != header.payload_bytes:
        raise Refused(Code.INVALID_ARGUMENT, f"{len(payload)} of {header.payload_bytes} declared bytes arrived")
    team.bytes_in += len(payload)

    def decode() -> torch.Tensor:  # a copy in native float32, checked for finite values
        part = torch.from_numpy(np.frombuffer(payload, dtype="<f4").astype(np.float32))
        check_contribution(part)
        return part

    try:
        return await asyncio.get_running_loop().run_in_executor(executor, decode)
    except ContributionRejected as err:
        raise Refused(Code.INVALID_ARGUMENT, str(err)) from None
