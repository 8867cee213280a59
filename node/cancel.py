"""Cancelling tasks so that they really end.

Python 3.11's ``asyncio.wait_for`` loses a cancellation that arrives just as the future it waits
on completes (fixed in 3.12): the task then runs on as if nothing happened. With DHT futures
that complete from another thread this was seen once in about 40 node shutdowns: the
heartbeat task swallowed its cancel and ``gather`` waited for it forever. So a task is
cancelled again until it is done, and code on the hot paths uses ``asyncio.timeout`` instead.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

RECANCEL_SECONDS = 0.1


async def cancel_and_wait(*tasks: asyncio.Task | None, patience: float = 10.0) -> None:
    """Cancel ``tasks`` (None is skipped) and wait until they are done, cancelling again while
    they are not; after ``patience`` seconds the rest is left behind with a warning."""
    pending = {task for task in tasks if task is not None and not task.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_SECONDS)
        if pending and loop.time() >= deadline:
            log.warning("task(s) %s did not end within %.0fs of being cancelled; leaving them",
                        ", ".join(task.get_name() for task in pending), patience)
            return
    for task in tasks:  # retrieved, so that asyncio does not report them as never retrieved
        if task is not None and task.done() and not task.cancelled():
            task.exception()
