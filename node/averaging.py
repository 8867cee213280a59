"""The network part of a round: average this peer's Δ with a group (or gossip), or say why not.

``Averager.run`` is what the round driver (node/driver.py) calls at a boundary: the behind check,
the matchmaking (DHT or a stable group's direct path), then the all-reduce, a solo outer step
when nobody else is in the swarm, or the gossip exchange (node/gossip_mode.py). It returns a
``RoundOutcome`` whose ``apply`` the driver runs as the round's local part (node/commit.py):
separately, because that part must finish once begun, while this one may be abandoned. What an
abandoned all-reduce wrote into the residual is recorded in ``undo`` for the driver's rollback.

Fault injection for tests (``Faults``, node/faults.py) stalls a round here: after the group
formed, or with a busy codec job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import ReduceRegistry, run_allreduce
from lowcomm.protocol.buckets import bucketed_by_plan
from lowcomm.protocol.handshake import IncompatiblePeer
from lowcomm.protocol.matchmaking import Matchmaker, MatchmakingError, RoundPeers
from lowcomm.protocol.missed_rounds import AppliedAverage
from lowcomm.protocol.ring import RING
from lowcomm.protocol.rpc import ChannelPool
from lowcomm.protocol.state import params_sha256

from . import decisions
from .apply import applied_averages, apply_averages
from .config import Config
from .errors import refused_by_the_swarm
from .faults import Faults
from .globalstate import GlobalState
from .metrics import NodeMetrics
from .ports import SwarmPort
from .repeated import RepeatedLine
from .runstats import RunStats

if TYPE_CHECKING:
    from .gossip_mode import GossipMode
    from .swarm import SwarmView

log = logging.getLogger("lowcomm.node")
# How often "nobody averaged with us" may show while it repeats (Averager._say_alone).
ALONE_LINE_EVERY_SECONDS = 60.0


@dataclass
class RoundReport:
    group_size: int
    seconds: float  # the whole round: matchmaking, all-reduce, outer step
    bytes_sent: int
    bytes_received: int
    skipped_shards: int
    allreduce_seconds: float = 0.0  # gossip mode: the exchange phase
    matchmaking_seconds: float = 0.0
    round_start_read: bool = True  # the table was read at the round's start (not: a direct follower, a plan member)
    tokens: float = 0.0  # what this node's Δ stood for (its weight in the round)
    consensus_distance: float = math.nan  # gossip mode: to the partners reached, before mixing
    schedule: str = ""  # all-reduce mode: how the group exchanged ("butterfly" or "ring", protocol/ring.py)
    owned_share: float = math.nan  # all-reduce mode: the fraction of the parameters whose shards this peer owned


def owned_share(group: averaging_pb2.Group, peer_id: str) -> float:
    """The fraction of the group's parameters in the shards ``peer_id`` owns (the leader sizes
    them by the members' declared bandwidths: protocol/layout.py)."""
    bounds = list(group.shard_bounds)
    if len(bounds) < 2 or bounds[-1] <= 0:
        return math.nan
    mine = [i for i, m in enumerate(group.members) if m.peer_id == peer_id]
    owned = sum(bounds[k + 1] - bounds[k] for k, owner in enumerate(group.shard_owners) if owner in mine)
    return owned / bounds[-1]


@dataclass
class RoundOutcome:
    """The network part of a round, done: what the commit (node/commit.py) turns into the next step."""

    report: RoundReport
    # Codec pool: the outer step on θ_global (returns the number of skipped shards); None when
    # the round already changed the state itself (gossip mode shields and waits for its own work).
    apply: Callable[[], int] | None = None
    # The group of an all-reduce round: the optimizer-state rounds (node/state_sync.py) reuse it.
    group: averaging_pb2.Group | None = None
    # An all-reduce round's averages as ``apply`` applies them, with their codec: kept for peers
    # that missed the round (protocol/missed_rounds.py). None for other rounds, and in runs that
    # sync the optimizer state (a missed round there changes that state too).
    applied: tuple[codecs.Codec, tuple[AppliedAverage, ...]] | None = None


@dataclass
class RoundUndo:
    """How to take back what an abandoned all-reduce wrote into our residual: its value before."""

    fragment: slice
    residual: torch.Tensor


class Averager:
    """The network part of this peer's rounds (see the module docstring)."""

    def __init__(self, config: Config, peer_id: str, state: GlobalState, *, swarm: SwarmPort, matchmaker: Matchmaker,
                 registry: ReduceRegistry, channels: ChannelPool, codec_executor: Executor, metrics: NodeMetrics,
                 stats: RunStats, faults: Faults, stop_training: threading.Event,
                 gossip: "GossipMode | None" = None) -> None:
        self.config = config
        self.peer_id = peer_id
        self.state = state
        self.swarm = swarm
        self.matchmaker = matchmaker
        self.registry = registry
        self.channels = channels
        self.codec_executor = codec_executor
        self.metrics = metrics
        self.stats = stats
        self.faults = faults
        self.stop_training = stop_training  # the busy-codec fault's job waits for a stop
        self.gossip = gossip
        # What the last all-reduce rounds said of our uplink; we declare their median (decisions.py).
        self.bandwidth_samples: deque[float] = deque(maxlen=decisions.BANDWIDTH_SAMPLES)
        self.tried: set[int] = set()  # recent steps whose round this peer started
        self.undo: RoundUndo | None = None  # set while an all-reduce may write our residual
        # (step it produced, Δ + residual we put into it): restored if that round's result loses
        # the majority vote at its step (the node's state download reads it).
        self.last_contribution: tuple[int, torch.Tensor] | None = None
        self._phase_task: asyncio.Task | None = None
        self._round_calls = 0  # rounds this process attempted (fault injection counts them)
        self._alone = RepeatedLine(ALONE_LINE_EVERY_SECONDS)

    def _say_alone(self, step: int, others: int) -> None:
        """A round nobody else joined, said at most once a minute: a peer whose others are busy
        (catching up, averaging elsewhere) fails one round per inner phase, every second with a
        small model, and the same line every second buried the rest of the log."""
        unsaid = self._alone.due()
        if unsaid is None:
            log.debug("nobody averaged with us at step %d although %d peer(s) are live; training on", step, others)
            return
        since = f" ({unsaid} more such round(s) since this line last showed)" if unsaid else ""
        log.warning("nobody averaged with us at step %d although %d peer(s) are live; training on%s",
                    step, others, since, extra={"event": "round_alone", "outer_step": step, "live_peers": others})

    async def _in_codec_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.codec_executor, fn, *args)

    def behind(self, view: "SwarmView") -> bool:
        """Whether ``view`` has peers past our step or a majority elsewhere at it."""
        return decisions.behind(view, self.swarm.position(), gossip=self.gossip is not None)

    async def others_registered(self, step: int, params_hash: str) -> bool:
        """Whether another peer registered for the round of ``step`` (overlapped phases cut on it)."""
        return await self.matchmaker.others_registered(step, params_hash)

    def publish_phase_soon(self) -> None:
        """Publish our record (with the current phase) in the background, now."""
        async def publish() -> None:
            try:
                await self.swarm.publish_record()
            except Exception as err:  # the heartbeat publishes again soon
                log.debug("publishing the phase failed: %r", err)

        self._phase_task = asyncio.create_task(publish())  # referenced, so it is not collected early

    async def run(self, fragment: slice, delta: torch.Tensor, weight: float) -> RoundOutcome | None:
        """Average ``delta`` (Δ of ``fragment``, trained on ``weight`` tokens) with a group.

        Returns what the round brought, or None when it failed before changing anything (the
        local progress then stays in the local model and goes into the next round).
        """
        started = time.monotonic()
        self.stats.phase = "averaging"
        step = self.state.step
        self.tried = {s for s in self.tried if s >= step - 1} | {step}
        if self.config.sync.overlap == "none":
            # Say so now rather than at the next heartbeat: slower peers cut their inner phase on it.
            self.publish_phase_soon()
        log.debug("round for step %d starts from params %s", step, self.state.params_hash[:8])
        if self.gossip is not None:  # gossip mode: its own partner choice, states differ by design
            report = await self.gossip.round(step, delta, weight)
            if report is None:
                return None
            self.stats.consensus_distance = report.consensus_distance
            if report.bytes_sent and report.allreduce_seconds > 0:
                self.stats.bandwidth_bps = report.bytes_sent / report.allreduce_seconds
            report.seconds = time.monotonic() - started
            report.tokens = weight
            return RoundOutcome(report)
        if await self._fault_miss(step):
            return None
        cached = self._direct_follower_view(step)
        # A member of the last step's split plan knows B and its bucket (protocol/buckets.py
        # ``bucketed_by_plan``) and starts from the heartbeat's view: only a leader needs a fresh
        # one (``RoundPeers.read_first``). At N = 1,024 the round start's read was 29 % of the
        # records a peer read (sim/README.md, "The heartbeat's reads").
        read_when_leading = False
        if cached is None and self.config.sync.matchmaking_buckets and bucketed_by_plan(
                step, self.matchmaker.last_plan, self.config.sync.group_size):
            cached = self.swarm.recent_view()
            read_when_leading = cached is not None
        view = cached if cached is not None else await self.swarm.refresh_view()
        if self.behind(view):
            # The swarm moved on while we trained, or holds other parameters at our step:
            # averaging now would fork a competing state. Our progress is kept (the catch-up
            # folds it into the residual) and we catch up.
            log.info("the swarm is past our state at step %d; catching up instead of averaging", step)
            self.metrics.round_failures.labels(reason="behind").inc()
            return None
        last = self.matchmaker.last_group
        if last is not None and not decisions.direct_round_allowed(view, self.swarm.position(),
                                                                   {m.peer_id for m in last.members}):
            # A live peer outside our last group (a joiner that just caught up, a slower peer):
            # the ordinary DHT round lets it see the round and join (the direct path of a stable
            # group closes in milliseconds, before a slower peer could notice and cut its phase).
            self.matchmaker.last_group = None
        # Only a fresh view may seed the matchmaker's first look: after a failed direct path, a
        # view from before the group's last commit would expect nobody at our step.
        unused_view = [view] if cached is None else []

        async def expected_peers() -> set[str]:
            # Peers the leader waits for: live, compatible, at our step with our parameters. The
            # matchmaker's first look uses the view just read (the direct path of a stable group
            # then reads the DHT no more); later looks read it afresh.
            seen = unused_view.pop() if unused_view else await self.swarm.refresh_view()
            return decisions.expected_peers(seen, self.swarm.position())

        # With [sync] matchmaking_buckets (the default) a large step matchmakes in buckets
        # (protocol/buckets.py): B from this view or the plan behind our state, and its leaders
        # wait for the peers expected in the heartbeat's latest one (no table read). Without it,
        # one leader per step, and neither O(N) pass over the view below runs on the event loop.
        position = self.swarm.position()

        def latest() -> set[str]:
            # Only a leader looks (a bucket's or the step coordinator); the coordinator's looks
            # also ask the heartbeat for a fresh table at its next beat (``watch``), a bucket
            # leader's do not (RoundPeers.look). The other members read no more than while training.
            return decisions.expected_peers(self.swarm.last_view(), position)

        round_peers = RoundPeers(frozenset(decisions.expected_peers(view, position)), latest=latest,
                                 plan_of_state=decisions.plan_of_state(view, position),
                                 read_first=self.swarm.refresh_view if read_when_leading else None,
                                 watch=self.swarm.want_view,
                                 ) if self.config.sync.matchmaking_buckets else None
        try:
            group = await self.matchmaker.form_group(
                step, weight, self.stats.bandwidth_bps, expected_peers,
                self.config.sync.matchmaking_timeout, params_hash=self.state.params_hash, numel=delta.numel(),
                round_peers=round_peers,
            )
        except MatchmakingError as err:
            log.warning("round for step %d failed: %s; training on", step, err)
            self.metrics.round_failures.labels(reason="matchmaking").inc()
            return None
        except IncompatiblePeer as err:
            raise refused_by_the_swarm(str(err), self.peer_id) from None
        matchmaking_seconds = time.monotonic() - started
        self.metrics.matchmaking_duration.observe(matchmaking_seconds)
        self.stats.rounds_attempted += 1
        if len(group.members) > 1:
            self.stats.group_rounds += 1
            self._alone.reset()
        log.debug("group of %d formed for step %d", len(group.members), step,
                  extra={"event": "group_formed", "outer_step": step, "group_size": len(group.members)})
        await self._fault_hold(step, group)

        if len(group.members) == 1:
            # Alone, a peer takes its own outer step only if nobody else is in the swarm: with
            # others present (perhaps still catching up to us) it waits for them by not moving on,
            # and its progress goes into the next round.
            view = self.swarm.last_view()
            if not decisions.solo_step_allowed(view, self.swarm.position()):
                self._say_alone(step, len(decisions.others(view, self.swarm.position())))
                self.metrics.round_failures.labels(reason="no_group").inc()
                return None
            outcome = self._solo_step(fragment, delta)
        else:
            outcome = await self._allreduce(group, fragment, delta)
        outcome.report.seconds = time.monotonic() - started
        outcome.report.matchmaking_seconds = matchmaking_seconds
        outcome.report.round_start_read = cached is None
        outcome.report.tokens = weight
        return outcome

    def _direct_follower_view(self, step: int) -> "SwarmView | None":
        """The heartbeat's view for the round start of a follower of a stable group's direct
        path, or None: read the table. Such a follower reads no table on its way to the leader:
        the leader reads it once for the group (somebody outside the group expected: the DHT
        way, protocol/direct.py), and the heartbeat's view answers ``behind`` unless the progress
        marks say it may not. Only while that view, too, has nobody outside the last group: a
        split step's round start needs a fresh view (its expected peers are what the step
        coordinator waits for; a view from before the last commit would leave most of them out).
        The read cost 0.16-0.21 s p50 at every round start (bench/overlap.py), on the path of
        the group's last member."""
        last = self.matchmaker.last_group
        if last is None or not self.matchmaker.follows_directly(step):
            return None
        return decisions.direct_follower_view(self.swarm.recent_view(), self.swarm.position(),
                                              {m.peer_id for m in last.members})

    async def _fault_hold(self, step: int, group: averaging_pb2.Group) -> None:
        """Fault injection for tests: stall inside a round (after the group formed, before sending
        anything) until the process is killed: in this process's ``hold_round``-th round with at
        least one partner, or in the first round in which this peer led (and so had already sent
        out) a group of at least ``hold_as_leader`` members."""
        as_leader = self.faults.hold_as_leader
        if (len(group.members) > 1 and self.faults.hold_round == self.stats.group_rounds) or (
            as_leader and self.matchmaker.led_last_group and len(group.members) >= as_leader
        ):
            log.warning("fault injection: holding the round of step %d", step,
                        extra={"event": "fault_hold", "outer_step": step})
            await asyncio.Event().wait()

    async def _fault_miss(self, step: int) -> bool:
        """Fault injection for tests: in this process's ``miss_round``-th round, take no part;
        wait until the swarm is past our step (at most the time a round may take), as a peer that
        came after the round's plan closed, and fail the round. True when it did."""
        self._round_calls += 1
        if self.faults.miss_round != self._round_calls:
            return False
        log.warning("fault injection: missing the round of step %d", step,
                    extra={"event": "fault_miss_round", "outer_step": step})
        sync = self.config.sync
        until = time.monotonic() + 2 * sync.matchmaking_timeout + 2 * sync.reduce_timeout
        while not self.behind(await self.swarm.refresh_view()) and time.monotonic() < until:
            await asyncio.sleep(0.5)
        self.metrics.round_failures.labels(reason="behind").inc()
        return True

    async def _fault_busy_codec(self, step: int, residual: torch.Tensor) -> None:
        """Fault injection for tests: in this process's ``busy_codec_round``-th round with a
        partner, hand the codec pool a job that writes the residual now and again after the grace
        period of a stop request (like an encode still running when the round is abandoned), then
        hold the round until it is abandoned."""
        if len(residual) == 0 or self.faults.busy_codec_round != self.stats.group_rounds:
            return
        grace = self.config.node.grace_period

        def busy() -> None:
            residual.fill_(math.nan)
            self.stop_training.wait()
            time.sleep(grace + 2.0)
            residual.fill_(math.nan)
            log.warning("fault injection: the busy codec job ended", extra={"event": "fault_codec_job_done"})

        self.codec_executor.submit(busy)
        log.warning("fault injection: codec pool busy in the round of step %d", step,
                    extra={"event": "fault_busy_codec", "outer_step": step})
        await asyncio.Event().wait()

    def _solo_step(self, fragment: slice, delta: torch.Tensor) -> RoundOutcome:
        """Alone in the swarm: the outer step uses our own Δ (plus what the residual carried)."""
        def work() -> int:
            grad = delta + self.state.residual[fragment]
            self.state.residual[fragment].zero_()
            self.state.outer.step_slice(self.state.params, fragment.start, grad)
            return 0

        return RoundOutcome(RoundReport(group_size=1, seconds=0.0, bytes_sent=0, bytes_received=0, skipped_shards=0),
                            apply=work)

    async def _allreduce(self, group: averaging_pb2.Group, fragment: slice, delta: torch.Tensor) -> RoundOutcome:
        reduce_started = time.monotonic()
        residual = self.state.residual[fragment]  # views: updated in place by the all-reduce

        def before() -> tuple[torch.Tensor, torch.Tensor]:
            contribution = self.state.residual.clone()
            contribution[fragment] += delta
            return contribution, residual.clone()

        contribution, residual_before = await self._in_codec_pool(before)
        # If this all-reduce is abandoned, the driver's rollback gives the residual this value back.
        self.undo = RoundUndo(fragment, residual_before)
        await self._fault_busy_codec(group.step, residual)
        result = await run_allreduce(group, self.peer_id, delta, residual, self.state.owner_residual[fragment],
                                     self.registry, self.channels, self.codec_executor, quorum=self.config.sync.quorum)
        self.undo = None
        sent, received = result.bytes_sent, result.bytes_received

        def apply() -> int:
            return apply_averages(self.state, fragment, result)

        seconds = time.monotonic() - reduce_started
        skipped = sum(average is None for average in result.averages)
        self.last_contribution = (group.step + 1, contribution)
        if log.isEnabledFor(logging.DEBUG):
            # Hashing every average is codec-pool work, not the loop's; submitted, not awaited, so
            # that nothing can cancel the round between its all-reduce and its outcome (undo is gone).
            header = (group.group_id.hex()[:8], self.state.params_hash[:8], [m.peer_id[-4:] for m in group.members],
                      list(group.shard_bounds))
            self.codec_executor.submit(lambda: log.debug(
                "round %s from %s: members %s bounds %s averages %s", *header,
                [None if a is None else params_sha256(a)[:8] for a in result.averages]))
        self.metrics.allreduce_duration.observe(seconds)
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)
        if result.payload_bytes:
            self.metrics.compression_ratio.set(4 * delta.numel() / result.payload_bytes)
        sample = decisions.bandwidth_sample(result.upload_bps, group.schedule == RING, sent, seconds)
        if sample is not None:
            self.bandwidth_samples.append(sample)
            self.stats.bandwidth_bps = decisions.declared_bandwidth(self.bandwidth_samples)
        if skipped:
            self.metrics.round_failures.labels(reason="shard_skipped").inc()
        applied = None if self.config.sync.state_sync else (codecs.get_codec(group.codec),
                                                             applied_averages(fragment, result))
        return RoundOutcome(RoundReport(len(group.members), 0.0, sent, received, skipped, allreduce_seconds=seconds,
                                        schedule="ring" if group.schedule == RING else "butterfly",
                                        owned_share=owned_share(group, self.peer_id)),
                            apply=apply, group=group, applied=applied)
