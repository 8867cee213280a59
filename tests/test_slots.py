"""Tests of lowcomm.protocol.slots: a donor's download slots, leases and overdue streams."""

from __future__ import annotations

import asyncio

import pytest

from lowcomm.protocol.slots import DownloadSlots, SlotsBusy


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_the_limit_holds_and_a_finished_range_frees_its_slot_at_once():
    async def scenario():
        slots = DownloadSlots(limit=1, lease_seconds=60, wait_seconds=30)
        order = []
        release = asyncio.Event()

        async def first():
            async with slots.lease():
                order.append("first in")
                await release.wait()
            order.append("first out")

        async def second():
            async with slots.lease():
                order.append("second in")

        tasks = [asyncio.create_task(first())]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(second()))
        await asyncio.sleep(0.05)
        assert order == ["first in"]  # the second waits for the only slot
        release.set()
        await asyncio.gather(*tasks)
        assert order == ["first in", "first out", "second in"]

    run(scenario())


def test_a_reader_past_its_lease_stops_counting_and_is_told_so():
    async def scenario():
        slots = DownloadSlots(limit=1, lease_seconds=0.2, wait_seconds=30)
        async with slots.lease() as stuck:  # never finishes within its lease
            assert not stuck.expired()
            async with slots.lease() as honest:  # served once the stuck lease expired
                assert stuck.expired() and not honest.expired()
                assert slots.counts() == (1, 1)
        assert slots.counts() == (0, 0)

    run(scenario())


def test_busy_donors_refuse_after_the_wait_and_overdue_streams_are_bounded():
    async def scenario():
        slots = DownloadSlots(limit=1, lease_seconds=60, wait_seconds=0.1)
        async with slots.lease():
            with pytest.raises(SlotsBusy, match="limit 1"):
                async with slots.lease():
                    pass
        overdue = DownloadSlots(limit=1, lease_seconds=0.05, wait_seconds=0.3, overdue_limit=2)
        async with overdue.lease(), overdue.lease():  # the second after the first expired
            await asyncio.sleep(0.1)  # now both are past their lease
            assert overdue.counts()[1] == 2
            with pytest.raises(SlotsBusy, match="overdue"):
                async with overdue.lease():
                    pass

    run(scenario())
