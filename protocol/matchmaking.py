"""Forming a round's group through DHT records and one leader (DESIGN §4).

Peers that committed step r with parameters hash h register under ``<run>/round/<r>/<h>`` (so
only peers that start from identical parameters can meet). A registrant that sees no reachable
registrant with a lower peer id acts as leader: it accepts JoinGroup calls and closes when every
peer the swarm expects at step r has joined or when its deadline passes. Everybody else calls
JoinGroup on the lowest registrant and gets its group back when the leader closes. Only the
leader decides membership, so all members of a group receive the same member list and shard
layout. When more peers came than ``group_size`` allows, the leader splits them into balanced
groups by a per-step hash of their ids (Moshpit-style re-mixing: partners change every round,
so information spreads through a large swarm in a few rounds), and gives every group the same
step plan, so that all groups end the step with one average (crossgroup.py).

Deadlines: ``form_group(timeout=...)`` is one overall deadline for everything it does (the
DHT registration and reads, redirects, JoinGroup calls, waiting as a leader); past it the call
raises MatchmakingError, never later. A follower tells the leader how long it still waits
(``JoinRequest.wait_s``), and a leader closes its group before the first of its followers gives
up (REPLY_MARGIN before), so that nobody it counts in has already left.

A stable group meets directly, without DHT reads: protocol/direct.py.

Seams (transport.py): calls go through a ``MatchmakingTransport`` (gRPC by default), time comes
from a ``Clock`` (the event loop's by default) and group ids from ``random_bytes``
(``os.urandom`` by default); ``handle_join`` refuses with ``Refused``, never with gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from ._pb.lowcomm.v1 import averaging_pb2
from .direct import DIRECT_TIMEOUT, DirectPath
from .handshake import Identity, IncompatiblePeer
from .layout import close_groups, shard_layout, split_into_groups  # noqa: F401 - shard_layout re-exported
from .transport import CallFailed, Clock, Code, LoopClock, MatchmakingTransport, RandomBytes, Refused

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how often a waiting peer re-reads the DHT; DHT reads are cheap and local-ish
LONELY_LEADER_GRACE = 1.0  # seconds a leader without followers waits before it joins another leader
REPLY_MARGIN = 0.5  # seconds a leader keeps between closing and a follower's own deadline, for the reply
MIN_FOLLOWER_WAIT = 1.0  # a follower that says it waits less is not waited for (it may leave unanswered)
MAX_DIRECT_HOLD = 30.0  # the longest a leader holds a direct JoinGroup for its round to start


class GroupDHT(Protocol):
    """The two DHT operations matchmaking needs (the node adapts hivemind's DHT to this)."""

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool: ...
    async def get(self, key: str) -> dict[str, dict]: ...


class MatchmakingError(Exception):
    """No group could be formed for this round."""


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
    step: int
    params_hash: str = ""
    numel: int = 0
    role: str = "undecided"  # "undecided" | "leader" | "follower" | "closed"
    leader: averaging_pb2.Redirect | None = None
    followers: dict[str, _Follower] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    direct: bool = False  # leading the direct path of a stable group (protocol/direct.py)


def round_key(run: str, step: int, params_hash: str = "") -> str:
    key = f"{run}/round/{step}"
    return f"{key}/{params_hash[:16]}" if params_hash else key


class Matchmaker(DirectPath):
    def __init__(
        self,
        dht: GroupDHT,
        run: str,
        identity: Identity,
        address: str,
        channel_for: Callable[[str], Any] | None,
        group_size: int,
        codec: int,
        numel: int,
        reduce_timeout: float,
        quorum: float = 2 / 3,
        min_straggler_wait: float = 2.0,
        direct_timeout: float = DIRECT_TIMEOUT,
        transport: MatchmakingTransport | None = None,
        clock: Clock | None = None,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        """``channel_for(address)``: grpc.aio channels for the default gRPC transport (unused
        when ``transport`` is given). ``clock`` and ``random_bytes``: see transport.py."""
        self.dht = dht
        self.run = run
        self.identity = identity
        self.peer_id = identity.peer_id
        self.address = address  # "" in client mode: never a leader, owns no shard
        self.channel_for = channel_for  # read at every call by the default transport (tests swap it)
        if transport is None:
            if channel_for is None:
                raise ValueError("a Matchmaker needs channel_for (for gRPC) or a transport")
            from .grpc_transport import GrpcMatchmakingTransport  # the adapter; the logic below never sees gRPC

            transport = GrpcMatchmakingTransport(lambda: self.channel_for)
        self.transport = transport
        self.clock = clock if clock is not None else LoopClock()
        self.random_bytes = random_bytes
        self.group_size = group_size
        self.codec = codec
        self.numel = numel
        self.reduce_timeout = reduce_timeout
        self.quorum = quorum
        self.min_straggler_wait = min_straggler_wait
        # Seconds between reaching the quorum and the last expected arrival, over recent rounds:
        # how long stragglers usually take, so that the leader waits for them adaptively.
        self.straggle_history: deque[float] = deque(maxlen=20)
        self._round: _Round | None = None
        self.led_last_group = False  # whether this peer decided the last group it was in
        self.direct_timeout = direct_timeout
        self.last_group: averaging_pb2.Group | None = None  # our last group of two or more
        self._round_started = asyncio.Event()  # set (and replaced) whenever form_group starts a round
        self._registering: set[asyncio.Task] = set()  # background DHT registrations of the direct path

    # -- server side: somebody wants to join the group we lead ------------------------------

    async def handle_join(self, request: averaging_pb2.JoinRequest, context: object = None) -> averaging_pb2.JoinResponse:
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
        if current.role == "follower" and current.leader is not None:
            return averaging_pb2.JoinResponse(redirect=current.leader)
        if request.direct and not current.direct and current.role != "closed" and self.address:
            # We do not lead a direct round: join again the ordinary way, with the whole deadline.
            return averaging_pb2.JoinResponse(redirect=averaging_pb2.Redirect(peer_id=self.peer_id, address=self.address))
        if current.role == "closed" or not self.address:
            raise Refused(Code.ABORTED, f"the group of step {request.step} is already closed")
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
        if isinstance(group, averaging_pb2.Redirect):  # we yielded to a lower leader: go there
            return averaging_pb2.JoinResponse(redirect=group)
        return averaging_pb2.JoinResponse(group=group)

    async def _await_round(self, step: int, arrived: float, wait_s: float) -> _Round | None:
        """Our round once it reaches ``step``, or whatever it is when the caller's wait ends."""
        hold = min(max(0.0, wait_s - REPLY_MARGIN), MAX_DIRECT_HOLD) if math.isfinite(wait_s) else 0.0
        try:
            async with asyncio.timeout(max(0.0, arrived + hold - self.clock.monotonic())):
                while (current := self._round) is None or current.step < step:
                    await self._round_started.wait()
        except TimeoutError:
            pass
        return self._round

    # -- client side: find or lead a group ----------------------------------------------------

    async def form_group(
        self,
        step: int,
        weight: float,
        bandwidth_bps: float,
        expected_peers: Callable[[], Awaitable[set[str]]],
        timeout: float,
        params_hash: str = "",
        numel: int | None = None,
    ) -> averaging_pb2.Group:
        """Return the closed group for round ``step`` (possibly just this peer).

        ``numel`` is the length of what this round averages (a fragment of the model, or all
        of it by default); the leader's shard layout covers it."""
        current = _Round(step, params_hash, self.numel if numel is None else numel)
        self._round = current
        self._round_started.set()  # direct JoinGroup calls held for this round go ahead
        self._round_started = asyncio.Event()
        self.led_last_group = False
        direct_leader = self._direct_leader(step)
        deadline = self.clock.monotonic() + timeout
        me = averaging_pb2.Member(peer_id=self.peer_id, address=self.address, weight=weight)
        request = averaging_pb2.JoinRequest(hello=self.identity.hello(), step=step, address=self.address,
                                            weight=weight, bandwidth_bps=bandwidth_bps, params_sha256=params_hash)
        registration = {"address": self.address, "weight": weight, "bandwidth_bps": bandwidth_bps}
        unreachable: set[str] = set()
        yielded = False  # set when our lead just yielded: follow somebody else once before leading again
        overall = asyncio.timeout(timeout)  # covers DHT calls, redirects and JoinGroup calls alike
        key, ttl = round_key(self.run, step, params_hash), timeout + self.reduce_timeout
        try:
            async with overall:
                if direct_leader is not None:
                    registered = self._register_soon(key, registration, ttl)
                    direct_by = min(deadline, self.clock.monotonic() + min(self.direct_timeout, timeout / 3))
                    outcome = await self._direct(current, me, request, direct_leader, bandwidth_bps,
                                                 expected_peers, direct_by)
                    if isinstance(outcome, averaging_pb2.Redirect):
                        outcome = await self._follow(current, request, outcome, deadline)
                    if outcome is not None:
                        return self._remember(outcome)
                    if current.role != "leader":
                        current.role = "undecided"
                    log.info("the direct path of step %d formed no group; matchmaking through the DHT", step)
                    await registered
                else:
                    await self.dht.store(key, self.peer_id, registration, ttl=ttl)
                while True:
                    if current.role == "leader":
                        # A leader closes a little before the overall deadline: the close must not race it.
                        close_by = deadline - min(REPLY_MARGIN, timeout / 10)
                        group = await self._lead(current, me, bandwidth_bps, expected_peers, close_by, unreachable)
                        if group is not None:
                            return self._remember(group)
                        yielded = True
                    registrants = await self._reachable_registrants(current, unreachable)
                    lowest = next(iter(registrants), None)
                    if self.address and not yielded and (lowest is None or lowest > self.peer_id):
                        current.role = "leader"
                        continue
                    yielded = False
                    if lowest is None:  # client mode and no reachable registrant yet
                        await self._wait(current, POLL_SECONDS)
                        continue
                    target = averaging_pb2.Redirect(peer_id=lowest, address=registrants[lowest])
                    group = await self._follow(current, request, target, deadline)
                    if group is not None:
                        return self._remember(group)
                    if current.role == "leader":  # somebody joined us while we were trying
                        continue
                    unreachable.add(lowest)
                    current.role = "undecided"
                    await self._wait(current, POLL_SECONDS)
        except TimeoutError:
            if not overall.expired():
                raise
            raise MatchmakingError(f"no group formed for step {step} within {timeout:.1f}s") from None
        finally:
            current.role = "closed"
            for follower in current.followers.values():
                if not follower.reply.done():
                    follower.reply.set_result(None)

    async def others_registered(self, step: int, params_hash: str) -> int:
        """How many other peers registered for the round of ``step`` from ``params_hash``: peers
        that finished the inner phase of that step and are forming its group right now."""
        registrants = await self.dht.get(round_key(self.run, step, params_hash))
        return sum(1 for pid in registrants if pid != self.peer_id)

    async def _reachable_registrants(self, current: _Round, unreachable: set[str]) -> dict[str, str]:
        """Other registrants of this round that could lead (have an address), lowest id first."""
        registrants = await self.dht.get(round_key(self.run, current.step, current.params_hash))
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

    async def _follow(self, current: _Round, request: averaging_pb2.JoinRequest,
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
                if err.code == Code.FAILED_PRECONDITION:  # used only for incompatibility
                    raise IncompatiblePeer(f"peer {target.peer_id} at {target.address} refused to average with "
                                           f"this node ({self.peer_id}): {err.detail}") from None
                log.debug("JoinGroup to %s failed: %s %s", target.peer_id, err.code.name, err.detail)
                return None
            if response.HasField("group"):
                return response.group
            target = response.redirect
        return None

    async def _lead(self, current: _Round, me: averaging_pb2.Member, my_bandwidth: float,
                    expected_peers: Callable[[], Awaitable[set[str]]], deadline: float,
                    unreachable: set[str], fixed_expected: set[str] | None = None) -> averaging_pb2.Group | None:
        """Wait for followers and close the group; ``None`` when this peer should follow instead.

        With ``fixed_expected`` (the direct path) the expected peers are known and the DHT is not
        read: the leader wakes on every join, and ``None`` means nobody joined by ``deadline``."""
        lonely_since = self.clock.monotonic()
        quorum_at: float | None = None
        while True:
            joined = {self.peer_id, *current.followers}
            expected = fixed_expected if fixed_expected is not None else await expected_peers()
            now = self.clock.monotonic()
            if expected and expected <= joined:
                if quorum_at is not None:
                    self.straggle_history.append(now - quorum_at)
                break
            close_at = self._close_at(current, deadline)
            if now >= close_at:
                if fixed_expected is not None and not current.followers:
                    current.role = "undecided"
                    return None
                break
            if quorum_at is None and len(joined) >= max(2, math.ceil(self.quorum * len(expected))):
                quorum_at = now
            if quorum_at is not None and now - quorum_at >= self.straggler_wait():
                # Not recorded in the history: only complete arrivals measure how long stragglers take.
                log.info("closing the group of step %d with %d of %d expected peers (stragglers waited %.1fs)",
                         current.step, len(joined), len(expected), now - quorum_at)
                break
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
            lower = [p for p in others if p < self.peer_id]
            if current.followers:
                lonely_since = self.clock.monotonic()
            if lower or (not current.followers and others and self.clock.monotonic() - lonely_since > LONELY_LEADER_GRACE):
                if lower:
                    self._redirect_followers(current, averaging_pb2.Redirect(peer_id=lower[0], address=others[lower[0]]))
                current.role = "undecided"
                return None
            await self._wait(current, min(POLL_SECONDS, max(0.0, close_at - self.clock.monotonic())))
        current.role = "closed"
        members = [me, *(self._member(f.request, p) for p, f in current.followers.items() if not f.reply.done())]
        bandwidth = {p: f.request.bandwidth_bps for p, f in current.followers.items()} | {self.peer_id: my_bandwidth}
        mine: averaging_pb2.Group | None = None
        template = averaging_pb2.Group(step=current.step, codec=self.codec, reduce_timeout_s=self.reduce_timeout)
        parts = split_into_groups(members, self.group_size, current.step)
        for group in close_groups(parts, bandwidth, current.numel, template, self.random_bytes):
            for member in group.members:
                if member.peer_id == self.peer_id:
                    mine = group
                elif not current.followers[member.peer_id].reply.done():
                    current.followers[member.peer_id].reply.set_result(group)
        assert mine is not None
        self.led_last_group = True
        return mine

    @staticmethod
    def _close_at(current: _Round, deadline: float) -> float:
        """When a leader must close: its own deadline, or just before its first follower gives up."""
        ends = [t - REPLY_MARGIN for f in current.followers.values() if (t := f.gives_up_at) is not None]
        return min([deadline, *ends])

    def straggler_wait(self) -> float:
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
