"""The round driver (node/driver.py) without sockets: a fake trainer whose every inner step moves
each parameter by -0.1, a fake network part of the round, the real commit, overlap and rollback;
and the driver's SwarmPort (node/swarmlink.py) over an in-memory DHT.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import torch

from lowcomm.node import decisions
from lowcomm.node.averaging import RoundOutcome, RoundReport, RoundUndo
from lowcomm.node.commit import Committer
from lowcomm.node.config import Config
from lowcomm.node.driver import RoundDriver, StopSignals
from lowcomm.node.executors import TrackedThreadPool
from lowcomm.node.faults import Faults
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.ports import PhaseStats, TrainerPort
from lowcomm.node.reports import ReportQueue
from lowcomm.node.runstats import RunStats
from lowcomm.node.swarm import SwarmView
from lowcomm.node.train_thread import TrainThread
from lowcomm.protocol import codecs
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.state import StateDonor

NUMEL = 8
STEP = 0.1  # what one fake inner step subtracts from every parameter
TOKENS = 10  # per fake inner step


class FakeTrainer:
    """A ``TrainerPort`` without a model: parameters in a vector, a fixed move per step."""

    def __init__(self, step_seconds: float = 0.0) -> None:
        self.numel = NUMEL
        self.params = torch.zeros(NUMEL)
        self.trace: list[float] = []  # params[0] before every inner step
        self.step_seconds = step_seconds  # a slower peer

    def get_params(self) -> torch.Tensor:
        return self.params.clone()

    def set_params(self, flat: torch.Tensor) -> None:
        self.params.copy_(flat)

    def set_params_slice(self, fragment: slice, values: torch.Tensor) -> None:
        self.params[fragment] = values

    def add_to_slice(self, fragment: slice, shift: torch.Tensor) -> None:
        self.params[fragment] += shift

    def reset_to(self, flat: torch.Tensor) -> None:
        self.set_params(flat)

    def train_phase(self, steps: int, should_stop: Callable[[], bool],
                    on_step: Callable[[int, float], None] | None = None) -> PhaseStats:
        done = 0
        for _ in range(steps):
            if should_stop():
                break
            self.trace.append(float(self.params[0]))
            self.params -= STEP
            time.sleep(self.step_seconds)
            done += 1
            if on_step is not None:
                on_step(done, 1.0)
        return PhaseStats(done, done * TOKENS, 1.0 if done else math.nan, 0.001 * done)

    def evaluate(self) -> float:
        return 0.0

    def local_state(self) -> dict:
        return {}

    def load_local_state(self, state: dict) -> None:
        pass


class FakeSwarm:
    """A ``SwarmPort`` of a peer alone with nobody to catch up with; records what it publishes."""

    def __init__(self, state: GlobalState, round_open: bool = False) -> None:
        self.state = state
        self.published: list[int] = []
        self.catch_ups = 0
        self.open = round_open  # what round_open() says: another peer averages at our step

    def last_view(self) -> SwarmView:
        return SwarmView({}, {}, 0.0)

    def want_view(self) -> None:
        pass  # a peer alone never leads a bucket

    async def refresh_view(self) -> SwarmView:
        return self.last_view()

    def recent_view(self) -> SwarmView | None:
        return self.last_view()

    async def publish_record(self) -> None:
        self.published.append(self.state.step)

    async def catch_up(self) -> None:
        self.catch_ups += 1

    def position(self) -> decisions.Position:
        return decisions.Position("peer-a", *self.state.published())

    def round_open(self) -> bool:
        return self.open


class FakeAverager:
    """The network part of a round: the group's average is our own Δ (what a group of identical
    peers would get), or, with ``hang``, an all-reduce that wrote the residual and never ends."""

    def __init__(self, state: GlobalState, hang: bool = False) -> None:
        self.state = state
        self.hang = hang
        self.calls: list[tuple[slice, torch.Tensor, float]] = []
        self.started = asyncio.Event()
        self.undo: RoundUndo | None = None
        self.tried: set[int] = set()
        self.last_contribution = None

    def behind(self, view: SwarmView) -> bool:
        return False

    def publish_phase_soon(self) -> None:
        pass

    async def others_registered(self, step: int, params_hash: str) -> bool:
        return False

    async def run(self, fragment: slice, delta: torch.Tensor, weight: float) -> RoundOutcome | None:
        self.calls.append((fragment, delta.clone(), weight))
        self.tried.add(self.state.step)
        if self.hang:
            self.undo = RoundUndo(fragment, self.state.residual[fragment].clone())
            self.state.residual[fragment].fill_(math.nan)  # the all-reduce's half-done write
            self.started.set()
            await asyncio.Event().wait()

        def apply() -> int:
            self.state.outer.step_slice(self.state.params, fragment.start, delta.clone())
            return 0

        return RoundOutcome(RoundReport(2, 0.0, 0, 0, 0, tokens=weight), apply=apply)


class Harness:
    def __init__(self, hang: bool = False, **settings: object) -> None:
        sync = {k: v for k, v in settings.items() if k in ("overlap", "overlap_apply", "fragments",
                                                          "matchmaking_timeout")}
        node = {"max_rounds": settings.get("max_rounds"), "grace_period": settings.get("grace_period", 20.0),
                "heartbeat_interval": 0.05}
        train = {"inner_steps": settings.get("inner_steps", 4)}
        self.config = Config.model_validate({"train": train, "sync": sync, "node": node})
        self.trainer: TrainerPort = FakeTrainer(float(settings.get("step_seconds", 0.0)))  # type: ignore[arg-type]
        self.state = GlobalState.fresh(torch.zeros(NUMEL), 0.7, 0.9)
        self.swarm = FakeSwarm(self.state, bool(settings.get("round_open", False)))
        self.averager = FakeAverager(self.state, hang)
        self.train_thread = TrainThread()
        self.codec_executor = TrackedThreadPool(2)
        self.report_executor = ThreadPoolExecutor(1)
        self.reports = ReportQueue(self.report_executor)
        self.metrics = NodeMetrics()
        self.stats = RunStats()
        self.stops = StopSignals()
        self.checkpoints: list[int] = []
        donor = StateDonor(Identity("peer-a", "f", "{}"))
        committer = Committer(self.state, self.trainer, swarm=self.swarm, donor=donor,
                              train_thread=self.train_thread, codec_executor=self.codec_executor,
                              reports=self.reports, metrics=self.metrics, stats=self.stats,
                              codec=codecs.get_codec("int8"), evaluate_global=lambda params, buffers: 0.0,
                              write_checkpoint=lambda frozen, *_: self.checkpoints.append(int(frozen["step"])))
        averager: Any = self.averager  # duck-typed: the driver uses the attributes FakeAverager has
        self.driver = RoundDriver(self.config, self.trainer, self.state, averager=averager,
                                  committer=committer, swarm=self.swarm, catch_up=self.swarm.catch_up,
                                  train_thread=self.train_thread,
                                  codec_executor=self.codec_executor, metrics=self.metrics, stats=self.stats,
                                  faults=Faults(), stops=self.stops, human=bool(settings.get("human", False)))

    def close(self) -> None:
        self.train_thread.shutdown()
        self.codec_executor.shutdown()
        self.report_executor.shutdown()


def run_driver(harness: Harness, during: Callable[[], object] | None = None) -> None:
    async def main() -> None:
        task = asyncio.create_task(harness.driver.run())
        if during is not None:
            await during()
        await asyncio.wait_for(task, 30)
        await harness.driver.abandon()
        await harness.reports.flush()

    try:
        asyncio.run(main())
    finally:
        harness.close()


def test_blocking_rounds_send_the_phase_delta_and_commit_in_order():
    h = Harness(max_rounds=3)
    run_driver(h)
    assert h.state.step == 3 and h.stats.rounds_completed == 3
    assert h.swarm.published == [1, 2, 3]  # each commit published its new step
    assert h.checkpoints == sorted(set(h.checkpoints)) and h.checkpoints[-1] == 3  # newest wins, in order
    for fragment, delta, weight in h.averager.calls:
        # The local model restarted from θ_global at every commit: each Δ is one phase's progress.
        assert fragment == slice(0, NUMEL) and torch.allclose(delta, torch.full((NUMEL,), 4 * STEP))
        assert weight == 4 * TOKENS
    assert torch.equal(h.trainer.get_params(), h.state.params)
    assert h.stats.tokens_since_round == 0 and h.stats.tokens_total == 3 * 4 * TOKENS
    assert h.swarm.catch_ups == 3  # asked before every phase


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys):
    """Human log lines (log_format "text", as deploy/lowcomm-node.service sets) may go to a
    journal: the inner-phase bar is for a terminal only, its \\r-redrawn frames would otherwise
    pile up there as one endless line per phase."""
    run_driver(Harness(max_rounds=1, human=True))
    assert "inner steps" not in capsys.readouterr().err


def test_fragments_are_synced_in_turn_and_only_the_synced_one_restarts():
    h = Harness(max_rounds=2, fragments=2)
    run_driver(h)
    assert [call[0] for call in h.averager.calls] == [slice(0, 4), slice(4, 8)]
    first, second = h.averager.calls[0][1], h.averager.calls[1][1]
    assert torch.allclose(first, torch.full((4,), 2 * STEP))  # H/K = 2 steps per phase
    assert torch.allclose(second, torch.full((4,), 4 * STEP))  # fragment 2 trained on through round 1


@pytest.mark.parametrize("apply", ["boundary", "arrival"])
def test_overlapped_round_shifts_the_local_model_without_losing_the_next_phase(apply):
    h = Harness(max_rounds=1, overlap="delayed", overlap_apply=apply)
    run_driver(h)
    assert h.state.step == 1 and len(h.averager.calls) == 1
    # Round 1 ran while phase 2 trained; the local model is θ_1 plus phase 2's progress.
    assert torch.allclose(h.trainer.get_params() - h.state.params, torch.full((NUMEL,), -4 * STEP), atol=1e-6)
    if apply == "boundary":  # the shift came only after phase 2: its steps ran on the unshifted model
        assert h.trainer.trace == pytest.approx([-i * STEP for i in range(8)])
    assert h.stats.tokens_since_round == 4 * TOKENS  # phase 2 goes with the next round


@pytest.mark.parametrize("round_open", [False, True])
def test_a_slower_peer_cuts_its_phase_by_the_join_by_time_of_a_round_it_sees_open(round_open):
    # A heartbeat (0.05 s) longer than half the matchmaking timeout (0.08 s): join_by is the
    # moment the round is seen open, i.e. the watcher's first look. 2,000 steps of 1 ms would
    # take 2 s; with the round open the phase ends at the first look, whatever the machine's speed.
    h = Harness(max_rounds=1, inner_steps=2000, step_seconds=0.001, matchmaking_timeout=0.08, round_open=round_open)
    run_driver(h)
    (_, _, weight), = h.averager.calls
    steps = weight // TOKENS
    cuts = h.metrics.inner_phase_cuts._value.get()
    if round_open:
        assert 0 < steps < 2000 and cuts == 1
    else:
        assert steps == 2000 and cuts == 0  # nobody averaging, no quorum: the whole phase


def test_an_abandoned_round_rolls_back_the_residual_and_keeps_the_progress():
    h = Harness(hang=True, grace_period=0.1)

    async def stop_once_started() -> None:
        await asyncio.wait_for(h.averager.started.wait(), 30)
        assert torch.isnan(h.state.residual).all()
        h.stops.requested.set()
        h.stops.training.set()

    run_driver(h, stop_once_started)
    assert h.state.step == 0 and h.stats.rounds_completed == 0
    assert torch.equal(h.state.residual, torch.zeros(NUMEL))  # the value from before the all-reduce
    assert h.averager.undo is None
    assert h.metrics.round_failures.labels(reason="aborted")._value.get() == 1
    assert h.stats.tokens_since_round == 4 * TOKENS  # the phase's progress waits for the next round


class MemoryDHT:
    """The two DHT calls of node/swarm.py, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, dict]] = {}

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.data.setdefault(key, {})[subkey] = value
        return True

    async def get(self, key: str) -> dict[str, dict]:
        return dict(self.data.get(key, {}))


def test_the_swarm_link_publishes_step_hash_and_phase_and_reads_them_back():
    from lowcomm.node.reconnect import Reconnector
    from lowcomm.node.swarmlink import SwarmLink

    config = Config.model_validate({})
    state = GlobalState.fresh(torch.zeros(NUMEL), 0.7, 0.9)
    stats = RunStats(phase="training", tokens_per_second=5.0)
    dht: Any = MemoryDHT()
    reconnector = Reconnector(dht, "peer-a", [], 10.0)  # only the heartbeat uses it
    link = SwarmLink(config, Identity("peer-a", config.run_fingerprint(), "{}"), state, dht_client=dht,
                     reconnector=reconnector, metrics=NodeMetrics(), stats=stats, address="127.0.0.1:1")

    async def main() -> None:
        await link.publish_record()
        mine = (await link.refresh_view()).peers["peer-a"]
        assert (mine.outer_step, mine.params_sha256, mine.phase, mine.tokens_per_second) == (
            0, state.params_hash, "training", 5.0)
        state.params += 1.0
        state.commit()
        stats.phase = "averaging"
        await link.publish_record()
        mine = (await link.refresh_view()).peers["peer-a"]
        assert (mine.outer_step, mine.params_sha256, mine.phase) == (1, state.params_hash, "averaging")
        assert link.position() == decisions.Position("peer-a", 1, state.params_hash) and link.last_view() is link.view
        await link.publish_record(leaving=True)
        view = await link.refresh_view()
        assert "peer-a" not in view.peers and "peer-a" in view.left

    asyncio.run(main())
