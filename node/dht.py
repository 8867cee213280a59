"""The hivemind DHT, started so that it can never outlive the node.

hivemind runs the DHT in a forked process that in turn starts the ``p2pd`` daemon. A node killed
with SIGKILL gets no chance to stop them, so both would be orphaned. On Linux each is asked to
receive SIGKILL when its parent dies (``PR_SET_PDEATHSIG``): node → DHT process → p2pd.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import os
import signal
import sys

import hivemind

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Make the calling process receive SIGKILL when its parent exits (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getppid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


class SupervisedDHT(hivemind.DHT):
    """``hivemind.DHT`` whose process and p2pd daemon die with the node."""

    def run(self) -> None:  # runs in the forked DHT process
        die_with_parent()
        spawn = asyncio.subprocess.create_subprocess_exec
        # Only this (forked) process is patched: p2pd, started from here, dies with it.
        asyncio.subprocess.create_subprocess_exec = functools.partial(spawn, preexec_fn=die_with_parent)
        super().run()
