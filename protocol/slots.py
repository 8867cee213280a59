"""How many state downloads a donor serves at once, without letting slow readers keep the slots.

A donor serves at most ``limit`` ranges at a time. Each range holds its slot for at most
``lease_seconds``: a downloader that reads too slowly (or not at all) stops counting against the
limit then, so it cannot keep honest joiners out, and once another range took its place
(``crowded``) its stream is ended at the next chunk (``expired``). Streams past their lease still hold a chunk in memory until they end, so there
may be at most ``overdue_limit`` of them; beyond that, and when no slot frees up within
``wait_seconds``, a new request is refused at once and the downloader asks another donor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator


class SlotsBusy(Exception):
    """No download slot became free in time."""


class Lease:
    def __init__(self, expires_at: float) -> None:
        self.expires_at = expires_at

    def expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.expires_at


class DownloadSlots:
    def __init__(self, limit: int, lease_seconds: float = 120.0, wait_seconds: float = 10.0,
                 overdue_limit: int | None = None) -> None:
        self.limit = limit
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        self.overdue_limit = 2 * limit if overdue_limit is None else overdue_limit
        self._open: set[Lease] = set()
        self._changed = asyncio.Condition()

    def counts(self, now: float | None = None) -> tuple[int, int]:
        """(ranges within their lease, ranges past it that are still open)."""
        now = time.monotonic() if now is None else now
        overdue = sum(lease.expired(now) for lease in self._open)
        return len(self._open) - overdue, overdue

    def crowded(self) -> bool:
        """Whether more ranges are open than the limit: a stream past its lease must then end, as
        it holds a slot another downloader took. While nobody else needs it, a slow reader goes
        on (a joiner on a 1.5 Mbit/s link needs more than the lease for a range; ended, it was
        told that its slot went to another downloader when there was none)."""
        return len(self._open) > self.limit

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Lease]:
        """A slot for one range; raises ``SlotsBusy`` when none frees up within ``wait_seconds``."""
        deadline = time.monotonic() + self.wait_seconds
        async with self._changed:
            while True:
                now = time.monotonic()
                active, overdue = self.counts(now)
                if active < self.limit and overdue < self.overdue_limit:
                    break
                # Wake up when a range ends (notify) or when the next lease expires.
                next_expiry = min((l.expires_at for l in self._open if not l.expired(now)), default=deadline)
                if now >= deadline:
                    raise SlotsBusy(f"{active} download(s) in progress and {overdue} overdue; limit {self.limit}")
                # Not wait_for: on Python 3.11 it can swallow a cancel that comes with the notify.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.01, min(deadline, next_expiry) - now)):
                        await self._changed.wait()
            lease = Lease(time.monotonic() + self.lease_seconds)
            self._open.add(lease)
        try:
            yield lease
        finally:
            async with self._changed:
                self._open.discard(lease)
                self._changed.notify_all()
