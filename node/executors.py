"""Executors whose running work can be waited for, and shut down without blocking the event loop.

A thread cannot be interrupted. When a round is cancelled (a stop request past the grace period,
a failure elsewhere in the round), the codec work it had handed to the pool runs on and still
writes into θ_global or the residuals. The shutdown checkpoint must not be taken while that
happens, so the node waits for everything that was in the pool at the moment of the cancel
(``settle``) before it rolls the round back and saves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable


class TrackedThreadPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that knows its unfinished jobs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unfinished: set[concurrent.futures.Future] = set()
        self._guard = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future = super().submit(fn, *args, **kwargs)
        with self._guard:
            self._unfinished.add(future)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: concurrent.futures.Future) -> None:
        with self._guard:
            self._unfinished.discard(future)

    def unfinished(self) -> list[concurrent.futures.Future]:
        with self._guard:
            return list(self._unfinished)

    async def settle(self) -> None:
        """Wait until every job that is queued or running now has ended (jobs submitted while
        waiting are waited for too). Never raises the jobs' errors: their owners handle them."""
        while pending := self.unfinished():
            await asyncio.wait([asyncio.wrap_future(job) for job in pending])


async def shutdown_without_blocking(*executors: Executor) -> None:
    """``shutdown(wait=True)`` for each, in a helper thread, so the event loop keeps serving."""
    def shutdown_all() -> None:
        for executor in executors:
            executor.shutdown(wait=True, cancel_futures=True)

    await asyncio.to_thread(shutdown_all)
