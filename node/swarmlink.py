"""This peer in the DHT: its record, the swarm view, and the heartbeat that keeps both fresh.

``SwarmLink`` is the round driver's ``SwarmPort`` (node/ports.py): the record (step and hash read
together, phase, throughput, bandwidth) is published every heartbeat and whenever the driver
asks; the view of the run's peers is read when a round needs it fresh, and by the heartbeat only
when node/swarmpace.py says a decision could need it (otherwise the heartbeat reads the small
``<run>/progress`` record, which the link writes a mark into at each commit and round start).
After a partition heals, hivemind alone never reintroduces the two sides: the
heartbeat asks node/reconnect.py to re-bootstrap towards peers that went missing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol.handshake import Identity

from . import decisions, swarmpace
from .config import Config
from .globalstate import GlobalState
from .metrics import NodeMetrics
from .peerbook import PeerBook
from .reconnect import Reconnector
from .runstats import RunStats
from .swarm import HivemindDHT, PeerRecord, SignedDHT, SwarmView, peers_key, read_swarm
from .swarmpace import Mark, ViewPace, parse_marks

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
        self.dht_address = ""  # our join multiaddr, set with ``address`` (peers remember it)
        self.peerbook: PeerBook | None = None  # where we remember the peers we saw (node/peerbook.py)
        self.view = SwarmView({}, {}, 0.0)
        self.has_view = False  # a full read of the table succeeded once
        self.reconnecting: asyncio.Task | None = None
        self.gossip = config.sync.mode == "gossip"
        # Gossip mode catches up with a swarm a few steps ahead by mixing (node/catchup.py).
        self.pace = ViewPace(self.peer_id, config.sync.quorum,
                             step_window=self._gossip_window() if self.gossip else None,
                             group_size=config.sync.group_size if config.sync.matchmaking_buckets else 0)
        self.marks: frozenset[Mark] = frozenset()  # the progress record as last read
        self.mark_writer = swarmpace.MarkWriter(self.gossip, config.sync.matchmaking_timeout,
                                                config.node.heartbeat_interval)
        # The size of the split plan that made our state at a step (Matchmaker.plan_behind; the
        # node sets it once its matchmaker exists): published so that peers outside that plan
        # take the next step's B from it (decisions.plan_of_state).
        self.plan_behind: Callable[[int], int] = lambda step: 0

    def record(self, leaving: bool = False) -> PeerRecord:
        step, digest = self.state.published()  # together: never a new step with the old hash
        return PeerRecord(
            peer_id=self.peer_id, address=self.address, outer_step=step,
            params_sha256=digest, bandwidth_bps=self.stats.bandwidth_bps,
            tokens_per_second=self.stats.tokens_per_second, protocol_version=PROTOCOL_VERSION,
            config_fingerprint=self.identity.config_fingerprint, phase=self.stats.phase, leaving=leaving,
            plan_peers=self.plan_behind(step), tls=self.config.node.tls_cert is not None,
            dht_address=self.dht_address,
        )

    @staticmethod
    def _gossip_window() -> int:
        from .gossip_mode import STEP_WINDOW  # imported late: gossip_mode pulls torch and the codecs

        return STEP_WINDOW

    async def publish_record(self, leaving: bool = False) -> None:
        ttl = 3 * self.config.node.heartbeat_interval
        await self.dht_client.store(peers_key(self.config.run.name), self.peer_id, self.record(leaving).to_value(), ttl)
        if not leaving:
            await self._publish_marks()

    async def _publish_marks(self) -> None:
        """Store the progress marks this peer stands for that are due (swarmpace.MarkWriter)."""
        now = asyncio.get_running_loop().time()  # monotonic; virtual in tests
        for mark in self.mark_writer.due(self.position(), self.stats.phase, now):
            if await self.dht_client.store(swarmpace.mark_key(self.config.run.name, mark), mark.subkey, mark.to_value(),
                                           self.mark_writer.ttl(mark)):
                self.mark_writer.stored(mark, now)

    async def read_marks(self) -> frozenset[Mark]:
        """The commit marks, and the open marks of our step while we train (one round trip)."""
        keys = swarmpace.mark_keys(self.config.run.name, self.state.published()[0], self.stats.phase, self.gossip)
        records = await asyncio.gather(*(self.dht_client.get(key) for key in keys))
        self.marks = frozenset().union(*(parse_marks(raw) for raw in records))
        return self.marks

    async def refresh_view(self) -> SwarmView:
        marks = self.marks  # known before this read: the view accounts for them
        self.view = await read_swarm(self.dht_client, self.config.run.name, self.identity.config_fingerprint,
                                     PROTOCOL_VERSION)
        self.has_view = True
        self.pace.read_full(marks, self.position())
        self.metrics.swarm_peers.set(len(self.view.peers | {self.peer_id: None}))
        self.metrics.set_swarm_outer_step_max(max(self.view.max_step, self.state.step))
        return self.view

    async def current_view(self) -> SwarmView:
        """A view that answers the catch-up as a fresh one would: the last one, unless the
        progress record has a mark that could make us download (node/swarmpace.py)."""
        marks = await self.read_marks()
        if not self.has_view or swarmpace.fresh_needed(marks, self.position(), self.pace.step_window):
            return await self.refresh_view()
        return self.view

    def last_view(self) -> SwarmView:
        return self.view

    def recent_view(self) -> SwarmView | None:
        """The heartbeat's view, unless the progress marks of the last beat show a commit that
        could make us download (None: read the table): ``current_view`` without its read. A
        swarm small enough to read the table at every beat reads no marks; its view is then at
        most a beat old."""
        if not self.has_view or swarmpace.fresh_needed(self.marks, self.position(), self.pace.step_window):
            return None
        return self.view

    def want_view(self) -> None:
        """A step coordinator waits on ``last_view``: keep it at most a beat old (swarmpace;
        RoundPeers.watch)."""
        self.pace.want_view()

    def position(self) -> decisions.Position:
        step, digest = self.state.published()
        return decisions.Position(self.peer_id, step, digest)

    def round_open(self) -> bool:
        # A large swarm reads the whole table only every few beats (swarmpace), the progress
        # record at every one: a round that opened since the last full read shows in its marks.
        me = self.position()
        return decisions.round_opened(self.view, me) or swarmpace.opened_by_others(self.marks, me)

    async def heartbeat(self) -> None:
        """Forever: publish our record, read the progress record and, when node/swarmpace.py says
        so, the view, then re-bootstrap towards missing peers (in ``reconnecting``, which the
        caller cancels with this task)."""
        while True:
            try:
                await self.publish_record()
                # A swarm that reads the table at every beat anyway needs no progress read.
                every = swarmpace.full_read_every(len(self.view.peers))
                marks = await self.read_marks() if every > 1 else self.marks
                me = self.position()
                same = len(decisions.same_state(self.view, me))
                if self.pace.full_read_due(len(self.view.peers), self.has_view, me, self.stats.phase, marks,
                                           same) is not None:
                    view = await self.refresh_view()
                    if self.peerbook is not None:
                        self.peerbook.remember([p.dht_address for p in view.peers.values()], view.left)
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
