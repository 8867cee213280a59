"""No silent loss of progress (issue 13 item 2): abandoned rounds, damaged checkpoints, step and
hash published together, a second stop signal."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import psutil
import pytest
import torch

from lowcomm.node import checkpoint, globalstate
from lowcomm.node.executors import TrackedThreadPool
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.stopsignals import REPEAT_WINDOW
from lowcomm.protocol.state import params_sha256

from .test_swarm_cli import ROUND_WAIT

SOLO = ["--max-rounds", "1"]  # a lone node takes solo outer steps


def two_checkpoints(swarm) -> list:
    """A lone node run twice: checkpoints of two different steps in its directory."""
    for _ in range(2):
        node = swarm.start(0, extra=SOLO)
        assert node.wait_exit(ROUND_WAIT * 2) == 0
    paths = checkpoint.list_checkpoints(swarm.workdir / "peer-0")
    assert len(paths) == 2
    return paths


# -- unit tests --------------------------------------------------------------------------------


def test_settle_waits_for_a_job_that_is_still_running():
    pool = TrackedThreadPool(2)
    release = threading.Event()
    wrote = []

    def busy() -> None:
        release.wait()
        wrote.append("late write")

    async def main() -> None:
        pool.submit(busy)
        settle = asyncio.create_task(pool.settle())
        await asyncio.sleep(0)  # settle is waiting: the job cannot end before release
        assert not settle.done()
        threading.Timer(0.05, release.set).start()
        await asyncio.wait_for(settle, 10)
        assert wrote == ["late write"]  # settle returned only after the job's write
        assert pool.unfinished() == []

    try:
        asyncio.run(main())
    finally:
        pool.shutdown()


def test_adopt_never_shows_the_new_step_with_the_old_hash(monkeypatch):
    state = GlobalState.fresh(torch.zeros(8), 0.7, 0.9)
    old = state.published()
    hashing = threading.Event()
    release = threading.Event()
    real_hash = globalstate.params_sha256

    def slow_hash(tensor):
        hashing.set()
        release.wait(10)
        return real_hash(tensor)

    monkeypatch.setattr(globalstate, "params_sha256", slow_hash)
    new_params = torch.ones(8)
    adopting = threading.Thread(target=state.adopt, args=(5, new_params, torch.zeros(8)))
    adopting.start()
    assert hashing.wait(10)
    assert state.published() == old  # mid-adopt: still the old pair, never (5, old hash)
    release.set()
    adopting.join(10)
    assert state.published() == (5, real_hash(new_params))


# -- through the real CLI ----------------------------------------------------------------------


def _damage_params(path) -> None:
    """A checkpoint whose file is intact but whose parameters do not match the hash stored with
    them (e.g. written from a state that changed under the writer)."""
    payload = checkpoint.read(path)
    payload["params"] = payload["params"] + 1.0
    checkpoint.save(path.parent, int(payload["step"]), payload)


@pytest.mark.multiprocess
def test_damaged_checkpoints_fall_back_to_the_previous_one_then_to_one_clear_error(swarm):
    older, newest = two_checkpoints(swarm)
    previous = checkpoint.read(older)
    _damage_params(newest)

    # The newest is damaged: the previous one is restored, not the initial weights.
    again = swarm.start(0, extra=SOLO)
    resumed = again.wait_event("resumed", ROUND_WAIT)
    assert resumed["checkpoint"] == older.name
    assert resumed["outer_step"] == previous["step"] > 0
    assert resumed["params_sha256"] == previous["params_sha256"] == params_sha256(previous["params"])
    assert again.wait_exit(ROUND_WAIT * 2) == 0

    # None is usable and nobody is there to download from: one clear line, not a fresh start.
    for path in checkpoint.list_checkpoints(swarm.workdir / "peer-0"):
        _damage_params(path)
    last = swarm.start(0, extra=SOLO)
    assert last.wait_exit(ROUND_WAIT) != 0
    errors = [line for line in last.raw_lines if line.startswith("lowcomm-node: error:")]
    assert len(errors) == 1 and "no usable checkpoint" in errors[0] and "--peers" in errors[0], errors
    assert not any("Traceback" in line for line in last.raw_lines)
    assert not any(e.get("event") == "round_done" for e in last.events)


# make test-slow (make test stays under 15 min); settling a busy codec pool is tested above
# without sockets
@pytest.mark.slow
@pytest.mark.multiprocess
def test_round_abandoned_at_shutdown_with_a_busy_codec_pool_restarts_consistently(swarm):
    grace = ["--set", "node.grace_period=1"]
    first = swarm.start(0, extra=grace)
    # The second peer's 2nd round with a partner: a codec job writes NaN into its residual (now,
    # and again after the grace period), and the round holds until it is abandoned.
    second = swarm.start(1, [first.multiaddr], extra=grace, env={"LOWCOMM_FAULT_BUSY_CODEC_ROUND": "2"})
    busy = second.wait_event("fault_busy_codec", ROUND_WAIT * 3)
    step = busy["outer_step"]
    children = swarm.descendants(second)
    second.signal(signal.SIGTERM)
    assert second.wait_exit(ROUND_WAIT) == 0
    kinds = [e.get("event") for e in second.events]
    # The checkpoint was taken only after the job that wrote the residual had ended.
    assert kinds.index("fault_codec_job_done") < kinds.index("round_rolled_back") < kinds.index("node_stopped")
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]

    newest = checkpoint.list_checkpoints(swarm.workdir / "peer-1")[-1]
    saved = checkpoint.read(newest)
    assert saved["step"] == step  # the step it had: the abandoned round changed nothing
    assert saved["params_sha256"] == params_sha256(saved["params"])
    assert bool(torch.isfinite(saved["residual"]).all())  # the job's writes were rolled back

    again = swarm.start(1, [first.multiaddr], extra=grace)
    resumed = again.wait_event("resumed", ROUND_WAIT)
    assert (resumed["outer_step"], resumed["params_sha256"]) == (step, saved["params_sha256"])
    again.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, ROUND_WAIT * 2)


@pytest.mark.multiprocess
def test_second_stop_signal_exits_within_seconds(swarm):
    patient = ["--set", "node.grace_period=120"]  # the first signal alone would wait this long
    first = swarm.start(0, extra=patient)
    second = swarm.start(1, [first.multiaddr], extra=patient, env={"LOWCOMM_FAULT_HOLD_ROUND": "1"})
    second.wait_event("fault_hold", ROUND_WAIT * 2)
    second.signal(signal.SIGTERM)
    second.wait_for(lambda e: "stop requested" in str(e.get("msg")), 30)
    # A person's second signal, later: one sent at once would repeat the first (node/stopsignals.py).
    time.sleep(REPEAT_WINDOW + 0.1)
    second.signal(signal.SIGTERM)
    assert second.wait_exit(30) == 0  # not the 120 s grace period
    second.wait_event("node_stopped", 5)  # it still saved its state
    newest = checkpoint.list_checkpoints(swarm.workdir / "peer-1")[-1]
    saved = checkpoint.read(newest)
    assert saved["params_sha256"] == params_sha256(saved["params"])
