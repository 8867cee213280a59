"""The leader/follower machinery of matchmaking, for one DHT key (a part of the Matchmaker).

Peers register under a key; a registrant that sees no reachable registrant with a lower peer id
leads: it accepts JoinGroup calls and closes when every peer it expects has joined, a quorum
and the straggler wait have passed, or its deadline comes. Everybody else calls JoinGroup on
the lowest registrant (following redirects) and gets its group back when the leader closes. A
leader yields to a lower registrant that shows up late and sends its followers there; a leader
nobody follows joins a higher one after a short grace. The same machinery runs at every level
of matchmaking: the only level of a small step (``<run>/round/<r>/<h>``), the buckets of a
large step and its top level, where bucket leaders meet the step coordinator (buckets.py); a
follower may bring the members of its closed bucket along (``JoinRequest.bucket_members``),
and the leader then counts them in and plans their groups too.

Deadlines: a follower tells the leader how long it still waits (``JoinRequest.wait_s``) and a
leader closes before the first of its followers gives up (``REPLY_MARGIN`` before, plus the
round's ``reserve``: the time a bucket leader keeps for the level above), so that nobody it
counts in has already left.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from ._pb.lowcomm.v1 import averaging_pb2
from .direct import raise_if_incompatible
from .handshake import IncompatiblePeer
from .layout import close_groups, split_into_groups
from .transport import CallFailed, Code, Refused

if TYPE_CHECKING:
    from .buckets import TopWatch
    from .matchmaking import Matchmaker

log = logging.getLogger("lowcomm.protocol.matchmaking")

POLL_SECONDS = 0.25  # how often a waiting peer re-reads the DHT; DHT reads are cheap and local-ish
LONELY_LEADER_GRACE = 1.0  # seconds a leader without followers waits before it joins another leader
REPLY_MARGIN = 0.5  # seconds a leader keeps between closing and a follower's own deadline, for the reply
MIN_FOLLOWER_WAIT = 1.0  # a follower that says it waits less is not waited for (it may leave unanswered)
MAX_DIRECT_HOLD = 30.0  # the longest a leader holds a direct JoinGroup for its round to start
CLOSED = "is already closed"  # in the detail of the refusal of a leader that closed its group
AT_TOP = "this peer is at the top level"  # in the refusal of a bucket's registrant that went up
PLAN_CLOSED = object()  # a bucket leader's answer to its members when the step's plan closed without them

ExpectedPeers = Callable[[], Awaitable[set[str]]]


class GroupDHT(Protocol):
    """The two DHT operations matchmaking needs (the node adapts hivemind's DHT to this)."""

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool: ...
    async def get(self, key: str) -> dict[str, dict]: ...


class MatchmakingError(Exception):
    """No group could be formed for this round."""


class PlanClosed(MatchmakingError):
    """The step's one plan closed without this peer (its bucket came too late): the swarm will
    be at the next step once that plan commits, so this peer's step is about to be behind."""


def planned_by(registrants: dict[str, dict], me: str) -> str:
    """The registrant (not ``me``) of the step's top key whose registration announces the step's
    plan as made: a bucketed step's coordinator (buckets.py ``_close_plan``) or the leader of a
    small step that split it into several groups (matchmaking.py). At the top level any such
    plan counts, whatever B its coordinator's view gave: a bucket leader there has closed its
    bucket and would otherwise plan the step a second time, and so would late peers of a small
    step (in the simulator at 16 peers in groups of 4, two stragglers made a plan of their own).
    (A bucket still open gives up only on a plan of its own B: ``buckets.TopWatch``.)"""
    for pid, info in sorted(registrants.items()):
        if pid != me and isinstance(info, dict) and info.get("planned"):
            return pid
    return ""


def raise_if_planned(current: "_Round") -> None:
    if current.plan_by:
        raise PlanClosed(f"the plan of step {current.step} closed before this peer reached it "
                         f"({current.plan_by} coordinated it)")


def round_key(run: str, step: int, params_hash: str = "") -> str:
    """The top-level key of the round of ``step`` from ``params_hash`` (its buckets: buckets.py)."""
    key = f"{run}/round/{step}"
    return f"{key}/{params_hash[:16]}" if params_hash else key


@dataclass
class _Follower:
    request: averaging_pb2.JoinRequest
    reply: asyncio.Future
    joined_at: float  # on the matchmaker's clock

    @property
    def gives_up_at(self) -> float | None:
        """When this follower stops waiting for the group (the matchmaker's clock), if it said so."""
        wait = self.request.wait_s
        if not math.isfinite(wait) or wait < MIN_FOLLOWER_WAIT:
            return None
        return self.joined_at + wait


@dataclass
class _Round:
    """This peer's matchmaking at one level of one step (what ``handle_join`` serves)."""

    step: int
    params_hash: str = ""
    numel: int = 0
    role: str = "undecided"  # "undecided" | "leader" | "follower" | "closed"
    leader: averaging_pb2.Redirect | None = None
    followers: dict[str, _Follower] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    direct: bool = False  # leading the direct path of a stable group (protocol/direct.py)
    key: str = ""  # the DHT key of this level's registrations
    bucket: str = ""  # "b<B>.<b>" at a bucket level, "" at the top level (JoinRequest.bucket)
    reserve: float = 0.0  # seconds a leader closes before its followers' REPLY_MARGIN (a bucket's level above)
    # At the top level of a bucketed step: our own closed bucket's members (we bring them), its
    # label, and every expected peer's bucket label in our view (a reported bucket covers them).
    carried: list[averaging_pb2.BucketMember] = field(default_factory=list)
    own_bucket: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # At either level of a bucketed step: a peer that refuses because its group closed has
    # made (or is in) the step's plan; coming later must not start a second one (MatchmakingError).
    one_plan: bool = False
    planned: bool = True  # with role "closed": whether the round ended with a group (False: it failed)
    # At a bucket level: what the step's top level shows (buckets.TopWatch): by when the step
    # coordinator must close (our bucket must be there before), and whether our view's B differs
    # from the other buckets' (then, with nobody in our bucket, we close it ``lonely``: without
    # covering anybody else of its label).
    watch: "TopWatch | None" = None
    lonely: bool = False
    # At either level of a bucketed step: B of our view (or, on a small step's key, the B that
    # bucket leaders registered there: buckets.py ``_adopt_buckets``), and a registrant of the
    # top key that announced the step's plan as made (``"planned"``, buckets.py): coming later
    # must not make a second one. 0: a small step's single level.
    buckets: int = 0
    plan_by: str = ""


class Election:
    """The Matchmaker's leader/follower methods (mixed into Matchmaker, which holds the state)."""

    # -- server side: somebody wants to join the group we lead ------------------------------

    async def handle_join(self: "Matchmaker", request: averaging_pb2.JoinRequest,
                          context: object = None) -> averaging_pb2.JoinResponse:
        """Serve a JoinGroup call; raises Refused. ``context`` is not used (the servicer and
        wrappers of this method pass the call's context along)."""
        try:
            self.identity.check(request.hello)
        except IncompatiblePeer as err:
            log.warning("refused JoinGroup from %s: %s", request.hello.peer_id, err)
            raise Refused(Code.FAILED_PRECONDITION, str(err)) from None
        arrived = self.clock.monotonic()
        current = self._round
        if request.direct and (current is None or current.step < request.step):
            # A member of our last group reached its boundary before us: hold its call until our
            # round starts (bounded by what it waits) rather than refuse it and have it poll.
            current = await self._await_round(request.step, arrived, request.wait_s)
        if current is None or current.step != request.step:
            have = "none" if current is None else current.step
            raise Refused(Code.ABORTED, f"not matchmaking for step {request.step} (this peer is at step {have})")
        if request.params_sha256 != current.params_hash:
            raise Refused(Code.ABORTED, f"this peer's parameters at step {request.step} differ from the caller's")
        if request.bucket and request.bucket == current.own_bucket and current.role == "closed" and current.planned:
            # We led the caller's bucket into the step's plan, which is made: it is too late.
            raise Refused(Code.ABORTED, f"the plan of step {request.step} {CLOSED} (this peer led bucket {request.bucket})")
        if request.bucket != current.bucket:
            # A bucket that closed (its leader went to the top level), or another bucket.
            where = AT_TOP if not current.bucket else f"this peer is at {current.bucket}"
            raise Refused(Code.ABORTED, f"not matchmaking at {request.bucket or 'the top level'} of step "
                                        f"{request.step} ({where})")
        if current.role == "follower" and current.leader is not None:
            return averaging_pb2.JoinResponse(redirect=current.leader)
        if request.direct and not current.direct and current.role != "closed" and self.address:
            # We do not lead a direct round: join again the ordinary way, with the whole deadline.
            return averaging_pb2.JoinResponse(redirect=averaging_pb2.Redirect(peer_id=self.peer_id, address=self.address))
        if current.role == "closed" and not current.planned and self.address:
            # Our round failed (or is being given up): no plan was made here; the caller may look on.
            raise Refused(Code.ABORTED, f"this peer's round of step {request.step} ended without a group")
        if current.role == "closed" or not self.address:
            raise Refused(Code.ABORTED, f"the group of step {request.step} {CLOSED}")
        peer = request.hello.peer_id
        if peer in current.followers or peer == self.peer_id:
            raise Refused(Code.ALREADY_EXISTS, f"peer {peer} already joined")
        current.role = "leader"
        follower = _Follower(request, asyncio.get_running_loop().create_future(), joined_at=arrived)
        current.followers[peer] = follower
        current.changed.set()
        try:
            group = await follower.reply
        finally:
            if not follower.reply.done():  # the caller went away before the group closed
                current.followers.pop(peer, None)
                current.changed.set()
        if group is None:
            raise Refused(Code.ABORTED, "group closed without this peer (full or abandoned)")
        if group is PLAN_CLOSED:
            raise Refused(Code.ABORTED, f"the plan of step {request.step} {CLOSED} (it closed before this bucket came)")
        if isinstance(group, averaging_pb2.Redirect):  # we yielded to a lower leader: go there
            return averaging_pb2.JoinResponse(redirect=group)
        return averaging_pb2.JoinResponse(group=group)

    async def _await_round(self: "Matchmaker", step: int, arrived: float, wait_s: float) -> _Round | None:
        """Our round once it reaches ``step``, or whatever it is when the caller's wait ends."""
        hold = min(max(0.0, wait_s - REPLY_MARGIN), MAX_DIRECT_HOLD) if math.isfinite(wait_s) else 0.0
        try:
            async with asyncio.timeout(max(0.0, arrived + hold - self.clock.monotonic())):
                while (current := self._round) is None or current.step < step:
                    await self._round_started.wait()
        except TimeoutError:
            pass
        return self._round

    # -- client side: find or lead the group of one level -----------------------------------

    async def _elect(self: "Matchmaker", current: _Round, request: averaging_pb2.JoinRequest,
                     expected_peers: ExpectedPeers, close_by: float, follow_by: float, unreachable: set[str],
                     finish: Callable[[_Round], Awaitable[averaging_pb2.Group]]) -> averaging_pb2.Group:
        """Lead (until ``close_by``, then ``finish``) or follow (waiting until ``follow_by``) at
        ``current.key`` until a group comes; the caller bounds it with its deadline."""
        yielded = False  # set when our lead just yielded: follow somebody else once before leading again
        while True:
            if current.role == "leader":
                if await self._gather(current, expected_peers, close_by, unreachable):
                    return await finish(current)
                yielded = True
            registrants = await self._reachable_registrants(current, unreachable)
            raise_if_planned(current)
            lowest = next(iter(registrants), None)
            if self.address and not yielded and (lowest is None or lowest > self.peer_id):
                current.role = "leader"
                continue
            yielded = False
            if lowest is None:  # client mode and no reachable registrant yet
                await self._wait(current, POLL_SECONDS)
                continue
            target = averaging_pb2.Redirect(peer_id=lowest, address=registrants[lowest])
            group = await self._follow(current, request, target, follow_by)
            if group is not None:
                return group
            if current.role == "leader":  # somebody joined us while we were trying
                continue
            unreachable.add(lowest)
            current.role = "undecided"
            await self._wait(current, POLL_SECONDS)

    async def _reachable_registrants(self: "Matchmaker", current: _Round, unreachable: set[str]) -> dict[str, str]:
        """Other registrants of this level that could lead (have an address), lowest id first."""
        registrants = await self.dht.get(current.key)
        if current.buckets == 0 and not current.direct:
            self._adopt_buckets(current, registrants)
        # A split step has one plan: who comes after it was announced gives up (PlanClosed)
        # rather than plan the step again with the other late peers (two params hashes).
        current.plan_by = current.plan_by or planned_by(registrants, self.peer_id)
        found = {
            pid: str(info["address"]) for pid, info in registrants.items()
            if isinstance(info, dict) and info.get("address") and pid not in unreachable and pid != self.peer_id
        }
        return dict(sorted(found.items()))

    async def _wait(self, current: _Round, seconds: float) -> None:
        current.changed.clear()
        try:  # not wait_for: on Python 3.11 it can swallow a cancel that comes with the event
            async with asyncio.timeout(seconds):
                await current.changed.wait()
        except TimeoutError:
            pass

    async def _follow(self: "Matchmaker", current: _Round, request: averaging_pb2.JoinRequest,
                      target: averaging_pb2.Redirect, deadline: float) -> averaging_pb2.Group | None:
        for _hop in range(4):  # a redirect chain longer than this means the view is in flux
            if target.peer_id == self.peer_id:
                # The peer we asked follows us (it yielded to us): lead instead of giving up on it.
                current.role = "leader"
                return None
            current.role, current.leader = "follower", target
            self._redirect_followers(current, target)
            # We wait no longer than our own deadline, and say so: the leader closes before it.
            remaining = max(0.0, deadline - self.clock.monotonic())
            request.wait_s = remaining
            try:
                response = await self.transport.join(target.address, request, max(0.01, remaining))
            except CallFailed as err:
                raise_if_incompatible(err, target, self.peer_id)
                log.debug("JoinGroup to %s failed: %s %s", target.peer_id, err.code.name, err.detail)
                if current.one_plan and err.code == Code.ABORTED and CLOSED in err.detail:
                    raise PlanClosed(f"the plan of step {current.step} closed before this peer's bucket "
                                           f"reached it ({target.peer_id} coordinated it)") from None
                if current.bucket and err.code == Code.ABORTED and AT_TOP in err.detail:
                    # Our bucket closed before we came (its leader waited for the quorum and the
                    # stragglers, not for the step's plan) and went up: go up alone at once, while
                    # the plan may still be open, instead of polling a bucket that is gone until
                    # after the lonely-leader grace (in the simulator at 31 peers in groups of 8,
                    # such stragglers were 0.3 s late to their bucket and 2 s early to the plan,
                    # and still failed their round).
                    current.lonely, current.role = True, "leader"
                return None
            if response.HasField("group"):
                return response.group
            target = response.redirect
        return None

    async def _lead(self: "Matchmaker", current: _Round, me: averaging_pb2.Member, my_bandwidth: float,
                    expected_peers: ExpectedPeers, deadline: float, unreachable: set[str],
                    fixed_expected: set[str] | None = None) -> averaging_pb2.Group | None:
        """Gather and close (the group of this peer), or ``None`` when it should follow instead."""
        if await self._gather(current, expected_peers, deadline, unreachable, fixed_expected):
            return self._close(current, me, my_bandwidth)
        return None

    async def _gather(self: "Matchmaker", current: _Round, expected_peers: ExpectedPeers, deadline: float,
                      unreachable: set[str], fixed_expected: set[str] | None = None) -> bool:
        """Wait for followers; True: close now, False: this peer should follow instead.

        With ``fixed_expected`` (the direct path) the expected peers are known and the DHT is not
        read: the leader wakes on every join, and False means nobody joined by ``deadline``."""
        if current.lonely:
            return True  # a bucket that closed without us: we go up alone (_follow)
        lonely_since = self.clock.monotonic()
        quorum_at: float | None = None
        covered_at: float | None = None  # the top level: when every bucket had reported
        while True:
            joined = {self.peer_id} | self._joined(current)
            expected = fixed_expected if fixed_expected is not None else await expected_peers()
            self._label(current, expected)
            now = self.clock.monotonic()
            if expected and self._waiting_for(current, expected) <= joined:
                # At the top level, a bucket that closed on its quorum reported without its
                # stragglers; one that comes now goes up alone (AT_TOP, _follow). Give them the
                # straggler wait once more before the plan closes: a straggler that misses the
                # plan fails its round and, a step behind, downloads the whole state.
                missing = expected - joined if current.labels else set()
                if missing and covered_at is None:
                    covered_at = now
                if not missing or now - covered_at >= self.straggler_wait():
                    if missing:
                        log.info("closing the plan of step %d without %d straggler(s) that their buckets did not "
                                 "bring (waited %.1fs for them)", current.step, len(missing), now - covered_at)
                    if quorum_at is not None:
                        self.straggle_history.append(now - quorum_at)
                    return True
            close_at = self._close_at(current, deadline)
            if now >= close_at:
                if fixed_expected is not None:
                    # The direct path ends without everybody expected: rather than close a part of
                    # the group (its late members would lose the step's plan), lead on the DHT way
                    # with the whole deadline; those who came directly join us again there.
                    if current.followers:
                        self._redirect_followers(current, averaging_pb2.Redirect(peer_id=self.peer_id,
                                                                                 address=self.address))
                    else:
                        current.role = "undecided"
                    return False
                return True
            # The top level of a bucketed step waits for every bucket (each closes within its own
            # share of the timeout): a bucket that comes after the plan closed loses its round.
            if quorum_at is None and not current.labels and len(joined) >= max(2, math.ceil(self.quorum * len(expected))):
                quorum_at = now
            if quorum_at is not None and not current.labels and now - quorum_at >= self.straggler_wait():
                # Not recorded in the history: only complete arrivals measure how long stragglers take.
                log.info("closing the group of step %d with %d of %d expected peers (stragglers waited %.1fs)",
                         current.step, len(joined), len(expected), now - quorum_at)
                return True
            if fixed_expected is not None:
                # No await since `joined` was read, so no join is missed: sleep until a join, the
                # close or the end of the straggler wait.
                due = close_at if quorum_at is None else min(close_at, quorum_at + self.straggler_wait())
                await self._wait(current, max(0.0, due - now))
                continue
            # The lowest registrant leads: a leader yields to a lower registrant that showed up
            # late and sends its followers there, and a leader nobody follows joins a higher one
            # after a short grace (in case that one cannot reach us), so that two leaders never
            # wait for each other until the deadline.
            others = await self._reachable_registrants(current, unreachable)
            raise_if_planned(current)
            lower = [p for p in others if p < self.peer_id]
            if current.followers:
                lonely_since = self.clock.monotonic()
            lonely = not current.followers and self.clock.monotonic() - lonely_since > LONELY_LEADER_GRACE
            if lower or (lonely and others):
                if lower:
                    self._redirect_followers(current, averaging_pb2.Redirect(peer_id=lower[0], address=others[lower[0]]))
                current.role = "undecided"
                return False
            if current.watch is not None:
                top_by, differs, current.plan_by = await current.watch.look()
                raise_if_planned(current)
                if lonely and differs:
                    current.lonely = True
                    return True
                if top_by is not None and self.clock.monotonic() >= top_by:
                    return True  # the coordinator closes soon: bring what we have (perhaps only us)
                if top_by is not None:
                    close_at = min(close_at, top_by)
            await self._wait(current, min(POLL_SECONDS, max(0.0, close_at - self.clock.monotonic())))

    def _close(self: "Matchmaker", current: _Round, me: averaging_pb2.Member,
               my_bandwidth: float) -> averaging_pb2.Group:
        """Close the level: plan the groups of everybody in, answer the followers, return ours."""
        current.role = "closed"
        members, bandwidth = [me], {self.peer_id: my_bandwidth}

        def add(member: averaging_pb2.Member, bps: float) -> None:
            if member.peer_id not in bandwidth:  # a peer that came twice (through a bucket, then itself) counts once
                members.append(member)
                bandwidth[member.peer_id] = bps

        for carried in current.carried:
            add(carried.member, carried.bandwidth_bps)
        for peer, follower in current.followers.items():
            if not follower.reply.done():
                add(self._member(follower.request, peer), follower.request.bandwidth_bps)
                for carried in follower.request.bucket_members:
                    add(carried.member, carried.bandwidth_bps)
        mine: averaging_pb2.Group | None = None
        template = averaging_pb2.Group(step=current.step, codec=self.codec, reduce_timeout_s=self.reduce_timeout,
                                       schedule=self.schedule)
        parts = split_into_groups(members, self.group_size, current.step)
        for group in close_groups(parts, bandwidth, current.numel, template, self.random_bytes):
            for member in group.members:
                follower = current.followers.get(member.peer_id)
                if member.peer_id == self.peer_id:
                    mine = group
                elif follower is not None and not follower.reply.done():
                    follower.reply.set_result(group)
        assert mine is not None
        self.led_last_group = True
        return mine

    @staticmethod
    def _close_at(current: _Round, deadline: float) -> float:
        """When a leader must close: its own deadline, or just before its first follower gives up."""
        ends = [t - REPLY_MARGIN - current.reserve for f in current.followers.values() if (t := f.gives_up_at) is not None]
        return min([deadline, *ends])

    def straggler_wait(self: "Matchmaker") -> float:
        """How long a leader with a quorum waits for the rest: twice the 90th percentile of what
        stragglers took recently, at least ``min_straggler_wait``, never past the deadline."""
        if not self.straggle_history:
            return self.min_straggler_wait * 4  # no history yet: be patient (startup skews arrivals)
        ordered = sorted(self.straggle_history)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        return max(self.min_straggler_wait, 2 * p90)

    @staticmethod
    def _redirect_followers(current: _Round, target: averaging_pb2.Redirect) -> None:
        """Send the peers waiting on us to ``target``, the leader we now follow."""
        for follower in current.followers.values():
            if not follower.reply.done():
                follower.reply.set_result(target)
        current.followers.clear()

    @staticmethod
    def _member(request: averaging_pb2.JoinRequest, peer_id: str) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=peer_id, address=request.address, weight=request.weight)
