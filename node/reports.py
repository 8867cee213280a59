"""Backpressure for the round reports: a single-slot, newest-wins queue run in the report thread.

Every committed round hands the report thread an eval of θ_global and a checkpoint, each holding
a frozen copy of the state (node/commit.py ``Committer.finish``). When the thread is slower than
the rounds (a slow disk, a big eval set, a loaded machine), chaining every report after the
previous one lets those copies pile up without bound. Here at most one report runs and at most
one waits; a newer report replaces the waiting one, whose copy is released at once:

- a stale evaluation is worth nothing once a newer state exists, so it is dropped;
- the newest checkpoint is always written (the replaced report's checkpoint is older than the
  one that replaces it), so the last committed state is never lost, and ``flush`` waits for it.

So however far the thread falls behind, the reports hold at most two frozen copies of the state:
the one being written and the newest waiting one (one extra copy beyond the one in flight). A dropped report still says that its round is
done (``Report.dropped``): the round line is logged without its eval.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Report(Generic[T]):
    """One round's report: ``work`` runs in the executor, then ``done(result)`` on the event loop.

    ``dropped()`` runs on the event loop instead of both when a newer report replaced this one
    before it started. ``work`` holds the frozen state; nothing else keeps it alive.
    """

    step: int
    work: Callable[[], T]
    done: Callable[[T], None]
    dropped: Callable[[], None]


class ReportQueue:
    """Runs reports one at a time in ``executor``, in submission order, keeping only the newest
    waiting one (see the module docstring). Use it from one event loop."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._waiting: Report[Any] | None = None
        self._worker: asyncio.Task[None] | None = None
        self.running_step: int | None = None  # the step of the report in the executor, if any
        self.dropped = 0  # reports replaced before they started (counted for tests and logs)

    @property
    def waiting_step(self) -> int | None:
        return None if self._waiting is None else self._waiting.step

    def submit(self, report: Report[Any]) -> None:
        """Queue ``report``; it replaces the waiting report, if any (that one is dropped)."""
        stale, self._waiting = self._waiting, report
        if stale is not None:
            self.dropped += 1
            log.debug("report of step %d dropped for step %d (report thread behind)", stale.step, report.step)
            try:
                stale.dropped()
            except Exception:  # a report's callback must never stop the queue
                log.exception("reporting the dropped round of step %d failed", stale.step)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain(), name="round-reports")

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting is not None:
            report, self._waiting = self._waiting, None
            self.running_step = report.step
            try:
                result = await loop.run_in_executor(self._executor, report.work)
            except Exception:  # nobody awaits this task's result: say it here, and go on
                log.exception("the report of step %d failed", report.step)
                continue
            finally:
                self.running_step = None
            try:
                report.done(result)
            except Exception:
                log.exception("reporting the round of step %d failed", report.step)
            del report, result  # release the frozen state before waiting for the next one

    async def flush(self) -> None:
        """Wait until every queued report has run (the newest checkpoint is then written).

        A cancel of the caller does not cancel the reports: a checkpoint half-written by a
        cancelled task is harmless (atomic files), but one never written loses the round.
        """
        while self._worker is not None and not self._worker.done():
            await asyncio.wait({self._worker})  # never raises, and a cancel here leaves the worker alone


def cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` (nested dicts, lists and tuples) whose tensors are on the CPU.

    What a report keeps must not hold accelerator memory: a waiting report would otherwise keep
    a second copy of the optimizer state on the GPU next to the live one.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: cpu_copy(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(cpu_copy(item) for item in value)
    return copy.deepcopy(value)
