"""The direct path of a stable group (issue 17), a part of the Matchmaker (protocol/matchmaking.py).

When this peer averaged at step r-1 in a group and
is at step r now, it skips the DHT reads. The lowest reachable member of that last group leads
at once, and the other members call JoinGroup on it straight away (``JoinRequest.direct``; a
leader that is not at step r yet holds the call until its round starts). The leader reads the
swarm view once (``expected_peers``): when every peer expected at step r was in the last group,
it closes as soon as they all joined, without polling the DHT; when somebody else is expected
(a newcomer, or a peer of another group of a split swarm) it leads the ordinary DHT way, so
newcomers get in and large swarms keep re-mixing. Members still register in the DHT, in the
background and off the critical path, so that newcomers find the group (a newcomer that asks a
member is redirected to its leader) and the overlapped inner-phase cut still sees the round.
The direct path lasts at most ``direct_timeout`` (within the overall deadline): a dead leader
fails the call at once or at that deadline. A leader closes at once when every member joined,
or on a quorum and the straggler wait within that time; otherwise it leads on the DHT way for
the rest of the overall deadline and sends its direct followers back to join it there (before
their calls give up), so that a member slower than the direct path still gets into the step's
one plan, and a dead member costs the quorum's straggler wait, as on the DHT way. (Closing at
the end of the direct path with whoever had come left, in the simulator at 16 peers in one
group, a third of the step outside the plan: they made a second plan of their own, two params
hashes.) A leader nobody joined in that time, like a follower whose call failed, goes on the
DHT way too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from ._pb.lowcomm.v1 import averaging_pb2
from .handshake import IncompatiblePeer
from .transport import CallFailed, Code

if TYPE_CHECKING:
    from .matchmaking import Matchmaker, _Round


log = logging.getLogger(__name__)

DIRECT_TIMEOUT = 3.0  # seconds of the direct path of a stable group before the DHT path takes over


def raise_if_incompatible(err: CallFailed, peer: averaging_pb2.Redirect | averaging_pb2.Member, me: str) -> None:
    """A JoinGroup refusal that means "we cannot average at all" (FAILED_PRECONDITION is used only
    for incompatibility) becomes IncompatiblePeer; any other failure is left to the caller."""
    if err.code == Code.FAILED_PRECONDITION:
        raise IncompatiblePeer(f"peer {peer.peer_id} at {peer.address} refused to average with "
                               f"this node ({me}): {err.detail}") from None


class DirectPath:
    """The Matchmaker's methods of the direct path (mixed into Matchmaker, which holds the state:
    ``last_group``, ``_registering`` and the leader/follower machinery they use)."""

    def _remember(self: "Matchmaker", group: averaging_pb2.Group) -> averaging_pb2.Group:
        """Keep ``group`` as the last group (the next step's direct path), if it had partners, and
        the size of its step's plan when the step was split (the next step's B, buckets.py
        ``next_bucket_count``). A single group says nothing of the swarm's size: a solo step at
        start-up, or one group while others formed elsewhere, would give B = 1 to its members
        while the rest of the swarm counts its views (on 32 real nodes that made two plans of
        one step)."""
        self.last_group = group if len(group.members) > 1 else None
        self.last_plan = (group.step, sum(len(g.members) for g in group.step_groups)) if group.step_groups else None
        return group

    def _direct_leader(self: "Matchmaker", step: int) -> averaging_pb2.Member | None:
        """The leader of the direct path at ``step``: the lowest reachable member of our group of
        step-1, or None when there was no such group (the DHT path then runs from the start)."""
        last = self.last_group
        if last is None or last.step != step - 1 or all(m.peer_id != self.peer_id for m in last.members):
            return None
        return min((m for m in last.members if m.address), key=lambda m: m.peer_id, default=None)

    def follows_directly(self: "Matchmaker", step: int) -> bool:
        """Whether the round of ``step`` starts on the direct path as a follower: we averaged at
        step-1 in a group whose leader on that path is another member (its own read of the
        swarm decides for the group whether somebody outside it is expected)."""
        leader = self._direct_leader(step)
        return leader is not None and leader.peer_id != self.peer_id

    def _register_soon(self: "Matchmaker", key: str, registration: dict, ttl: float) -> asyncio.Task:
        """Store our registration in the background (newcomers find the group through it)."""
        task = asyncio.get_running_loop().create_task(self.dht.store(key, self.peer_id, registration, ttl=ttl),
                                                      name=f"register-{key}")
        self._registering.add(task)  # referenced until done, so that it is not collected early

        def done(finished: asyncio.Task) -> None:
            self._registering.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                log.debug("background registration of %s failed: %r", key, finished.exception())

        task.add_done_callback(done)
        return task

    async def _direct(self: "Matchmaker", current: _Round, me: averaging_pb2.Member, request: averaging_pb2.JoinRequest,
                      leader: averaging_pb2.Member, my_bandwidth: float,
                      expected_peers: Callable[[], Awaitable[set[str]]],
                      direct_by: float) -> averaging_pb2.Group | averaging_pb2.Redirect | None:
        """The direct path of a stable group, until ``direct_by``: the group, or where to go on
        (a Redirect, followed with the overall deadline), or None: the DHT way."""
        me_as_leader = averaging_pb2.Redirect(peer_id=self.peer_id, address=self.address)
        if leader.peer_id == self.peer_id:
            current.direct = True
            expected = await expected_peers()  # the one read of the swarm on this path
            last = {m.peer_id for m in self.last_group.members} if self.last_group is not None else set()
            if expected and not expected <= last:
                log.debug("peers outside the last group are expected at step %d: leading through the DHT", current.step)
                current.direct = False
                # Those who came directly wait only as long as the direct path lasts: have them
                # join again, with their whole deadline, for the ordinary round.
                self._redirect_followers(current, me_as_leader)
                return None
            current.role = "leader"
            try:
                return await self._lead(current, me, my_bandwidth, expected_peers, direct_by, set(),
                                        fixed_expected=expected or last)
            finally:
                current.direct = False
        target = averaging_pb2.Redirect(peer_id=leader.peer_id, address=leader.address)
        current.role, current.leader = "follower", target  # a newcomer that asks us is sent there
        remaining = max(0.0, direct_by - self.clock.monotonic())
        direct = averaging_pb2.JoinRequest()
        direct.CopyFrom(request)
        direct.direct, direct.wait_s = True, remaining  # the leader closes before we give up
        try:
            response = await self.transport.join(leader.address, direct, max(0.01, remaining))
        except CallFailed as err:
            raise_if_incompatible(err, leader, self.peer_id)
            log.debug("direct JoinGroup to %s failed: %s %s", leader.peer_id, err.code.name, err.detail)
            return None
        finally:
            current.role, current.leader = "undecided", None
        return response.group if response.HasField("group") else response.redirect
