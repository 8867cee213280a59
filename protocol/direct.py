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
fails the call at once or at that deadline, a leader closes before its direct followers give
up even if a dead member never comes, and a leader nobody joined in that time, like a follower
whose call failed, goes on the DHT way for the rest of the overall deadline.

Round notices (``RoundStarted``): the first member of the last group to start the next round
tells the other members at once (``announce_round``, which the node calls as its round starts,
before any DHT read), in the background, so that an overlapped peer ends its inner phase
within a round trip instead of at its next poll of the DHT registrations
(``wait_round_started``; node/overlap.py). Only a member of our last group is listened to, so a
stranger cannot cut our phases; a member that was told does not tell the others again, so a
group of g costs about g-1 tiny calls per round. A notice never delays the round: it is sent
in the background with a short deadline, and a dead or older member only fails its own call.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from ._pb.lowcomm.v1 import averaging_pb2
from .handshake import IncompatiblePeer
from .transport import CallFailed, Code, Refused

if TYPE_CHECKING:
    from .matchmaking import Matchmaker, _Round


log = logging.getLogger(__name__)

DIRECT_TIMEOUT = 3.0  # seconds of the direct path of a stable group before the DHT path takes over
NOTICE_TIMEOUT = 1.0  # seconds a RoundStarted call may take: later, the receiver's DHT poll has seen the round
NOTICES_KEPT = 8  # round notices remembered (the latest steps'): the watcher asks only about the next step


def raise_if_incompatible(err: CallFailed, peer: averaging_pb2.Redirect | averaging_pb2.Member, me: str) -> None:
    """A JoinGroup refusal that means "we cannot average at all" (FAILED_PRECONDITION is used only
    for incompatibility) becomes IncompatiblePeer; any other failure is left to the caller."""
    if err.code == Code.FAILED_PRECONDITION:
        raise IncompatiblePeer(f"peer {peer.peer_id} at {peer.address} refused to average with "
                               f"this node ({me}): {err.detail}") from None


class DirectPath:
    """The Matchmaker's methods of the direct path (mixed into Matchmaker, which holds the state:
    ``last_group``, ``_registering``, the round notices ``_noticed``, ``_notice_arrived``,
    ``_announced`` and ``_noticing``, and the leader/follower machinery they use)."""

    def _remember(self: "Matchmaker", group: averaging_pb2.Group) -> averaging_pb2.Group:
        """Keep ``group`` as the last group (the next step's direct path), if it had partners."""
        self.last_group = group if len(group.members) > 1 else None
        return group

    def _direct_leader(self: "Matchmaker", step: int) -> averaging_pb2.Member | None:
        """The leader of the direct path at ``step``: the lowest reachable member of our group of
        step-1, or None when there was no such group (the DHT path then runs from the start)."""
        last = self.last_group
        if last is None or last.step != step - 1 or all(m.peer_id != self.peer_id for m in last.members):
            return None
        return min((m for m in last.members if m.address), key=lambda m: m.peer_id, default=None)

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

    # -- round notices ----------------------------------------------------------------------

    async def handle_round_started(self: "Matchmaker", notice: averaging_pb2.RoundNotice,
                                   context: object = None) -> averaging_pb2.RoundNoticeReply:
        """Serve a RoundStarted call: remember that a member of our last group started the round
        of (step, params hash) and wake ``wait_round_started``; raises Refused for an
        incompatible caller. A notice from anybody outside our last group, or for another step
        than the one after that group's, is ignored (``accepted`` False)."""
        try:
            self.identity.check(notice.hello)
        except IncompatiblePeer as err:
            log.warning("refused RoundStarted from %s: %s", notice.hello.peer_id, err)
            raise Refused(Code.FAILED_PRECONDITION, str(err)) from None
        sender, last = notice.hello.peer_id, self.last_group
        if (last is None or sender == self.peer_id or notice.step != last.step + 1
                or all(m.peer_id != sender for m in last.members)):
            log.debug("ignored a round notice of step %d from %s: not a member of our last group, "
                      "or not that group's next step", notice.step, sender)
            return averaging_pb2.RoundNoticeReply(accepted=False)
        key = (notice.step, notice.params_sha256)
        if key not in self._noticed:
            log.debug("%s started the round of step %d", sender, notice.step)
            self._noticed[key] = sender
            while len(self._noticed) > NOTICES_KEPT:  # the oldest step first: only recent ones are asked about
                del self._noticed[min(self._noticed)]
            self._notice_arrived.set()  # wakes every waiter; they check their key
            self._notice_arrived = asyncio.Event()
        return averaging_pb2.RoundNoticeReply(accepted=True)

    def round_noticed(self: "Matchmaker", step: int, params_hash: str | None) -> bool:
        """Whether a member of our last group said it started the round of ``step`` from
        ``params_hash`` (None: from any parameters)."""
        if params_hash is None:
            return any(noticed == step for noticed, _ in self._noticed)
        return (step, params_hash) in self._noticed

    async def wait_round_started(self: "Matchmaker", step: int, params_hash: str | None, timeout: float) -> bool:
        """True as soon as a member of our last group says it started the round of ``step`` from
        ``params_hash`` (None: from any parameters; at once if it already did); False when
        ``timeout`` seconds pass first."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                while not self.round_noticed(step, params_hash):
                    await self._notice_arrived.wait()
        except TimeoutError:
            return self.round_noticed(step, params_hash)
        return True

    def announce_round(self: "Matchmaker", step: int, params_hash: str) -> None:
        """We start the round of ``step`` from ``params_hash``: when our last group averaged at
        step-1 (its direct path is ours now), tell its other members, in the background. Once
        per round, and not when one of them told us first (then it told them too). The node
        calls it as its round starts, before the round's first DHT read; form_group's direct
        path calls it too (a second call does nothing)."""
        key = (step, params_hash)
        if self._direct_leader(step) is None or key == self._announced or self.round_noticed(step, params_hash):
            return
        self._announced = key
        log.debug("telling the last group that the round of step %d started", step)
        notice = averaging_pb2.RoundNotice(hello=self.identity.hello(), step=step, params_sha256=params_hash)
        assert self.last_group is not None  # _direct_leader found it
        for member in self.last_group.members:
            if member.peer_id == self.peer_id or not member.address:  # a client-mode member serves no calls
                continue
            task = asyncio.get_running_loop().create_task(self._send_notice(member, notice),
                                                          name=f"round-notice-{member.peer_id}")
            self._noticing.add(task)  # referenced until done, so that it is not collected early
            task.add_done_callback(self._noticing.discard)

    async def _send_notice(self: "Matchmaker", member: averaging_pb2.Member, notice: averaging_pb2.RoundNotice) -> None:
        try:
            reply = await self.transport.notice(member.address, notice, NOTICE_TIMEOUT)
        except CallFailed as err:  # UNIMPLEMENTED: an older peer; anything else: it polls the DHT
            log.debug("round notice of step %d to %s failed: %s %s", notice.step, member.peer_id,
                      err.code.name, err.detail)
            return
        if not reply.accepted:
            log.debug("%s ignored our round notice of step %d", member.peer_id, notice.step)

    # -- the direct round --------------------------------------------------------------------

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
