"""This peer in the DHT: its record, the swarm view, and the heartbeat that keeps both fresh.

``SwarmLink`` is the round driver's ``SwarmPort`` (node/ports.py): the record (step and hash read
together, phase, throughput, bandwidth) is published every heartbeat and whenever the driver
asks; the view of the run's peers is read on each heartbeat and when a round or a catch-up needs
it fresh. After a partition heals, hivemind alone never reintroduces the two sides: the
heartbeat asks node/reconnect.py to re-bootstrap towards peers that went missing.
"""

from __future__ import annotations

import asyncio
import logging

from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol.handshake import Identity

from . import decisions
from .config import Config
from .globalstate import GlobalState
from .metrics import NodeMetrics
from .reconnect import Reconnector
from .runstats import RunStats
from .swarm import HivemindDHT, PeerRecord, SignedDHT, SwarmView, peers_key, read_swarm

log = logging.getLogger("lowcomm.node")


class SwarmLink:
    """This peer's record and view of the swarm (see the module docstring)."""

    def __init__(self, config: Config, identity: Identity, state: GlobalState, *, dht_client: HivemindDHT | SignedDHT,
                 reconnector: Reconnector, metrics: NodeMetrics, stats: RunStats, address: str = "") -> None:
        self.config = config
        self.identity = identity
        self.peer_id = identity.peer_id
        self.state = state
        self.dht_client = dht_client  # signed (node/swarm.py) when the run has a secret
        self.reconnector = reconnector
        self.metrics = metrics
        self.stats = stats
        self.address = address  # "" in client mode: peers cannot call us
        self.view = SwarmView({}, {}, 0.0)
        self.reconnecting: asyncio.Task | None = None

    def record(self, leaving: bool = False) -> PeerRecord:
        step, digest = self.state.published()  # together: never a new step with the old hash
        return PeerRecord(
            peer_id=self.peer_id, address=self.address, outer_step=step,
            params_sha256=digest, bandwidth_bps=self.stats.bandwidth_bps,
            tokens_per_second=self.stats.tokens_per_second, protocol_version=PROTOCOL_VERSION,
            config_fingerprint=self.identity.config_fingerprint, phase=self.stats.phase, leaving=leaving,
        )

    async def publish_record(self, leaving: bool = False) -> None:
        ttl = 3 * self.config.node.heartbeat_interval
        await self.dht_client.store(peers_key(self.config.run.name), self.peer_id, self.record(leaving).to_value(), ttl)

    async def refresh_view(self) -> SwarmView:
        self.view = await read_swarm(self.dht_client, self.config.run.name, self.identity.config_fingerprint,
                                     PROTOCOL_VERSION)
        self.metrics.swarm_peers.set(len(self.view.peers | {self.peer_id: None}))
        self.metrics.swarm_outer_step_max.set(max(self.view.max_step, self.state.step))
        return self.view

    def last_view(self) -> SwarmView:
        return self.view

    def position(self) -> decisions.Position:
        step, digest = self.state.published()
        return decisions.Position(self.peer_id, step, digest)

    async def heartbeat(self) -> None:
        """Forever: publish our record, read the view, re-bootstrap towards missing peers (in
        ``reconnecting``, which the caller cancels with this task)."""
        while True:
            try:
                await self.publish_record()
                view = await self.refresh_view()
                missing = self.reconnector.missing(view.peers.keys(), view.left)
                # In a task of its own: pinging unreachable peers must never delay our record
                # past its TTL (the others would think we left).
                if self.reconnector.due(missing) and (self.reconnecting is None or self.reconnecting.done()):
                    self.reconnecting = asyncio.create_task(self._reconnect(missing), name="dht-reconnect")
            except Exception:  # a heartbeat must survive any DHT hiccup
                log.exception("heartbeat failed")
            await asyncio.sleep(self.config.node.heartbeat_interval)

    async def _reconnect(self, missing: list[str]) -> None:
        try:
            answered = await self.reconnector.reconnect(missing)
        except Exception as err:  # never an unhandled task error: the next heartbeat tries again
            log.debug("DHT re-bootstrap failed: %r", err)
            return
        if answered is not None:
            self.metrics.dht_rebootstraps.labels(outcome="reached" if answered else "unreachable").inc()
