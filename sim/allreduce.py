"""A round's all-reduce with the tensors replaced by sizes: who contributes to which shard, who
gets which average back, when, and which shards the group skips.

Everything structural comes from the real protocol: the group (members, ``shard_bounds`` from
protocol/layout.py's ``shard_layout``, ``shard_owners``) is the one the real leader closed; the
bytes of a shard are the real codec's ``encoded_size``; the order of uploads and results and
their stage budgets are protocol/schedule.py's ``upload_order`` / ``result_order`` /
``stage_budget`` / ``result_budget``; the weights are accumulator.py's ``bounded_weights``; the
deadlines are allreduce.py's (owners finalize T = ``reduce_timeout_s`` after they got the group,
a result may take ``RESULT_MARGIN``·T more). The owner's wait for senders follows
``ShardAccumulator.wait_for_senders`` (deadline, or after a quorum twice the time it took, at
least MIN_STRAGGLER_GRACE), re-stated here on times because the accumulator itself holds
tensors (see README "Seams": the reduce transport of item 1 would let the real state machine run).

Skip-on-failure (agreement.py's rule, for the failures the simulator makes: crashes and slow
links): a shard is applied by every member only if its owner computed the average and every
live member received it in time; otherwise every member skips it and keeps its contribution
in its residual. Crash times are known in advance (churn draws each peer's lifetime), so the
whole round's timeline is computed once, when the last member arrives or T after the first.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from lowcomm.protocol.accumulator import MIN_STRAGGLER_GRACE, bounded_weights
from lowcomm.protocol.allreduce import RESULT_MARGIN, shard_slices
from lowcomm.protocol.crossgroup import StepPlan
from lowcomm.protocol.schedule import result_budget, result_order, stage_budget, upload_order

from .links import Link, one_way, transfer_seconds


@dataclass
class MemberResult:
    """What one member's round brought: the shards it applies and what it cost."""

    applied: list[bool]  # per shard: the member applies the average
    contributed: list[bool]  # per shard: its contribution is in the average
    averages: list[dict[str, float]]  # per shard: contributors' normalised weights
    done_at: float
    bytes_sent: int
    bytes_received: int


@dataclass
class Timeline:
    results: dict[str, MemberResult]
    skipped: int  # shards every member skipped
    rpcs: dict[str, Counter]  # per member: calls received by kind (Reduce, ReportShards, Team)


@dataclass
class PeerFacts:
    """What the reduce model needs to know about a member."""

    link: Link
    dies_at: float  # math.inf when it outlives the run


class GroupReduce:
    """One group's all-reduce, shared by its members (found by group id)."""

    def __init__(self, group, shard_bytes: Callable[[int], int], facts: Callable[[str], PeerFacts],
                 quorum: float) -> None:
        self.group = group
        self.shard_bytes = shard_bytes
        self.facts = facts
        self.quorum = quorum
        self.arrivals: dict[str, float] = {}
        self.timeline: Timeline | None = None
        self._decided = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    async def join(self, peer_id: str) -> MemberResult:
        loop = asyncio.get_running_loop()
        self.arrivals[peer_id] = loop.time()
        if self._timer is None:  # a member that never arrives is given up on at the owners' deadline
            self._timer = loop.call_later(self.group.reduce_timeout_s, self._decide)
        if all(m.peer_id in self.arrivals or self.facts(m.peer_id).dies_at <= loop.time()
               for m in self.group.members):
            self._decide()
        await self._decided.wait()
        result = self.timeline.results.get(peer_id)
        if result is None:  # arrived after the owners' deadline: every owner refuses it, it applies nothing
            shards = len(self.group.shard_owners)
            return MemberResult([False] * shards, [False] * shards, [{} for _ in range(shards)], loop.time(), 0, 0)
        await asyncio.sleep(max(0.0, result.done_at - loop.time()))
        return result

    def _decide(self) -> None:
        if self.timeline is None:
            self.timeline = self._compute()
            self._timer.cancel()
            self._decided.set()

    def _compute(self) -> Timeline:
        group, T = self.group, self.group.reduce_timeout_s
        members = [m.peer_id for m in group.members]
        arrived = {p: self.arrivals[p] for p in members if p in self.arrivals}
        facts = {p: self.facts(p) for p in members}
        slices = shard_slices(group)
        owners = [members[i] for i in group.shard_owners]
        nbytes = [self.shard_bytes(s.stop - s.start) for s in slices]
        weights = bounded_weights(group.members)
        plan = StepPlan.of(group)
        sent = dict.fromkeys(members, 0)
        received = dict.fromkeys(members, 0)
        rpcs: dict[str, Counter] = {p: Counter() for p in members}

        # Uploads: member p's part of shard j reaches owner j at upload[j][p] (None: never).
        upload: list[dict[str, float]] = [{} for _ in slices]
        for p, start in arrived.items():
            order = upload_order(group, p)
            budget = stage_budget(group, len(order))
            t = start
            for j in order:
                finish = t + transfer_seconds(facts[p].link, facts[owners[j]].link, nbytes[j])
                if finish <= facts[p].dies_at and owners[j] in arrived:
                    upload[j][p] = finish
                    sent[p] += nbytes[j]
                    rpcs[owners[j]]["Reduce"] += 1
                t = min(finish, t + budget)  # the next stage starts when this one is done or its budget is spent
            for j, owner in enumerate(owners):
                if owner == p:
                    upload[j][p] = start

        applied_by_all = [True] * len(slices)
        contributors: list[set[str]] = []
        result_at: list[dict[str, float]] = [{} for _ in slices]
        for j, owner in enumerate(owners):
            if owner not in arrived:
                applied_by_all[j] = False
                contributors.append(set())
                continue
            opened, deadline = arrived[owner], arrived[owner] + T
            senders = len(members) - 1
            times = sorted(t for p, t in upload[j].items() if p != owner)
            needed = max(1, math.ceil(self.quorum * senders))
            limit = deadline
            if len(times) >= needed:
                quorum_at = max(opened, times[needed - 1])
                limit = min(deadline, quorum_at + max(MIN_STRAGGLER_GRACE, 2 * (quorum_at - opened)))
            counted = {p for p, t in upload[j].items() if t <= limit}
            # The owner finalizes as soon as every sender is in (or gone), else at its limit.
            waiting_for = [p for p in members if p not in counted and facts[p].dies_at > limit]
            finalized = limit if waiting_for else max(upload[j][p] for p in counted)
            contributors.append(counted)
            if plan is not None:  # a split step: the team of shard j reduces the groups' partial averages
                finalized += self._team_stage(plan, j, owner, slices[j].stop - slices[j].start, nbytes[j],
                                              facts, sent, received, rpcs)
            if facts[owner].dies_at <= finalized:
                applied_by_all[j] = False
                continue
            for p in counted - {owner}:
                received[owner] += nbytes[j]
            order = result_order(group, owner)
            budget = result_budget(group, len(order))
            t = finalized
            for p in order:
                if p not in arrived:
                    continue
                finish = t + transfer_seconds(facts[owner].link, facts[p].link, nbytes[j])
                if finish <= facts[owner].dies_at and finish <= arrived[p] + T * (1 + RESULT_MARGIN):
                    result_at[j][p] = finish
                    sent[owner] += nbytes[j]
                    received[p] += nbytes[j]
                t = min(finish, t + budget)
            result_at[j][owner] = finalized
            # A live member that lacks the average asks everybody to skip the shard (agreement.py).
            if any(p not in result_at[j] and facts[p].dies_at > arrived[p] + T * (1 + RESULT_MARGIN)
                   for p in arrived):
                applied_by_all[j] = False

        results: dict[str, MemberResult] = {}
        for p, start in arrived.items():
            got = [t for j in range(len(slices)) for q, t in result_at[j].items() if q == p]
            reduce_done = max([start, *got])
            # The shard report exchange: one round trip with the slowest other member.
            report = max((2 * one_way(facts[p].link, facts[q].link) for q in arrived if q != p), default=0.0)
            for q in arrived:
                if q != p:
                    rpcs[q]["ReportShards"] += 1
            averages = []
            for j in range(len(slices)):
                total = sum(weights[q] for q in contributors[j]) or 1.0
                averages.append({q: weights[q] / total for q in sorted(contributors[j])})
            results[p] = MemberResult(
                applied=list(applied_by_all), contributed=[p in contributors[j] for j in range(len(slices))],
                averages=averages, done_at=reduce_done + report, bytes_sent=sent[p], bytes_received=received[p])
        return Timeline(results, sum(not a for a in applied_by_all), rpcs)

    def _team_stage(self, plan: StepPlan, k: int, owner: str, numel: int, encoded: int, facts: dict[str, PeerFacts],
                    sent: dict[str, int], received: dict[str, int], rpcs: dict[str, Counter]) -> float:
        """Stage 2 of a split step (protocol/crossgroup.py) for shard k, seen from this group's
        owner: its partial average goes up the team's tree in float32 (4 bytes per value: to its
        subreducer, whose partial average goes to the reducer; in a flat team straight to the
        reducer) and the encoded result comes back down. A reducer's downlink carries its
        children's parts and its uplink their answers; the slowest subreducer's level and then the
        reducer's bound the stage: returns its seconds. Failures of other groups' owners are not
        modelled (their groups are simulated on their own), nor the fetches an owner without the
        reducer's answer makes (team.py)."""
        def level(g: int) -> float:  # the reduce at group g's owner of k: its children's parts in, answers out
            children = len(plan.children(k, g))
            link = self.facts(plan.owner(g, k).peer_id).link
            return 2 * link.latency + children * (4 * numel / link.down + encoded / link.up) if children else 0.0

        top = plan.reducer_group(k)
        seconds = level(top) + max((level(g) for g in plan.children(k, top) if plan.children(k, g)), default=0.0)
        children = len(plan.children(k, plan.index))
        received[owner] += children * 4 * numel
        sent[owner] += children * encoded
        rpcs[owner]["Team"] += children
        if plan.parent(k, plan.index) is not None:
            sent[owner] += 4 * numel
            received[owner] += encoded
        return seconds
