"""cancel_and_wait ends tasks that swallow a cancellation (Python 3.11's wait_for race)."""

from __future__ import annotations

import asyncio

from lowcomm.node.cancel import cancel_and_wait


def test_a_task_that_swallows_one_cancel_is_cancelled_again_until_it_ends():
    swallowed = []

    async def stubborn() -> None:
        # What a lost cancel looks like from the outside: the first CancelledError never
        # reaches the loop, which goes on as before (the heartbeat's case).
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)

    async def scenario() -> bool:
        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(task), 5)
        return task.cancelled()

    assert asyncio.run(scenario()) and swallowed == [True]


def test_gives_up_on_a_task_that_never_ends_and_skips_none():
    release = asyncio.Event()

    async def immortal() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def scenario() -> bool:
        task = asyncio.create_task(immortal(), name="immortal")
        await asyncio.sleep(0)
        await asyncio.wait_for(cancel_and_wait(task, None, patience=0.3), 5)
        still_running = not task.done()
        release.set()  # let it end, or asyncio.run would wait for it forever
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return still_running

    assert asyncio.run(scenario())
