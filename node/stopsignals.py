"""The signals that stop a node (and the demo) gracefully: the first finishes or abandons the
round in flight within the grace period, a second one forces the stop.

SIGTERM (a service manager's or container's stop), SIGINT (Ctrl-C) and SIGHUP (the terminal or
ssh session closed: without it the process died at once, its progress since the last round lost),
unless the process was started to outlive its terminal (`nohup`, which ignores hangups).
"""

from __future__ import annotations

import signal


def stop_signals() -> list[int]:
    """SIGTERM, SIGINT, and SIGHUP unless this process ignores it. Read in the main thread, before
    a handler of our own replaces what the process inherited."""
    wanted = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        wanted.append(signal.SIGHUP)
    return wanted
