"""The protocol's default clock (protocol/transport.py ``LoopClock``) on the loops it runs on:
fine enough to time a sub-millisecond transfer, and in the time base of the loop's timers."""

from __future__ import annotations

import asyncio
import time

import uvloop

from lowcomm.protocol.transport import LoopClock


def _busy(seconds: float) -> None:
    """Spend ``seconds`` without yielding to the loop (as the owner's read of a fast upload does)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def _whole_milliseconds(seconds: float) -> bool:
    return abs(seconds * 1000 - round(seconds * 1000)) < 1e-6


async def _interval_and_timer_gap() -> tuple[float, float]:
    clock = LoopClock()
    started = clock.monotonic()
    _busy(0.0003)
    interval = clock.monotonic() - started
    # The loop's timers count in the clock's time base: a sleep never ends early by its reading
    # (uvloop's timers lag time.monotonic() by less than a millisecond).
    before = clock.monotonic()
    await asyncio.sleep(0.01)
    return interval, clock.monotonic() - before


def test_under_uvloop_a_sub_millisecond_interval_is_timed_not_rounded_to_whole_milliseconds() -> None:
    # uvloop's loop.time() counts whole milliseconds: 0.3 ms read as 0 or 1 ms, so an owner timed
    # small uploads at exactly 1 or 2 ms and members declared bandwidths exactly 2x apart.
    interval, slept = uvloop.run(_interval_and_timer_gap())
    assert interval >= 0.0003 and not _whole_milliseconds(interval), interval
    assert slept >= 0.009, slept


def test_on_asyncios_own_loop_it_reads_the_loops_time() -> None:
    async def main() -> tuple[float, float]:
        return LoopClock().monotonic(), asyncio.get_running_loop().time()

    ours, loops = asyncio.run(main())
    assert ours <= loops
    interval, slept = asyncio.run(_interval_and_timer_gap())
    assert interval >= 0.0003 and not _whole_milliseconds(interval), interval
    assert slept >= 0.01, slept
