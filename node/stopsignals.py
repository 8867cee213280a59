"""The signals that stop a node (and the demo) gracefully: the first finishes or abandons the
round in flight within the grace period, a second one forces the stop.

SIGTERM (a service manager's or container's stop), SIGINT (Ctrl-C) and SIGHUP (the terminal or
ssh session closed: without it the process died at once, its progress since the last round lost),
unless the process was started to outlive its terminal (`nohup`, which ignores hangups).

One stop can arrive twice: coreutils `timeout 60 lowcomm-node join ...` sends its SIGTERM to the
node and then to its whole process group, the node included, microseconds apart. Counted as two,
that forced the stop ("second stop signal: abandoning everything") and skipped the graceful one
it asked for. So a stop signal within ``REPEAT_WINDOW`` of the first is the same request.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

log = logging.getLogger("lowcomm.node")

# Seconds after the first stop signal in which another one repeats it rather than forcing the
# stop. The copies a program and its process group get (`timeout`, a supervisor that signals a
# group) arrive within microseconds, or back to back once a busy event loop takes them; a person
# who wants the stop forced presses Ctrl-C again after seeing "stop requested", well over a second.
REPEAT_WINDOW = 1.0


def stop_signals() -> list[int]:
    """SIGTERM, SIGINT, and SIGHUP unless this process ignores it. Read in the main thread, before
    a handler of our own replaces what the process inherited."""
    wanted = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        wanted.append(signal.SIGHUP)
    return wanted


class RepeatFilter:
    """Tells a new stop signal from a repeat of the first one (see ``REPEAT_WINDOW``). ``clock``:
    monotonic seconds (a wall clock stepped by NTP would stretch or shrink the window)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = REPEAT_WINDOW) -> None:
        self.clock = clock
        self.window = window
        self._first: float | None = None  # when the first stop signal came

    def is_repeat(self) -> bool:
        """Whether a stop signal arriving now repeats the first one; the first one is not."""
        now = self.clock()
        if self._first is None:
            self._first = now
            return False
        # Measured from the first signal, not the last: a stream of copies cannot hold off a
        # person's later Ctrl-C.
        return now - self._first < self.window


def route_stop_signals(loop: asyncio.AbstractEventLoop, request_stop: Callable[[], None],
                       clock: Callable[[], float] = time.monotonic) -> list[int]:
    """Call ``request_stop`` in ``loop`` on each of ``stop_signals()``, but not on a repeat of the
    first one; returns the signals taken. Main thread only (asyncio's signal handlers)."""
    repeats = RepeatFilter(clock)

    def on_signal(sig: int) -> None:
        if repeats.is_repeat():
            log.debug("%s within %.0fs of the first stop signal: the same stop request",
                      signal.Signals(sig).name, REPEAT_WINDOW)
            return
        request_stop()

    taken = stop_signals()
    for sig in taken:
        loop.add_signal_handler(sig, on_signal, sig)
    return taken
