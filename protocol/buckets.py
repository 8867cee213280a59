"""Two-level matchmaking of a large step: buckets, then the step coordinator (issue 15 item 4).

With one leader per (step, params hash), that leader receives the JoinGroup of the whole swarm.
When the peers a peer expects at step r number n ≥ 4·group_size (``MIN_BUCKETS``; issue 15
proposed 2·group_size, see ``bucket_count``), it matchmakes in two levels:

1. **Buckets.** B = the power of two nearest √n, at least 4 and at most n / group_size (a power of
   two, so peers whose views differ a little still agree on B; ``bucket_count``); a peer's bucket
   is sha256(r, peer id) mod B, re-mixed every step. It registers under ``<round key>/b<B>.<b>``
   and the election of election.py runs there: the lowest registrant leads the bucket, about n/B
   peers call it. B comes from the size of the split step's plan the peer was in at the step
   before (``next_bucket_count``: all its members agree), else from that size as the plan's
   members publish it in their peer records (``RoundPeers.plan_of_state``: a joiner or a peer
   that missed the step agrees with them too), else from the round-start view
   (``RoundPeers.expected``); what a leader waits for is the bucket's part of the peers expected
   in the heartbeat's latest view (``RoundPeers.latest``): no read of the peers table while it
   waits, and a peer that reached the step since is waited for too. It closes when they are all
   in, after a quorum and the straggler wait, at ``BUCKET_SHARE`` of the timeout, or
   ``TOP_RESERVE`` of the timeout before its first member gives up. A member that comes after
   its bucket closed finds the leader at the top level (election.py ``AT_TOP``) and goes up
   alone at once, covering nobody else.
2. **The top level.** A bucket leader whose bucket closed registers under the step's round key
   (the key of a small step, so a peer whose view gave B = 1 meets it there) and runs the same
   election with its bucket's members attached (``JoinRequest.bucket_members``, one call): the
   lowest registrant is the step coordinator. A peer whose view gave B = 1 that is the lowest
   there takes the B that the bucket leaders registered and coordinates as one of them would
   (``BucketLevel._adopt_buckets``). It expects the whole round-start view, and a
   bucket that reported covers its members that did not come. Closing, it splits everybody into
   groups with one step plan (layout.py: so all groups of the step end with one θ,
   crossgroup.py) and answers each bucket leader with the leader's group; the bucket leader
   rebuilds its members' groups from that group's plan (``layout.groups_of_step``) and answers
   them, before any of them gives up.

A coordinator therefore receives about n/B + B − 1 JoinGroup calls (its bucket's and the other
buckets' leaders': about 2·√n) and a bucket leader about n/B. A peer whose view gave another B
lands in a bucket of its own: nobody else comes there, and once the top level has registrants
whose views gave another B (bucket leaders register their B there) it goes up alone after the
lonely-leader grace, without claiming its bucket closed, and still reaches the coordinator through
the round key. If the top level does not answer in time, the bucket's members are refused (their
round fails before their deadline, their Δ waits for the next round) rather than closing a second
plan for the step. The peer that makes the plan announces it in its top registration
(``"planned"``): a bucket that comes late but whose leader has a lower id than the coordinator
would otherwise lead the top level anew and plan the step twice (two params hashes); whoever is
about to plan reads the top key once more first, and a bucket still open that sees the
announcement gives up at once (PlanClosed).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Collection

from ._pb.lowcomm.v1 import averaging_pb2
from .election import (
    PLAN_CLOSED, REPLY_MARGIN, ExpectedPeers, MatchmakingError, PlanClosed, _Round, raise_if_planned, round_key,
)
from .layout import groups_of_step

if TYPE_CHECKING:
    from .matchmaking import Matchmaker

log = logging.getLogger("lowcomm.protocol.matchmaking")

BUCKET_SHARE = 0.75  # a bucket closes at the latest this far into the matchmaking timeout (the rest: TOP_RESERVE)
TOP_SLACK = 0.1  # share of the timeout for a top registration's staleness, the way up and the coordinator's margin
TOP_RESERVE = 0.25  # share of the timeout a bucket keeps before its members give up: the top level and the answers


MIN_BUCKETS = 4  # fewer buckets save the coordinator little and cost a second level (small swarms stay single-level)


def bucket_count(expected: int, group_size: int) -> int:
    """B for ``expected`` peers at a step: 1 below MIN_BUCKETS groups' worth of peers, else the
    power of two nearest √n (2^⌊(⌊log₂ n⌋ + 1) / 2⌋), but no more than 2^⌊log₂(n / group_size)⌋,
    so that a bucket holds at least about a group. A power of two, so that slightly different
    views agree.

    Why about √n: the step coordinator is also a bucket leader, so it receives about n/B calls from
    its bucket and B − 1 from the other buckets' leaders, fewest at B = √n (2·√n in all). With
    B = n/group_size alone, as before, that was group_size + n/group_size: 271 calls at n = 4,096
    in groups of 16 against 127 (174 and 131 measured in the simulator, sim/README.md). Why no
    bucket smaller than a group: it saves the coordinator nothing once n < group_size² (its load
    is about 2·group_size either way) and adds registrants at the top level; on 32 real processes
    in groups of 8, B = 8 (buckets of 4) failed 4 rounds and sent 2 peers to download where B = 4
    failed none. Never B = 2 or 3: with B = 2 the coordinator would receive one bucket call
    instead of about two groups' JoinGroup calls, and six real nodes in groups of three (B = 2)
    showed that views which disagree on B near that threshold can close two plans of one step;
    the single level has neither cost."""
    if group_size < 1 or expected < MIN_BUCKETS * group_size:
        return 1
    by_groups = 2 ** ((expected // group_size).bit_length() - 1)  # 2^⌊log₂(n / group_size)⌋, ≥ MIN_BUCKETS here
    near_root = 2 ** (expected.bit_length() // 2)  # bit_length = ⌊log₂ n⌋ + 1, exact for ints
    return max(MIN_BUCKETS, min(by_groups, near_root))


def next_bucket_count(step: int, expected: int, group_size: int, last_plan: tuple[int, int] | None,
                      plan_of_state: int = 0) -> int:
    """B for our round of ``step``: from the size of the split step's plan that made our state
    at ``step``, when there was one, else from the ``expected`` peers of our round-start view.
    The plan's size is ours when we were in it (``last_plan`` = (its step, its peers), the plan
    of ``step − 1``), else what the peers at our step and hash publish (``plan_of_state``,
    node/decisions.py ``plan_of_state``: a joiner or a peer that missed the step reads it).

    Views differ by a few peers (churn, records not yet propagated), and with about
    2^k · group_size peers, where B doubles, they disagree on B: half the swarm then matchmakes
    in B buckets and half in 2B, the coordinator's plan leaves out those of the other B, and
    their buckets reach it after it closed (in the simulator at N = 256 in groups of 16, seed 0,
    88 and 112 failed rounds at two steps). Every member of one plan counts the same peers, so
    they all agree, and a peer outside it agrees with them through their records; only when
    nobody at our state came from a split plan (a small step before, a swarm that just grew)
    does the view decide, and a peer whose B differs still reaches the coordinator alone."""
    if last_plan is not None and last_plan[0] == step - 1:
        expected = last_plan[1]
    elif plan_of_state > 0:
        expected = plan_of_state
    return bucket_count(expected, group_size)


def bucketed_by_plan(step: int, last_plan: tuple[int, int] | None, group_size: int) -> bool:
    """Whether our round of ``step`` matchmakes in buckets whatever the peer table says: we were
    in the split plan of ``step − 1`` (``last_plan``) and its size gives B > 1 (``next_bucket_count``
    takes B from it). Such a round needs no view to start: a member only calls its bucket's
    leader, and whoever finds itself leading reads the table at its first look
    (``RoundPeers.read_first``)."""
    return last_plan is not None and last_plan[0] == step - 1 and bucket_count(last_plan[1], group_size) > 1


def bucket_label(step: int, peer_id: str, buckets: int) -> str:
    """``b<B>.<b>``: the bucket of ``peer_id`` at ``step`` among ``buckets`` (JoinRequest.bucket)."""
    index = int.from_bytes(hashlib.sha256(f"{step}/{peer_id}".encode()).digest()[:8], "big") % buckets
    return f"b{buckets}.{index}"


def bucket_key(run: str, step: int, params_hash: str, label: str) -> str:
    return f"{round_key(run, step, params_hash)}/{label}"


@dataclass(frozen=True)
class RoundPeers:
    """What a step's matchmaking knows of the swarm without reading the peers table again:
    ``expected``, the peers expected at the step in the view read at round start (this peer
    included; it sets B unless ``plan_of_state`` or our own last plan does), and ``latest()``,
    the peers expected at the step in the heartbeat's latest view (no DHT call): those still
    coming, a peer that reached the step since included, a peer that died or moved on left out.

    ``read_first``: the round started from an older view (a member of the last step's split
    plan, ``bucketed_by_plan``: it knows B and its bucket without one). Such a view shows nobody
    at the new step, so the first look of a leader awaits ``read_first()`` (a fresh read of the
    table, which ``latest()`` then sees) before it answers. Most members never lead and so read
    no table at all at the round start (issue 15: that read was N records per peer and round)."""

    expected: frozenset[str]
    latest: Callable[[], Collection[str]]
    plan_of_state: int = 0  # peers in the split plan that made our state, as its members publish it (0: none)
    read_first: Callable[[], Awaitable[object]] | None = None
    watch: Callable[[], None] | None = None  # asks the heartbeat to read the table at its next beat
    _first_read: dict = field(default_factory=dict, compare=False, repr=False)  # "done" once read_first() returned

    def now(self, me: str) -> set[str]:
        return {*self.latest(), me}

    async def look(self, me: str, whole_step: bool = False) -> set[str]:
        """``now``, after the first read when the round started without one. Levels of a round
        look one after the other (the step coordinator is a bucket leader that went up), so
        one read serves them all; a read that failed or was cancelled is tried again.

        ``whole_step``: the top level looks (a step coordinator, or a bucket leader about to
        find it). Its wait spans every bucket, so each of its looks asks for a view at most a
        beat old (``watch``). A bucket leader's looks do not: its view is fresh from the round
        start or its first look (``read_first``), it waits at most BUCKET_SHARE of the timeout,
        and a member that dies meanwhile costs it the straggler wait, not the round. Those
        fresh views at every beat were ~230 records per peer and round at N=1,024 in groups of
        16, more than a third of what a peer read once the periodic reads were bounded
        (python -m sim.heartbeat)."""
        if self.read_first is not None and not self._first_read.get("done"):
            try:
                await self.read_first()
            except Exception as err:  # a DHT failure fails the round, as the round start's read would
                raise MatchmakingError(f"could not read the peer table to lead: {err!r}") from err
            self._first_read["done"] = True
        if whole_step and self.watch is not None:
            self.watch()  # after the first read: the next beat's view is newer than it
        return self.now(me)


class TopWatch:
    """What a bucket leader reads from the step's top key while its bucket is open (one read of
    about B registrations per poll): by when its bucket must be there, and whether its view's B
    differs from the others'. A top registrant says until when it waits there (``answer_at``, on
    the wall clock: the DHT's own expirations assume peers' wall clocks agree, and a skewed
    clock only makes a bucket close too early or miss the plan, never splits the plan); we go
    up TOP_SLACK of the timeout before the earliest of them, for staleness and the way up."""

    def __init__(self, matchmaker: "Matchmaker", key: str, buckets: int, timeout: float) -> None:
        self.matchmaker, self.key, self.buckets = matchmaker, key, buckets
        self.slack = max(2 * REPLY_MARGIN, TOP_SLACK * timeout)

    async def look(self) -> tuple[float | None, bool, str]:
        """(by when to go up, whether another B shows there, who announced the plan as made)."""
        m = self.matchmaker
        top = {pid: info for pid, info in (await m.dht.get(self.key)).items() if pid != m.peer_id and isinstance(info, dict)}
        ends = [float(at) for info in top.values() if isinstance(at := info.get("answer_at"), (int, float)) and math.isfinite(at)]
        by = m.clock.monotonic() + (min(ends) - m.wall_clock()) - self.slack if ends else None
        # Only a plan of our own B makes a bucket that is still open give up; at the top level any
        # plan counts (election.planned_by). Measured, not derived: giving up here on a plan of any
        # B cost the simulator at N = 1,024 in groups of 64 most of its peers (0.10 averaged
        # instead of 0.26; a coordinator whose view gave another B counts our bucket as covered
        # under its own labels, so its plan closes without us early).
        planned = next((pid for pid, info in sorted(top.items())
                        if info.get("planned") and info.get("buckets") == self.buckets), "")
        return by, any(info.get("buckets", 1) != self.buckets for info in top.values()), planned


class BucketLevel:
    """The Matchmaker's two-level path (mixed into Matchmaker; it uses election.py's methods)."""

    @staticmethod
    def _joined(current: _Round) -> set[str]:
        """Who is in if the leader closed now: its followers and the buckets they (and it) bring."""
        joined = set(current.followers)
        joined.update(m.member.peer_id for m in current.carried)
        for follower in current.followers.values():
            joined.update(m.member.peer_id for m in follower.request.bucket_members)
        return joined

    @staticmethod
    def _adopt_buckets(current: _Round, registrants: dict[str, dict]) -> None:
        """On a small step's key (our view gave B = 1), bucket leaders whose views gave B > 1
        registered their B: their step is bucketed, and whoever leads here coordinates it. So
        we take their B (the largest shown) and from now on act as its top level: wait for
        every bucket instead of closing at a quorum (a bucket that comes after the close fails
        its round and, a step behind, downloads the state), count the peers of a reported
        bucket as covered, announce the plan we make and give up on one announced before us
        (``one_plan``). Without this, a leader whose view counted one peer fewer than the others'
        closed at its quorum before the buckets came up, and on eight real nodes in groups of
        two a late bucket then planned the step a second time (two params hashes)."""
        shown = [info.get("buckets") for info in registrants.values() if isinstance(info, dict)]
        buckets = max((b for b in shown if isinstance(b, int) and not isinstance(b, bool) and b > 1), default=0)
        if buckets:
            current.buckets, current.one_plan = buckets, True

    @staticmethod
    def _label(current: _Round, expected: set[str]) -> None:
        """Label the expected peers with their buckets at a bucketed step's top level, whether
        this peer led a bucket there or took B from the bucket leaders (``_adopt_buckets``):
        what a reported bucket covers (``_waiting_for``). The bucket level labels its own peers."""
        if current.buckets > 1 and not current.bucket:
            for peer in expected:
                if peer not in current.labels:
                    current.labels[peer] = bucket_label(current.step, peer, current.buckets)

    @staticmethod
    def _waiting_for(current: _Round, expected: set[str]) -> set[str]:
        """The expected peers still to be waited for: those whose bucket has not reported yet
        (a bucket leader brings everybody of its bucket who came; the others will not come)."""
        reported = {f.request.closed_bucket for f in current.followers.values() if f.request.closed_bucket}
        if current.own_bucket:
            reported.add(current.own_bucket)
        if not reported:
            return expected
        return {p for p in expected if current.labels.get(p) not in reported}

    async def _form_bucketed(self: "Matchmaker", current: _Round, me: averaging_pb2.Member,
                             request: averaging_pb2.JoinRequest, registration: dict, ttl: float,
                             peers: RoundPeers, buckets: int, deadline: float, timeout: float) -> averaging_pb2.Group:
        step, margin = current.step, min(REPLY_MARGIN, timeout / 10)
        labels = {p: bucket_label(step, p, buckets) for p in peers.expected | {self.peer_id}}

        def label(peer: str) -> str:  # a peer that reached the step after our round started is labelled once
            if (known := labels.get(peer)) is None:
                known = labels[peer] = bucket_label(step, peer, buckets)
            return known

        current.bucket = request.bucket = labels[self.peer_id]
        current.key = bucket_key(self.run, step, current.params_hash, current.bucket)
        current.reserve = TOP_RESERVE * timeout
        current.one_plan = True
        current.buckets = buckets
        top_key = round_key(self.run, step, current.params_hash)

        unreachable: set[str] = set()  # a registrant of our bucket we could not reach is not waited for

        async def bucket_peers() -> set[str]:
            return {p for p in await peers.look(self.peer_id) if label(p) == current.bucket} - unreachable

        async def all_peers() -> set[str]:  # the top level labels them (``_label``, in election._gather)
            return await peers.look(self.peer_id, whole_step=True)

        async def to_top(bucket: _Round) -> averaging_pb2.Group:
            return await self._through_top(bucket, me, request, registration, ttl, all_peers, labels,
                                           deadline - margin, deadline)

        current.watch = TopWatch(self, top_key, buckets, timeout)
        await self.dht.store(current.key, self.peer_id, registration, ttl=ttl)
        close_by = min(self.clock.monotonic() + BUCKET_SHARE * timeout, deadline - margin)
        return await self._elect(current, request, bucket_peers, close_by, deadline, unreachable, to_top)

    async def _through_top(self: "Matchmaker", bucket: _Round, me: averaging_pb2.Member,
                           request: averaging_pb2.JoinRequest, registration: dict, ttl: float,
                           all_peers: ExpectedPeers, labels: dict[str, str], close_by: float,
                           deadline: float) -> averaging_pb2.Group:
        """Our bucket closed with us as its leader: bring it to the step coordinator (or be it),
        then answer the bucket's members with their groups of the one step plan."""
        bucket.role = "closed"
        buckets = int(bucket.bucket[1:].split(".")[0])  # "b<B>.<b>"
        waiting = {p: f for p, f in bucket.followers.items() if not f.reply.done()}
        carried = [averaging_pb2.BucketMember(member=self._member(f.request, p), bandwidth_bps=f.request.bandwidth_bps)
                   for p, f in waiting.items()]
        # Everybody of the bucket must have its answer before it gives up.
        answer_by = min([close_by, *(t - REPLY_MARGIN for f in waiting.values() if (t := f.gives_up_at) is not None)])
        top = _Round(bucket.step, bucket.params_hash, bucket.numel, key=round_key(self.run, bucket.step, bucket.params_hash),
                     carried=carried, own_bucket="" if bucket.lonely else bucket.bucket, labels=labels, one_plan=True,
                     buckets=buckets)
        self._open.append(top)
        self._round = top  # JoinGroup calls for the closed bucket are refused from now on
        up = averaging_pb2.JoinRequest()
        up.CopyFrom(request)
        # A bucket that closed alone because our view differs covers nobody else of its label.
        up.bucket, up.closed_bucket = "", "" if bucket.lonely else bucket.bucket
        up.bucket_members.extend(carried)

        top_registration = {**registration, "buckets": buckets}

        async def close(level: _Round) -> averaging_pb2.Group:
            return await self._close_plan(level, me, request.bandwidth_bps, {**top_registration, "answer_at": answer_at},
                                          ttl)

        answer_at = self.wall_clock() + answer_by - self.clock.monotonic()
        stop = asyncio.timeout(max(0.0, min(answer_by + REPLY_MARGIN / 4, deadline) - self.clock.monotonic()))
        group: averaging_pb2.Group | None = None
        try:
            async with stop:
                # Our B and until when we wait here: the buckets still open close before the first
                # of us gives up (TopWatch), so that they reach the plan.
                await self.dht.store(top.key, self.peer_id, {**top_registration, "answer_at": answer_at}, ttl=ttl)
                group = await self._elect(top, up, all_peers, answer_by, answer_by, set(), close)
        except TimeoutError:
            if not stop.expired():
                raise
        except PlanClosed:
            self._answer(waiting, PLAN_CLOSED)  # our members give up too: no second plan for the step
            raise
        finally:
            self._release(top)
        if group is None:
            self._answer(waiting, PLAN_CLOSED)  # their deadline is near: they give up rather than lead alone
            raise MatchmakingError(f"the step coordinator of step {bucket.step} did not answer in time "
                                   f"(this peer led bucket {bucket.bucket} of {len(waiting) + 1})")
        log.info("bucket %s of step %d: %d member(s) in the step's plan of %d group(s)", bucket.bucket, bucket.step,
                 len(waiting) + 1, max(1, len(group.step_groups)),
                 extra={"event": "bucket_closed", "outer_step": bucket.step, "bucket": bucket.bucket,
                        "bucket_members": len(waiting) + 1, "coordinated": self.led_last_group})
        answers = groups_of_step(group)
        for peer, follower in waiting.items():
            if not follower.reply.done():
                follower.reply.set_result(answers.get(peer))  # None: left out (refused, fails its round)
        return group

    async def _close_plan(self: "Matchmaker", level: _Round, me: averaging_pb2.Member, bandwidth_bps: float,
                          registration: dict, ttl: float) -> averaging_pb2.Group:
        """Make the step's plan at its top key, unless somebody there announced it made already.

        A coordinator that closed first may have a higher id than one that comes after it (a
        bucket late by its members' start, not by its leader's id): without the announcement
        the later one would lead and plan the step a second time. So the one that makes the
        plan says so in its registration (``"planned"``, in the background: its members'
        answers do not wait for the DHT), and a peer at the top level or still in a bucket that
        sees it at one of its polls gives up (PlanClosed). No extra read here: the close comes
        REPLY_MARGIN before the first follower gives up, and a DHT read (0.1 s on loopback, more
        on a WAN) would eat that margin (in the simulator it cost 7 % of the peers at N = 16)."""
        raise_if_planned(level)  # from this level's last poll of the key
        group = self._close(level, me, bandwidth_bps)
        self._register_soon(level.key, {**registration, "planned": True}, ttl)
        return group

    @staticmethod
    def _answer(waiting: dict, answer: object) -> None:
        for follower in waiting.values():
            if not follower.reply.done():
                follower.reply.set_result(answer)
