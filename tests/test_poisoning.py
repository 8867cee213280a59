"""Poisoning (issue 7): a 5-peer swarm where one peer sends Δ scaled by 100 or filled with NaN.

Five peers in one event loop, each with its own ``Trainer`` (tiny model, one torch thread) and a
real gRPC server on 127.0.0.1; several DiLoCo rounds: inner phase → Δ = θ_global − θ_local →
butterfly all-reduce (int8) → Nesterov outer step. The last peer is the attacker:

* ``scale100``: it runs the honest protocol code with its Δ multiplied by 100 (so its own
  shard's contribution goes through its own owner-side rules too);
* ``nan``: its outgoing payloads are replaced on the wire (the int8 encoder refuses NaN, so the
  bytes are crafted): NaN block scales on even shards (refused by the decoder, reason ``codec``),
  scales of float32-max on odd shards, which decode to ±inf (reason ``non_finite``).

The final eval loss of θ_global (on an honest peer) is compared with a clean run of the same seeds
(five honest peers, plain mean). Shown here:

* plain mean without the norm bound IS harmed by ×100 (so this test can fail);
* the norm bound alone (the default: plain mean, 20 × the median norm) rejects the ×100
  contributions, counted as ``norm`` with the attacker's id;
* clipped_mean and trimmed_mean keep the loss within 2 % of the clean run *by themselves*, with
  the norm bound switched off, against both attacks;
* no NaN ever reaches θ_global, and the honest peers stay bit-identical every round.
"""

from __future__ import annotations

import asyncio
import math
import struct
from dataclasses import dataclass, field

import pytest
import torch

from lowcomm.node.apply import apply_averages
from lowcomm.node.config import load_config
from lowcomm.node.data import load_corpus
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.trainer import Trainer
from lowcomm.protocol import codecs
from lowcomm.protocol.aggregation import Aggregation

from .swarm_harness import RewritingChannels, digest, start_peers, stop_peers

PEERS = 5
ROUNDS = 4
INNER_STEPS = 8
CODEC = "int8"
ATTACKER = PEERS - 1
TOLERANCE = 0.02
OVERRIDES = [
    "model.preset=tiny", "data.seq_len=32", "train.batch_size=8", f"train.inner_steps={INNER_STEPS}",
    "train.warmup_steps=4", "train.seed=7", "data.eval_batches=4", "node.torch_threads=1", "node.device=cpu",
]

NO_BOUND = dict(norm_bound_factor=None)


@dataclass
class RunResult:
    initial: float  # eval loss of the initial θ_global
    losses: list[float]  # eval loss of the honest θ_global after each round
    rejections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # owner -> (reason, sender)

    @property
    def final(self) -> float:
        return self.losses[-1]


@pytest.fixture(scope="module")
def corpus():
    config = load_config(environ={}, overrides=OVERRIDES)
    return load_corpus(config.data.path, config.data.eval_fraction, max_bytes=2 * 2**20)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def poison_nan(header, payload: bytes) -> bytes:
    """Keep the int8 values, replace every block scale: NaN (even shards) or float32 max (odd)."""
    codec = codecs.get_codec(CODEC)
    blocks = codec.n_blocks(header.numel)
    scale = float("nan") if header.shard_index % 2 == 0 else 3.4028234663852886e38
    quantized = bytearray(payload[4 * blocks:])
    for i in range(0, len(quantized), 2):
        quantized[i] = 127  # ±127 * float32 max overflows to inf
    return struct.pack(f"<{blocks}f", *([scale] * blocks)) + bytes(quantized)


def run_swarm(corpus, aggregation: Aggregation | None, attack: str | None) -> RunResult:
    config = load_config(environ={}, overrides=OVERRIDES)

    async def scenario() -> RunResult:
        trainers = [Trainer(config, f"peer-{i:02d}", corpus) for i in range(PEERS)]
        numel = trainers[0].numel
        peers = await start_peers(PEERS, numel, CODEC, reduce_timeout=10.0, aggregation=aggregation)
        honest = [i for i in range(PEERS) if attack is None or i != ATTACKER]
        if attack == "nan":
            peers[ATTACKER].channels = RewritingChannels(peers[ATTACKER].channels, poison_nan)
        try:
            theta = [t.get_params() for t in trainers]
            assert len({digest(t) for t in theta}) == 1  # one seed, one initial θ_global
            # θ_global and the outer momentum of each peer, stepped by the node's own code.
            states = [GlobalState.fresh(t, config.sync.outer_lr, config.sync.outer_momentum) for t in theta]
            initial = trainers[0].evaluate()
            losses = []
            expected = {p.peer_id for p in peers}
            for step in range(ROUNDS):
                deltas = []
                for i, trainer in enumerate(trainers):
                    trainer.train_phase(INNER_STEPS, lambda: False)
                    delta = theta[i] - trainer.get_params()
                    deltas.append(delta * 100 if attack == "scale100" and i == ATTACKER else delta)
                groups = await asyncio.gather(*(p.form(step, expected) for p in peers))
                assert all(len(g.members) == PEERS for g in groups)
                results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas)))
                for i, result in enumerate(results):
                    assert all(bool(torch.isfinite(a).all()) for a in result.averages if a is not None)
                    apply_averages(states[i], slice(0, numel), result)
                    theta[i] = states[i].params
                    trainers[i].set_params(theta[i])
                for i in honest:
                    assert all(a is not None for a in results[i].averages), "an honest peer skipped a shard"
                    assert bool(torch.isfinite(theta[i]).all()), "a NaN reached θ_global"
                assert len({digest(theta[i]) for i in honest}) == 1, "honest peers disagree on θ_global"
                losses.append(trainers[honest[0]].evaluate())
            return RunResult(initial, losses, {p.peer_id: list(p.rejections) for p in peers})
        finally:
            await stop_peers(peers)

    async def bounded():
        async with asyncio.timeout(120):
            return await scenario()

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def clean(corpus) -> RunResult:
    result = run_swarm(corpus, None, None)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.final < 0.7 * result.initial, (result.initial, result.losses)  # it learns
    assert not any(result.rejections.values())  # the norm bound leaves honest peers alone
    return result


def attacker_id() -> str:
    return f"peer-{ATTACKER:02d}"


def test_scaled_delta_harms_plain_mean_without_norm_bound(corpus, clean):
    attacked = run_swarm(corpus, Aggregation("mean", **NO_BOUND), "scale100")
    print(f"clean {clean.final:.4f}  x100+mean(no bound) {attacked.final:.4f}")
    assert not any(attacked.rejections.values())
    assert attacked.final > clean.final * (1 + TOLERANCE) * 1.5  # badly hurt: the defences below matter


def test_norm_bound_alone_rejects_scaled_delta(corpus, clean):
    attacked = run_swarm(corpus, Aggregation(), "scale100")  # the default: plain mean, bound 20 x median
    print(f"clean {clean.final:.4f}  x100+mean(norm bound) {attacked.final:.4f}")
    assert abs(attacked.final - clean.final) <= TOLERANCE * clean.final
    for owner, rejections in attacked.rejections.items():
        # Every owner, the attacker too (its own part), rejects the attacker's part every round.
        assert rejections == [("norm", attacker_id())] * ROUNDS, owner


@pytest.mark.parametrize("attack", ["scale100", "nan"])
@pytest.mark.parametrize("rule", ["clipped_mean", "trimmed_mean"])
def test_robust_rule_alone_keeps_loss_within_2_percent(corpus, clean, rule, attack):
    attacked = run_swarm(corpus, Aggregation(rule, **NO_BOUND), attack)
    print(f"clean {clean.final:.4f}  {attack}+{rule}(no bound) {attacked.final:.4f}  rounds {attacked.losses}")
    assert abs(attacked.final - clean.final) <= TOLERANCE * clean.final, (clean.losses, attacked.losses)
    honest_owners = [o for o in attacked.rejections if o != attacker_id()]
    if attack == "nan":
        # Refused on arrival by every honest owner, every round, with the attacker's id.
        reasons = set()
        for owner in honest_owners:
            assert len(attacked.rejections[owner]) == ROUNDS
            assert {s for _, s in attacked.rejections[owner]} == {attacker_id()}
            reasons |= {r for r, _ in attacked.rejections[owner]}
        assert reasons == {"codec", "non_finite"}
    else:
        assert not any(attacked.rejections.values())  # no bound: the rule alone takes the blow
