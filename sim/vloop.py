"""A virtual-time asyncio event loop: ``loop.time()`` is simulated, and when no callback is
ready the loop jumps straight to the next timer instead of sleeping.

asyncio's ``BaseEventLoop._run_once`` computes how long it may block (until the first timer)
and hands that timeout to its selector. Our selector never blocks: it advances the virtual
clock by exactly that timeout and reports no I/O. So ``asyncio.sleep``, ``asyncio.timeout``
and ``call_later`` behave exactly as on a real loop, in the same order, while an hour of
simulated time passes in microseconds. Nothing of the real protocol code has to change.

The simulator does no real I/O and uses no threads, so a selector without file descriptors is
all the loop needs (the loop's self-pipe is registered but never becomes readable). A loop
with nothing ready and no timer would block forever on a real loop; here it is a deadlock of
the simulation and raises ``SimulationDeadlock``.

The protocol reads its deadlines from an injected clock whose default is the running loop's
``loop.time()`` (protocol/transport.py ``LoopClock``), so on this loop it reads virtual time.
"""

from __future__ import annotations

import asyncio
import selectors
import types

START = 1_000.0  # virtual seconds at start (not 0: deadlines computed as "now - x" stay positive)


class SimulationDeadlock(RuntimeError):
    """Every task waits and no timer is scheduled: nothing can ever happen again."""


class _JumpingSelector(selectors.BaseSelector):
    """Registers file objects but never reports I/O; ``select(t)`` advances virtual time by t."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        self._loop = loop
        self._map: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj, events, data=None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fd] = key
        return key

    def unregister(self, fileobj) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._map.pop(fd)

    def modify(self, fileobj, events, data=None) -> selectors.SelectorKey:
        self.unregister(fileobj)
        return self.register(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:
            raise SimulationDeadlock("every task waits and no timer is scheduled")
        if timeout > 0:
            self._loop._now += timeout
        return []

    def get_map(self):
        return types.MappingProxyType(self._map)

    def close(self) -> None:
        self._map.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on virtual time (see the module docstring)."""

    def __init__(self, start: float = START) -> None:
        self._now = start
        super().__init__(selector=_JumpingSelector(self))
        self._clock_resolution = 1e-9  # timers fire at their exact virtual time, not "soon after"

    def time(self) -> float:
        return self._now


def run(coro, start: float = START):
    """Run ``coro`` to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
