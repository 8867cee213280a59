"""One average across two groups of a split step over real gRPC (grpc.aio on 127.0.0.1:0, one
event loop): the team streams to the reducers, the shard reports of the teams and the fetches
go through the same Averaging service as a single group's round (protocol/crossgroup.py), also
through subreducers when a step has many groups."""

from __future__ import annotations

import asyncio

import torch

from .swarm_harness import apply_outer, digest, start_peers


def split_round(count: int, numel: int, group_size: int, seed: int):
    """``count`` peers form step 0's groups and run the round: (θ, deltas, groups, results)."""
    async def scenario():
        peers = await start_peers(count, numel, "int8", group_size=group_size)
        try:
            gen = torch.Generator().manual_seed(seed)
            theta = torch.randn(numel, generator=gen)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected, timeout=30) for p in peers))
            results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in zip(peers, groups, deltas)))
            return theta, deltas, groups, results
        finally:
            await asyncio.gather(*(p.stop() for p in peers))

    return asyncio.run(scenario())


def test_two_groups_of_a_split_step_end_with_one_state_over_grpc():
    theta, deltas, groups, results = split_round(5, 50_001, 3, seed=0)
    assert sorted(len(g.members) for g in {g.group_id: g for g in groups}.values()) == [2, 3]
    assert all(len(g.step_groups) == 2 for g in groups)
    assert all(a is not None for r in results for a in r.averages)
    assert len({digest(apply_outer(theta, r)) for r in results}) == 1  # one θ_global for both groups
    mean = torch.stack(deltas).mean(0)
    average = torch.cat(results[0].averages)
    assert torch.allclose(average, mean, atol=0.01 * mean.abs().max().item() + 1e-7)  # int8 of the global mean
    # Not just one group's mean: a group's own average differs from the global one by far more.
    for g in {g.group_id: g for g in groups}.values():
        ids = [int(m.peer_id.split("-")[1]) for m in g.members]
        local = torch.stack([deltas[i] for i in ids]).mean(0)
        assert (local - average).abs().max() > 0.01 * mean.abs().max()


def test_nine_groups_reduce_each_team_in_a_tree_over_grpc():
    """18 peers in groups of 2: 9 groups, so each team goes through subreducers to its reducer."""
    theta, deltas, groups, results = split_round(18, 20_001, 2, seed=1)
    assert all(len(g.step_groups) == 9 and len(g.team_subreducers) == 3 * (len(g.shard_bounds) - 1) for g in groups)
    assert all(a is not None for r in results for a in r.averages)
    assert len({digest(apply_outer(theta, r)) for r in results}) == 1  # one θ_global for all nine groups
    mean = torch.stack(deltas).mean(0)
    assert torch.allclose(torch.cat(results[0].averages), mean, atol=0.01 * mean.abs().max().item() + 1e-7)


def test_a_dead_owner_costs_its_group_only_its_own_parts_over_grpc():
    """The owner of shard 0 in the group that does not reduce shard 0 stops its server after the
    groups formed. Its group's other member fetches shard 0 from the team; all survivors end
    with the same averages of every shard."""
    numel, count = 20_001, 5

    async def scenario():
        peers = await start_peers(count, numel, "int8", group_size=3, reduce_timeout=2.0)
        try:
            gen = torch.Generator().manual_seed(1)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            groups = await asyncio.gather(*(p.form(0, {p.peer_id for p in peers}) for p in peers))
            plan = groups[0].step_groups
            other = 1 - 0 % len(plan)  # shard 0 is reduced in group 0
            victim_id = plan[other].members[plan[other].shard_owners[0]].peer_id
            victim = next(p for p in peers if p.peer_id == victim_id)
            await victim.stop()
            live = [(p, g, d) for p, g, d in zip(peers, groups, deltas) if p is not victim]
            results = await asyncio.gather(*(p.reduce(g, d) for p, g, d in live))
            return results
        finally:
            await asyncio.gather(*(p.stop() for p in peers))

    results = asyncio.run(scenario())
    assert len(results) == 4
    for r in results:
        assert all(a is not None for a in r.averages)
        assert all(torch.equal(a, b) for a, b in zip(r.averages, results[0].averages))
