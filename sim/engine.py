"""The simulated swarm: peers, churn, the shared DHT and network, and the run itself.

``simulate(config)`` builds the world on a virtual-time loop (sim/vloop.py), starts
``config.peers`` peers at step 0 with the same initial parameters (gossip: 10 % apart, so
that the consensus distance has something to close), lets churn remove and add peers, and stops
once every live peer holding the state committed step ``rounds``; it returns one figure line per round
(sim/metrics.py) and a summary.

The protocol classes are the real ones, imported here so that a test can check that they are
(``sim.engine.Matchmaker is lowcomm.protocol.matchmaking.Matchmaker``, and so on).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from lowcomm.node import decisions  # noqa: F401  (re-exported for the test: the very module)
from lowcomm.node.gossip_mode import STEP_WINDOW, GossipMode  # noqa: F401
from lowcomm.node.swarm import PeerRecord, SwarmView, peers_key  # noqa: F401  (SwarmView: re-exported)
from lowcomm.protocol import codecs
from lowcomm.protocol.gossip import Inbox  # noqa: F401
from lowcomm.protocol.layout import shard_layout, split_into_groups  # noqa: F401
from lowcomm.protocol.matchmaking import Matchmaker  # noqa: F401

from . import vloop
from .allreduce import GroupReduce, PeerFacts
from .dht import SimDHT
from .gossip import SimGossip
from .links import draw_link
from .metrics import Metrics
from .heartbeat import PacedPeer
from .peer import SimPeer, params_hash
from .transport import SimNet


@dataclass
class SimConfig:
    peers: int = 64
    rounds: int = 10
    churn: float = 0.05  # share of the swarm that leaves per hour (as many join)
    crash_share: float = 0.5  # of those leaving, the share that crash (the others leave gracefully)
    seed: int = 0
    mode: str = "allreduce"  # "allreduce" | "gossip"
    group_size: int = 16
    gossip_partners: int = 2
    links: str = "mixed"  # residential | datacenter | mixed (sim/links.py)
    speed_spread: float = 0.3  # sigma of the log-normal compute speed
    numel: int = 25_000_000  # parameters averaged per round (100 MB in fp32)
    codec: str = "int8"
    inner_steps: int = 50
    step_seconds: float = 1.0  # one inner step at nominal speed
    heartbeat: float = 5.0  # [node] heartbeat_interval
    matchmaking_timeout: float = 30.0  # [sync] matchmaking_timeout
    reduce_timeout: float = 60.0  # [sync] reduce_timeout
    quorum: float = 2 / 3
    straggler_wait: float = 2.0
    single_level: bool = False  # what-if: matchmaking without buckets (the protocol before protocol/buckets.py)
    unpaced_heartbeat: bool = False  # the heartbeat reads the whole peer table at every beat (before node/swarmpace.py)
    lag_tolerant: bool = False  # what-if: one step behind averages instead of downloading (sim/whatif.py)
    no_missed_rounds: bool = False  # what-if: the protocol before missed rounds (a peer behind always downloads)
    catch_up_missed_plan: bool = False  # what-if: a peer that missed its step's plan downloads next (sim/whatif.py)
    ideal_global: bool = False  # what-if: every group of a step ends with the same θ (item 3), free
    dim: int = 16  # floats of simulated parameters per peer
    run: str = "sim"

    def check(self) -> None:
        if self.peers < 2:
            raise ValueError("--peers must be at least 2")
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        if not 0 <= self.churn <= 10:
            raise ValueError("--churn is a share of the swarm per hour, between 0 and 10")
        if self.mode not in ("allreduce", "gossip"):
            raise ValueError(f"--mode must be allreduce or gossip, not {self.mode!r}")
        if self.group_size < 2:
            raise ValueError("--group-size must be at least 2")
        codecs.get_codec(self.codec)


@dataclass
class _Reduce:
    model: GroupReduce
    vectors: dict[str, np.ndarray] = field(default_factory=dict)


class World:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loop = asyncio.get_running_loop()
        self.rng = np.random.default_rng([config.seed, 1])
        self.codec = codecs.get_codec(config.codec)
        self.dht = SimDHT()
        self.metrics = Metrics(self.dht, self.loop.time)
        self.network = SimNet(self._on_rpc)
        self.peers: dict[str, SimPeer] = {}  # live ones
        self.everyone: dict[str, SimPeer] = {}  # ever spawned (the reduce model asks about the dead too)
        self.states: dict[tuple[int, str], np.ndarray] = {}
        self.reduces: dict[bytes, _Reduce] = {}
        self.global_theta: dict[tuple[int, str], np.ndarray] = {}  # ideal_global: θ of (step, hash)
        self.state_bytes = 8 * config.numel  # θ_global and the outer momentum, fp32
        # (step, hash) -> (step − 1, hash) it was averaged from, for group rounds: a peer behind
        # by at most KEPT_ROUNDS of these applies their averages instead of downloading.
        self.round_bases: dict[tuple[int, str], tuple[int, str]] = {}
        self.gossip_window = STEP_WINDOW
        self.next_index = 0
        self.started_at = self.loop.time()
        self._tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None
        self.stop = asyncio.Event()
        self._directions: dict[int, np.ndarray] = {}
        self.dht.parse_with(peers_key(config.run), PeerRecord.parse)

    # -- what peers ask of the world ----------------------------------------------------------

    def _on_rpc(self, receiver: str, method: str, request) -> None:
        self.metrics.rpc(int(getattr(request, "step", 0)), receiver, method)

    def propagation(self, peer: SimPeer) -> float:
        return float(np.exp(self.rng.uniform(np.log(0.05), np.log(0.5))))

    def live_count(self) -> int:
        return sum(1 for p in self.peers.values() if p.caught_up)

    def delta(self, peer: SimPeer, step: int) -> np.ndarray:
        """A peer's pseudo-gradient: the step's common direction plus its own noise, in
        proportion to the inner steps it did."""
        common = self._directions.get(step)
        if common is None:
            common = np.random.default_rng([self.config.seed, step, 3]).normal(0.0, 0.01, self.config.dim)
            self._directions[step] = common
        share = peer.tokens_since_round / self.config.inner_steps
        return (common + peer.rng.normal(0.0, 0.01, self.config.dim)) * share

    def coords(self, group) -> list[tuple[int, int]]:
        """The simulated coordinates each shard of ``group`` covers (its bounds scaled to dim)."""
        dim, numel = self.config.dim, self.config.numel
        edges = [math.ceil(b * dim / numel) for b in group.shard_bounds]
        return list(zip(edges[:-1], edges[1:]))

    def reduce_for(self, group) -> _Reduce:
        found = self.reduces.get(group.group_id)
        if found is None:
            found = _Reduce(GroupReduce(group, self.codec.encoded_size, self._facts, self.config.quorum))
            self.reduces[group.group_id] = found
            self.loop.call_later(3 * group.reduce_timeout_s, self._reduce_done, group)
        return found

    def _reduce_done(self, group) -> None:
        done = self.reduces.pop(group.group_id, None)
        if done is not None and done.model.timeline is not None:
            self.metrics.reduced(group.step, done.model.timeline.skipped, done.model.timeline.rpcs)

    def _facts(self, peer_id: str) -> PeerFacts:
        peer = self.everyone[peer_id]
        return PeerFacts(peer.link, peer.dies_at)

    def gossip_state(self, peer: SimPeer) -> SimGossip:
        return SimGossip(peer)

    # -- churn --------------------------------------------------------------------------------

    def _lifetime(self) -> float:
        rate = self.config.churn / 3600.0
        return float(self.rng.exponential(1.0 / rate)) if rate > 0 else math.inf

    def spawn(self, theta: np.ndarray | None, step: int, delay: float = 0.0) -> SimPeer:
        cfg = self.config
        link = draw_link(self.rng, cfg.links, cfg.speed_spread)
        dies_at = self.loop.time() + delay + self._lifetime()
        crash = bool(self.rng.random() < cfg.crash_share)
        # The node's heartbeat (sim/heartbeat.py), or the one that reads the table at every beat.
        peer_class = SimPeer if cfg.unpaced_heartbeat else PacedPeer
        peer = peer_class(self, self.next_index, link, dies_at, crash, theta, step)
        self.next_index += 1
        self.peers[peer.peer_id] = peer
        self.everyone[peer.peer_id] = peer
        self.dht.add_peer(peer.peer_id)

        async def start() -> None:
            await asyncio.sleep(delay)
            await peer.live()

        task = self.loop.create_task(start(), name=f"peer-{peer.index}")
        task.add_done_callback(self._check)
        peer.tasks.append(task)
        if math.isfinite(dies_at):
            self.loop.call_at(dies_at, self._end, peer)
        return peer

    def _end(self, peer: SimPeer) -> None:
        """``peer`` crashes or leaves gracefully now (its lifetime is over)."""
        if not peer.alive:
            return
        peer.alive = False
        peer.server.crash()
        for task in [*peer.tasks, *peer._background]:
            task.cancel()
        self.peers.pop(peer.peer_id, None)
        self.dht.remove_peer(peer.peer_id)
        if not peer.crash:  # a graceful leave says so in the DHT (node/daemon.py shutdown)
            self._keep(self.loop.create_task(peer.publish_record(leaving=True)))

    def _check(self, task: asyncio.Task) -> None:
        """A peer's loop never ends by itself: an exception in it is a bug, and ends the run."""
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            self.stop.set()

    def _keep(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _joins(self) -> None:
        rate = self.config.churn * self.config.peers / 3600.0
        if rate <= 0:
            return
        while True:
            await asyncio.sleep(float(self.rng.exponential(1.0 / rate)))
            self.spawn(None, -1)

    # -- the run ------------------------------------------------------------------------------

    async def run(self) -> list[dict]:
        cfg = self.config
        base = np.random.default_rng([cfg.seed, 5]).normal(0.0, 1.0, cfg.dim)
        if cfg.mode == "gossip":  # different starts (10 % spread), so that mixing has a distance to close
            init = [base + np.random.default_rng([cfg.seed, i, 5]).normal(0.0, 0.1, cfg.dim) for i in range(cfg.peers)]
        else:
            init = [base] * cfg.peers
        for i in range(cfg.peers):
            theta = init[i].copy()
            self.states.setdefault((0, params_hash(theta)), theta.copy())
            self.spawn(theta, 0, delay=float(self.rng.uniform(0.0, cfg.heartbeat)))
        self.metrics.initial_distance = self.metrics.distance(init)
        joins = self.loop.create_task(self._joins())
        nominal = cfg.inner_steps * cfg.step_seconds
        limit = self.started_at + (cfg.rounds + 2) * 20 * max(nominal, cfg.matchmaking_timeout)
        try:
            while self.loop.time() < limit and not self.stop.is_set():
                try:
                    async with asyncio.timeout(5.0):
                        await self.stop.wait()
                except TimeoutError:
                    pass
                # Every live peer that holds the state has committed the last reported round.
                if min((p.step for p in self.peers.values() if p.caught_up), default=0) >= cfg.rounds:
                    break
        finally:
            joins.cancel()
            tasks = [t for p in self.peers.values() for t in (*p.tasks, *p._background)] + [joins, *self._tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for group_id in list(self.reduces):
                self._reduce_done(self.reduces[group_id].model.group)
        if self.error is not None:
            raise RuntimeError("a simulated peer failed") from self.error
        return [self.metrics.round_line(r) for r in range(cfg.rounds)]


def simulate(config: SimConfig) -> tuple[list[dict], dict]:
    """Run ``config`` on a virtual-time loop: (one figure line per round, a summary)."""
    config.check()
    wall = time.perf_counter()
    holder: dict = {}

    async def main() -> list[dict]:
        world = World(config)
        holder["world"] = world
        return await world.run()

    lines = vloop.run(main())
    world = holder["world"]
    summary = {"config": asdict(config), "wall_seconds": round(time.perf_counter() - wall, 2),
               "virtual_seconds": round(world.loop.time() - world.started_at, 1),
               "peers_spawned": world.next_index, **summarize(lines)}
    if config.mode == "gossip":
        summary["initial_consensus_distance"] = round(world.metrics.initial_distance, 6)
        summary["rounds_to_halve_consensus"] = rounds_to_halve(world.metrics.initial_distance, lines)
    return lines, summary


def summarize(lines: list[dict]) -> dict:
    """Means over the rounds after the first (which includes the swarm's start-up)."""
    steady = lines[1:] or lines
    keys = ["share_averaged", "share_majority", "form_p50_s", "form_p95_s", "groups", "group_size_median", "dht_reads_per_peer",
            "dht_writes_per_peer", "dht_subkeys_read_per_peer", "dht_busiest_holder_requests", "busiest_peer_rpcs",
            "busiest_peer_joins", "bytes_per_peer_mb", "skipped_shards", "downloads_minority", "downloads_behind",
            "downloads_joiner", "missed_rounds_applied", "hashes", "consensus_distance", "partner_distance", "commit_spread_s"]
    out = {}
    for key in keys:
        values = [line[key] for line in steady if line.get(key) is not None]
        if values:
            out[f"mean_{key}"] = round(float(np.mean(values)), 4)
    out["min_share_averaged"] = min((line["share_averaged"] for line in steady if line["share_averaged"] is not None),
                                    default=None)
    out["max_form_p95_s"] = max((line["form_p95_s"] for line in steady if line["form_p95_s"] is not None), default=None)
    # What the busiest peer's calls were, per method, averaged over the rounds (that peer may
    # differ between rounds): the profile of the busiest-peer goal.
    kinds = sorted({kind for line in steady for kind in line.get("busiest_peer_rpc_kinds", {})})
    out["mean_busiest_peer_rpc_kinds"] = {
        kind: round(float(np.mean([line.get("busiest_peer_rpc_kinds", {}).get(kind, 0) for line in steady])), 1)
        for kind in kinds}
    return out


def rounds_to_halve(initial: float, lines: list[dict]) -> int | None:
    """Rounds until the consensus distance is half of what it was at the start (None: never)."""
    for i, line in enumerate(lines):
        d = line.get("consensus_distance")
        if d is not None and d <= initial / 2:
            return i + 1
    return None
