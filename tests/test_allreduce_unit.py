"""The all-reduce state machine without sockets: the real run_allreduce, accumulators and shard
agreement over a fake transport and a virtual clock (tests/protocol_fakes.py). Quorum and
grace, a dead or silent owner's shard skipped by everybody, a silent client member, and the
quorum counts of the owner's wait and the report exchange; protocol minutes in milliseconds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.accumulator import MIN_STRAGGLER_GRACE, ShardAccumulator
from lowcomm.protocol.agreement import MIN_REPORT_GRACE, ShardAgreement
from lowcomm.protocol.allreduce import EXCHANGE_END, AllReduceResult, ReduceRegistry, run_allreduce
from lowcomm.protocol.member import MIN_TIMED_UPLOAD_SECONDS
from lowcomm.protocol import layout
from lowcomm.protocol.layout import shard_layout
from lowcomm.protocol.schedule import StageChain

from .protocol_fakes import FakeNet, InlineExecutor, VirtualTimeLoop, run_virtual

NUMEL = 3000
EXECUTOR = InlineExecutor()


class Member:
    """One peer of the round: its registry (the serving side) and its error-feedback state."""

    def __init__(self, net: FakeNet, loop: VirtualTimeLoop, peer_id: str, client: bool = False) -> None:
        self.peer_id = peer_id
        self.address = "" if client else f"fake://{peer_id}"
        self.rejections: list[tuple[str, str]] = []
        self.registry = ReduceRegistry(peer_id, lambda reason, sender, _: self.rejections.append((reason, sender)),
                                       EXECUTOR, clock=loop.clock)
        if self.address:
            net.registries[self.address] = self.registry
        self.residual = torch.zeros(NUMEL)
        self.owner_residual = torch.zeros(NUMEL)
        self.net = net

    def member(self) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=self.peer_id, address=self.address, weight=1.0)

    async def reduce(self, group: averaging_pb2.Group, delta: torch.Tensor, quorum: float = 1.0) -> AllReduceResult:
        return await run_allreduce(group, self.peer_id, delta, self.residual, self.owner_residual, self.registry,
                                   None, EXECUTOR, quorum=quorum, transport=self.net)


def make_group(members: list[Member], codec: str = "fp32", reduce_timeout: float = 5.0) -> averaging_pb2.Group:
    owners = [i for i, m in enumerate(members) if m.address]
    return averaging_pb2.Group(
        group_id=b"u" * 16, step=0, members=[m.member() for m in members],
        shard_bounds=shard_layout(NUMEL, [0.0] * len(owners)), shard_owners=owners,
        codec=int(codecs.get_codec(codec).id), reduce_timeout_s=reduce_timeout)


def deltas(count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) * 0.01 for _ in range(count)]


def test_every_member_ends_with_the_same_decoded_average_at_once():
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, f"peer-{i:02d}") for i in range(3)] + [Member(net, loop, "peer-50", client=True)]
        group = make_group(members, codec="int8")
        results = await asyncio.gather(*(m.reduce(group, d) for m, d in zip(members, deltas(4))))
        return loop.time(), results

    elapsed, results = run_virtual(scenario)
    mean = torch.stack(deltas(4)).mean(0)
    for i, sl in enumerate(results[0].slices):
        assert all(torch.equal(r.averages[i], results[0].averages[i]) for r in results)  # bit-identical
        assert torch.allclose(results[0].averages[i], mean[sl], atol=2e-3)  # int8 of the mean
    assert all(r.reports_heard == 3 for r in results)
    assert elapsed < 0.1  # nothing waited for a deadline or a grace


def test_a_silent_client_member_costs_the_graces_after_the_quorum_not_the_deadline():
    """The round of test_allreduce_faults' straggler test: three owners and a client-mode member
    that never sends (nor reports: nobody can call it). The owners wait a grace after the quorum
    for it, twice: for its contribution and for its shard report."""
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        owners = [Member(net, loop, f"peer-{i:02d}") for i in range(3)]
        group = make_group([*owners, Member(net, loop, "peer-99", client=True)], reduce_timeout=300.0)
        results = await asyncio.gather(*(m.reduce(group, d, quorum=0.6) for m, d in zip(owners, deltas(3))))
        return loop.time(), results

    elapsed, results = run_virtual(scenario)
    mean = torch.stack(deltas(3)).mean(0)
    for i, sl in enumerate(results[0].slices):
        assert all(torch.equal(r.averages[i], results[0].averages[i]) for r in results)
        assert torch.allclose(results[0].averages[i], mean[sl], atol=1e-6)
    assert MIN_STRAGGLER_GRACE + MIN_REPORT_GRACE <= elapsed <= MIN_STRAGGLER_GRACE + 2 * MIN_REPORT_GRACE + 0.1


def test_the_owners_quorum_counts_senders_that_arrived_before_it_started_waiting():
    """Regression: the quorum was counted over the senders still missing when the wait began, so
    with two of three in before it, it needed the silent third one and waited until the deadline."""
    async def scenario(loop: VirtualTimeLoop):
        group = make_group([Member(FakeNet(), loop, p) for p in ("a", "b", "c")], reduce_timeout=300.0)
        acc = ShardAccumulator(group=group, shard_index=0, owner_id="a", codec=codecs.get_codec("fp32"),
                               executor=EXECUTOR, owner_residual=torch.zeros(10), own=torch.ones(10),
                               expected={"b", "c", "silent"}, weights={"a": 1.0, "b": 1.0, "c": 1.0, "silent": 1.0},
                               clock=loop.clock)
        await asyncio.sleep(0.5)
        await acc.add("b", torch.ones(10))
        await asyncio.sleep(0.5)
        await acc.add("c", torch.ones(10))  # the quorum (0.6 of 3): 1 s after the accumulator opened
        await acc.wait_for_senders(deadline=300.0, quorum=0.6)
        return loop.time()

    assert run_virtual(scenario) == pytest.approx(1.0 + 2 * 1.0)  # twice what the quorum took


def test_the_report_quorum_counts_reports_heard_before_the_own_reduce_phase_ended():
    """Regression: the same in the shard agreement, for reports that came in during the reduce."""
    async def scenario(loop: VirtualTimeLoop):
        agreement = ShardAgreement(b"u" * 16, "a", ["a", "b", "c", "silent"], 2, deadline=450.0, clock=loop.clock)
        await asyncio.sleep(0.5)
        agreement.hear("b", [False, False])
        await asyncio.sleep(0.5)
        agreement.hear("c", [False, False])
        agreement.own([True, True], [False, False], deadline=450.0)
        await agreement.settle(0.6)
        return loop.time(), agreement.decide()

    elapsed, decision = run_virtual(scenario)
    assert elapsed == pytest.approx(1.0 + MIN_REPORT_GRACE) and decision == [True, True]


@pytest.mark.parametrize("fault", ["dead", "silent"])
def test_a_failed_owners_shard_is_skipped_by_everybody_and_kept_in_the_residuals(fault):
    """``dead``: the owner's address refuses every call. ``silent``: it formed the group and its
    server answers, but it never runs the round (no accumulator, no report). Either way the
    survivors skip its shard alike, keep all of x there, renormalise the others' averages over
    who sent, and the round ends within the exchange deadline. A dead owner's refused call tells
    the survivors' own shards not to wait for its part: their round ends before the deadline."""
    reduce_timeout = 5.0

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, f"peer-{i:02d}") for i in range(3)]
        group = make_group(members, reduce_timeout=reduce_timeout)
        if fault == "dead":
            net.down.add(members[2].address)
        gen = torch.Generator().manual_seed(1)
        old = []
        for m in members[:2]:
            m.residual.copy_(torch.randn(NUMEL, generator=gen) * 0.001)
            old.append(m.residual.clone())
        results = await asyncio.gather(*(m.reduce(group, d) for m, d in zip(members[:2], deltas(2))))
        return loop.time(), results, [m.residual for m in members[:2]], old

    elapsed, results, residuals, old = run_virtual(scenario)
    x = [d + o for d, o in zip(deltas(2), old)]
    failed = 2  # shard 2 belongs to peer-02
    for i, sl in enumerate(results[0].slices):
        if i == failed:
            assert all(r.averages[i] is None for r in results)
            assert all(torch.equal(res[sl], xi[sl]) for res, xi in zip(residuals, x))
            continue
        assert torch.equal(results[0].averages[i], results[1].averages[i])
        assert torch.allclose(results[0].averages[i], ((x[0] + x[1]) / 2)[sl], atol=1e-7, rtol=1e-6)
    if fault == "dead":
        assert elapsed < reduce_timeout  # nobody waited for a member that refuses every call
    else:
        assert reduce_timeout <= elapsed <= EXCHANGE_END * reduce_timeout + 1.0  # the owners waited for it, no longer


def test_runs_are_deterministic():
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, f"peer-{i:02d}") for i in range(3)] + [Member(net, loop, "peer-99", client=True)]
        group = make_group(members, codec="int8", reduce_timeout=30.0)
        results = await asyncio.gather(*(m.reduce(group, d, quorum=0.6) for m, d in zip(members[:3], deltas(3))))
        return loop.time(), [torch.cat([a for a in r.averages]).numpy().tobytes() for r in results], net.calls

    assert run_virtual(scenario) == run_virtual(scenario)


# -- stage budgets (schedule.py StageChain) --------------------------------------------------------


def test_each_stage_waits_for_the_one_before_or_a_budget_counted_from_that_ones_start():
    """A stage that never ends delays the next by one budget, and the one after that by another:
    the budgets add up, so a long chain stays staggered (counted from the round's start, every
    later stage would have started after one budget, all at once)."""
    async def scenario(loop: VirtualTimeLoop) -> list[tuple[str, float]]:
        chain = StageChain(["a", "b", "c", "d"], budget=10.0, clock=loop.clock)
        started: list[tuple[str, float]] = []
        t0 = loop.time()

        async def stage(name: str, lasts: float | None) -> None:
            await chain.turn(name)
            started.append((name, loop.time() - t0))
            if lasts is not None:  # None: hangs (a dead owner) until the chain is over
                await asyncio.sleep(lasts)
                chain.done(name)

        # "a" hangs, "b" hangs, "c" ends after 3 s: "d" starts then, not at c's budget.
        await asyncio.gather(stage("d", 1.0), stage("c", 3.0), stage("b", None), stage("a", None))
        return started

    assert run_virtual(scenario) == [("a", 0.0), ("b", 10.0), ("c", 20.0), ("d", 23.0)]


def test_a_stage_that_fails_before_its_turn_frees_the_next_at_once():
    async def scenario(loop: VirtualTimeLoop) -> float:
        chain = StageChain(["a", "b"], budget=10.0, clock=loop.clock)
        chain.done("a")  # failed before it started (an encode error): "b" need not wait
        t0 = loop.time()
        await chain.turn("b")
        await chain.turn("not staggered")  # a stage outside the order has no turn to wait for
        return loop.time() - t0

    assert run_virtual(scenario) == 0.0


def test_each_member_learns_its_own_uplink_from_the_owners_timing_not_the_rounds_length():
    """One member with a slow link among fast ones: the round lasts as long as the slow member's
    part for everybody, but the owners time every upload from its header, and a member takes
    its fastest upload as its uplink (an upload to the slow owner runs at that owner's pace)."""
    fast, slow = 100e3, 10e3  # bytes/s: a 4 kB part takes 40 ms and 400 ms, long enough to time

    seconds, results = run_virtual(_round_on_links({"a": fast, "b": fast, "c": slow}))
    estimates = {p: r.upload_bps for p, r in zip("abc", results)}
    assert estimates["a"] == pytest.approx(fast, rel=0.01) and estimates["b"] == pytest.approx(fast, rel=0.01)
    assert estimates["c"] == pytest.approx(slow, rel=0.01)
    # What the node declared before: bytes over the round, which the slow part sets for all.
    whole_round = [r.bytes_sent / seconds for r in results]
    assert max(whole_round) / min(whole_round) < 2


def test_uploads_too_quick_to_time_say_only_that_the_uplink_is_at_least_that_fast():
    """Parts that cross fast links in under MIN_TIMED_UPLOAD_SECONDS are timed at the pace of the
    event loops, not the links (loopback: 0.3-1.7 ms for equal links): each counts as taking that
    long, so members whose uploads all beat it declare alike and get equal shares, while a thin
    uplink, whose parts take longer, is still told apart."""
    part = 4000  # bytes per part: NUMEL = 3,000 fp32 values in 3 shards
    _, results = run_virtual(_round_on_links({"a": 10e6, "b": 1e6, "c": 10e3}))  # 0.4 ms, 4 ms, 400 ms
    estimates = [r.upload_bps for r in results]
    assert estimates[0] == estimates[1] == pytest.approx(part / MIN_TIMED_UPLOAD_SECONDS)
    assert estimates[2] == pytest.approx(10e3, rel=0.01)
    assert layout.owner_shares(layout.effective_bandwidths(estimates[:2])) == [0.5, 0.5]


def _round_on_links(link_bps: dict[str, float]):
    """A round of members a, b and c whose links carry ``link_bps`` bytes/s; (seconds, results)."""
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, p) for p in ("a", "b", "c")]
        net.link_bps = link_bps
        group = make_group(members)
        started = loop.time()
        results = await asyncio.gather(*(m.reduce(group, d) for m, d in zip(members, deltas(3))))
        return loop.time() - started, results
    return scenario


def test_a_ring_round_times_no_upload():
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, p) for p in ("a", "b", "c")]
        group = make_group(members)
        group.schedule = averaging_pb2.ALL_REDUCE_SCHEDULE_RING
        return await asyncio.gather(*(m.reduce(group, d) for m, d in zip(members, deltas(3))))

    assert [r.upload_bps for r in run_virtual(scenario)] == [0.0, 0.0, 0.0]


def test_a_reachable_member_that_owns_nothing_averages_like_the_others():
    """The leader gives a member too slow to own anything no shard (layout.owner_shares) though it
    can be called: it uploads all of its parts, gets every average, and ends bit-identical."""
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        members = [Member(net, loop, f"peer-{i:02d}") for i in range(4)]
        group = make_group(members, codec="int8")
        del group.shard_owners[:]
        group.shard_owners.extend([0, 1, 2])
        group.shard_bounds[:] = shard_layout(NUMEL, [0.0] * 3)
        results = await asyncio.gather(*(m.reduce(group, d) for m, d in zip(members, deltas(4))))
        return loop.time(), results

    elapsed, results = run_virtual(scenario)
    mean = torch.stack(deltas(4)).mean(0)
    assert len(results[0].slices) == 3
    for i, sl in enumerate(results[0].slices):
        assert all(torch.equal(r.averages[i], results[0].averages[i]) for r in results)
        assert torch.allclose(results[0].averages[i], mean[sl], atol=2e-3)
    assert all(r.reports_heard == 3 for r in results)
    assert elapsed < 0.1
