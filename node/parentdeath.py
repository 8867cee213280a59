"""A child process that must not outlive the process that started it.

A process killed with SIGKILL (or by the OOM killer) gets no chance to stop its children, and
children in a session of their own get no hangup either: they run on as orphans. On Linux a child
can ask the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``; it survives exec, and
"parent" is the thread that forked it). Used by the node's DHT process and p2pd (SIGKILL: node →
DHT process → p2pd) and by examples/launch.py's peers (SIGTERM: they stop gracefully).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Make the calling process receive ``signum`` when its parent exits (Linux; elsewhere a no-op
    that returns False). ``parent``: the pid the parent had, where the child knows it; without it,
    the parent of the moment. If the parent is gone already, the request could never fire: the
    process exits at once (status 1)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid() if parent is None else parent
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    return True
