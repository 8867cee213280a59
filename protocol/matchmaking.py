"""Forming a round's group through DHT records and one leader (DESIGN §4): the ``Matchmaker``.

Peers that committed step r with parameters hash h register under ``<run>/round/<r>/<h>`` (so
only peers that start from identical parameters can meet). A registrant that sees no reachable
registrant with a lower peer id acts as leader: it accepts JoinGroup calls and closes when every
peer the swarm expects at step r has joined or when its deadline passes. Everybody else calls
JoinGroup on the lowest registrant and gets its group back when the leader closes
(election.py). Only the leader decides membership, so all members of a group receive the same
member list and shard layout. When more peers came than ``group_size`` allows, the leader splits
them into balanced groups by a per-step hash of their ids (Moshpit-style re-mixing: partners
change every round, so information spreads through a large swarm in a few rounds), and gives
every group the same step plan, so that all groups end the step with one average
(crossgroup.py). A step that expects at least four groups' worth of peers matchmakes in two
levels, buckets and then a step coordinator, so that no peer receives every JoinGroup of the
swarm (buckets.py). A stable group meets directly, without DHT reads (direct.py).

Deadlines: ``form_group(timeout=...)`` is one overall deadline for everything it does (the
DHT registration and reads, redirects, JoinGroup calls, waiting as a leader); past it the call
raises MatchmakingError, never later. A follower tells the leader how long it still waits
(``JoinRequest.wait_s``), and a leader closes its group before the first of its followers gives
up (REPLY_MARGIN before), so that nobody it counts in has already left.

Seams (transport.py): calls go through a ``MatchmakingTransport`` (gRPC by default), time comes
from a ``Clock`` (the event loop's by default) and group ids from ``random_bytes``
(``os.urandom`` by default); ``handle_join`` refuses with ``Refused``, never with gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import Any, Callable

from ._pb.lowcomm.v1 import averaging_pb2
from .buckets import BucketLevel, RoundPeers, bucket_key, bucket_label, next_bucket_count
from .direct import DIRECT_TIMEOUT, DirectPath
from .election import (  # noqa: F401 - re-exported: the names matchmaking has always offered
    LONELY_LEADER_GRACE, MAX_DIRECT_HOLD, MIN_FOLLOWER_WAIT, POLL_SECONDS, REPLY_MARGIN, Election, ExpectedPeers,
    GroupDHT, MatchmakingError, PlanClosed, _Follower, _Round, round_key,
)
from .handshake import Identity
from .layout import close_groups, shard_layout, split_into_groups  # noqa: F401 - re-exported
from .transport import Clock, LoopClock, MatchmakingTransport, RandomBytes

log = logging.getLogger(__name__)

__all__ = ["Matchmaker", "MatchmakingError", "PlanClosed", "RoundPeers", "round_key", "GroupDHT", "POLL_SECONDS", "REPLY_MARGIN"]


class Matchmaker(Election, BucketLevel, DirectPath):
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
        wall_clock: Callable[[], float] = time.time,
        schedule: int = averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY,
    ) -> None:
        """``channel_for(address)``: grpc.aio channels for the default gRPC transport (unused
        when ``transport`` is given). ``clock`` and ``random_bytes``: see transport.py.
        ``wall_clock``: seconds that peers agree on (the DHT's time), for the one deadline
        that peers tell each other through the DHT (buckets.py ``TopWatch``). ``schedule``: the
        Group.schedule this peer's groups get when it leads (a ring where the group can be one,
        layout.py ``close_groups``)."""
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
        self.wall_clock = wall_clock
        self.group_size = group_size
        self.codec = codec
        self.schedule = schedule
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
        self._open: list[_Round] = []  # the levels of the round in progress, released when it ends
        self.last_buckets = 1  # B of our last round (buckets.py): where to look for the next round's registrants
        self.last_plan: tuple[int, int] | None = None  # (step, peers in its plan) of our last group: the next B

    async def form_group(
        self,
        step: int,
        weight: float,
        bandwidth_bps: float,
        expected_peers: ExpectedPeers,
        timeout: float,
        params_hash: str = "",
        numel: int | None = None,
        round_peers: RoundPeers | None = None,
    ) -> averaging_pb2.Group:
        """Return the closed group for round ``step`` (possibly just this peer).

        ``numel`` is the length of what this round averages (a fragment of the model, or all
        of it by default); the leader's shard layout covers it. ``expected_peers()``: the peers
        a leader waits for (it may read the DHT; called at every look). ``round_peers``: what
        the round-start view expects and who is alive (no DHT read); when it expects four
        groups' worth of peers or more, the step matchmakes in buckets (buckets.py), otherwise
        (and without it) exactly as a single level."""
        current = _Round(step, params_hash, self.numel if numel is None else numel,
                         key=round_key(self.run, step, params_hash))
        self._round = current
        self._open = [current]
        self._round_started.set()  # direct JoinGroup calls held for this round go ahead
        self._round_started = asyncio.Event()
        self.led_last_group = False
        buckets = 1 if round_peers is None else next_bucket_count(step, len(round_peers.expected), self.group_size,
                                                                  self.last_plan, round_peers.plan_of_state)
        self.last_buckets = buckets
        direct_leader = self._direct_leader(step) if buckets == 1 else None
        deadline = self.clock.monotonic() + timeout
        me = averaging_pb2.Member(peer_id=self.peer_id, address=self.address, weight=weight)
        request = averaging_pb2.JoinRequest(hello=self.identity.hello(), step=step, address=self.address,
                                            weight=weight, bandwidth_bps=bandwidth_bps, params_sha256=params_hash)
        registration = {"address": self.address, "weight": weight, "bandwidth_bps": bandwidth_bps}
        unreachable: set[str] = set()
        overall = asyncio.timeout(timeout)  # covers DHT calls, redirects and JoinGroup calls alike
        key, ttl = current.key, timeout + self.reduce_timeout

        async def close(level: _Round) -> averaging_pb2.Group:
            if level.one_plan:  # bucket leaders joined this small step's key: we coordinate their step
                return await self._close_plan(level, me, bandwidth_bps, {**registration, "buckets": level.buckets}, ttl)
            group = self._close(level, me, bandwidth_bps)
            if group.step_groups:
                # A split plan says so, like a bucketed step's coordinator: a late peer of the
                # step, or a bucket leader whose view gave B > 1, that comes after we closed gives
                # up instead of planning the step a second time (election.planned_by).
                self._register_soon(key, {**registration, "planned": True}, ttl)
            return group

        try:
            async with overall:
                if buckets > 1:
                    assert round_peers is not None
                    return self._remember(await self._form_bucketed(current, me, request, registration, ttl,
                                                                    round_peers, buckets, deadline, timeout))
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
                # A leader closes a little before the overall deadline: the close must not race it.
                close_by = deadline - min(REPLY_MARGIN, timeout / 10)
                return self._remember(await self._elect(current, request, expected_peers, close_by, deadline,
                                                        unreachable, close))
        except TimeoutError:
            if not overall.expired():
                raise
            raise MatchmakingError(f"no group formed for step {step} within {timeout:.1f}s") from None
        except BaseException:
            for level in self._open:
                level.planned = False  # late callers are told that no plan was made here
            raise
        finally:
            for level in self._open:
                self._release(level)

    @staticmethod
    def _release(level: _Round) -> None:
        """The round is over at ``level``: refuse whoever still waits on us there."""
        level.role = "closed"
        for follower in level.followers.values():
            if not follower.reply.done():
                follower.reply.set_result(None)

    def plan_behind(self, step: int) -> int:
        """Peers in the split plan whose round made our state at ``step`` (what our peer record
        publishes, ``plan_peers``), or 0 when that step did not come from a plan of ours."""
        return self.last_plan[1] if self.last_plan is not None and self.last_plan[0] == step - 1 else 0

    async def others_registered(self, step: int, params_hash: str) -> int:
        """How many other peers registered for the round of ``step`` from ``params_hash``: peers
        that finished the inner phase of that step and are forming its group right now.

        When our last round matchmade in buckets, the next one most likely does too (B changes
        only when the swarm doubles or halves): its peers register under their buckets, and only
        a closed bucket's leader at the top key, so we also read our own bucket's key there (B
        as last time): its members are the ones we would meet first."""
        keys = [round_key(self.run, step, params_hash)]
        if self.last_buckets > 1:
            keys.append(bucket_key(self.run, step, params_hash, bucket_label(step, self.peer_id, self.last_buckets)))
        found = await asyncio.gather(*(self.dht.get(key) for key in keys))  # one round trip, not two
        return len({pid for registrants in found for pid in registrants} - {self.peer_id})

