"""The round-report queue (node/reports.py): newest wins, the newest checkpoint is always written."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from lowcomm.node.reports import Report, ReportQueue, cpu_copy


class State:
    """Stands for a frozen copy of θ_global: weakly referenced to see when the queue lets it go."""

    def __init__(self, step: int) -> None:
        self.step = step


def test_a_slow_report_thread_drops_stale_evals_but_writes_the_newest_checkpoint() -> None:
    async def scenario() -> tuple[list[int], list[int], list[int], ReportQueue, list]:
        written: list[int] = []  # checkpoints, in the report thread
        done: list[int] = []
        dropped: list[int] = []
        gate = threading.Event()
        states: list[weakref.ref] = []
        with ThreadPoolExecutor(1) as executor:
            queue = ReportQueue(executor)

            def submit(step: int) -> None:
                state = State(step)
                states.append(weakref.ref(state))

                def work(state: State = state) -> int:
                    gate.wait(10)  # the disk is slow: every commit arrives while step 1 is written
                    written.append(state.step)
                    return state.step

                queue.submit(Report(step, work, done.append, lambda: dropped.append(step)))

            for step in range(1, 11):
                submit(step)
                await asyncio.sleep(0)  # the worker takes step 1 into the executor
                if step >= 2:
                    # One running, one waiting: the older waiting report and its state are gone.
                    assert queue.running_step == 1 and queue.waiting_step == step
                    gc.collect()
                    assert [ref() is not None for ref in states].count(True) == 2
            gate.set()
            await queue.flush()
        return written, done, dropped, queue, states

    written, done, dropped, queue, states = asyncio.run(scenario())
    assert written == [1, 10] and done == [1, 10]  # the newest checkpoint is written, after the running one
    assert dropped == list(range(2, 10)) and queue.dropped == 8
    gc.collect()
    assert all(ref() is None for ref in states)  # nothing kept once written


def test_reports_run_in_order_and_a_failing_one_does_not_stop_the_queue() -> None:
    async def scenario() -> list[int]:
        done: list[int] = []
        with ThreadPoolExecutor(1) as executor:
            queue = ReportQueue(executor)

            def work(step: int) -> int:
                if step == 2:
                    raise OSError("disk full")
                return step

            for step in range(1, 5):
                queue.submit(Report(step, lambda step=step: work(step), done.append, lambda: None))
                await queue.flush()  # a report thread that keeps up drops nothing
            assert queue.dropped == 0
        return done

    assert asyncio.run(scenario()) == [1, 3, 4]


def test_flush_survives_the_cancel_of_its_caller() -> None:
    async def scenario() -> list[int]:
        done: list[int] = []
        gate = threading.Event()
        with ThreadPoolExecutor(1) as executor:
            queue = ReportQueue(executor)
            queue.submit(Report(7, lambda: gate.wait(10) and 7, done.append, lambda: None))
            waiter = asyncio.create_task(queue.flush())
            await asyncio.sleep(0)
            waiter.cancel()
            gate.set()
            await queue.flush()  # the checkpoint of step 7 is still written
        return done

    assert asyncio.run(scenario()) == [7]


def test_cpu_copy_is_deep_and_on_the_cpu() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moment = torch.ones(3, device=device)
    state = {"optimizer": {"state": {0: {"exp_avg": moment, "step": torch.tensor(4.0)}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "inner_steps_done": 5, "pair": (torch.zeros(1), "x")}
    frozen = cpu_copy(state)
    moment.add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    copied = frozen["optimizer"]["state"][0]["exp_avg"]
    assert copied.device.type == "cpu" and torch.equal(copied, torch.ones(3))
    assert frozen["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert isinstance(frozen["pair"], tuple) and frozen["inner_steps_done"] == 5
