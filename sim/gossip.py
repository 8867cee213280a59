"""Gossip mode on a simulated peer: node/gossip_mode.py's round with the parameters as small vectors.

Real code: the partner choice is ``GossipMode._candidates`` itself (live peers with an address
within ``STEP_WINDOW`` steps, shuffled by the peer's RNG), called on this object, which has the
two attributes it reads (``host`` with ``view()``/``peer_id``, and ``_rng``); the responder's
inbox is protocol/gossip.py's ``Inbox`` (its capacity refusals make a busy peer answer
RESOURCE_EXHAUSTED and the caller try its next candidate). The exchange follows
``GossipResponder.handle`` / ``exchange``: hello+header, the callee's go-ahead, our payload,
its payload, all within ``reduce_timeout``; k workers each take candidates until one exchange
succeeds (``GossipMode._exchange_all``). Mixing is the node's: the equal-weight mean of our θ
after our own outer step, the partners' θ and what our inbox holds.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import TYPE_CHECKING

import numpy as np

from lowcomm.node.gossip_mode import STEP_WINDOW, GossipMode, gossip_codec
from lowcomm.protocol.gossip import Inbox

from .links import one_way, transfer_seconds

if TYPE_CHECKING:
    from .peer import SimPeer

EXCHANGE_METHOD = "Exchange"


class _Unreachable(Exception):
    pass


class _Host:
    """What GossipMode._candidates reads of its host: ``view()`` and ``peer_id``."""

    def __init__(self, peer: "SimPeer") -> None:
        self.peer_id = peer.peer_id
        self._peer = peer

    def view(self):
        return self._peer.view


class SimGossip:
    def __init__(self, peer: "SimPeer") -> None:
        world = peer.world
        self.node = peer
        self.host = _Host(peer)  # what GossipMode._candidates reads (host.view(), host.peer_id)
        self.k = world.config.gossip_partners
        self.timeout = world.config.reduce_timeout
        self.inbox = Inbox(capacity=max(4, 2 * self.k))
        self._rng = random.Random(f"{world.config.seed}/{peer.index}/gossip")
        self.payload = gossip_codec(world.codec).encoded_size(world.config.numel)

    def candidates(self, step: int):
        return GossipMode._candidates(self, step)

    async def round(self, step: int, delta: np.ndarray) -> None:
        peer, world = self.node, self.node.world
        loop = asyncio.get_running_loop()
        own = peer.theta - (delta + peer.residual)  # our own outer step, exactly as alone
        peer.residual[:] = 0
        await peer.refresh_view()
        started = loop.time()
        partners, sent, received = await self._exchange_all(self.candidates(step), step, own, started + self.timeout)
        inbox = self.inbox.drain()
        norm = float(np.linalg.norm(own)) or 1.0
        distance = (sum(float(np.linalg.norm(own - theta)) for theta in partners.values()) / (norm * len(partners))
                    if partners else math.nan)
        mixed = [*partners.values(), *inbox.values()]
        theta = own.copy()
        for other in mixed:
            theta += other
        theta /= 1 + len(mixed)
        world.metrics.formed(step, peer.peer_id, loop.time() - started, None, False, world.live_count(),
                             size=1 + len(partners))
        world.metrics.gossiped(step, peer.peer_id, distance, len(partners), len(inbox))
        if not partners:  # every candidate refused, was unreachable or too slow (counted as the node does)
            world.metrics.failed(step, peer.peer_id, "no_partner")
        world.metrics.averaged(step, peer.peer_id, 1 + len(partners), sent, received, alone=not partners)
        peer.commit(theta)

    async def _exchange_all(self, candidates, step: int, payload: np.ndarray, deadline: float):
        queue = list(candidates)
        partners: dict[str, np.ndarray] = {}
        traffic = [0, 0]

        async def worker() -> None:
            while queue:
                if deadline - asyncio.get_running_loop().time() <= 0:
                    return
                record = queue.pop()
                try:
                    async with asyncio.timeout(deadline - asyncio.get_running_loop().time()):
                        partners[record.peer_id] = await self._exchange(record.peer_id, step, payload, traffic)
                    return
                except (_Unreachable, TimeoutError):
                    continue

        async with asyncio.TaskGroup() as tasks:
            for _ in range(min(self.k, len(queue))):
                tasks.create_task(worker())
        return partners, traffic[0], traffic[1]

    async def _exchange(self, partner_id: str, step: int, theta: np.ndarray, traffic: list[int]) -> np.ndarray:
        """One push-pull exchange with the callee's checks (protocol/gossip.py), or _Unreachable."""
        me, world = self.node, self.node.world
        other = world.peers.get(partner_id)
        if other is None:
            await asyncio.sleep(2 * me.link.latency)
            raise _Unreachable("connection refused")
        await asyncio.sleep(one_way(me.link, other.link))
        if not other.alive or other.gossip is None:
            raise _Unreachable("connection refused")
        world.metrics.rpc(other.step, partner_id, EXCHANGE_METHOD)
        if abs(step - other.step) > STEP_WINDOW:
            raise _Unreachable("ABORTED: steps too far apart")
        if not other.gossip.inbox.reserve(me.peer_id):
            await asyncio.sleep(one_way(other.link, me.link))
            raise _Unreachable("RESOURCE_EXHAUSTED")
        try:
            await asyncio.sleep(one_way(other.link, me.link))  # the go-ahead header
            await asyncio.sleep(transfer_seconds(me.link, other.link, self.payload))
            traffic[0] += self.payload
            world.metrics.traffic(partner_id, step, received=self.payload)
            if not other.alive:
                raise _Unreachable("the partner went away")
            other.gossip.inbox.put(me.peer_id, theta.copy())
            reply = other.theta.copy()
        finally:
            other.gossip.inbox.release(me.peer_id)
        await asyncio.sleep(transfer_seconds(other.link, me.link, self.payload))
        traffic[1] += self.payload
        world.metrics.traffic(partner_id, step, sent=self.payload)
        return reply
