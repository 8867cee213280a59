"""The train/round loop of a node: inner phases, rounds (blocking or overlapped), commits.

``RoundLoop`` is mixed into ``Node`` (node/daemon.py), which owns the state it works on: the
trainer, θ_global and residuals (``self.state``), the matchmaker, the reduce registry, metrics
and executors. Blocking rounds: inner phase → Δ → round → commit. Overlapped rounds (``[sync]
overlap``): the round of step r runs in the background while step r+1 trains. Streaming
fragments (``[sync] fragments``): each round syncs one slice of the flat parameters.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from lowcomm.protocol.allreduce import run_allreduce
from lowcomm.protocol.handshake import IncompatiblePeer
from lowcomm.protocol.matchmaking import POLL_SECONDS, MatchmakingError
from lowcomm.protocol.state import Snapshot, params_sha256

from .apply import apply_averages
from . import decisions
from .cancel import cancel_and_wait
from .errors import FatalError
from .progress import InnerProgress
from .reports import Report
from .ports import PhaseStats

log = logging.getLogger("lowcomm.node")


@dataclass
class _Pending:
    """A round running in the background (overlap mode) and how its result reaches the local model."""

    fragment: slice
    delta: torch.Tensor
    local_at_send: torch.Tensor  # the local model's fragment when Δ was taken
    estimate: torch.Tensor | None  # eager mode: where the local model continued from
    step: int
    weight: float  # tokens the round's Δ stands for (given back to the next round if it fails)
    task: asyncio.Task | None = None  # _round_in_background: the round, its commit, the local shift
    # Once the averages are in: apply, commit and report, shielded (local work always finishes).
    commit: asyncio.Task | None = None
    weight_returned: bool = False  # the weight went back to tokens_since_round (exactly once)
    merged: bool = False  # the local model holds the round's outcome (shifted, or the eager step undone)


@dataclass
class RoundReport:
    group_size: int
    seconds: float  # the whole round: matchmaking, all-reduce, outer step
    bytes_sent: int
    bytes_received: int
    skipped_shards: int
    allreduce_seconds: float = 0.0
    matchmaking_seconds: float = 0.0
    tokens: float = 0.0  # what this node's Δ stood for (its weight in the round)


@dataclass
class RoundOutcome:
    """The network part of a round, done: what ``_apply_and_commit`` turns into the next step."""

    report: RoundReport
    # Codec pool: the outer step on θ_global (returns the number of skipped shards); None when
    # the round already changed the state itself (gossip mode shields and waits for its own work).
    apply: Callable[[], int] | None = None


@dataclass
class _RoundUndo:
    """How to take back what an abandoned all-reduce wrote into our residual: its value before."""

    fragment: slice
    residual: torch.Tensor


class RoundLoop:
    """The loop methods of ``Node``; see the module docstring."""

    async def _main_loop(self) -> None:
        if self.config.sync.overlap != "none":
            await self._overlapped_loop()
            return
        while not self._should_stop():
            await self._catch_up()
            await self._inner_phase(cut_when_outpaced=True)
            if self.stop_requested.is_set():
                break
            prepared = await self._prepare_round()
            if prepared is None:
                continue
            fragment, delta, _ = prepared
            outcome = await self._with_grace(self._round(fragment, delta, float(self.tokens_since_round)))
            if outcome is not None:
                self.tokens_since_round = 0
                frozen = await self._shielded_commit(self._apply_and_commit(outcome))
                await self._finish_commit(outcome.report, fragment, frozen, reset_local=True)

    def _should_stop(self) -> bool:
        max_rounds = self.config.node.max_rounds
        if max_rounds is not None and self.rounds_completed >= max_rounds:
            log.info("completed %d round(s) (--max-rounds); stopping", self.rounds_completed)
            return True
        return self.stop_requested.is_set()

    async def _with_grace(self, coro) -> RoundOutcome | None:
        """Run a round's network part; on a stop request it gets the grace period (a second
        signal ends that at once), then it is abandoned and rolled back (``_settle_state``)."""
        round_task = asyncio.create_task(coro, name="round")
        try:
            if await self._wait_or_stop(round_task):
                return round_task.result()
            log.warning("abandoning the round in flight")
            await cancel_and_wait(round_task)
            if round_task.cancelled():
                self.metrics.round_failures.labels(reason="aborted").inc()
                await self._settle_state()
                return None
            return round_task.result()  # it finished just as it was abandoned: keep its result
        finally:
            if not round_task.done():  # we were cancelled ourselves (a forced stop)
                await cancel_and_wait(round_task)
                await self._settle_state()

    async def _wait_or_stop(self, task: asyncio.Task) -> bool:
        """Wait for ``task``; once a stop is requested, for at most the grace period, and not at
        all after a second stop signal. Returns whether it is done."""
        stop = asyncio.create_task(self.stop_requested.wait())
        force = asyncio.create_task(self.force_stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task, force}, timeout=self.config.node.grace_period,
                                   return_when=asyncio.FIRST_COMPLETED)
            return task.done()
        finally:
            stop.cancel()
            force.cancel()

    async def _shielded_commit(self, coro):
        """Run the local part of a round (outer step, commit) so that it always finishes: a
        thread cannot be interrupted, and θ_global changed without its commit would be saved
        with the old step and hash. ``_settle_state`` waits for it if we are cancelled."""
        self._committing = asyncio.create_task(coro, name="commit")
        return await asyncio.shield(self._committing)

    async def _settle_state(self) -> None:
        """After a round was cancelled: wait for the work it left running (a commit, codec jobs
        in the pool that write θ_global or the residual), then give the residual back its value
        from before the all-reduce, so that the local progress is counted exactly once (the
        shutdown fold or the next round sends it) and the checkpoint matches its hash."""
        if self._committing is not None and not self._committing.done():
            await asyncio.wait([self._committing])
        await self.codec_executor.settle()
        undo, self._round_undo = self._round_undo, None
        if undo is not None:
            def restore() -> None:
                self.state.residual[undo.fragment].copy_(undo.residual)

            await self.in_codec_pool(restore)
            log.info("rolled back the abandoned round's residual", extra={"event": "round_rolled_back"})

    def _next_fragment(self) -> slice:
        """The part of the flat parameters this round syncs: all of it, or fragment (step mod K)."""
        count = self.config.sync.fragments
        bounds = [self.trainer.numel * i // count for i in range(count + 1)]
        index = self.state.step % count
        return slice(bounds[index], bounds[index + 1])

    async def _prepare_round(self) -> tuple[slice, torch.Tensor, torch.Tensor] | None:
        """(fragment, Δ, local parameters of the fragment) at a round boundary; None when the
        local model diverged. Whole-tensor arithmetic runs in the training thread, not on the
        event loop."""
        step = self.state.step
        if self.faults.nan_round == self.rounds_attempted + 1 and not self._nan_injected:
            # Fault injection for tests: the local model diverges (NaN weights) before this round.
            self._nan_injected = True
            await self.in_train_thread(self.trainer.set_params, torch.full_like(self.state.params, math.nan))
        fragment = self._next_fragment()

        def delta_now() -> tuple[bool, torch.Tensor, torch.Tensor]:
            local = self._local_params_now()[fragment]
            return bool(torch.isfinite(local).all()), self.state.params[fragment] - local, local

        finite, delta, local = await self.in_train_thread(delta_now)
        if not finite:
            # A diverged local model never sends: start over from θ_global, keep nothing of it.
            log.error("local model diverged (non-finite weights); resetting it to the global parameters",
                      extra={"event": "diverged", "outer_step": step})
            await self.in_train_thread(self.trainer.reset_to, self.state.params)
            self.tokens_since_round = 0
            self.metrics.round_failures.labels(reason="diverged").inc()
            return None
        return fragment, delta, local

    def _local_params_now(self) -> torch.Tensor:
        """Training thread: the local parameters, after whatever the inbox still had for them."""
        self.train_thread.drain()
        return self.trainer.get_params()

    def _phase_steps(self) -> int:
        """Inner steps between two rounds: H, or H/K with K fragments (each fragment is then
        synced every H steps, the fragments at staggered times)."""
        return max(1, round(self.config.train.inner_steps / self.config.sync.fragments))

    # -- overlapped rounds (DESIGN: never wait for the network) ---------------------------------

    async def _overlapped_loop(self) -> None:
        """The round of step r runs in the background while the inner phase of step r+1 trains.
        Its result shifts the local model by the difference between the averaged and the local
        update (so no local progress is lost): between two inner steps as soon as it is done
        (``overlap_apply = "arrival"``) or at the next boundary ("boundary"). An inner phase
        ends early when the round of its step already started elsewhere, so that no peer waits
        for a slower one; the training thread waits only for a round more than one step late."""
        while True:
            await self._inner_phase(watch=self._watch_round_start(self._pending))
            failed = False
            if self._pending is not None:
                failed = not await self._finish_overlapped(self._pending)
                self._pending = None
            if self._should_stop():
                break
            if failed or self._behind(self.view):
                await self._catch_up()  # only here is no round in flight
            prepared = await self._prepare_round()
            if prepared is None:
                continue
            fragment, delta, local = prepared
            pending = _Pending(fragment, delta, local, None, self.state.step, float(self.tokens_since_round))
            # The tokens of the phase just ended go with this Δ; the next phase counts afresh.
            self.tokens_since_round = 0
            if self.config.sync.overlap == "eager":
                estimate = await self.in_codec_pool(self._eager_estimate, fragment, delta)
                await self.in_train_thread(self.trainer.set_params_slice, fragment, estimate)
                pending.estimate = estimate
            pending.task = asyncio.create_task(self._round_in_background(pending), name="background-round")
            self._pending = pending

    def _eager_estimate(self, fragment: slice, delta: torch.Tensor) -> torch.Tensor:
        """Eager updates: where the local model trains on from while the round is on the wire,
        an outer step previewed (the shared momentum is left untouched) with our own Δ as the
        stand-in for the average that has not arrived. (The eager-updates paper mixes our
        fresh Δ for our 1/M share with the others' delayed ones; that measured worse here, see
        bench/analysis.md.)"""
        estimate = self.state.params[fragment].clone()
        self.state.outer.preview_slice(estimate, fragment.start, delta + self.state.residual[fragment])
        return estimate

    def _behind(self, view) -> bool:
        """Whether the (heartbeat's) view has peers past our step or a majority elsewhere at it."""
        return decisions.behind(view, self.position(), gossip=self.gossip is not None)

    async def _round_in_background(self, pending: "_Pending") -> RoundReport | None:
        """A background round that commits θ_global the moment it is done, not at the next
        boundary: peers that reach their boundary first then see us at the new step, with the
        new hash, and start the next round with us instead of averaging without us. With
        ``overlap_apply = "arrival"`` the local model gets the result right away too."""
        outcome = await self._round(pending.fragment, pending.delta, pending.weight)
        if outcome is None:
            self._return_weight(pending)  # the local model keeps that progress
            if self.config.sync.overlap_apply == "arrival":
                await self.train_thread.run_soon(self._merge, pending, False)
            return None
        pending.commit = asyncio.create_task(self._commit_in_background(pending, outcome), name="background-commit")
        self._committing = pending.commit
        return await asyncio.shield(pending.commit)

    async def _commit_in_background(self, pending: "_Pending", outcome: RoundOutcome) -> RoundReport:
        frozen = await self._apply_and_commit(outcome)
        if self.config.sync.overlap_apply == "arrival":
            await self.train_thread.run_soon(self._merge, pending, True)
        await self._finish_commit(outcome.report, pending.fragment, frozen, reset_local=False)
        return outcome.report

    def _return_weight(self, pending: "_Pending") -> None:
        """A round that averaged nothing: its tokens go with the next round (exactly once)."""
        if not pending.weight_returned:
            pending.weight_returned = True
            self.tokens_since_round += pending.weight

    def _merge(self, pending: "_Pending", succeeded: bool) -> None:
        """Training thread: give the local model the round's outcome. θ_global moved from where
        the local model started the phase (its Δ point, or the eager estimate) to the averaged
        result; after a failed round only the eager step is undone (nothing was averaged)."""
        if pending.merged:
            return
        pending.merged = True
        base = pending.estimate if pending.estimate is not None else pending.local_at_send
        if succeeded:
            self.trainer.add_to_slice(pending.fragment, self.state.params[pending.fragment] - base)
        elif pending.estimate is not None:
            self.trainer.add_to_slice(pending.fragment, pending.local_at_send - pending.estimate)

    async def _finish_overlapped(self, pending: "_Pending") -> bool:
        """At the boundary after the round: wait for it only if it is still running (more than
        one step late: said in the log and ``lowcomm_round_waits_total``); returns whether it
        produced a result."""
        assert pending.task is not None
        if not pending.task.done():
            waited = time.monotonic()
            log.info("the round of step %d is more than one step late; training waits for it", pending.step,
                     extra={"event": "round_late", "outer_step": pending.step})
            self.metrics.round_waits.inc()
            if not await self._wait_or_stop(pending.task):
                log.warning("abandoning the round in flight")
                await cancel_and_wait(pending.task)
            self.metrics.round_wait_seconds.inc(time.monotonic() - waited)
        if pending.commit is not None:
            # The averages were in: the commit always finishes, even when the round was abandoned.
            await asyncio.wait([pending.commit])
            pending.commit.result()
            succeeded = True
        else:
            if pending.task.cancelled():  # abandoned in the network part: its Δ stays in the local model
                self.metrics.round_failures.labels(reason="aborted").inc()
                await self._settle_state()
                self._return_weight(pending)
            else:
                pending.task.result()  # a failure that is not the round's (e.g. refused by the swarm) ends the node
            succeeded = False
        await self.in_train_thread(self._merge, pending, succeeded)
        return succeeded

    def _watch_round_start(self, pending: "_Pending | None"):
        """The watcher of an overlapped inner phase: ends it (sets ``cut``) as soon as another
        peer registered for the round that this phase leads to. Cutting costs no compute in
        overlapped mode (the next phase starts at once), and it keeps the swarm at the pace of
        its fastest peer instead of having everybody wait for the slowest at every round."""
        watch_step = pending.step + 1 if pending is not None else self.state.step
        if watch_step in self._rounds_tried:
            return None  # we already tried that round (and it failed): train a full phase

        async def watch(cut: threading.Event) -> None:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                if self.state.step != watch_step:
                    continue  # our background round is not done yet (or failed: then nothing to join)
                try:
                    if await self.matchmaker.others_registered(watch_step, self.state.params_hash):
                        cut.set()
                        return
                except Exception as err:  # a DHT hiccup: the phase simply runs to its end
                    log.debug("reading the round registrations failed: %r", err)

        return watch

    async def _inner_phase(self, cut_when_outpaced: bool = False, watch=None) -> PhaseStats:
        """Up to H inner steps (H/K with K fragments). With ``cut_when_outpaced`` (blocking
        rounds) the phase ends early once enough peers at our step finished theirs that the round
        could close without us: a slower peer then joins that round with the steps it did (its
        weight is its tokens) instead of arriving after it closed, catching up, and never
        averaging at all. ``watch`` (overlapped rounds) is another such watcher."""
        self.phase = "training"
        steps = self._phase_steps()
        progress = InnerProgress(steps, self.state.step, enabled=self.human)
        cut = threading.Event()
        done_steps = 0

        slow = self.faults.slow_step  # fault injection for tests: a straggler

        def on_step(done: int, loss: float) -> None:
            nonlocal done_steps
            done_steps = done
            progress.update(done, loss)
            self.train_thread.drain()  # an overlapped round's result, as soon as it is there
            if slow:
                self.stop_training.wait(slow)

        def should_stop() -> bool:
            return self.stop_training.is_set() or (cut.is_set() and done_steps > 0)

        def work() -> PhaseStats:
            try:
                return self.trainer.train_phase(steps, should_stop, on_step)
            finally:
                progress.close()

        watcher = None
        if cut_when_outpaced:
            self._publish_phase_soon()  # a failed round may have left "averaging" in our record
            watcher = asyncio.create_task(self._watch_pace(cut))
        elif watch is not None:
            watcher = asyncio.create_task(watch(cut))
        try:
            stats = await self.in_train_thread(work)
        finally:
            if watcher is not None:
                watcher.cancel()
        if stats.steps < steps and cut.is_set() and not self.stop_training.is_set():
            log.info("the swarm finished its inner phase of step %d first; joining its round after %d of %d steps",
                     self.state.step, stats.steps, steps,
                     extra={"event": "inner_phase_cut", "outer_step": self.state.step, "steps": stats.steps})
            self.metrics.inner_phase_cuts.inc()
        self.tokens_since_round += stats.tokens
        self.tokens_total += stats.tokens
        self.train_seconds += stats.seconds
        self.metrics.inner_steps.inc(stats.steps)
        self.metrics.tokens.inc(stats.tokens)
        if stats.steps:
            self.last_loss = stats.mean_loss
            self.tokens_per_second = stats.tokens / max(stats.seconds, 1e-9)
            self.metrics.train_loss.set(stats.mean_loss)
        # Measured at phase ends, where both clocks are exact (mid-phase the training time is not).
        self.train_clock = time.monotonic() - self.training_since
        self.metrics.compute_utilization.set(self.train_seconds / max(self.train_clock, 1e-9))
        return stats

    def _publish_phase_soon(self) -> None:
        """Publish our record (with the current phase) in the background, now."""
        async def publish() -> None:
            try:
                await self.publish_record()
            except Exception as err:  # the heartbeat publishes again soon
                log.debug("publishing the phase failed: %r", err)

        self._phase_task = asyncio.create_task(publish())  # referenced, so it is not collected early

    async def _watch_pace(self, cut: threading.Event) -> None:
        """Set ``cut`` when ``_outpaced`` says so; reads the view the heartbeat keeps fresh."""
        while True:
            await asyncio.sleep(min(1.0, self.config.node.heartbeat_interval))
            if self._outpaced(self.view):
                cut.set()
                return

    def _outpaced(self, view) -> bool:
        return decisions.outpaced(view, self.position(), self.config.sync.quorum)

    async def _round(self, fragment: slice, delta: torch.Tensor, weight: float) -> RoundOutcome | None:
        """The network part of a round: average ``delta`` (Δ of ``fragment``, trained on
        ``weight`` tokens) with a group. ``_apply_and_commit`` then applies the outer step to
        θ_global[fragment]: separately, because that local work must finish once begun, while
        this part may be abandoned (``_with_grace``).

        Returns what the round brought, or None when it failed before changing anything (the
        local progress then stays in the local model and goes into the next round).
        """
        started = time.monotonic()
        self.phase = "averaging"
        step = self.state.step
        self._rounds_tried = {s for s in self._rounds_tried if s >= step - 1} | {step}
        if self.config.sync.overlap == "none":
            # Say so now rather than at the next heartbeat: slower peers cut their inner phase on it.
            self._publish_phase_soon()
        log.debug("round for step %d starts from params %s", step, self.state.params_hash[:8])
        if self.gossip is not None:  # gossip mode: its own partner choice, states differ by design
            report = await self.gossip.round(step, delta, weight)
            if report is None:
                return None
            report.seconds = time.monotonic() - started
            report.tokens = weight
            return RoundOutcome(report)
        view = await self.refresh_view()
        if self._behind(view):
            # The swarm moved on while we trained, or holds other parameters at our step:
            # averaging now would fork a competing state. Our progress is kept (the catch-up
            # folds it into the residual) and we catch up.
            log.info("the swarm is past our state at step %d; catching up instead of averaging", step)
            self.metrics.round_failures.labels(reason="behind").inc()
            return None
        last = self.matchmaker.last_group
        if last is not None and not decisions.direct_round_allowed(view, self.position(),
                                                                   {m.peer_id for m in last.members}):
            # A live peer outside our last group (a joiner that just caught up, a slower peer):
            # the ordinary DHT round lets it see the round and join (the direct path of a stable
            # group closes in milliseconds, before a slower peer could notice and cut its phase).
            self.matchmaker.last_group = None
        unused_view = [view]

        async def expected_peers() -> set[str]:
            # The matchmaker's first look uses the view just read (the direct path of a stable
            # group then reads the DHT no more); later looks read it afresh.
            if unused_view:
                return decisions.expected_peers(unused_view.pop(), self.position())
            return await self._expected_peers()

        try:
            group = await self.matchmaker.form_group(
                step, weight, self.bandwidth_bps, expected_peers,
                self.config.sync.matchmaking_timeout, params_hash=self.state.params_hash, numel=delta.numel(),
            )
        except MatchmakingError as err:
            log.warning("round for step %d failed: %s; training on", step, err)
            self.metrics.round_failures.labels(reason="matchmaking").inc()
            return None
        except IncompatiblePeer as err:
            raise FatalError(f"refused by the swarm: {err}") from None
        matchmaking_seconds = time.monotonic() - started
        self.metrics.matchmaking_duration.observe(matchmaking_seconds)
        self.rounds_attempted += 1
        if len(group.members) > 1:
            self.group_rounds += 1
        log.debug("group of %d formed for step %d", len(group.members), step,
                  extra={"event": "group_formed", "outer_step": step, "group_size": len(group.members)})
        await self._fault_hold(step, group)

        if len(group.members) == 1:
            # Alone, a peer takes its own outer step only if nobody else is in the swarm: with
            # others present (perhaps still catching up to us) it waits for them by not moving on,
            # and its progress goes into the next round.
            if not decisions.solo_step_allowed(self.view, self.position()):
                log.warning("nobody averaged with us at step %d although %d peer(s) are live; training on",
                            step, len(decisions.others(self.view, self.position())))
                self.metrics.round_failures.labels(reason="no_group").inc()
                return None
            outcome = self._solo_step(fragment, delta)
        else:
            outcome = await self._allreduce(group, fragment, delta)
        outcome.report.seconds = time.monotonic() - started
        outcome.report.matchmaking_seconds = matchmaking_seconds
        outcome.report.tokens = weight
        return outcome

    async def _fault_hold(self, step: int, group) -> None:
        """Fault injection for tests: stall inside a round (after the group formed, before sending
        anything) until the process is killed. LOWCOMM_FAULT_HOLD_ROUND=<n>: in this process's
        n-th round with at least one partner; LOWCOMM_FAULT_HOLD_AS_LEADER=<size>: in the first round in which this peer
        led (and so had already sent out) a group of at least that size."""
        as_leader = self.faults.hold_as_leader
        if (len(group.members) > 1 and self.faults.hold_round == self.group_rounds) or (
            as_leader and self.matchmaker.led_last_group and len(group.members) >= as_leader
        ):
            log.warning("fault injection: holding the round of step %d", step,
                        extra={"event": "fault_hold", "outer_step": step})
            await asyncio.Event().wait()

    async def _fault_busy_codec(self, step: int, residual: torch.Tensor) -> None:
        """Fault injection for tests: LOWCOMM_FAULT_BUSY_CODEC_ROUND=<n> makes this process's n-th
        round with a partner hand the codec pool a job that writes the residual now and again
        after the grace period of a stop request (like an encode still running when the round is
        abandoned), then hold the round until it is abandoned."""
        if len(residual) == 0 or self.faults.busy_codec_round != self.group_rounds:
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

    async def _allreduce(self, group, fragment: slice, delta: torch.Tensor) -> RoundOutcome:
        reduce_started = time.monotonic()
        residual = self.state.residual[fragment]  # views: updated in place by the all-reduce

        def before() -> tuple[torch.Tensor, torch.Tensor]:
            contribution = self.state.residual.clone()
            contribution[fragment] += delta
            return contribution, residual.clone()

        contribution, residual_before = await self.in_codec_pool(before)
        # If this all-reduce is abandoned, _settle_state gives the residual this value back.
        self._round_undo = _RoundUndo(fragment, residual_before)
        await self._fault_busy_codec(group.step, residual)
        result = await run_allreduce(group, self.peer_id, delta, residual, self.state.owner_residual[fragment],
                                     self.registry, self.channels, self.codec_executor, quorum=self.config.sync.quorum)
        self._round_undo = None
        sent, received = result.bytes_sent, result.bytes_received

        def apply() -> int:
            return apply_averages(self.state, fragment, result)

        skipped = sum(average is None for average in result.averages)
        self.last_contribution = (group.step + 1, contribution)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("round %s from %s: members %s bounds %s averages %s", group.group_id.hex()[:8],
                      self.state.params_hash[:8], [m.peer_id[-4:] for m in group.members], list(group.shard_bounds),
                      [None if a is None else params_sha256(a)[:8] for a in result.averages])
        seconds = time.monotonic() - reduce_started
        self.metrics.allreduce_duration.observe(seconds)
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)
        if result.payload_bytes:
            self.metrics.compression_ratio.set(4 * delta.numel() / result.payload_bytes)
        if sent and seconds > 0:
            self.bandwidth_bps = sent / seconds
        if skipped:
            self.metrics.round_failures.labels(reason="shard_skipped").inc()
        return RoundOutcome(RoundReport(len(group.members), 0.0, sent, received, skipped, allreduce_seconds=seconds),
                            apply=apply)

    async def _apply_and_commit(self, outcome: RoundOutcome) -> dict:
        """The local part of a round: the outer step on θ_global, then the commit."""
        if outcome.apply is not None:
            await self.in_codec_pool(outcome.apply)
        return await self._commit_global()

    async def _commit_global(self) -> dict:
        """The round's result becomes our state: new step and hash, served to joiners, published.
        Returns copies of the committed state (``GlobalState.frozen_checkpoint``) for the eval
        and the checkpoint, written in the report thread while the next round may already
        change θ_global.

        The record says "training": a committed peer is on to its next inner phase (or, when
        overlapped, already in it), and peers at the new step must not take it for a finished one.
        """
        step = self.state.step + 1

        def freeze() -> tuple[dict, Snapshot]:
            # One hash and one copy serve the commit, the donor snapshot and the checkpoint.
            frozen = self.state.frozen_checkpoint()
            digest = params_sha256(frozen["params"])
            frozen.update(step=step, params_sha256=digest)
            return frozen, Snapshot.build(step, frozen["params"], frozen["momentum"], params_hash=digest)

        frozen, snapshot = await self.in_codec_pool(freeze)
        self.state.commit(frozen["params_sha256"])
        self.donor.publish(snapshot)
        self.phase = "training"
        await self.publish_record()
        return frozen

    async def _finish_commit(self, report: RoundReport, fragment: slice, frozen: dict, reset_local: bool) -> None:
        """After ``_commit_global``: count the round, then evaluate, checkpoint and report it in
        the report thread (training goes on meanwhile). Blocking rounds restart the local model
        of the fragment from θ_global first; overlapped rounds shift it instead (_merge)."""
        if reset_local:
            def reset_and_freeze() -> dict:
                self.trainer.set_params_slice(fragment, self.state.params[fragment])
                return self.frozen_trainer_state()

            trainer_state = await self.in_train_thread(reset_and_freeze)
        else:
            trainer_state = await self.train_thread.run_soon(self.frozen_trainer_state)
        self.rounds_completed += 1
        m = self.metrics
        m.rounds.inc()
        m.round_group_size.set(report.group_size)
        m.round_duration.observe(report.seconds)
        m.last_sync_timestamp.set(time.time())
        m.outer_step.set(self.state.step)
        event = {"outer_step": self.state.step, "params_sha256": self.state.params_hash,
                 "loss": self.last_loss, "group_size": report.group_size,
                 "round_seconds": report.seconds, "allreduce_seconds": report.allreduce_seconds,
                 "matchmaking_seconds": report.matchmaking_seconds, "bytes_sent": report.bytes_sent,
                 "payload_bytes": self.codec.encoded_size(fragment.stop - fragment.start),
                 "fragment": [fragment.start, fragment.stop],
                 "bytes_received": report.bytes_received, "skipped_shards": report.skipped_shards,
                 "numel": self.trainer.numel, "codec": self.codec.name, "tokens_total": self.tokens_total,
                 "tokens_averaged": report.tokens,
                 "compute_utilization": self.train_seconds / max(self.train_clock, 1e-9),
                 "train_seconds": self.train_seconds, "train_clock": self.train_clock}
        tokens_per_second = self.tokens_per_second

        def evaluate_and_save() -> float:
            eval_loss = self.evaluate_global(frozen["params"])
            try:
                self._write_checkpoint(frozen, trainer_state, event["tokens_total"])
            except OSError as err:  # the previous checkpoint stays intact (atomic writes)
                log.error("could not write the checkpoint of step %d: %s; training goes on", frozen["step"], err)
            return eval_loss

        def log_round(eval_loss: float, skipped: bool) -> None:
            log.info(
                "step %d | loss %.3f | eval %s | %.0f tok/s | round %.2fs | sent %s recv %s | group %d%s | %s",
                event["outer_step"], event["loss"], "skipped" if skipped else f"{eval_loss:.3f}", tokens_per_second,
                report.seconds, _human_bytes(report.bytes_sent), _human_bytes(report.bytes_received),
                report.group_size, f" | {report.skipped_shards} shard(s) skipped" if report.skipped_shards else "",
                event["params_sha256"][:12],
                extra={"event": "round_done", "eval_loss": eval_loss, "eval_skipped": skipped, **event},
            )

        def evaluated(eval_loss: float) -> None:
            if event["outer_step"] >= self.state.step:  # not overtaken by a catch-up meanwhile
                self.last_eval = eval_loss
                m.eval_loss.set(eval_loss)
            log_round(eval_loss, skipped=False)

        # Newest wins (node/reports.py): when the report thread is behind, this report replaces the
        # waiting one, whose eval is stale and whose checkpoint this one supersedes; its round line
        # then carries the last eval we have, marked skipped.
        self.reports.submit(Report(event["outer_step"], evaluate_and_save, evaluated,
                                   lambda: log_round(self.last_eval, skipped=True)))


def _human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f}{unit}" if unit == "B" else f"{count:.1f}{unit}"
        count /= 1000
    return f"{count:.1f}GB"
