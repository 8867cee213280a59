"""The round driver: inner phase → Δ → round → commit, blocking or overlapped, over fragments.

``RoundDriver`` runs a peer's training between rounds and its rounds between inner phases, on
the event loop; the model lives in the one training thread (node/train_thread.py). Everything it
works with comes through its constructor: the trainer (``TrainerPort``), θ_global and the
residuals (``GlobalState``), the network part of a round (``Averager``, node/averaging.py: the
matchmaker, the all-reduce registry, gossip), its local part (``Committer``, node/commit.py), the
swarm as the node sees it (``SwarmPort``: views, our record), the catch-up, the executors, the metrics,
the shared ``RunStats``, the fault injection of tests (``Faults``) and the stop signals. What to
do when (behind? outpaced? alone?) is decided by the plain functions of node/decisions.py.

Blocking rounds: inner phase → Δ → round → commit, and the fragment's local model restarts from
θ_global. Overlapped rounds (``[sync] overlap``, node/overlap.py): the round of step r runs in the
background while step r+1 trains. Streaming fragments (``[sync] fragments``): each round syncs one
slice of the flat parameters.

Stopping: a stop request lets the round in flight finish within the grace period, then abandons
it; an abandoned round's codec jobs are waited for and its residual rolled back
(``settle_state``), so that the local progress is counted exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import torch

from . import decisions
from .averaging import Averager, RoundOutcome
from .cancel import cancel_and_wait
from .commit import Committer
from .config import Config
from .errors import FatalError
from .executors import TrackedThreadPool
from .faults import Faults
from .globalstate import GlobalState
from .metrics import NodeMetrics
from .ports import PhaseStats, SwarmPort, TrainerPort
from .progress import InnerProgress
from .runstats import RunStats
from .state_sync import OptimizerStateHolding, StateSync
from .train_thread import TrainThread
from .trainer import Trainer

log = logging.getLogger("lowcomm.node")
T = TypeVar("T")

# A local model that diverges this many rounds in a row, each time from θ_global, will not train
# at these settings: the node stops and says what to lower instead of resetting forever.
DIVERGED_ROUNDS_LIMIT = 3
# How often a node waiting for peers to start with reads the swarm (``[node] wait_for_peers``):
# a peer that joined is in the table at its announce.
WAIT_FOR_PEERS_POLL = 1.0
# A watcher of an inner phase: sets the event to end the phase early (node/overlap.py).
PhaseWatch = Callable[[threading.Event], Awaitable[None]]


@dataclass
class StopSignals:
    """How the node tells the driver to stop: ``requested`` (first signal: finish or abandon the
    round within the grace period), ``forced`` (second signal: no grace any more) and ``training``
    (read by the training thread between inner steps)."""

    requested: asyncio.Event = field(default_factory=asyncio.Event)
    forced: asyncio.Event = field(default_factory=asyncio.Event)
    training: threading.Event = field(default_factory=threading.Event)


class RoundDriver:
    """Drives one peer's inner phases and rounds; see the module docstring. ``run`` is the
    node's main task; after it was cancelled or failed, ``abandon`` leaves a consistent state."""

    def __init__(self, config: Config, trainer: TrainerPort, state: GlobalState, *, averager: Averager,
                 committer: Committer, swarm: SwarmPort, catch_up: Callable[[], Awaitable[None]],
                 train_thread: TrainThread, codec_executor: TrackedThreadPool,
                 metrics: NodeMetrics, stats: RunStats, faults: Faults, stops: StopSignals,
                 human: bool = False) -> None:
        self.config = config
        self.trainer = trainer
        self.state = state
        self.averager = averager
        self.committer = committer
        self.swarm = swarm
        # Download the swarm's state when it is ahead of us or holds other parameters (node/catchup.py).
        self.catch_up = catch_up
        self.train_thread = train_thread
        self.codec_executor = codec_executor
        self.metrics = metrics
        self.stats = stats
        self.faults = faults
        self.stops = stops
        self.human = human  # a progress bar of the inner steps (InnerProgress: on a terminal only)
        self.committing: asyncio.Task | None = None  # the local part of the last round
        self._nan_injected = False
        self._diverged_in_a_row = 0  # rounds whose local model diverged since the last that did not
        # [sync] state_sync (DES-LOC, MT-DAO): optimizer-state rounds after a round's commit.
        self.state_sync: StateSync | None = None
        if config.sync.state_sync:
            if not isinstance(trainer, OptimizerStateHolding):
                raise FatalError("[sync] state_sync (method = \"desloc\" or \"mtdao\") works with lowcomm-node's own "
                                 "trainer only: the optimizer of a training loop of your own is not lowcomm's to average")
            self.state_sync = StateSync(config.sync.state_sync, averager.peer_id, trainer.numel, trainer,
                                        registry=averager.registry, channels=averager.channels,
                                        executor=codec_executor, in_train_thread=train_thread.run,
                                        codec=config.sync.state_codec, quorum=config.sync.quorum,
                                        residuals=state.state_residuals, owner_residuals=state.state_owner_residuals)
        self.overlap = None
        if config.sync.overlap != "none":
            from .overlap import OverlappedLoop  # it uses this class's public methods

            self.overlap = OverlappedLoop(self)

    async def in_train_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.train_thread.run(fn, *args)

    async def in_codec_pool(self, fn: Callable[..., T], *args: Any) -> T:
        executor: Executor = self.codec_executor
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self) -> None:
        if not await self.wait_for_peers():
            return
        if self.overlap is not None:
            await self.overlap.run()
            return
        while not self.should_stop():
            await self.catch_up()
            await self.inner_phase(cut_when_outpaced=True)
            if self.stops.requested.is_set():
                break
            prepared = await self.prepare_round()
            if prepared is None:
                continue
            fragment, delta, _ = prepared
            outcome = await self.with_grace(self.averager.run(fragment, delta, float(self.stats.tokens_since_round)))
            if outcome is not None:
                self.stats.tokens_since_round = 0
                frozen = await self.shielded_commit(self.committer.apply_and_commit(outcome))
                await self.sync_optimizer_state(outcome)
                await self.committer.finish(outcome.report, fragment, frozen, reset_local=True)

    async def wait_for_peers(self) -> bool:
        """Hold the first inner phase until ``[node] wait_for_peers`` peers, this one included,
        are in the swarm, or until another peer trains (the swarm has started: a lone peer that
        trains would otherwise wait for us, never stepping alone while we are there); False when
        a stop came first. Meanwhile our record says "waiting". The swarm is read every
        ``WAIT_FOR_PEERS_POLL`` seconds, and the count is logged whenever it changes."""
        wanted = self.config.node.wait_for_peers
        if wanted <= 1:
            return True  # no read: the default costs nothing
        logged = None
        while True:
            view = await self.swarm.refresh_view()
            started = decisions.swarm_training(view, self.swarm.position())
            present = len(decisions.others(view, self.swarm.position())) + 1
            if present >= wanted or started:
                if logged is not None:
                    log.info("%s: training starts", "the swarm trains already" if started and present < wanted
                             else f"{present} peers in the swarm")
                return True
            if present != logged:
                if logged is None:
                    self.stats.phase = "waiting"
                    await self.swarm.publish_record()
                log.info("waiting for %d peers before training (--wait-for-peers): %d in the swarm", wanted, present,
                         extra={"event": "waiting_for_peers", "wanted": wanted, "present": present})
                logged = present
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancel (node/cancel.py)
                async with asyncio.timeout(WAIT_FOR_PEERS_POLL):
                    await self.stops.requested.wait()
                return False
            except TimeoutError:
                pass

    async def abandon(self) -> None:
        """After ``run`` was cancelled or failed: wait for the work a round left running and roll
        it back, so that the shutdown checkpoint holds a consistent state."""
        if self.overlap is not None:
            await self.overlap.abandon()
        else:
            await self.settle_state()

    def should_stop(self) -> bool:
        return self.reached_max_rounds() or self.stops.requested.is_set()

    def reached_max_rounds(self) -> bool:
        max_rounds = self.config.node.max_rounds
        return max_rounds is not None and self.stats.rounds_completed >= max_rounds

    # -- stopping within the grace period ---------------------------------------------------------

    async def with_grace(self, coro: Coroutine[Any, Any, RoundOutcome | None]) -> RoundOutcome | None:
        """Run a round's network part; on a stop request it gets the grace period (a second
        signal ends that at once), then it is abandoned and rolled back (``settle_state``)."""
        round_task = asyncio.create_task(coro, name="round")
        try:
            if await self.wait_or_stop(round_task):
                return round_task.result()
            log.warning("abandoning the round in flight")
            await cancel_and_wait(round_task)
            if round_task.cancelled():
                self.metrics.round_failures.labels(reason="aborted").inc()
                await self.settle_state()
                return None
            return round_task.result()  # it finished just as it was abandoned: keep its result
        finally:
            if not round_task.done():  # we were cancelled ourselves (a forced stop)
                await cancel_and_wait(round_task)
                await self.settle_state()

    async def wait_or_stop(self, task: asyncio.Task) -> bool:
        """Wait for ``task``; once a stop is requested, for at most the grace period, and not at
        all after a second stop signal. Returns whether it is done."""
        stop = asyncio.create_task(self.stops.requested.wait())
        force = asyncio.create_task(self.stops.forced.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task, force}, timeout=self.config.node.grace_period,
                                   return_when=asyncio.FIRST_COMPLETED)
            return task.done()
        finally:
            stop.cancel()
            force.cancel()

    async def sync_optimizer_state(self, outcome: RoundOutcome) -> None:
        """After a committed all-reduce round: the optimizer-state rounds due at it
        (node/state_sync.py), abandoned like a round on a stop; their bytes count in its report."""
        if self.state_sync is None or outcome.group is None or not self.state_sync.due(outcome.group):
            return
        task = asyncio.create_task(self.state_sync.run(outcome.group), name="state_sync")
        try:
            finished = await self.wait_or_stop(task)
            if not finished:
                log.warning("abandoning the optimizer-state round in flight")
                await cancel_and_wait(task)
        finally:
            if not task.done():  # we were cancelled ourselves (a forced stop)
                await cancel_and_wait(task)
            if task.cancelled() or task.exception() is not None:
                await self.codec_executor.settle()  # its codec jobs write the residuals
                self.state_sync.rollback()
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error
        if not task.cancelled():
            synced = task.result()
            outcome.report.bytes_sent += synced.bytes_sent
            outcome.report.bytes_received += synced.bytes_received
            log.info("optimizer state %s averaged with the group (%d shard(s) skipped)", ", ".join(synced.synced),
                     synced.skipped_shards, extra={"event": "state_synced", "outer_step": self.state.step,
                                                   "states": synced.synced, "state_sha256": synced.hashes,
                                                   "skipped_shards": synced.skipped_shards})

    async def shielded_commit(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run the local part of a round (outer step, commit) so that it always finishes: a
        thread cannot be interrupted, and θ_global changed without its commit would be saved
        with the old step and hash. ``settle_state`` waits for it if we are cancelled."""
        self.committing = asyncio.create_task(coro, name="commit")
        return await asyncio.shield(self.committing)

    async def settle_state(self) -> None:
        """After a round was cancelled: wait for the work it left running (a commit, codec jobs
        in the pool that write θ_global or the residual), then give the residual back its value
        from before the all-reduce, so that the local progress is counted exactly once (the
        shutdown fold or the next round sends it) and the checkpoint matches its hash."""
        if self.committing is not None and not self.committing.done():
            await asyncio.wait([self.committing])
        await self.codec_executor.settle()
        undo, self.averager.undo = self.averager.undo, None
        if undo is not None:
            def restore() -> None:
                self.state.residual[undo.fragment].copy_(undo.residual)

            await self.in_codec_pool(restore)
            log.info("rolled back the abandoned round's residual", extra={"event": "round_rolled_back"})

    # -- the round boundary -----------------------------------------------------------------------

    def next_fragment(self) -> slice:
        """The part of the flat parameters this round syncs: all of it, or fragment (step mod K)."""
        return decisions.fragment(self.trainer.numel, self.config.sync.fragments, self.state.step)

    async def prepare_round(self) -> tuple[slice, torch.Tensor, torch.Tensor] | None:
        """(fragment, Δ, local parameters of the fragment) at a round boundary; None when the
        local model diverged. Whole-tensor arithmetic runs in the training thread, not on the
        event loop."""
        step = self.state.step
        if self.faults.nan_round == self.stats.rounds_attempted + 1 and not self._nan_injected:
            # Fault injection for tests: the local model diverges (NaN weights) before this round.
            self._nan_injected = True
            await self.in_train_thread(self.trainer.set_params, torch.full_like(self.state.params, math.nan))
        fragment = self.next_fragment()

        def delta_now() -> tuple[bool, torch.Tensor, torch.Tensor]:
            local = self.local_params_now()[fragment]
            return bool(torch.isfinite(local).all()), self.state.params[fragment] - local, local

        finite, delta, local = await self.in_train_thread(delta_now)
        if not finite:
            # A diverged local model never sends: start over from θ_global, keep nothing of it.
            log.error("local model diverged (non-finite weights); resetting it to the global parameters",
                      extra={"event": "diverged", "outer_step": step})
            await self.in_train_thread(self.trainer.reset_to, self.state.params)
            self.stats.tokens_since_round = 0
            self.metrics.round_failures.labels(reason="diverged").inc()
            self._diverged_in_a_row += 1
            if self._diverged_in_a_row >= DIVERGED_ROUNDS_LIMIT:
                raise FatalError(self._unstable_training())
            return None
        self._diverged_in_a_row = 0
        return fragment, delta, local

    def _unstable_training(self) -> str:
        """Why the node stops after DIVERGED_ROUNDS_LIMIT divergences in a row, and what to change."""
        train = self.config.train
        knobs = (f"lower [train] lr (now {train.lr:g}) or grad_clip (now {train.grad_clip:g})"
                 if isinstance(self.trainer, Trainer) else "lower your optimizer's learning rate")
        return (f"the local model diverged (non-finite weights) in {self._diverged_in_a_row} rounds in a row, each "
                f"time restarted from the global parameters of step {self.state.step}: the inner training is unstable "
                f"at these settings; {knobs}. The checkpoint of step {self.state.step} is kept")

    def local_params_now(self) -> torch.Tensor:
        """Training thread: the local parameters, after whatever the inbox still had for them."""
        self.train_thread.drain()
        return self.trainer.get_params()

    def phase_steps(self) -> int:
        """Inner steps between two rounds (decisions.phase_steps)."""
        return decisions.phase_steps(self.config.train.inner_steps, self.config.sync.fragments)

    # -- the inner phase --------------------------------------------------------------------------

    async def inner_phase(self, cut_when_outpaced: bool = False, watch: PhaseWatch | None = None) -> PhaseStats:
        """Up to H inner steps (H/K with K fragments). With ``cut_when_outpaced`` (blocking
        rounds) the phase ends early once enough peers at our step finished theirs that the round
        could close without us: a slower peer then joins that round with the steps it did (its
        weight is its tokens) instead of arriving after it closed, catching up, and never
        averaging at all. ``watch`` (overlapped rounds) is another such watcher."""
        self.stats.phase = "training"
        steps = self.phase_steps()
        progress = InnerProgress(steps, self.state.step, enabled=self.human)
        cut = threading.Event()
        done_steps = 0
        stop_training = self.stops.training

        slow = self.faults.slow_step  # fault injection for tests: a straggler

        def on_step(done: int, loss: float) -> None:
            nonlocal done_steps
            done_steps = done
            progress.update(done, loss)
            self.train_thread.drain()  # an overlapped round's result, as soon as it is there
            if slow:
                stop_training.wait(slow)

        def should_stop() -> bool:
            return stop_training.is_set() or (cut.is_set() and done_steps > 0)

        def work() -> PhaseStats:
            try:
                return self.trainer.train_phase(steps, should_stop, on_step)
            finally:
                progress.close()

        watcher = None
        if cut_when_outpaced:
            self.averager.publish_phase_soon()  # a failed round may have left "averaging" in our record
            watcher = asyncio.create_task(self._watch_pace(cut))
        elif watch is not None:
            watcher = asyncio.create_task(watch(cut))
        try:
            stats = await self.in_train_thread(work)
        finally:
            if watcher is not None:
                watcher.cancel()
        if stats.steps < steps and cut.is_set() and not stop_training.is_set():
            # Blocking rounds: _watch_pace set the cut and returned why ("outpaced" or "join_by");
            # overlapped ones: the next round started.
            reason = watcher.result() if cut_when_outpaced else "overlap"
            log.info("the swarm finished its inner phase of step %d first; joining its round after %d of %d steps (%s)",
                     self.state.step, stats.steps, steps, reason,
                     extra={"event": "inner_phase_cut", "outer_step": self.state.step, "steps": stats.steps,
                            "reason": reason})
            self.metrics.inner_phase_cuts.inc()
        self._count(stats)
        return stats

    def _count(self, phase: PhaseStats) -> None:
        stats, m = self.stats, self.metrics
        stats.tokens_since_round += phase.tokens
        stats.tokens_total += phase.tokens
        stats.train_seconds += phase.seconds
        m.inner_steps.inc(phase.steps)
        m.tokens.inc(phase.tokens)
        if phase.steps:
            stats.last_loss = phase.mean_loss
            stats.tokens_per_second = phase.tokens / max(phase.seconds, 1e-9)
            m.train_loss.set(phase.mean_loss)
        # Measured at phase ends, where both clocks are exact (mid-phase the training time is not).
        stats.train_clock = time.monotonic() - stats.training_since
        m.compute_utilization.set(stats.compute_utilization)

    async def _watch_pace(self, cut: threading.Event) -> str:
        """Set ``cut`` when decisions.outpaced says so, or at decisions.join_by of the round of our
        step once we see it open; reads what the heartbeat keeps fresh (no DHT call here).
        Returns which of the two cut the phase."""
        sync, heartbeat = self.config.sync, self.config.node.heartbeat_interval
        loop = asyncio.get_running_loop()
        join_by = math.inf
        while True:
            await asyncio.sleep(min(1.0, heartbeat))
            me = self.swarm.position()
            if decisions.outpaced(self.swarm.last_view(), me, sync.quorum):
                cut.set()
                return "outpaced"
            now = loop.time()
            if join_by == math.inf and self.swarm.round_open():
                join_by = decisions.join_by(now, sync.matchmaking_timeout, heartbeat)
                log.debug("the round of step %d is open; this phase ends within %.1fs", me.step, join_by - now,
                          extra={"event": "round_seen_open", "outer_step": me.step})
            if now >= join_by:
                cut.set()
                return "join_by"
