"""The training thread's inbox: work that reaches the model between two inner steps."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from lowcomm.node.train_thread import TrainThread


@pytest.fixture
def thread():
    worker = TrainThread()
    yield worker
    worker.shutdown()


def test_run_soon_lands_between_steps_of_a_running_phase(thread):
    """A job submitted while a phase runs lands between two of its steps: not at its start (the
    job is submitted only after the phase drained its inbox once) and not after its end (the
    phase ends only once the job ran)."""
    started = threading.Event()  # set after the phase's first drain
    job_ran = threading.Event()
    give_up = threading.Event()  # the test failed: let the phase end so the thread can stop
    steps = 0
    ran_at: list[int] = []

    def phase() -> int:
        """A stand-in for an inner phase: steps, draining the inbox after each, until the job ran."""
        nonlocal steps
        while not job_ran.is_set() and not give_up.is_set():
            steps += 1
            thread.drain()
            started.set()
        return steps

    def job() -> str:
        ran_at.append(steps)
        job_ran.set()
        return threading.current_thread().name

    async def scenario() -> tuple[int, str]:
        running = asyncio.ensure_future(thread.run(phase))
        try:
            assert await asyncio.to_thread(started.wait, 10), "the phase did not start"
            name = await asyncio.wait_for(thread.run_soon(job), 10)
            return await asyncio.wait_for(running, 10), name
        finally:
            give_up.set()
            await asyncio.gather(running, return_exceptions=True)

    total, name = asyncio.run(scenario())
    assert name.startswith("lowcomm-train")
    # Run by the drain of a later step than the first, inside the phase.
    assert len(ran_at) == 1 and 1 < ran_at[0] <= total


def test_run_soon_runs_at_once_when_idle_and_keeps_order(thread):
    order: list[int] = []

    async def scenario() -> list[int]:
        results = await asyncio.gather(*(thread.run_soon(order.append, i) for i in range(5)))
        return results

    asyncio.run(scenario())
    assert order == [0, 1, 2, 3, 4]


def test_run_soon_hands_errors_back(thread):
    def broken() -> None:
        raise ValueError("shift does not fit")

    with pytest.raises(ValueError, match="shift does not fit"):
        asyncio.run(thread.run_soon(broken))


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are a Linux feature")
def test_compute_runs_nicer_than_the_rest_of_the_node():
    nicer = TrainThread(niceness=5)
    try:
        def nice_here() -> int:
            return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

        base = nice_here()
        assert asyncio.run(nicer.run(nice_here)) == min(19, base + 5)
        assert nice_here() == base  # only the training thread changed
    finally:
        nicer.shutdown()
