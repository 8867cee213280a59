"""Which shards of a round every member applies: a short exchange after the reduce phase.

DESIGN §4 says that a shard whose owner fails is skipped by *every* member, so that the members
stay identical and nobody downloads state. Losing the owner's result stream is something each
member sees on its own, though: an owner that dies while it streams its average back leaves
some members holding the average and others not. This module makes the outcome of every shard
something the members agree on.

**The rule.** After its reduce phase a member knows which shards it *holds* (their decoded,
checked average) and, for each shard it lacks, whose fault that is. It reports to every
reachable member (``ReportShards``) a vector ``skip`` with one flag per shard, true where it
lacks the shard through no fault of its own (the owner failed, the stream broke, the average
did not decode) or has received a report that asks to skip it; and it keeps every report it
receives, as requests from members that call it and as answers to its own calls. A member
applies exactly the shards that it holds and that no report it received (its own included)
asks to skip; every other shard is skipped, and the member's whole contribution to it
(x = Δ + residual) stays in its residual for the next round, as with a shard that failed
outright. A member whose own contribution the owner refused (INVALID_ARGUMENT: it sent
something invalid) lacks that average too, but does not ask the others to skip it: a fault of
one member costs that member alone (it ends with other parameters and downloads the state).

**Timing.** A callee answers once its own reduce phase is over and it has heard from every
other member (or given up on it: a call to it failed), or, once it has heard from a quorum of
them, after a grace of twice the time that took (at least MIN_REPORT_GRACE), or at its
deadline; it answers with everything it knows. So answers relay the reports of members the
caller could not hear from directly: client-mode members (nobody can call them; they call every
reachable member, and wait only for those) and members whose call to the caller failed. A member decides when all its
own calls are answered or failed (or MIN_REPORT_GRACE after that wait: a callee that has not
answered by then is hung or slower than the round). When every member is alive this takes one
round trip after the slowest member's reduce phase.

**Failure cases.**
- The owner dies before it streams its average: nobody holds the shard and everybody skips it.
  A call to a dead peer fails at once (connection refused), so nobody waits for its report.
- The owner dies while streaming: the members that lost the stream ask to skip the shard, and
  every member that hears it skips it. Live members hear each other, so all skip it.
- The owner dies after every member has its average: nobody's report lacks it, all apply it.
- A member dies during the exchange: the members that received its report pass it on in their
  answers. Two failures close together (a member that lacks a shard reaches some members and
  dies before any of them answered anybody else) can still split the group; the params-hash
  vote after the round then sends the minority to download the state, as before.
- A slow member: its report counts if it arrives before the others' deadline. Otherwise they
  decide without it; when it reports later, their answers carry the decision, and it applies the
  same shards if it holds them. Only if it lacks a shard the others applied does it end up alone
  with other parameters (and downloads): a fault of one member then costs that member alone.
  A member whose calls to every other owner (two at least) ran out of time counts its own link
  as the cause and asks to skip none of those shards (member.py ``own_link_at_fault``): a
  volunteer on a line far too slow for the deadline used to make the whole group skip them,
  round after round.
- A member that abandons the round (cancelled, shutting down) answers ABORTED and reports
  nothing: leaving never vetoes a shard, it only stops the others from waiting.

**Trust.** Any member can make the others skip shards by asking to. That costs
progress for a round (nothing is lost: every member keeps its part in its residual) and never
makes members differ; with a run secret a report is bound to the caller's token
(``auth.claimed_sender`` reads ``sender_peer_id``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from typing import Awaitable, Callable, Iterable, Sequence

from ._pb.lowcomm.v1 import averaging_pb2
from .transport import CallFailed, Clock, Code, LoopClock, ReduceTransport, Refused

log = logging.getLogger(__name__)

KEPT_ROUNDS = 4  # agreements kept for late reports: the current round and a few before it
FIND_TIMEOUT = 10.0  # seconds a report waits for the callee to open that round
ANSWER_MARGIN = 1.0  # seconds past its deadline a callee still waits for its own round to decide
MIN_REPORT_GRACE = 1.0  # seconds a member with a quorum of reports still waits for the rest


class ReportFailed(Exception):
    """A report call got no usable answer (the callee is gone, refused it, or answered nonsense)."""


# Sends one report to the member at an address and returns its answer; raises ReportFailed.
SendReport = Callable[[str, averaging_pb2.ShardReport, float], Awaitable[averaging_pb2.ShardReport]]


def report_sender(transport: ReduceTransport) -> SendReport:
    """``agree``'s way to send a report: ReportShards through ``transport``, a failed call as
    ReportFailed (at least 0.1 s, so that a call at the deadline still gets a chance)."""
    async def send(address: str, report: averaging_pb2.ShardReport, timeout: float) -> averaging_pb2.ShardReport:
        try:
            return await transport.report_shards(address, report, max(0.1, timeout))
        except CallFailed as err:
            raise ReportFailed(f"{err.code.name}: {err.detail}") from None
    return send


class ShardAgreement:
    """One member's view of which shards of one round every member may apply."""

    def __init__(self, group_id: bytes, peer_id: str, members: Iterable[str], shards: int, deadline: float,
                 reachable: Iterable[str] | None = None, clock: Clock | None = None) -> None:
        """``reachable``: the members that have an address, when this member has none (client
        mode): it can hear only from them, directly (other clients reach it relayed in their
        answers). None: every member can reach this one. ``deadline`` is on ``clock`` (the
        event loop's by default, transport.py)."""
        self.clock = clock if clock is not None else LoopClock()
        self.group_id = group_id
        self.peer_id = peer_id
        self.members = frozenset(members)
        self.shards = shards
        self.deadline = deadline  # clock time after which nobody is waited for any more
        self.heard: set[str] = set()  # members whose report arrived (request or answer)
        # Members neither heard from nor given up on.
        self._waiting = set(self.members if reachable is None else reachable) - {peer_id}
        # The quorum of settle() counts over all of them: reports often arrive before this
        # member's own reduce phase is over, and those count towards it too.
        self._expected = len(self._waiting)
        self._skip: set[int] = set()  # shards that some report (this member's included) asks to skip
        self._held: list[bool] | None = None  # this member's own outcome, once its reduce phase is over
        self.decision: list[bool] | None = None  # frozen by decide()
        self._decided_skip: frozenset[int] = frozenset()  # the skips the decision was taken on
        self.abandoned = False
        # Set when an answer may be given: own outcome known and the wait for reports over (settle).
        self.ready = asyncio.Event()
        self._progress = asyncio.Event()  # a report arrived or a member was given up on
        self.decided = asyncio.Event()  # set by decide()

    def check(self, report: averaging_pb2.ShardReport) -> str | None:
        """Why ``report`` cannot come from a member of this round, or None."""
        if report.sender_peer_id not in self.members or report.sender_peer_id == self.peer_id:
            return f"{report.sender_peer_id or '?'} is not another member of this group"
        if len(report.skip) != self.shards:
            return f"the report has {len(report.skip)} entries for {self.shards} shards"
        return None

    def own(self, held: Sequence[bool], skip: Sequence[bool], deadline: float) -> None:
        """This member's reduce phase is over: it holds the shards ``held`` marks, and asks to
        skip those ``skip`` marks (the ones it lacks through no fault of its own)."""
        assert len(held) == len(skip) == self.shards
        self._held = list(held)
        self._skip.update(i for i, s in enumerate(skip) if s)
        self.deadline = deadline

    def hear(self, sender: str, skip: Sequence[bool]) -> None:
        """A checked report from ``sender`` (see ``check``). After the decision it changes nothing."""
        if self.decision is not None:
            return
        self.heard.add(sender)
        self._waiting.discard(sender)
        self._skip.update(i for i, s in enumerate(skip) if s)
        self._progress.set()

    def give_up(self, member: str) -> None:
        """No report will come from ``member`` through our call; its own call may still bring one."""
        self._waiting.discard(member)
        self._progress.set()

    async def settle(self, quorum: float) -> None:
        """Wait for the other members' reports (see "Timing"), then let answers go out.

        Every member resolved (heard from or given up on) ends the wait; so does the deadline, or
        a grace after ``quorum`` of them are resolved: twice what the quorum took, at least
        MIN_REPORT_GRACE, the same shape as an owner's wait for senders."""
        started = self.clock.monotonic()
        needed = max(1, math.ceil(quorum * self._expected))
        quorum_at: float | None = None
        while self._waiting and not self.ready.is_set():
            now = self.clock.monotonic()
            if quorum_at is None and self._expected - len(self._waiting) >= needed:
                quorum_at = now
            limit = self.deadline if quorum_at is None else min(
                self.deadline, quorum_at + max(MIN_REPORT_GRACE, 2 * (quorum_at - started)))
            if now >= limit:
                log.info("shard reports: no word from %s by the %s", ", ".join(sorted(self._waiting)),
                         "deadline" if quorum_at is None else "grace after the quorum")
                break
            self._progress.clear()
            try:  # not wait_for: on Python 3.11 it can swallow a cancel that comes with the event
                async with asyncio.timeout(limit - now):
                    await self._progress.wait()
            except TimeoutError:
                pass
        self.ready.set()

    def view(self) -> list[bool]:
        """The shards this member would apply now: the decision once it is taken."""
        if self.decision is not None:
            return list(self.decision)
        assert self._held is not None, "view() before own()"
        return [h and i not in self._skip for i, h in enumerate(self._held)]

    def report(self) -> averaging_pb2.ShardReport:
        """What this member tells the others: every skip it knows of (frozen with the decision)."""
        skip = self._decided_skip if self.decision is not None else self._skip
        return averaging_pb2.ShardReport(group_id=self.group_id, sender_peer_id=self.peer_id,
                                         skip=[i in skip for i in range(self.shards)])

    def decide(self) -> list[bool]:
        """Freeze the decision: the shards this member applies."""
        if self.decision is None:
            self.decision = self.view()
            self._decided_skip = frozenset(self._skip)
            self.ready.set()
            self.decided.set()
        return list(self.decision)

    def abandon(self) -> None:
        """This member leaves the round without deciding: callers get ABORTED, not a report."""
        if self.decision is None:
            self.abandoned = True
            self.ready.set()

    @property
    def waiting(self) -> frozenset[str]:
        return frozenset(self._waiting)


class AgreementBook:
    """The agreements of this peer's recent rounds, found by group id by the ReportShards handler."""

    def __init__(self) -> None:
        self._rounds: OrderedDict[bytes, ShardAgreement] = OrderedDict()
        self._changed = asyncio.Event()

    def open(self, agreement: ShardAgreement) -> None:
        self._rounds[agreement.group_id] = agreement
        while len(self._rounds) > KEPT_ROUNDS:  # bounded: an old round's late reports get NOT_FOUND
            self._rounds.popitem(last=False)
        self._changed.set()
        self._changed = asyncio.Event()

    def get(self, group_id: bytes) -> ShardAgreement | None:
        return self._rounds.get(group_id)

    async def find(self, group_id: bytes, timeout: float) -> ShardAgreement | None:
        """The agreement of ``group_id``; waits a little, since a caller may be ahead of us."""
        try:
            async with asyncio.timeout(timeout):
                while (agreement := self._rounds.get(group_id)) is None:
                    await self._changed.wait()
        except TimeoutError:
            return None
        return agreement

    async def handle(self, request: averaging_pb2.ShardReport, context: object = None) -> averaging_pb2.ShardReport:
        """Server side of ``ReportShards``: keep the caller's report, answer with our view; raises
        Refused (transport.py). ``context`` is not used (callers pass the call's context along)."""
        agreement = await self.find(request.group_id, FIND_TIMEOUT)
        if agreement is None:
            raise Refused(Code.NOT_FOUND, "no such group on this peer")
        problem = agreement.check(request)
        if problem is not None:
            raise Refused(Code.INVALID_ARGUMENT, problem)
        agreement.hear(request.sender_peer_id, request.skip)
        try:  # our own round decides by its deadline; the margin covers a busy event loop
            async with asyncio.timeout(max(0.0, agreement.deadline - agreement.clock.monotonic()) + ANSWER_MARGIN):
                await agreement.ready.wait()
        except TimeoutError:
            raise Refused(Code.DEADLINE_EXCEEDED, "this peer's reduce phase did not end in time") from None
        if agreement.abandoned:
            raise Refused(Code.ABORTED, "this peer abandoned the round")
        return agreement.report()


async def agree(agreement: ShardAgreement, held: Sequence[bool], skip: Sequence[bool], deadline: float,
                reachable: dict[str, str], send: SendReport, quorum: float = 1.0) -> list[bool]:
    """Exchange reports with the group and return the shards to apply (see the module docstring).

    ``held`` and ``skip`` are this member's outcome (ShardAgreement.own); ``reachable`` maps
    the other members that can be called to their addresses; ``deadline`` is when this member
    stops waiting for anybody (on ``agreement.clock``); ``quorum`` is the fraction of
    the other members whose reports end the wait after a grace (ShardAgreement.settle)."""
    agreement.own(held, skip, deadline)
    report = agreement.report()

    async def ask(peer: str, address: str) -> None:
        remaining = deadline - agreement.clock.monotonic()
        try:
            if remaining <= 0:
                raise ReportFailed("the exchange deadline passed before the call")
            async with asyncio.timeout(remaining):
                answer = await send(address, report, remaining)
            if answer.group_id != agreement.group_id or answer.sender_peer_id != peer:
                raise ReportFailed("the answer is for another group or from another peer")
            if (problem := agreement.check(answer)) is not None:
                raise ReportFailed(problem)
        except (ReportFailed, TimeoutError) as err:
            log.info("no shard report from %s: %s", peer, err or "deadline")
            agreement.give_up(peer)
            return
        agreement.hear(peer, answer.skip)

    # The calls bring the callees' reports (and what they relay); members that cannot be called
    # (client mode), or whose call failed, may still call us meanwhile. Once settled, answers
    # still on their way get a short grace: a callee that does not answer by then is hung or
    # slower than the round, and we decide without it.
    asks = [asyncio.create_task(ask(peer, address)) for peer, address in reachable.items()]
    try:
        await agreement.settle(quorum)
        if asks:
            await asyncio.wait(asks, timeout=max(0.0, min(deadline - agreement.clock.monotonic(), MIN_REPORT_GRACE)))
    finally:
        for task in asks:
            task.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
    return agreement.decide()
