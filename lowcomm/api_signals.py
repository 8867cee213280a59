"""SIGTERM and SIGHUP in a program inside a ``lowcomm.Swarm``: leave the block as Ctrl-C does.

A batch scheduler stops a job with SIGTERM (then SIGKILL after a grace period), and a closed
terminal sends SIGHUP. By default either ended the program at once: its progress since the last
round was lost, and its peers waited for it in their next round until its record expired. The
daemon stops gracefully on both (node/daemon.py); a program with a Swarm open does now too: the
signal raises ``Terminated`` in the main thread, which leaves the ``with`` block (or reaches
``close()`` at the program's end) like a ``KeyboardInterrupt``: the round in flight gets the grace
period, the progress is saved, the peer leaves the DHT; a second signal while it stops forces
the stop. A copy of the first signal within a second of it (``timeout`` signals the program and
then its process group) is the same stop, not a second one (REPEAT_WINDOW, node/stopsignals.py).
``Terminated`` is a ``SystemExit``, so the program then ends quietly with the shell's code for the
signal (128 + its number), and an ``except Exception`` in the loop does not catch it.

Only signals whose handler is still the default are taken, and only in the main thread (the only
one Python runs handlers in); the previous handlers come back when the Swarm is left.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any, Callable

from .node.stopsignals import RepeatFilter

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_repeats = RepeatFilter()  # tells the first stop signal from its copies; new at each take_stop_signals


class Terminated(SystemExit):
    """A stop signal reached the program while a Swarm was open; its ``code`` is 128 + the
    signal's number."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    # Raised again for the group's copy of a SIGTERM, it reached the Swarm while it stopped for
    # the first one, as a second signal does, and forced the stop.
    if _repeats.is_repeat():
        return
    raise Terminated(128 + signum)


def take_stop_signals(clock: Callable[[], float] = time.monotonic) -> dict[int, Any]:
    """Route SIGTERM and SIGHUP to ``Terminated`` where their handler is the default; returns the
    handlers replaced, for ``give_back_stop_signals``. ``clock``: monotonic seconds, for the
    window in which a signal repeats the first."""
    global _repeats
    if threading.current_thread() is not threading.main_thread():
        return {}
    _repeats = RepeatFilter(clock)
    replaced = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            replaced[sig] = signal.signal(sig, _raise_terminated)
    return replaced


def give_back_stop_signals(replaced: dict[int, Any]) -> None:
    """Restore the handlers ``take_stop_signals`` replaced, unless the program set its own since."""
    if not replaced or threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in replaced.items():
        if signal.getsignal(sig) is _raise_terminated:
            signal.signal(sig, previous)
