"""The optimizer-state sync (node/state_sync.py) over the real all-reduce on a fake network and a
virtual clock (tests/protocol_fakes.py): after a sync round every member holds the bit-identical
averaged state, error feedback carries what the codec did not deliver, a skipped shard keeps the
local state and its residual; which rounds sync which state; the config's checks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lowcomm.node.config import ConfigError, load_config
from lowcomm.node.state_sync import StateSync, derived_group, due
from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import ReduceRegistry
from lowcomm.protocol.layout import shard_layout

from .protocol_fakes import FakeNet, InlineExecutor, VirtualTimeLoop, run_virtual

NUMEL = 2000
EXECUTOR = InlineExecutor()


class FakeTrainer:
    """An optimizer state per name, as the daemon's Trainer exposes it."""

    def __init__(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: value.clone() for name, value in states.items()}

    def optimizer_state(self, name: str) -> torch.Tensor:
        return self.states[name].clone()

    def load_optimizer_state(self, name: str, flat: torch.Tensor) -> None:
        self.states[name].copy_(flat)


async def inline(fn, *args):
    return fn(*args)


def peers(loop: VirtualTimeLoop, net: FakeNet, states: list[dict[str, torch.Tensor]], periods: dict[str, int],
          codec: str = "bf16"):
    out = []
    for i, state in enumerate(states):
        peer_id = f"peer-{i:02d}"
        registry = ReduceRegistry(peer_id, lambda *_: None, EXECUTOR, clock=loop.clock)
        net.registries[f"fake://{peer_id}"] = registry
        out.append(StateSync(periods, peer_id, NUMEL, FakeTrainer(state), registry=registry, channels=None,
                             executor=EXECUTOR, in_train_thread=inline, codec=codec, transport=net))
    return out


def group_of(syncs: list[StateSync], step: int, weights: list[float], codec: str = "int8") -> averaging_pb2.Group:
    """The Δ round's group (its codec int8); the state rounds use the state codec instead."""
    return averaging_pb2.Group(
        group_id=b"g" * 16, step=step,
        members=[averaging_pb2.Member(peer_id=s.peer_id, address=f"fake://{s.peer_id}", weight=w)
                 for s, w in zip(syncs, weights)],
        shard_bounds=shard_layout(NUMEL, [0.0] * len(syncs)), shard_owners=list(range(len(syncs))),
        codec=int(codecs.get_codec(codec).id), reduce_timeout_s=5.0)


def random_states(count: int, names: tuple[str, ...], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{name: torch.rand(NUMEL, generator=gen) * (i + 1) for name in names} for i in range(count)]


def test_after_a_sync_round_every_member_holds_the_same_token_weighted_mean():
    states = random_states(3, ("exp_avg", "exp_avg_sq"))
    weights = [1.0, 2.0, 3.0]

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        syncs = peers(loop, net, states, {"exp_avg": 1, "exp_avg_sq": 2})
        # step 2 → the round that produces step 3: exp_avg (period 1) is due, exp_avg_sq (2) is not.
        reports = await asyncio.gather(*(s.run(group_of(syncs, 2, weights)) for s in syncs))
        return syncs, reports

    syncs, reports = run_virtual(scenario)
    assert all(r.synced == ["exp_avg"] and r.skipped_shards == 0 and r.bytes_sent > 0 for r in reports)
    synced = [s.trainer.states["exp_avg"] for s in syncs]
    assert all(torch.equal(x, synced[0]) for x in synced)  # bit-identical on every member
    expected = sum(w * st["exp_avg"] for w, st in zip(weights, states)) / sum(weights)
    assert torch.allclose(synced[0], expected, rtol=2 ** -7, atol=0)  # bf16 of the weighted mean
    assert not torch.equal(synced[0], expected)  # lossy: the residuals carry the rest...
    for s, st in zip(syncs, states):
        assert torch.equal(s.trainer.states["exp_avg_sq"], st["exp_avg_sq"])  # not due: untouched
        assert s.residuals["exp_avg"].abs().max() > 0  # ...sender-side error feedback is kept
        assert torch.count_nonzero(s.residuals["exp_avg_sq"]) == 0


def test_error_feedback_makes_repeated_syncs_of_a_fixed_state_converge_to_its_mean():
    states = random_states(2, ("exp_avg_slow",), seed=3)

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        syncs = peers(loop, net, states, {"exp_avg_slow": 1})
        errors = []
        mean = (states[0]["exp_avg_slow"] + states[1]["exp_avg_slow"]) / 2
        for step in range(8):
            for s, st in zip(syncs, states):  # every round starts from the same local state again
                s.trainer.states["exp_avg_slow"].copy_(st["exp_avg_slow"])
            await asyncio.gather(*(s.run(group_of(syncs, step, [1.0, 1.0])) for s in syncs))
            errors.append(syncs[0].trainer.states["exp_avg_slow"] - mean)
        return errors

    errors = run_virtual(scenario)
    running = [torch.stack(errors[: k + 1]).mean(0).abs().max().item() for k in range(len(errors))]
    assert running[-1] < running[0] / 3  # what a round drops, the next rounds deliver


def test_a_skipped_shard_keeps_the_local_state_and_the_residual():
    states = random_states(3, ("exp_avg",), seed=5)

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        syncs = peers(loop, net, states, {"exp_avg": 1}, codec="fp32")
        net.down.add("fake://peer-02")  # its shard's owner is unreachable for the others
        group = group_of(syncs, 0, [1.0, 1.0, 1.0])
        await asyncio.gather(*(s.run(group) for s in syncs[:2]))
        return syncs, group

    syncs, group = run_virtual(scenario, limit=600)
    dead = slice(group.shard_bounds[2], group.shard_bounds[3])
    for s, st in zip(syncs[:2], states[:2]):
        assert torch.equal(s.trainer.states["exp_avg"][dead], st["exp_avg"][dead])
        assert torch.count_nonzero(s.residuals["exp_avg"][dead]) == 0  # not carried into the next sync
    assert torch.equal(syncs[0].trainer.states["exp_avg"][: dead.start], syncs[1].trainer.states["exp_avg"][: dead.start])


def test_which_rounds_sync_which_state_and_the_derived_group():
    assert due({"exp_avg": 3, "exp_avg_sq": 6}, 3) == ["exp_avg"]
    assert due({"exp_avg": 3, "exp_avg_sq": 6}, 6) == ["exp_avg", "exp_avg_sq"]
    assert due({"exp_avg": 3, "exp_avg_sq": 6}, 4) == []
    group = averaging_pb2.Group(group_id=b"x" * 16, step=5, step_groups=[averaging_pb2.StepGroup(group_id=b"y")],
                                group_index=1)
    a, b = derived_group(group, "exp_avg", "bf16"), derived_group(group, "exp_avg_sq", "bf16")
    assert a.group_id != group.group_id and a.group_id != b.group_id and len(a.group_id) == 16
    assert a == derived_group(group, "exp_avg", "bf16")  # every member derives the same group
    assert a.codec == codecs.get_codec("bf16").id
    assert not a.step_groups and a.group_index == 0 and a.step == 5


def config(*overrides: str):
    return load_config(overrides=list(overrides), environ={})


def test_methods_set_their_periods_and_optimizer():
    desloc = config("sync.method=desloc")
    assert desloc.train.optimizer == "adamw" and desloc.sync.state_sync == {"exp_avg": 3, "exp_avg_sq": 6}
    mtdao = config("sync.method=mtdao")
    assert mtdao.train.optimizer == "mtdao" and mtdao.sync.state_sync == {"exp_avg_slow": 1, "exp_avg_sq": 6}
    assert config("sync.method=desloc", "sync.state_sync={exp_avg=2}").sync.state_sync == {"exp_avg": 2}
    # New keys at their defaults leave the fingerprint of earlier runs as it was.
    assert "state_sync" not in config().run_config()["sync"] and "optimizer" not in config().run_config()["train"]
    assert config("sync.method=desloc").run_fingerprint() != config().run_fingerprint()


@pytest.mark.parametrize("overrides, message", [
    (("sync.method=mtdao", "train.optimizer=adamw"), 'needs [train] optimizer = "mtdao"'),
    (("sync.state_sync={exp_avg_slow=1}",), 'exp_avg_slow, which [train] optimizer = "adamw" does not have'),
    (("sync.state_sync={exp_avg=0}",), "at least 1"),
    (("sync.method=desloc", "sync.state_codec=int8"), "[sync] state_codec = 'int8' is invalid"),
    (("sync.method=desloc", "sync.overlap=delayed"), "overlap"),
    (("sync.method=mtdao", "sync.mode=gossip"), 'mode = "allreduce"'),
])
def test_config_mistakes_are_named(overrides, message):
    with pytest.raises(ConfigError, match="invalid configuration") as err:
        config(*overrides)
    assert message in str(err.value)


def test_the_reported_hashes_of_the_synced_state_agree():
    states = random_states(2, ("exp_avg_sq",), seed=7)

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        syncs = peers(loop, net, states, {"exp_avg_sq": 1})
        return await asyncio.gather(*(s.run(group_of(syncs, 0, [1.0, 1.0])) for s in syncs))

    reports = run_virtual(scenario)
    assert reports[0].hashes == reports[1].hashes and set(reports[0].hashes) == {"exp_avg_sq"}


def test_a_refused_contribution_takes_the_groups_average_and_carries_nothing():
    """The norm bound (20× the median) refuses a far larger state: that member loads the others'
    average like everyone, and its residual is not left holding its whole state."""
    states = random_states(3, ("exp_avg",), seed=9)
    states[2]["exp_avg"] *= 1000.0

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        syncs = peers(loop, net, states, {"exp_avg": 1}, codec="fp32")
        await asyncio.gather(*(s.run(group_of(syncs, 0, [1.0, 1.0, 1.0])) for s in syncs))
        return syncs

    syncs = run_virtual(scenario)
    loaded = [s.trainer.states["exp_avg"] for s in syncs]
    assert all(torch.equal(x, loaded[0]) for x in loaded)
    assert torch.allclose(loaded[0], (states[0]["exp_avg"] + states[1]["exp_avg"]) / 2)
    assert torch.count_nonzero(syncs[2].residuals["exp_avg"]) == 0


def test_the_driver_abandons_a_state_round_on_a_stop_and_rolls_its_residual_back():
    """A state round whose partner never comes: a stop request gives it the grace period, then it
    is cancelled, its codec jobs are waited for, and the residual it already wrote is put back."""
    from lowcomm.node.averaging import RoundOutcome, RoundReport

    from .test_driver import Harness

    h = Harness(grace_period=0.1)
    try:
        async def scenario() -> tuple[StateSync, float]:
            net = FakeNet()
            states = random_states(2, ("exp_avg",), seed=11)
            registry = ReduceRegistry("peer-00", lambda *_: None, EXECUTOR)
            net.registries["fake://peer-00"] = registry
            sync = StateSync({"exp_avg": 1}, "peer-00", NUMEL, FakeTrainer(states[0]), registry=registry,
                             channels=None, executor=h.codec_executor, in_train_thread=inline, codec="int8",
                             transport=net)
            sync.residuals["exp_avg"].fill_(0.25)
            h.driver.state_sync = sync
            # peer-01 answers calls (a peer that cannot be reached is given up at once) but never
            # runs its side of the round.
            silent = ReduceRegistry("peer-01", lambda *_: None, EXECUTOR)
            net.registries["fake://peer-01"] = silent
            other = StateSync({"exp_avg": 1}, "peer-01", NUMEL, FakeTrainer(states[1]), registry=silent,
                              channels=None, executor=EXECUTOR, in_train_thread=inline)
            group = group_of([sync, other], 0, [1.0, 1.0])
            group.reduce_timeout_s = 300.0
            outcome = RoundOutcome(RoundReport(2, 0.0, 100, 100, 0), group=group)
            task = asyncio.create_task(h.driver.sync_optimizer_state(outcome))
            async with asyncio.timeout(30):
                while sync.undo is None:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the upload to peer-01 is encoded: the residual was written
            h.stops.requested.set()
            await asyncio.wait_for(task, 30)
            return sync, outcome.report.bytes_sent

        sync, sent = asyncio.run(scenario())
    finally:
        h.close()
    assert torch.equal(sync.residuals["exp_avg"], torch.full((NUMEL,), 0.25))  # as before the round
    assert sync.undo is None
    assert sync.trainer.states["exp_avg"].equal(random_states(2, ("exp_avg",), seed=11)[0]["exp_avg"])  # not loaded
    assert sent == 100  # nothing of the abandoned round counted
