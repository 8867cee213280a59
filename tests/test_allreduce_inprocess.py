"""Butterfly all-reduce and matchmaking with several peers in one event loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from .swarm_harness import apply_outer, digest, start_peers


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("codec", ["int8", "fp32"])
def test_three_peers_end_bit_identical(codec):
    numel = 100_003

    async def scenario():
        peers = await start_peers(3, numel, codec)
        try:
            gen = torch.Generator().manual_seed(0)
            theta = torch.randn(numel, generator=gen)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            expected = {p.peer_id for p in peers}
            results = await asyncio.gather(*(p.average(0, d, expected) for p, d in zip(peers, deltas)))
            groups = [g for g, _ in results]
            assert all(len(g.members) == 3 for g in groups)
            assert len({g.group_id for g in groups}) == 1
            new = [apply_outer(theta, r) for _, r in results]
            assert len({digest(t) for t in new}) == 1
            # The result is the weighted mean of the deltas, up to the codec's error.
            mean = torch.stack(deltas).mean(0)
            got = results[0][1]
            approx = torch.cat([a for a in got.averages])
            tolerance = 0 if codec == "fp32" else 0.01 * mean.abs().max().item()
            assert torch.allclose(approx, mean, atol=tolerance + 1e-7)
        finally:
            await asyncio.gather(*(p.stop() for p in peers))

    run(scenario())
