"""SIGTERM and SIGHUP in a program inside a ``lowcomm.Swarm``: leave the block as Ctrl-C does.

A batch scheduler stops a job with SIGTERM (then SIGKILL after a grace period), and a closed
terminal sends SIGHUP. By default either ended the program at once: its progress since the last
round was lost, and its peers waited for it in their next round until its record expired. The
daemon stops gracefully on both (node/daemon.py); a program with a Swarm open does now too: the
signal raises ``Terminated`` in the main thread, which leaves the ``with`` block (or reaches
``close()`` at the program's end) like a ``KeyboardInterrupt``: the round in flight gets the grace
period, the progress is saved, the peer leaves the DHT; a second signal while it stops forces
the stop. ``Terminated`` is a ``SystemExit``, so the program then ends quietly with the shell's
code for the signal (128 + its number), and an ``except Exception`` in the loop does not catch it.

Only signals whose handler is still the default are taken, and only in the main thread (the only
one Python runs handlers in); the previous handlers come back when the Swarm is left.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(SystemExit):
    """A stop signal reached the program while a Swarm was open; its ``code`` is 128 + the
    signal's number."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated(128 + signum)


def take_stop_signals() -> dict[int, Any]:
    """Route SIGTERM and SIGHUP to ``Terminated`` where their handler is the default; returns the
    handlers replaced, for ``give_back_stop_signals``."""
    if threading.current_thread() is not threading.main_thread():
        return {}
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
