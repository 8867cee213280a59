"""The one thread that touches the model (DESIGN §5), with an inbox for work that cannot wait.

Everything that reads or writes the local model runs here, so the trainer needs no locks. Most
work simply queues behind the current job (``run``): between rounds the thread is idle anyway.
An overlapped round, though, finishes while an inner phase is running, and its result should
reach the local model at once rather than when the phase ends: ``run_soon`` puts such work in
an inbox that the inner loop drains between two steps (``drain``), or that runs at once when
the thread is idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def lower_priority(niceness: int) -> None:
    """Make the calling thread ``niceness`` nicer (Linux: nice values are per thread). Threads
    it starts later (torch's intra-op pool) inherit it. Elsewhere: does nothing."""
    if niceness <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
    except OSError as err:  # e.g. a seccomp profile without setpriority: run at normal priority
        log.debug("could not lower the priority of %s: %s", threading.current_thread().name, err)


class TrainThread:
    def __init__(self, niceness: int = 0) -> None:
        # Compute yields the CPU to the node's latency-bound work (see [node] compute_niceness).
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-train",
                                           initializer=lower_priority, initargs=(niceness,))
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` after whatever the thread is doing now (an inner phase: after all of it)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def run_soon(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` between two inner steps of the running phase, or at once when idle."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as err:  # handed to the awaiting coroutine
                    done.set_exception(err)

        self._inbox.put(job)
        # Drains the inbox when the thread is idle; finds it empty if an inner step got there first.
        asyncio.get_running_loop().run_in_executor(self.executor, self.drain)
        return await asyncio.wrap_future(done)

    def drain(self) -> None:
        """In the thread only (the inner loop calls it between steps): run the inbox, in order."""
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            job()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.drain()  # nothing may be left waiting on a job that will never run
