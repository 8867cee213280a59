"""One average across the groups of a split step, without sockets (protocol/crossgroup.py): the
real Matchmaker splits 11 peers into groups of 4, 4 and 3, and the real run_allreduce of every
member (over tests/protocol_fakes.py) ends every group with the same bytes, equal to the weighted
global mean to the codec's bound; a dead or silent owner, or a dead team reducer, costs its
shard's parts for one round and leaves every group identical, within bounded deadlines; an owner
whose answer from the reducer broke fetches the result from its team."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
import torch

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import AllReduceResult, ReduceRegistry, run_allreduce
from lowcomm.protocol.auth import claimed_sender
from lowcomm.protocol.crossgroup import CROSS_EXTRA, StepPlan, TeamBook, TeamState
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.layout import close_groups, groups_of_step, split_step_layout, team_reducers
from lowcomm.protocol.matchmaking import Matchmaker
from lowcomm.protocol.transport import Refused

from .protocol_fakes import FakeDHT, FakeNet, InlineExecutor, VirtualTimeLoop, run_virtual

NUMEL = 2400
EXECUTOR = InlineExecutor()
REDUCE_TIMEOUT = 5.0


class Peer:
    def __init__(self, net: FakeNet, dht: FakeDHT, loop: VirtualTimeLoop, peer_id: str, group_size: int,
                 codec: str, weight: float = 1.0) -> None:
        self.peer_id, self.address, self.weight = peer_id, f"fake://{peer_id}", weight
        self.matchmaker = Matchmaker(dht, "unit", Identity(peer_id, "f" * 64, "{}"), self.address, None, group_size,
                                     int(codecs.get_codec(codec).id), NUMEL, reduce_timeout=REDUCE_TIMEOUT,
                                     transport=net, clock=loop.clock, random_bytes=random.Random(peer_id).randbytes)
        self.registry = ReduceRegistry(peer_id, lambda *_: None, EXECUTOR, clock=loop.clock)
        net.matchmakers[self.address] = self.matchmaker
        net.registries[self.address] = self.registry
        self.residual = torch.zeros(NUMEL)
        self.owner_residual = torch.zeros(NUMEL)
        self.net = net

    async def group(self, everybody: set[str]) -> averaging_pb2.Group:
        async def expected() -> set[str]:
            return set(everybody)
        return await self.matchmaker.form_group(0, self.weight, 0.0, expected, timeout=10.0)

    async def reduce(self, group: averaging_pb2.Group, delta: torch.Tensor) -> AllReduceResult:
        return await run_allreduce(group, self.peer_id, delta, self.residual, self.owner_residual, self.registry,
                                   None, EXECUTOR, quorum=1.0, transport=self.net)


def deltas(count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) * 0.01 for _ in range(count)]


async def split_round(loop: VirtualTimeLoop, count: int, group_size: int, codec: str, fault=None,
                      weights: list[float] | None = None):
    """Form the step's groups with the real leader, apply ``fault(net, groups, peers)`` (it
    returns the peers that do not run the round), then run every other member's all-reduce."""
    net, dht = FakeNet(), FakeDHT(loop)
    peers = [Peer(net, dht, loop, f"peer-{i:02d}", group_size, codec, 1.0 if weights is None else weights[i])
             for i in range(count)]
    ids = {p.peer_id for p in peers}
    groups = await asyncio.gather(*(p.group(ids) for p in peers))
    absent = fault(net, groups, peers) if fault is not None else set()
    started = loop.time()
    live = [(p, g, d) for p, g, d in zip(peers, groups, deltas(count)) if p.peer_id not in absent]
    results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in live))
    return loop.time() - started, groups, {p.peer_id: r for (p, _, _), r in zip(live, results)}, peers


def test_three_groups_end_with_one_bit_identical_weighted_global_mean():
    weights = [1.0 + (i % 3) for i in range(11)]  # tokens differ: the mean must weigh them
    elapsed, groups, results, peers = run_virtual(lambda loop: split_round(loop, 11, 4, "int8", weights=weights))
    assert sorted(len(g.members) for g in {g.group_id: g for g in groups}.values()) == [3, 4, 4]
    assert all(p.matchmaker.last_plan == (0, 11) for p in peers)  # the next step's B counts the whole plan
    assert len({g.group_id for g in groups}) == 3
    plan = StepPlan.of(groups[0])
    assert plan is not None and len(plan.groups) == 3
    assert all(list(g.shard_bounds) == list(groups[0].shard_bounds) for g in groups)  # one layout
    assert len(groups[0].shard_bounds) == 4  # K = 3, the smallest group's size
    first = next(iter(results.values()))
    for r in results.values():
        assert all(a is not None for a in r.averages)
        assert all(torch.equal(a, b) for a, b in zip(r.averages, first.averages))  # bit-identical everywhere
    w = torch.tensor(weights)[:, None]
    mean = (torch.stack(deltas(11)) * w).sum(0) / w.sum()
    average = torch.cat(first.averages)
    assert torch.allclose(average, mean, atol=3e-4)  # int8 of the weighted global mean (|Δ| ≲ 0.04)
    assert not torch.allclose(average, torch.stack(deltas(11)).mean(0), atol=3e-5)  # not the unweighted mean
    assert elapsed < 1.0  # nobody waited for a deadline


def test_a_healthy_split_round_asks_no_owner_for_more_than_its_own_groups_agreement():
    """Each owner is called for its group's shard agreement only: a team's owners exchange no
    reports (an all-to-all among the G owners of a team would cost each G − 1 calls per round);
    only an owner that lacks the reducer's answer calls the others."""
    _, groups, _, peers = run_virtual(lambda loop: split_round(loop, 11, 4, "int8"))
    plan = StepPlan.of(groups[0])
    assert plan is not None
    reports = Counter(address for method, address in peers[0].net.calls if method == "ReportShards")
    for step_group in plan.groups:
        for member in step_group.members:
            assert reports[member.address] == len(step_group.members) - 1


def test_a_single_group_is_unchanged():
    _, groups, results, peers = run_virtual(lambda loop: split_round(loop, 4, 8, "fp32"))
    assert all(len(g.step_groups) == 0 and g.group_index == 0 for g in groups)
    assert all(p.matchmaker.last_plan is None for p in peers)  # one group says nothing of the swarm's size
    mean = torch.stack(deltas(4)).mean(0)
    assert torch.allclose(torch.cat(next(iter(results.values())).averages), mean, atol=1e-7)


def owner_of(groups: list[averaging_pb2.Group], g: int, k: int) -> str:
    plan = StepPlan.of(groups[0])
    assert plan is not None
    return plan.owner(g, k).peer_id


@pytest.mark.parametrize("role", ["owner", "reducer"])
@pytest.mark.parametrize("fault", ["dead", "silent"])
def test_a_failed_owner_or_reducer_costs_its_shard_at_most_and_every_group_stays_identical(role, fault):
    """Shard 1's reducer is the owner in group 1. ``owner``: the owner of shard 1 in group 2 fails
    (its group fetches the step's average from the team and keeps its own parts in the residual);
    ``reducer``: the reducer fails (nobody has shard 1: everybody skips it). Either way every
    live member of every group ends with the same averages."""
    victim = {}

    def inject(net: FakeNet, groups, peers):
        peer = owner_of(groups, 2 if role == "owner" else 1, 1)
        victim["id"] = peer
        (net.down if fault == "dead" else net.silent).add(f"fake://{peer}")
        return {peer}

    elapsed, groups, results, peers = run_virtual(lambda loop: split_round(loop, 11, 4, "fp32", fault=inject))
    first = next(iter(results.values()))
    for r in results.values():
        assert [a is None for a in r.averages] == [a is None for a in first.averages]
        assert all(a is None or torch.equal(a, b) for a, b in zip(r.averages, first.averages))
    skipped = [i for i, a in enumerate(first.averages) if a is None]
    assert skipped == ([] if role == "owner" else [1])
    sl = first.slices[1]
    by_id = {p.peer_id: (p, d) for p, d in zip(peers, deltas(11))}
    gone_group = next(g for g in groups if victim["id"] in {m.peer_id for m in g.members})
    lost = {m.peer_id for m in gone_group.members} if role == "owner" else set(results)
    for pid in results:
        peer, delta = by_id[pid]
        if pid in lost:  # its part of shard 1 did not make it: all of x is kept for the next round
            assert torch.equal(peer.residual[sl], delta[sl])
        else:
            assert torch.equal(peer.residual[sl], torch.zeros(sl.stop - sl.start))  # fp32: delivered exactly
    if role == "owner":  # shard 1's average is the mean over the other two groups
        others = [pid for g in groups if g.group_id != gone_group.group_id for pid in [m.peer_id for m in g.members]]
        mean = torch.stack([by_id[p][1] for p in sorted(set(others))]).mean(0)
        assert torch.allclose(first.averages[1], mean[sl], atol=1e-7)
    assert elapsed <= (1.5 + CROSS_EXTRA) * REDUCE_TIMEOUT + 1.5  # every wait bounded by the split step's


def test_a_silent_group_costs_its_parts_and_the_shard_it_reduces_and_the_others_stay_identical():
    """Every member of group 2 formed the group and then never runs the round (hung). Shard 2's
    reducer is in group 2: nobody has it and everybody skips it. Shards 0 and 1 average the other
    two groups, with group 2 left out, bit-identical in both."""
    gone: set[str] = set()

    def inject(net: FakeNet, groups, peers):
        plan = StepPlan.of(groups[0])
        gone.update(m.peer_id for m in plan.groups[2].members)
        net.silent.update(f"fake://{p}" for p in gone)
        return set(gone)

    elapsed, groups, results, peers = run_virtual(lambda loop: split_round(loop, 11, 4, "fp32", fault=inject))
    first = next(iter(results.values()))
    assert [a is None for a in first.averages] == [False, False, True]
    for r in results.values():
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(r.averages, first.averages))
    by_id = dict(zip([p.peer_id for p in peers], deltas(11)))
    mean = torch.stack([d for p, d in sorted(by_id.items()) if p not in gone]).mean(0)
    for k in (0, 1):
        sl = first.slices[k]
        assert torch.allclose(first.averages[k], mean[sl], atol=1e-7)
    assert elapsed <= (1.5 + CROSS_EXTRA) * REDUCE_TIMEOUT + 1.5


def test_runs_are_deterministic():
    def run():
        return run_virtual(lambda loop: split_round(loop, 11, 4, "int8"))

    (t1, _, r1, _), (t2, _, r2, _) = run(), run()
    assert t1 == t2
    assert all(torch.equal(torch.cat(r1[p].averages), torch.cat(r2[p].averages)) for p in r1)


def test_the_split_layout_is_one_for_every_group_with_the_fastest_reachable_owners():
    def member(pid: str, reachable: bool = True) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=pid, address=f"fake://{pid}" if reachable else "")

    groups = [[member("a"), member("b"), member("c"), member("d", reachable=False)], [member("e"), member("f")]]
    bounds, owners = split_step_layout(1001, groups, {"a": 1.0, "b": 5.0, "c": 3.0, "e": 0.0})
    assert bounds == [0, 500, 1001]  # K = 2 (the smaller group), equal shards
    assert owners == [[1, 2], [0, 1]]  # b and c are faster than a; d is client-mode and never owns


def test_each_team_is_reduced_by_its_owner_with_the_fastest_link_and_every_group_names_the_same():
    def member(pid: str) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=pid, address=f"fake://{pid}", weight=1.0)

    groups = [[member("a"), member("b")], [member("c"), member("d")], [member("e"), member("f")]]
    speeds = {"a": 10.0, "b": 1.0, "c": 50.0, "d": 1.0, "e": 50.0, "f": 0.0}  # f declared nothing
    owners = [[0, 1]] * 3
    # Shard 0: a, c, e own it; c and e tie at 50: the first group from 0 on (1). Shard 1: b, d, f;
    # b and d tie at 1: the first group from 1 on (1 itself).
    assert team_reducers(groups, owners, speeds) == [1, 1]
    assert team_reducers(groups, owners, {}) == [0, 1]  # nothing declared: team k in group k mod G
    template = averaging_pb2.Group(step=3, reduce_timeout_s=5.0)
    closed = close_groups(groups, speeds, 1000, template, lambda n: bytes(n))
    assert all(list(g.team_reducers) == list(closed[0].team_reducers) for g in closed)
    for group in closed:
        plan = StepPlan.of(group)
        assert plan is not None and [plan.owner(plan.reducer_group(k), k).peer_id for k in (0, 1)] == ["c", "d"]
    # A bucket leader rebuilds its members' messages from the plan: the same reducers.
    assert all(list(g.team_reducers) == [1, 1] for g in groups_of_step(closed[2]).values())
    bad = averaging_pb2.Group()
    bad.CopyFrom(closed[0])
    del bad.team_reducers[:]
    bad.team_reducers.extend([1, 3])  # only 3 groups
    with pytest.raises(ValueError, match="team_reducers"):
        StepPlan.of(bad)


def test_a_team_reducer_refuses_parts_that_the_plan_does_not_allow():
    """Only the owner of the shard in another group may send its part, once, of the right size,
    with contributors from its own group; a fetch comes from a member of the group it names."""
    def member(pid: str) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=pid, address=f"fake://{pid}", weight=1.0)

    plan = StepPlan((averaging_pb2.StepGroup(group_id=b"g" * 16, members=[member("a"), member("b")], shard_owners=[0]),
                     averaging_pb2.StepGroup(group_id=b"h" * 16, members=[member("c"), member("d")], shard_owners=[0])),
                    index=0, reducers=(0,))

    async def scenario(loop: VirtualTimeLoop):
        book = TeamBook()
        team = TeamState(plan, 0, 4, codecs.get_codec("fp32"), reducer=True, close_at=5.0, ends_at=10.0,
                         clock=loop.clock)
        book.open([team])

        async def send(**fields) -> str:
            header = averaging_pb2.TeamHeader(group_id=b"g" * 16, shard_index=0, numel=4, **fields)

            async def nothing():
                return
                yield

            try:
                async for _ in book.handle(header, nothing(), EXECUTOR, find_timeout=1.0):
                    pass
            except Refused as err:
                return err.code.name
            return "OK"

        return [
            await send(from_group=1, sender_peer_id="d", payload_bytes=16, contributors=["c", "d"]),  # not the owner
            await send(from_group=1, sender_peer_id="c", payload_bytes=16, contributors=["c", "a"]),  # a is not in group 1
            await send(from_group=1, sender_peer_id="c", payload_bytes=12, contributors=["c"]),  # wrong size
            await send(from_group=0, sender_peer_id="a", payload_bytes=16, contributors=["a"]),  # the reducer's own group
            await send(from_group=1, sender_peer_id="a", fetch=True),  # a fetch naming a group it is not in
        ]

    assert run_virtual(scenario) == ["INVALID_ARGUMENT"] * 5


def test_a_team_header_names_its_sender_for_the_run_secret_check():
    header = averaging_pb2.TeamHeader(sender_peer_id="peer-c")
    assert claimed_sender(averaging_pb2.ReduceMessage(team_header=header)) == "peer-c"


class BrokenAnswerNet(FakeNet):
    """A FakeNet whose team reducers answer ``victim``'s team stream with a result that does not
    match the shard (as if the reducer died mid-reply to that owner only)."""

    def __init__(self, victim: list[str]) -> None:
        super().__init__()
        self.victim = victim

    async def reduce(self, address, requests, timeout):
        first = await anext(requests)

        async def replay():
            yield first
            async for message in requests:
                yield message

        broken = first.HasField("team_header") and not first.team_header.fetch and \
            first.team_header.sender_peer_id in self.victim
        async for message in super().reduce(address, replay(), timeout):
            if broken and message.HasField("result"):
                message.result.numel += 1
            yield message


@pytest.mark.parametrize("broken_groups", [(2,), (0, 2)])
def test_an_owner_without_the_reducers_answer_fetches_it_from_its_team_and_every_group_applies_it(broken_groups):
    """Shard 1's reducer (group 1) answers the owner in group 2 (or both other owners) with a
    broken result: such an owner fetches the result from another owner of its team (or, when no
    other holds it, from the reducer, asked last) instead, so every group applies shard 1,
    bit-identical, with every group's parts in it, and the reducer keeps the error feedback of
    the average everybody applied."""
    victim: list[str] = []

    async def scenario(loop: VirtualTimeLoop):
        net, dht = BrokenAnswerNet(victim), FakeDHT(loop)
        peers = [Peer(net, dht, loop, f"peer-{i:02d}", 4, "int8") for i in range(11)]
        groups = await asyncio.gather(*(p.group({q.peer_id for q in peers}) for p in peers))
        victim.extend(owner_of(groups, g, 1) for g in broken_groups)
        results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas(11))))
        reducer = next(p for p in peers if p.peer_id == owner_of(groups, 1, 1))
        return groups, results, peers, reducer

    groups, results, peers, reducer = run_virtual(scenario)
    assert owner_of(groups, 1, 1) not in victim  # the reducer's own group is never a victim here
    assert all(a is not None for r in results for a in r.averages)
    assert all(torch.equal(r.averages[k], results[0].averages[k]) for r in results for k in range(3))
    plan = StepPlan.of(groups[0])
    assert plan is not None
    sl = results[0].slices[1]
    group2 = {m.peer_id for m in plan.groups[2].members}
    mean = torch.stack([d for p, d in zip(peers, deltas(11))]).mean(0)  # everybody's part is in it
    assert torch.allclose(results[0].averages[1], mean[sl], atol=2e-3)
    assert all(r.averages[1] is not None for p, r in zip(peers, results) if p.peer_id in group2)
    assert reducer.owner_residual[sl].abs().sum() > 0  # the applied int8 average leaves its feedback


class TeamCountingNet(FakeNet):
    """A FakeNet that records every team stream: (callee address, sending group, fetch)."""

    def __init__(self) -> None:
        super().__init__()
        self.team_streams: list[tuple[str, int, bool]] = []

    async def reduce(self, address, requests, timeout):
        first = await anext(requests)
        if first.HasField("team_header"):
            self.team_streams.append((address, first.team_header.from_group, first.team_header.fetch))

        async def replay():
            yield first
            async for message in requests:
                yield message

        async for message in super().reduce(address, replay(), timeout):
            yield message


def tree_round(loop: VirtualTimeLoop, down: set[int] = frozenset()):
    """18 peers in groups of 2: 9 groups, so every team is a tree of subteams of 3 groups. The
    owners of shard 0 in the groups of ``down`` (by index) are dead when the round starts."""
    async def scenario():
        net, dht = TeamCountingNet(), FakeDHT(loop)
        weights = [1.0 + (i % 3) for i in range(18)]
        peers = [Peer(net, dht, loop, f"peer-{i:02d}", 2, "int8", weights[i]) for i in range(18)]
        groups = await asyncio.gather(*(p.group({q.peer_id for q in peers}) for p in peers))
        dead = {owner_of(groups, g, 0) for g in down}
        net.down.update(f"fake://{p}" for p in dead)
        live = [(p, g, d, w) for p, g, d, w in zip(peers, groups, deltas(18), weights) if p.peer_id not in dead]
        results = await asyncio.gather(*(p.reduce(g, d) for p, g, d, _ in live))
        return net, groups, live, results
    return scenario()


def test_many_groups_reduce_each_team_in_a_tree_and_end_with_the_same_weighted_global_mean():
    net, groups, live, results = run_virtual(lambda loop: tree_round(loop))
    plan = StepPlan.of(groups[0])
    assert plan is not None and len(plan.groups) == 9 and plan.fanin == 3
    assert all(list(g.team_subreducers) == list(groups[0].team_subreducers) for g in groups)
    first = results[0]
    assert all(a is not None for r in results for a in r.averages)
    assert all(torch.equal(a, b) for r in results for a, b in zip(r.averages, first.averages))  # bit-identical
    w = torch.tensor([weight for *_, weight in live])[:, None]
    mean = (torch.stack([d for _, _, d, _ in live]) * w).sum(0) / w.sum()
    assert torch.allclose(torch.cat(first.averages), mean, atol=3e-4)  # int8 of the weighted global mean
    # No owner receives a part from every other group: the top reducer gets its subteam's two
    # and the two other subreducers' partial averages, a subreducer its subteam's two.
    for k in range(len(plan.reducers)):
        received = Counter(address for address, _, fetch in net.team_streams if not fetch and
                           address == plan.owner(plan.reducer_group(k), k).address)
        assert sum(received.values()) == 4
        for g in range(9):
            streams = [s for s in net.team_streams if s[0] == plan.owner(g, k).address and not s[2]]
            assert len(streams) == len(plan.children(k, g)) <= 4


def test_a_dead_subreducer_costs_its_subteams_parts_and_every_group_still_applies_the_team_average():
    def find_down(loop):
        return tree_round(loop)

    net, groups, _, _ = run_virtual(find_down)
    plan = StepPlan.of(groups[0])
    assert plan is not None
    top = plan.reducer_group(0)
    sub = next(g for g in range(9) if plan.children(0, g) and g != top)  # a subreducer of shard 0, not the top
    subteam = plan.covered(0, sub)
    net, groups, live, results = run_virtual(lambda loop: tree_round(loop, down={sub}))
    first = results[0]
    assert all(r.averages[0] is not None for r in results)  # its subteam's owners fetched it from the team
    assert all(torch.equal(r.averages[0], first.averages[0]) for r in results)
    lost = {m.peer_id for g in subteam for m in plan.groups[g].members}
    kept = [(d, w) for p, _, d, w in live if p.peer_id not in lost]
    w = torch.tensor([weight for _, weight in kept])[:, None]
    mean = (torch.stack([d for d, _ in kept]) * w).sum(0) / w.sum()
    sl = first.slices[0]
    assert torch.allclose(first.averages[0], mean[sl], atol=3e-4)  # the dead subteam's parts are left out
    for (p, _, d, _), r in zip(live, results):
        if p.peer_id in lost:  # its part of shard 0 is not in the average: all of x stays for the next round
            assert torch.equal(p.residual[sl], d[sl])
