"""Overlapped rounds (``[sync] overlap``): the round of step r runs while step r+1 trains.

DESIGN: never wait for the network. At a boundary the driver (node/driver.py) takes Δ and starts
the round in the background; the next inner phase trains meanwhile. The round commits θ_global
the moment it is done (peers reaching their boundary first then see us at the new step), and its
result shifts the local model by the difference between the averaged and the local update, so
that no local progress is lost: between two inner steps as soon as it is done (``overlap_apply
= "arrival"``) or at the next boundary ("boundary"). ``overlap = "eager"`` previews the outer
step with our own Δ, so the local model trains on from that estimate while the round is on the
wire. A round that averaged nothing gives its weight (tokens) back to the next round, and only
the eager step is undone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lowcomm.protocol.matchmaking import POLL_SECONDS

from .averaging import RoundOutcome, RoundReport
from .cancel import cancel_and_wait

if TYPE_CHECKING:
    from .driver import PhaseWatch, RoundDriver

log = logging.getLogger("lowcomm.node")


@dataclass
class Pending:
    """A round running in the background and how its result reaches the local model."""

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


class OverlappedLoop:
    """The overlapped main loop of a ``RoundDriver``, built by it (uses its public methods)."""

    def __init__(self, driver: "RoundDriver") -> None:
        self.driver = driver
        self.pending: Pending | None = None  # the round running in the background

    async def run(self) -> None:
        """An inner phase ends early when the round of its step already started elsewhere, so
        that no peer waits for a slower one; the training thread waits only for a round more
        than one step late."""
        d = self.driver
        while True:
            await d.inner_phase(watch=self._watch_round_start(self.pending))
            failed = False
            if self.pending is not None:
                failed = not await self._finish(self.pending)
                self.pending = None
            if d.should_stop():
                break
            if failed or d.averager.behind(d.swarm.last_view()):
                await d.catch_up()  # only here is no round in flight
            prepared = await d.prepare_round()
            if prepared is None:
                continue
            fragment, delta, local = prepared
            pending = Pending(fragment, delta, local, None, d.state.step, float(d.stats.tokens_since_round))
            # The tokens of the phase just ended go with this Δ; the next phase counts afresh.
            d.stats.tokens_since_round = 0
            if d.config.sync.overlap == "eager":
                estimate = await d.in_codec_pool(self._eager_estimate, fragment, delta)
                await d.in_train_thread(d.trainer.set_params_slice, fragment, estimate)
                pending.estimate = estimate
            pending.task = asyncio.create_task(self._round_in_background(pending), name="background-round")
            self.pending = pending

    async def abandon(self) -> None:
        """After the loop was cancelled or failed: cancel the round in flight, wait for what it
        left running and roll it back; the local model then takes the committed average (or
        loses the eager step of a round that averaged nothing), so that no progress is counted
        twice by the shutdown fold."""
        d = self.driver
        pending, self.pending = self.pending, None
        if pending is not None and pending.task is not None:
            await cancel_and_wait(pending.task)
        await d.settle_state()
        if pending is not None:
            committed = pending.commit is not None and not pending.commit.cancelled()
            if not committed:
                self._return_weight(pending)
            await d.in_train_thread(self._merge, pending, committed)

    def _eager_estimate(self, fragment: slice, delta: torch.Tensor) -> torch.Tensor:
        """Eager updates: where the local model trains on from while the round is on the wire,
        an outer step previewed (the shared momentum is left untouched) with our own Δ as the
        stand-in for the average that has not arrived. (The eager-updates paper mixes our
        fresh Δ for our 1/M share with the others' delayed ones; that measured worse here, see
        bench/analysis.md.)"""
        state = self.driver.state
        estimate = state.params[fragment].clone()
        state.outer.preview_slice(estimate, fragment.start, delta + state.residual[fragment])
        return estimate

    async def _round_in_background(self, pending: Pending) -> RoundReport | None:
        """A background round that commits θ_global the moment it is done, not at the next
        boundary: peers that reach their boundary first then see us at the new step, with the
        new hash, and start the next round with us instead of averaging without us. With
        ``overlap_apply = "arrival"`` the local model gets the result right away too."""
        d = self.driver
        outcome = await d.averager.run(pending.fragment, pending.delta, pending.weight)
        if outcome is None:
            self._return_weight(pending)  # the local model keeps that progress
            if d.config.sync.overlap_apply == "arrival":
                await d.train_thread.run_soon(self._merge, pending, False)
            return None
        pending.commit = asyncio.create_task(self._commit_in_background(pending, outcome), name="background-commit")
        d.committing = pending.commit
        return await asyncio.shield(pending.commit)

    async def _commit_in_background(self, pending: Pending, outcome: RoundOutcome) -> RoundReport:
        d = self.driver
        frozen = await d.committer.apply_and_commit(outcome)
        if d.config.sync.overlap_apply == "arrival":
            await d.train_thread.run_soon(self._merge, pending, True)
        await d.committer.finish(outcome.report, pending.fragment, frozen, reset_local=False)
        return outcome.report

    def _return_weight(self, pending: Pending) -> None:
        """A round that averaged nothing: its tokens go with the next round (exactly once)."""
        if not pending.weight_returned:
            pending.weight_returned = True
            self.driver.stats.tokens_since_round += pending.weight

    def _merge(self, pending: Pending, succeeded: bool) -> None:
        """Training thread: give the local model the round's outcome. θ_global moved from where
        the local model started the phase (its Δ point, or the eager estimate) to the averaged
        result; after a failed round only the eager step is undone (nothing was averaged)."""
        if pending.merged:
            return
        pending.merged = True
        d = self.driver
        base = pending.estimate if pending.estimate is not None else pending.local_at_send
        if succeeded:
            d.trainer.add_to_slice(pending.fragment, d.state.params[pending.fragment] - base)
        elif pending.estimate is not None:
            d.trainer.add_to_slice(pending.fragment, pending.local_at_send - pending.estimate)

    async def _finish(self, pending: Pending) -> bool:
        """At the boundary after the round: wait for it only if it is still running (more than
        one step late: said in the log and ``lowcomm_round_waits_total``); returns whether it
        produced a result."""
        d = self.driver
        assert pending.task is not None
        if not pending.task.done():
            waited = time.monotonic()
            log.info("the round of step %d is more than one step late; training waits for it", pending.step,
                     extra={"event": "round_late", "outer_step": pending.step})
            d.metrics.round_waits.inc()
            if not await d.wait_or_stop(pending.task):
                log.warning("abandoning the round in flight")
                await cancel_and_wait(pending.task)
            d.metrics.round_wait_seconds.inc(time.monotonic() - waited)
        if pending.commit is not None:
            # The averages were in: the commit always finishes, even when the round was abandoned.
            await asyncio.wait([pending.commit])
            pending.commit.result()
            succeeded = True
        else:
            if pending.task.cancelled():  # abandoned in the network part: its Δ stays in the local model
                d.metrics.round_failures.labels(reason="aborted").inc()
                await d.settle_state()
                self._return_weight(pending)
            else:
                pending.task.result()  # a failure that is not the round's (e.g. refused by the swarm) ends the node
            succeeded = False
        await d.in_train_thread(self._merge, pending, succeeded)
        return succeeded

    def _watch_round_start(self, pending: Pending | None) -> "PhaseWatch | None":
        """The watcher of an overlapped inner phase: ends it (sets ``cut``) as soon as another
        peer registered for the round that this phase leads to. Cutting costs no compute in
        overlapped mode (the next phase starts at once), and it keeps the swarm at the pace of
        its fastest peer instead of having everybody wait for the slowest at every round."""
        d = self.driver
        watch_step = pending.step + 1 if pending is not None else d.state.step
        if watch_step in d.averager.tried:
            return None  # we already tried that round (and it failed): train a full phase

        async def watch(cut: threading.Event) -> None:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                if d.state.step != watch_step:
                    continue  # our background round is not done yet (or failed: then nothing to join)
                try:
                    if await d.averager.others_registered(watch_step, d.state.params_hash):
                        cut.set()
                        return
                except Exception as err:  # a DHT hiccup: the phase simply runs to its end
                    log.debug("reading the round registrations failed: %r", err)

        return watch
