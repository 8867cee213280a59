"""A joiner receives the inner optimizer's state in runs that sync it (DES-LOC, MT-DAO), and the
state-sync residuals survive a restart: the format-2 snapshot round trip into a fresh optimizer
(the joiner then steps exactly as its donor), the committer serving a step only with the state
its state round left, a donor of the other layout refused with the reason, and the residuals'
checkpoint round trip (an older checkpoint without them still loads, at zero)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from lowcomm.node import checkpoint, restore
from lowcomm.node.averaging import RoundReport
from lowcomm.node.commit import Committer
from lowcomm.node.config import load_config
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.optimizers import (
    MTDAO,
    capture_served,
    capture_states,
    install_states,
    served_state_names,
)
from lowcomm.node.reports import ReportQueue
from lowcomm.node.runstats import RunStats
from lowcomm.node.train_thread import TrainThread
from lowcomm.protocol import codecs
from lowcomm.protocol.handshake import IncompatiblePeer
from lowcomm.protocol.state import (
    OptimizerStates,
    Snapshot,
    StateDonor,
    StateError,
    download_state,
    read_blob,
    state_bytes,
)

from .test_driver import FakeSwarm
from .test_state_download import Swarm, donor_with, identity, run

ADAMW = ("exp_avg", "exp_avg_sq")
MTDAO_STATES = ("exp_avg_fast", "exp_avg_slow", "exp_avg_sq")


class TinyTrainer:
    """A model, an inner optimizer and fixed batches: the parts of the daemon's Trainer that the
    commit and the state serving use (``OptimizerOwning`` and ``TrainerPort``'s few methods)."""

    def __init__(self, kind: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
        self.params = list(self.model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.optimizer: torch.optim.Optimizer = (
            MTDAO(self.params, lr=1e-2, beta_slow=0.99) if kind == "mtdao"
            else torch.optim.AdamW(self.params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1))

    def step(self, batch: int) -> None:
        gen = torch.Generator().manual_seed(1000 + batch)  # the same batch for donor and joiner
        inputs, targets = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        self.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(inputs), targets).backward()
        self.optimizer.step()

    def get_params(self) -> torch.Tensor:
        return torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def set_params(self, flat: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(flat.clone(), self.params)

    def set_params_slice(self, fragment: slice, values: torch.Tensor) -> None:
        flat = self.get_params()
        flat[fragment] = values
        self.set_params(flat)

    def local_state(self) -> dict:
        return {"optimizer": self.optimizer.state_dict()}

    def load_local_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


@pytest.mark.parametrize("kind, names", [("adamw", ADAMW), ("mtdao", MTDAO_STATES)])
def test_a_joiner_loads_the_served_optimizer_state_and_then_steps_exactly_as_its_donor(kind, names):
    donor = TinyTrainer(kind)
    for batch in range(7):
        donor.step(batch)
    served = capture_states(donor.optimizer, donor.params, names)
    assert served.step == 7 and set(served.tensors) == set(names)
    momentum = torch.randn(donor.numel)
    snapshot = Snapshot.build(3, donor.get_params(), momentum, optimizer=served)
    assert len(snapshot.blob) == state_bytes(donor.numel, names)  # what a joiner expects before downloading

    got = read_blob(snapshot.blob, donor.numel, names)
    joiner = TinyTrainer(kind, seed=1)  # other initial weights, an optimizer that never stepped
    joiner.set_params(got.params)
    install_states(joiner.optimizer, joiner.params, got.optimizer)
    loaded = capture_states(joiner.optimizer, joiner.params, names)
    assert loaded.hashes() == served.hashes() and loaded.step == served.step
    assert torch.equal(got.momentum, momentum)
    # Not only the bytes: the joiner's next steps are the donor's, bit for bit (moments and step
    # count, hence the bias corrections, all arrived).
    for batch in (7, 8):
        donor.step(batch)
        joiner.step(batch)
    assert torch.equal(joiner.get_params(), donor.get_params())
    assert capture_states(joiner.optimizer, joiner.params, names).hashes() == \
        capture_states(donor.optimizer, donor.params, names).hashes()


def test_an_optimizer_that_never_stepped_is_served_as_zeros_and_loads_as_a_fresh_one():
    donor, fresh, joiner = TinyTrainer("adamw"), TinyTrainer("adamw"), TinyTrainer("adamw")
    served = capture_states(donor.optimizer, donor.params, ADAMW)
    assert served.step == 0 and all(torch.count_nonzero(t) == 0 for t in served.tensors.values())
    install_states(joiner.optimizer, joiner.params, read_blob(
        Snapshot.build(0, donor.get_params(), torch.zeros(donor.numel), optimizer=served).blob, None, ADAMW).optimizer)
    fresh.step(0)
    joiner.step(0)
    assert torch.equal(joiner.get_params(), fresh.get_params())


def test_runs_without_state_sync_serve_what_they_always_served():
    plain, desloc = load_config(environ={}), load_config(overrides=["sync.method=desloc"], environ={})
    assert served_state_names(plain) == () and served_state_names(desloc) == ADAMW
    assert served_state_names(load_config(overrides=["sync.method=mtdao"], environ={})) == MTDAO_STATES
    trainer = TinyTrainer("adamw")
    assert capture_served(trainer, ()) is None
    state = GlobalState.fresh(trainer.get_params(), 0.7, 0.9)
    assert len(state.snapshot().blob) == state_bytes(trainer.numel) == 24 + 8 * trainer.numel  # format 1
    assert set(state.to_checkpoint()) == {"step", "params", "momentum", "residual", "owner_residual",
                                          "params_sha256"}


def test_a_blob_of_the_other_layout_is_refused_with_the_reason():
    params, momentum = torch.randn(50), torch.randn(50)
    served = OptimizerStates(4, {name: torch.rand(50) for name in ADAMW})
    with_states = Snapshot.build(2, params, momentum, optimizer=served).blob
    plain = Snapshot.build(2, params, momentum).blob
    with pytest.raises(StateError, match=r"format 1 .*this run expects format 2"):
        read_blob(plain, 50, ADAMW)
    with pytest.raises(StateError, match=r"format 2 .*exp_avg, exp_avg_sq.*this run expects format 1"):
        read_blob(with_states, 50, ())
    with pytest.raises(StateError, match="this run expects"):
        read_blob(with_states, 50, MTDAO_STATES)
    truncated = bytearray(with_states[:-4])
    with pytest.raises(StateError, match="bytes, expected"):
        read_blob(truncated, 50, ADAMW)


def test_a_download_takes_the_states_from_donors_serving_them_and_refuses_the_other_layout():
    params, momentum = torch.randn(20_000), torch.randn(20_000)
    served = OptimizerStates(9, {name: torch.rand(20_000) for name in ADAMW})
    with_states = Snapshot.build(5, params, momentum, optimizer=served)
    plain = Snapshot.build(5, params, momentum)

    async def scenario() -> None:
        swarm = Swarm()
        try:
            both = [await swarm.add(donor_with(with_states, f"d{i}")) for i in range(2)]
            old = await swarm.add(donor_with(plain, "old"))

            async def download(donors, states):
                return await download_state(donors, 5, with_states.params_sha256, identity("joiner"), swarm.channels,
                                            timeout=10.0, expected_numel=20_000, expected_states=states)

            got = await download([*both, old], ADAMW)  # the old donor is left out, the others serve
            assert got.donors_used == 2 and got.optimizer is not None and got.optimizer.step == 9
            assert got.optimizer.hashes() == served.hashes() and torch.equal(got.params, params)
            with pytest.raises(IncompatiblePeer, match=r"serves a \d+-byte state \(format 1 .*expects format 2"):
                await download([old], ADAMW)
            with pytest.raises(IncompatiblePeer, match=r"\(format 2 .*expects format 1"):
                await download(both, ())
        finally:
            await swarm.close()

    run(scenario())


def test_the_committer_serves_a_step_with_the_state_and_residuals_its_state_round_left():
    """The snapshot of a state-sync step waits for the state round (between commit and finish)
    and carries the optimizer state after it; the checkpoint takes that round's residuals."""
    trainer = TinyTrainer("adamw")
    for batch in range(3):
        trainer.step(batch)
    state = GlobalState.fresh(trainer.get_params(), 0.7, 0.9, synced_states=("exp_avg",))
    state.optimizer_states = capture_served(trainer, ADAMW)
    written: list[dict[str, Any]] = []
    train_thread, pool, report_pool = TrainThread(), ThreadPoolExecutor(2), ThreadPoolExecutor(1)
    donor = StateDonor(identity("peer-a"))
    reports = ReportQueue(report_pool)
    committer = Committer(state, trainer, swarm=FakeSwarm(state), donor=donor, train_thread=train_thread,
                          codec_executor=pool, reports=reports, metrics=NodeMetrics(), stats=RunStats(),
                          codec=codecs.get_codec("int8"), evaluate_global=lambda params, buffers: 0.0,
                          write_checkpoint=lambda frozen, *_: written.append(frozen))

    async def scenario() -> None:
        frozen = await committer.commit_global()
        assert state.step == 1 and donor.latest() is None  # not served before its state round
        # The state round: the group's average replaces exp_avg, its residual changes.
        averaged = torch.full((trainer.numel,), 0.125)
        await train_thread.run(lambda: install_states(trainer.optimizer, trainer.params, OptimizerStates(
            3, {"exp_avg": averaged, "exp_avg_sq": capture_states(trainer.optimizer, trainer.params,
                                                                   ("exp_avg_sq",)).tensors["exp_avg_sq"]})))
        state.state_residuals["exp_avg"].fill_(0.5)
        await committer.finish(RoundReport(2, 0.0, 0, 0, 0), slice(0, trainer.numel), frozen, reset_local=True)
        await reports.flush()

    try:
        asyncio.run(scenario())
    finally:
        train_thread.shutdown()
        pool.shutdown()
        report_pool.shutdown()
    snapshot = donor.latest()
    assert snapshot is not None and snapshot.step == 1 and snapshot.params_sha256 == state.params_hash
    got = read_blob(snapshot.blob, trainer.numel, ADAMW)
    assert torch.equal(got.optimizer.tensors["exp_avg"], torch.full((trainer.numel,), 0.125))
    assert got.optimizer.step == 3
    (saved,) = written
    assert torch.equal(saved["state_residuals"]["exp_avg"], torch.full((trainer.numel,), 0.5))  # after the round
    state.state_residuals["exp_avg"].fill_(2.0)
    assert saved["state_residuals"]["exp_avg"][0] == 0.5  # a copy: the next round does not change it


def test_state_sync_residuals_survive_a_checkpoint_and_an_older_checkpoint_loads_at_zero(tmp_path, caplog):
    numel = 300
    gen = torch.Generator().manual_seed(4)
    state = GlobalState.fresh(torch.randn(numel, generator=gen), 0.7, 0.9, synced_states=("exp_avg", "exp_avg_sq"))
    for part in (state.state_residuals, state.state_owner_residuals):
        for value in part.values():
            value.copy_(torch.randn(numel, generator=gen))
    checkpoint.save(tmp_path, state.step, state.frozen_checkpoint())
    (payload, _), = [checkpoint.load_latest(tmp_path)]
    restored = GlobalState.from_checkpoint(payload, 0.7, 0.9, ("exp_avg", "exp_avg_sq"))
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(restored.state_residuals[name], state.state_residuals[name])
        assert torch.equal(restored.state_owner_residuals[name], state.state_owner_residuals[name])

    # A checkpoint of this run written before the residuals were checkpointed.
    old = {key: value for key, value in payload.items() if not key.startswith("state_")}
    with caplog.at_level(logging.INFO, logger="lowcomm.node"):
        restored = GlobalState.from_checkpoint(old, 0.7, 0.9, ("exp_avg", "exp_avg_sq"))
    assert all(torch.count_nonzero(r) == 0 for r in (*restored.state_residuals.values(),
                                                    *restored.state_owner_residuals.values()))
    assert set(restored.state_residuals) == {"exp_avg", "exp_avg_sq"}
    assert "no state-sync residuals of exp_avg, exp_avg_sq" in caplog.text and "start at zero" in caplog.text

    bad = payload | {"state_residuals": {"exp_avg": torch.zeros(7), "exp_avg_sq": torch.zeros(numel)}}
    with pytest.raises(ValueError, match="residual of exp_avg does not fit"):
        GlobalState.from_checkpoint(bad, 0.7, 0.9, ("exp_avg", "exp_avg_sq"))


def test_adopting_a_download_with_optimizer_state_restarts_the_state_residuals_only():
    state = GlobalState.fresh(torch.zeros(10), 0.7, 0.9, synced_states=("exp_avg",))
    state.residual.fill_(1.0)
    state.state_residuals["exp_avg"].fill_(1.0)
    state.state_owner_residuals["exp_avg"].fill_(1.0)
    state.adopt(4, torch.ones(10), torch.ones(10))  # no optimizer state downloaded: they stay
    assert state.state_residuals["exp_avg"][0] == 1.0
    served = OptimizerStates(2, {name: torch.ones(10) for name in ADAMW})
    state.adopt(5, torch.ones(10), torch.ones(10), served)
    assert state.optimizer_states is served and torch.equal(state.residual, torch.ones(10))  # Δ residual: ours
    assert torch.count_nonzero(state.state_residuals["exp_avg"]) == 0
    assert torch.count_nonzero(state.state_owner_residuals["exp_avg"]) == 0
    assert read_blob(state.snapshot().blob, 10, ADAMW).optimizer.step == 2


def test_a_restarted_desloc_node_resumes_its_residuals_and_serves_its_restored_optimizer_state(tmp_path):
    config = load_config(overrides=["sync.method=desloc", f"node.checkpoint_dir={tmp_path}"], environ={})
    before = TinyTrainer("adamw")
    for batch in range(4):
        before.step(batch)
    state = GlobalState.fresh(before.get_params(), 0.7, 0.9, synced_states=("exp_avg", "exp_avg_sq"))
    state.state_residuals["exp_avg_sq"].fill_(0.25)
    state.state_owner_residuals["exp_avg"].fill_(-0.5)
    restore.save(config, state.frozen_checkpoint(), before.local_state(), tokens_total=1000)

    after = TinyTrainer("adamw", seed=3)  # the restarted process: other weights until it loads
    restored = restore.restore(config, after)
    assert not restored.must_download and restored.tokens_total == 1000
    assert torch.equal(restored.state.state_residuals["exp_avg_sq"], torch.full((after.numel,), 0.25))
    assert torch.equal(restored.state.state_owner_residuals["exp_avg"], torch.full((after.numel,), -0.5))
    assert torch.count_nonzero(restored.state.state_residuals["exp_avg"]) == 0
    served = restored.state.optimizer_states
    assert served is not None and served.step == 4
    assert served.hashes() == capture_states(before.optimizer, before.params, ADAMW).hashes()
    assert read_blob(restored.state.snapshot().blob, after.numel, ADAMW).optimizer.hashes() == served.hashes()
