"""Validation and robust aggregation at the shard owner (issue 7 items 2 and 3).

Pure properties of ``protocol.aggregation`` (hypothesis), then the rules wired through the
butterfly all-reduce: several peers with real gRPC servers in one event loop.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lowcomm.node.config import load_config
from lowcomm.protocol import accumulator
from lowcomm.protocol import aggregation as agg
from lowcomm.protocol.aggregation import Aggregated, Aggregation, aggregate, lower_median
from lowcomm.protocol.validate import ContributionRejected, check_norm, contribution_norm

from .swarm_harness import apply_outer, digest, start_peers, stop_peers

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_BOUND = dict(norm_bound_factor=None)


def as_contributions(values: np.ndarray, weights: list[float]) -> list[agg.Contribution]:
    return [(f"p{i}", w, torch.from_numpy(values[i].copy())) for i, w in enumerate(weights)]


@st.composite
def contributions(draw, min_n: int = 1, max_n: int = 7, max_numel: int = 40, bound: float = 1024.0):
    n = draw(st.integers(min_n, max_n))
    numel = draw(st.integers(1, max_numel))
    values = draw(arrays(np.float32, (n, numel), elements=st.floats(-bound, bound, width=32)))
    weights = draw(st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n))
    return as_contributions(values, weights)


def reference_mean(contributions) -> torch.Tensor:
    total = sum(w * x.double() for _, w, x in contributions)
    return total / sum(w for _, w, _ in contributions)


# -- settings -------------------------------------------------------------------------------------


def test_settings_are_checked_and_come_from_the_config():
    assert Aggregation() == Aggregation("mean", 2.0, 0.2, 20.0)
    for bad in (dict(rule="median"), dict(trim_fraction=0.5), dict(norm_bound_factor=1.0), dict(clip_factor=0.0)):
        with pytest.raises(ValueError):
            Aggregation(**bad)
    config = load_config(environ={}, overrides=["sync.aggregation=trimmed_mean", "sync.trim_fraction=0.3",
                                                "sync.clip_factor=3", "sync.norm_bound_factor=10"])
    assert Aggregation.from_config(config.sync) == Aggregation("trimmed_mean", 3.0, 0.3, 10.0)
    defaults = load_config(environ={})
    assert Aggregation.from_config(defaults.sync) == Aggregation()  # the dataclass mirrors [sync]'s defaults


def test_rejection_reasons_are_metric_labels():
    from lowcomm.node.metrics import REJECTION_REASONS
    assert {"codec", "length", "non_finite", "norm"} <= set(REJECTION_REASONS)


def test_lower_median_and_norms():
    assert lower_median([3.0]) == 3.0
    assert lower_median([5.0, 1.0]) == 1.0  # in a pair, the smaller one is the reference
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert lower_median([4.0, 1.0, 3.0, 2.0, 9.0]) == 3.0
    huge = torch.full((1000,), 1e30)
    assert math.isclose(contribution_norm(huge), 1e30 * math.sqrt(1000), rel_tol=1e-6)  # no float32 overflow
    assert contribution_norm(torch.empty(0)) == 0.0
    with pytest.raises(ContributionRejected) as err:
        check_norm(21.0, 1.0, 20.0)
    assert err.value.reason == "norm"
    check_norm(20.0, 1.0, 20.0)  # at the bound: kept
    check_norm(0.0, 0.0, 20.0)  # all-zero rounds reject nothing


def test_empty_and_all_zero_shards():
    empty = [(f"p{i}", 1.0, torch.empty(0)) for i in range(3)]
    for rule in agg.RULES:
        out = aggregate(empty, Aggregation(rule))
        assert out.average is not None and out.average.numel() == 0 and not out.rejected
    zeros = [(f"p{i}", 1.0, torch.zeros(5)) for i in range(3)]
    assert torch.equal(aggregate(zeros).average, torch.zeros(5))
    # With a zero median, a non-zero contribution is an outlier by the rule's letter.
    out = aggregate([*zeros, ("p9", 1.0, torch.ones(5))])
    assert [(r.sender, r.reason) for r in out.rejected] == [("p9", "norm")]


def test_malformed_input_is_refused():
    with pytest.raises(ValueError):
        aggregate([("a", 1.0, torch.zeros(3)), ("a", 1.0, torch.zeros(3))])
    with pytest.raises(ValueError):
        aggregate([("a", 1.0, torch.zeros(3)), ("b", 1.0, torch.zeros(4))])
    with pytest.raises(ValueError):
        aggregate([("a", math.inf, torch.zeros(3))])
    with pytest.raises(ValueError):
        aggregate([("a", 0.0, torch.zeros(3))])


def test_trimmed_mean_chunks_agree_with_one_block(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    contributions = [(f"p{i}", float(i + 1), torch.randn(1000, generator=gen)) for i in range(6)]
    whole = agg.trimmed_mean(contributions, 0.2)
    monkeypatch.setattr(agg, "TRIM_CHUNK", 7)
    assert torch.equal(agg.trimmed_mean(contributions, 0.2), whole)


# -- properties -----------------------------------------------------------------------------------


@PROPERTY
@given(contributions())
def test_mean_is_the_weighted_mean(contributions):
    out = aggregate(contributions, Aggregation("mean", **NO_BOUND))
    assert out.used == [s for s, _, _ in contributions] and not out.rejected
    assert torch.allclose(out.average.double(), reference_mean(contributions), rtol=1e-6, atol=1e-4)


@PROPERTY
@given(contributions(max_n=5), st.sampled_from(agg.RULES), st.randoms(use_true_random=False))
def test_arrival_order_does_not_matter(contributions, rule, rnd):
    shuffled = list(contributions)
    rnd.shuffle(shuffled)
    a, b = aggregate(contributions, Aggregation(rule)), aggregate(shuffled, Aggregation(rule))
    assert torch.equal(a.average, b.average) and a.used == b.used


@PROPERTY
@given(contributions(min_n=2), st.floats(1.5, 10.0), st.data())
def test_clipped_mean_bounds_the_influence_of_one_huge_contribution(contributions, clip_factor, data):
    victim = data.draw(st.integers(0, len(contributions) - 1))
    sender, weight, x = contributions[victim]
    norms = [contribution_norm(c) for _, _, c in contributions]
    assume(norms[victim] > 1e-3 and lower_median(n for i, n in enumerate(norms) if i != victim) > 0)
    biggest = max(norms)
    settings_ = Aggregation("clipped_mean", clip_factor=clip_factor, **NO_BOUND)
    results = []
    for blowup in (1e3, 1e9):
        poisoned = list(contributions)
        poisoned[victim] = (sender, weight, x * float(blowup * biggest / norms[victim]))
        out = aggregate(poisoned, settings_)
        tau = clip_factor * lower_median(contribution_norm(c) for _, _, c in poisoned)
        assert contribution_norm(out.average) <= tau * (1 + 1e-5) + 1e-30
        results.append(out.average)
    # Once above the clipping threshold, the scale of the outlier changes nothing.
    assert torch.allclose(results[0], results[1], rtol=1e-5, atol=1e-5 * biggest)
    # The plain mean is dragged away with it.
    plain = aggregate(poisoned, Aggregation("mean", **NO_BOUND)).average
    assert contribution_norm(plain) > contribution_norm(results[1])


@PROPERTY
@given(st.data())
def test_trimmed_mean_ignores_up_to_k_outliers_per_coordinate(data):
    n = data.draw(st.integers(1, 9))
    fraction = data.draw(st.floats(0.0, 0.49))
    outliers = data.draw(st.integers(0, math.floor(fraction * n)))
    numel = data.draw(st.integers(1, 30))
    honest = data.draw(arrays(np.float32, (n - outliers, numel), elements=st.floats(-1024.0, 1024.0, width=32)))
    bad = data.draw(arrays(np.float32, (outliers, numel), elements=st.floats(-2.0**100, 2.0**100, width=32)))
    weights = data.draw(st.lists(st.floats(0.1, 10.0), min_size=n, max_size=n))
    order = data.draw(st.permutations(range(n)))  # outliers anywhere in the sender order
    rows = np.concatenate([honest, bad])[list(order)]
    out = aggregate(as_contributions(rows, weights), Aggregation("trimmed_mean", trim_fraction=fraction, **NO_BOUND))
    low, high = torch.from_numpy(honest.min(0)), torch.from_numpy(honest.max(0))
    slack = 1e-6 * torch.maximum(low.abs(), high.abs())
    assert bool((out.average >= low - slack).all()) and bool((out.average <= high + slack).all())


@PROPERTY
@given(contributions(max_n=6), st.sampled_from(agg.RULES), st.data())
def test_non_finite_values_never_pass(contributions, rule, data):
    poisoned_senders = data.draw(st.sets(st.sampled_from([s for s, _, _ in contributions]), min_size=1))
    poisoned = []
    for sender, weight, x in contributions:
        if sender in poisoned_senders:
            x = x.clone()
            where = data.draw(st.lists(st.integers(0, x.numel() - 1), min_size=1, max_size=x.numel()))
            x[where] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        poisoned.append((sender, weight, x))
    out = aggregate(poisoned, Aggregation(rule))
    assert {(r.sender, r.reason) for r in out.rejected} >= {(s, "non_finite") for s in poisoned_senders}
    assert not set(out.used) & poisoned_senders
    if len(poisoned_senders) == len(contributions):
        assert out.average is None and out.used == []
    else:
        assert bool(torch.isfinite(out.average).all())


@PROPERTY
@given(contributions(max_n=7), st.floats(1.5, 50.0), st.data())
def test_norm_bound_keeps_the_median_and_drops_only_what_exceeds_it(contributions, factor, data):
    victim = data.draw(st.integers(0, len(contributions) - 1))
    scale = data.draw(st.floats(1.0, 1e6))
    sender, weight, x = contributions[victim]
    contributions = list(contributions)
    contributions[victim] = (sender, weight, x * scale)
    # Compared at equal weight: each norm scaled to the lower median weight.
    median_weight = lower_median(w for _, w, _ in contributions)
    norms = {s: contribution_norm(c) * (median_weight / w) for s, w, c in contributions}
    median = lower_median(norms.values())
    out = aggregate(contributions, Aggregation("mean", norm_bound_factor=factor))
    assert out.used and set(out.used) | {r.sender for r in out.rejected} == set(norms)
    assert all(norms[s] <= factor * median for s in out.used)
    assert all(r.reason == "norm" and norms[r.sender] > factor * median for r in out.rejected)
    assert any(norms[s] == median for s in out.used)


def test_norm_bound_compares_contributions_at_equal_weight():
    # Two honest members: one joined an overlapped round after 1 of 10 inner steps (weight 1),
    # the other trained all 10 (weight capped at 4x the median): its Δ is 23.6x longer. Compared
    # as raw norms, the longer one was dropped as an attack.
    gen = torch.Generator().manual_seed(3)
    short = torch.randn(1000, generator=gen) * 0.01
    long = short * 23.6
    out = aggregate([("p1", 1.0, short), ("p2", 4.0, long)], Aggregation("mean", norm_bound_factor=20.0))
    assert out.used == ["p1", "p2"] and not out.rejected
    # At equal weights nothing changes, and a weight claim buys at most its own factor of norm.
    for weight, scale in ((1.0, 23.6), (4.0, 100.0)):
        out = aggregate([("p1", 1.0, short), ("p2", weight, short * scale)], Aggregation("mean", norm_bound_factor=20.0))
        assert out.used == ["p1"] and [r.sender for r in out.rejected] == ["p2"]
    claimed, honest = contribution_norm(short * 100.0), contribution_norm(short)
    assert out.rejected[0].detail == (f"norm {claimed:.4g} at 4 x the median weight ({claimed / 4:.4g} at the median "
                                      f"weight) exceeds 20 x the median {honest:.4g} of this shard's contributions "
                                      f"at the median weight")


# -- through the all-reduce -----------------------------------------------------------------------


def run(coro, limit: float = 20.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


def deltas_with_outlier(count: int, numel: int, outlier: int, scale: float = 100.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in range(count)]
    deltas[outlier] = deltas[outlier] * scale
    return deltas


def test_norm_bound_rejects_an_outlier_everywhere_including_its_own_shard():
    """Default registry (plain mean, norm bound): peer-03's ×100 Δ is rejected by every owner,
    itself included (the owner's own contribution goes through the same rules); everybody gets
    the mean of the three others, ends bit-identical, and peer-03 keeps all of its Δ."""
    numel = 20_003

    async def scenario():
        peers = await start_peers(4, numel, "fp32")
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            deltas = deltas_with_outlier(4, numel, outlier=3)
            results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas)))
            mean = (deltas[0] + deltas[1] + deltas[2]) / 3
            for r in results:
                assert all(torch.equal(a, b) for a, b in zip(r.averages, results[0].averages))
            assert torch.allclose(torch.cat(results[0].averages), mean, atol=1e-7, rtol=1e-6)
            for p in peers:
                assert p.rejections == [("norm", "peer-03")], p.peer_id
            assert torch.equal(peers[3].residual, deltas[3])  # nothing of it was used: all carried
            for p in peers[:3]:
                assert torch.count_nonzero(p.residual) == 0
            theta = torch.zeros(numel)
            updated = [apply_outer(theta, r) for r in results]
            assert len({digest(t) for t in updated}) == 1
        finally:
            await stop_peers(peers)

    run(scenario())


@pytest.mark.parametrize("rule", ["clipped_mean", "trimmed_mean"])
def test_registry_applies_the_configured_rule(rule):
    """Every shard's average is exactly the pure rule over the members' contributions (fp32:
    decoding is exact), and every member holds the same bits."""
    numel = 10_007
    settings_ = Aggregation(rule, **NO_BOUND)

    async def scenario():
        peers = await start_peers(5, numel, "fp32", aggregation=settings_)
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            deltas = deltas_with_outlier(5, numel, outlier=2)
            results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas)))
            for index, sl in enumerate(results[0].slices):
                want = aggregate([(p.peer_id, 1.0, d[sl]) for p, d in zip(peers, deltas)], settings_)
                assert want.used == sorted(p.peer_id for p in peers)
                for r in results:
                    assert torch.equal(r.averages[index], want.average)
            assert not any(p.rejections for p in peers)
            plain = torch.stack(deltas).mean(0)
            robust = torch.cat(results[0].averages)
            honest = torch.stack([d for i, d in enumerate(deltas) if i != 2]).mean(0)
            assert (robust - honest).norm() < 0.5 * (plain - honest).norm()
        finally:
            await stop_peers(peers)

    run(scenario())


def test_an_average_that_cannot_be_published_is_skipped_by_every_member(monkeypatch):
    """If the owner's average comes out non-finite, it is neither applied nor sent: every member
    skips the shard (ABORTED for senders) and keeps its part in its residual."""
    numel = 3_001

    def overflowing(contributions, settings_):
        out = aggregate(contributions, settings_)
        return Aggregated(torch.full_like(out.average, math.inf), out.used, out.rejected)

    monkeypatch.setattr(accumulator, "aggregate", overflowing)  # where the owner aggregates

    async def scenario():
        peers = await start_peers(3, numel, "fp32")
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            deltas = deltas_with_outlier(3, numel, outlier=0, scale=1.0)
            results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas)))
            for p, d, r in zip(peers, deltas, results):
                assert r.averages == [None, None, None]
                assert torch.equal(p.residual, d)
        finally:
            await stop_peers(peers)

    run(scenario())
