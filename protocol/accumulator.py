"""The owner's side of one shard in one round: contributions kept until the deadline, then
aggregated and encoded once (allreduce.py runs it; DESIGN §4 "Trust" for the checks), and the
weights every member gives every other member's contribution.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import torch

from . import codecs, wire
from ._pb.lowcomm.v1 import averaging_pb2
from .aggregation import Aggregated, Aggregation, aggregate
from .schedule import StageChain, result_budget, result_order
from .sender import CHUNK_BYTES
from .transport import Clock, LoopClock

log = logging.getLogger(__name__)

MIN_STRAGGLER_GRACE = 1.0  # seconds an owner with a quorum of contributions still waits for the rest

RejectCallback = Callable[[str, str, str], None]  # (reason, sender peer id, detail)
# A split step's hook (crossgroup.py): from the group's partial average (None if it has none) and
# who is inside it to the step's (payload, decoded average or None, failure, contributors).
Publish = Callable[[torch.Tensor | None, list[str]], Awaitable[tuple[bytes, torch.Tensor | None, str, list[str]]]]


@dataclass
class ShardAccumulator:
    """The owner's side of one shard in one round."""

    group: averaging_pb2.Group
    shard_index: int
    owner_id: str
    codec: codecs.Codec
    executor: Executor
    owner_residual: torch.Tensor  # view into the owner's full-size residual, updated in place
    own: torch.Tensor  # the owner's own exact contribution to this shard
    expected: set[str]
    weights: dict[str, float]
    aggregation: Aggregation = field(default_factory=Aggregation)
    on_reject: RejectCallback | None = None
    contributions: dict[str, torch.Tensor] = field(default_factory=dict)  # sender -> decoded, until finalize
    contributors: list[str] = field(default_factory=list)  # after finalize: who entered the average
    finalized: asyncio.Event = field(default_factory=asyncio.Event)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a sender arrived or was given up on
    result_payload: bytes = b""
    result: torch.Tensor | None = None  # after finalize: the decoded average, None if it could not be made
    failure: str = ""  # after finalize, when result is None: why
    bytes_in: int = 0  # contribution payload bytes received for this shard
    bytes_out: int = 0  # average payload bytes streamed back to senders
    active_streams: int = 0
    announced: set[str] = field(default_factory=set)  # senders whose header was accepted (no duplicates)
    staggered: bool = True  # send the average to one sender after the other (schedule.py)
    awaiting: set[str] = field(default_factory=set)  # senders whose stream waits for the average
    turns: list[str] = field(default_factory=list)  # after finalize: who gets the average when (schedule.py)
    _turns: StageChain | None = None  # after finalize: the result stages (schedule.py)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # no Reduce stream is open
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    clock: Clock = field(default_factory=LoopClock)  # the time base of ``wait_for_senders``' deadline
    # None: the average is this group's, encoded here. Set in a split step: the group's partial
    # average goes to the shard's team instead and the team's encoded average is published.
    publish: Publish | None = None
    _result_chunks: list[wire.Chunk] | None = None

    def __post_init__(self) -> None:
        self.contributions.setdefault(self.owner_id, self.own)
        # The quorum counts every sender of the round, also those that arrive before the owner
        # starts waiting: fast senders find the accumulator open before wait_for_senders runs.
        self._senders = len(self.expected)
        self._opened_at = self.clock.monotonic()

    def stream_opened(self) -> None:
        self.active_streams += 1
        self.idle.clear()

    def stream_closed(self) -> None:
        self.active_streams -= 1
        if self.active_streams == 0:
            self.idle.set()

    @property
    def numel(self) -> int:
        return self.own.numel()

    async def add(self, sender: str, decoded: torch.Tensor) -> bool:
        """Keep a validated contribution until finalize; False if it came after the average was computed."""
        async with self._lock:
            if self.finalized.is_set():
                return False
            self.contributions[sender] = decoded
            self.expected.discard(sender)
            self.progress.set()
            if not self.expected:
                self.all_arrived.set()
            return True

    def give_up(self, sender: str) -> None:
        """Nothing (more) will come from ``sender`` this round: do not wait for it."""
        self.expected.discard(sender)
        self.progress.set()
        if not self.expected:
            self.all_arrived.set()

    def unreachable(self, sender: str) -> None:
        """Our own call to ``sender`` could not reach it (it died, or its link is down): unless its
        stream to us has begun (that stream ends, or fails, on its own), stop waiting for it. A
        dead member used to hold this shard until the deadline (the whole reduce timeout in a
        group of two, where the quorum is the one other sender); one that is alive but sends
        after this gets its part refused as late and keeps it in its residual."""
        if sender not in self.announced:
            self.give_up(sender)

    async def wait_for_senders(self, deadline: float, quorum: float) -> None:
        """Wait until every sender is in, or the deadline, or an adaptive grace after a quorum.

        Once ``quorum`` of the expected senders have contributed, the rest get twice the time the
        quorum took (at least MIN_STRAGGLER_GRACE): the round follows observed transfer times
        instead of always waiting for the worst case. The quorum and the time it took count from
        when the accumulator opened: senders that came in before this wait began count too."""
        started = self._opened_at
        needed = max(1, math.ceil(quorum * self._senders))
        quorum_at: float | None = None
        while not self.all_arrived.is_set():
            now = self.clock.monotonic()
            if quorum_at is None and self._senders - len(self.expected) >= needed:
                quorum_at = now
            limit = deadline if quorum_at is None else min(
                deadline, quorum_at + max(MIN_STRAGGLER_GRACE, 2 * (quorum_at - started)))
            if now >= limit:
                log.info("shard %d: %d member(s) missed the %s and are left out", self.shard_index,
                         len(self.expected), "deadline" if quorum_at is None else "grace after the quorum")
                return
            self.progress.clear()
            try:  # not wait_for: on Python 3.11 it can swallow a cancel that comes with the event
                async with asyncio.timeout(limit - now):
                    await self.progress.wait()
            except TimeoutError:
                pass

    async def finalize(self) -> torch.Tensor | None:
        """Aggregate what arrived, encode the average once; None if no average can be published."""
        async with self._lock:
            if not self.finalized.is_set():
                loop = asyncio.get_running_loop()
                contributions = [(s, self.weights[s], x) for s, x in self.contributions.items()]

                def aggregate_only() -> tuple[Aggregated, str]:
                    try:
                        outcome = aggregate(contributions, self.aggregation)
                    except ValueError as err:  # malformed weights or lengths: no average rather than a crash
                        return Aggregated(None, []), f"the contributions cannot be aggregated: {err}"
                    if outcome.average is None:
                        return outcome, "no valid contribution was left"
                    if not bool(torch.isfinite(outcome.average).all()):
                        return outcome, "the average overflowed to non-finite values"
                    return outcome, ""

                def aggregate_and_encode() -> tuple[Aggregated, bytes, torch.Tensor | None, str]:
                    outcome, failure = aggregate_only()
                    if failure:
                        return outcome, b"", None, failure
                    try:
                        payload, decoded = codecs.encode_with_feedback(self.codec, outcome.average, self.owner_residual)
                    except codecs.CodecError as err:
                        return outcome, b"", None, f"the average cannot be encoded: {err}"
                    return outcome, payload, decoded, ""

                contributors: list[str] | None = None
                try:
                    if self.publish is None:
                        outcome, self.result_payload, self.result, self.failure = await loop.run_in_executor(
                            self.executor, aggregate_and_encode)
                    else:
                        outcome, problem = await loop.run_in_executor(self.executor, aggregate_only)
                        self.contributions = {}
                        partial = None if problem else outcome.average
                        self.result_payload, self.result, self.failure, contributors = await self.publish(
                            partial, outcome.used if partial is not None else [])
                finally:
                    self.contributions = {}  # the memory goes back as soon as the average exists
                    # Senders waiting now get the average one after the other; later ones at once.
                    self.turns = [s for s in result_order(self.group, self.owner_id)
                                  if s in self.awaiting] if self.staggered else []
                    self._turns = StageChain(self.turns, result_budget(self.group, len(self.turns)), self.clock)
                    self.finalized.set()
                if contributors is not None:  # a split step: who is inside the step's average
                    self.contributors = contributors if self.result is not None else []
                else:
                    self.contributors = outcome.used if self.result is not None else []
                for rejection in outcome.rejected:
                    self._reject(rejection.reason, rejection.sender, rejection.detail)
                if self.result is None:
                    log.warning("shard %d: %s; every member skips it this round", self.shard_index, self.failure)
        return self.result

    def result_chunks(self) -> list[wire.Chunk]:
        """The encoded average as stream messages, framed once: every sender gets the same bytes."""
        if self._result_chunks is None:
            self._result_chunks = wire.chunks(self.result_payload, CHUNK_BYTES, framed=True)
        return self._result_chunks

    async def wait_turn(self, sender: str) -> None:
        """Staggered results: return once the sender before ``sender`` has its average, or a
        result budget after that one's turn began (a slow downloader delays the next one that
        long at most; schedule.py ``StageChain``)."""
        if self._turns is not None:
            await self._turns.turn(sender)

    def served(self, sender: str) -> None:
        """``sender``'s result stream is over (sent, failed or cancelled): the next may start."""
        if self._turns is not None:
            self._turns.done(sender)

    def _reject(self, reason: str, sender: str, detail: str) -> None:
        if self.on_reject is not None:
            self.on_reject(reason, sender, detail)
        else:
            log.warning("rejected a contribution from %s (%s): %s", sender, reason, detail)


MAX_WEIGHT_RATIO = 4.0


def bounded_weights(members) -> dict[str, float]:
    """Each member's averaging weight: its self-reported tokens, capped at MAX_WEIGHT_RATIO times
    the group's lower median.

    Weights are claims nobody can check, so one peer claiming 10¹² tokens would otherwise own
    every average. Honest weights differ by small factors (a peer whose last round failed brings
    two inner phases' worth), which the cap leaves alone. The lower median makes a lone liar in
    a group of two capped by the honest member. Every member computes this from the same group
    message, so all use the same weights.
    """
    claimed = {m.peer_id: (m.weight if m.weight > 0 and math.isfinite(m.weight) else 1.0) for m in members}
    if not claimed:
        return {}
    ordered = sorted(claimed.values())
    cap = MAX_WEIGHT_RATIO * ordered[(len(ordered) - 1) // 2]
    return {peer: min(weight, cap) for peer, weight in claimed.items()}
