"""One simulated peer: node/rounds.py's blocking round loop with the real protocol objects.

What runs for real: the ``Matchmaker`` (with its direct path, redirects, leader election,
deadlines and the group split of protocol/layout.py), every decision of node/decisions.py
(catch-up target, behind, outpaced cut, expected peers, solo step, direct round allowed), the
``PeerRecord`` / ``SwarmView`` of node/swarm.py and, in gossip mode, node/gossip_mode.py's partner
choice and protocol/gossip.py's ``Inbox``. What is simulated: time spent training (inner steps
at the peer's compute speed), the DHT (sim/dht.py), links (sim/transport.py), the all-reduce's
transfers (sim/allreduce.py) and the parameters, which are ``dim`` floats per peer so that hashes,
majority votes and consensus distances come from real arithmetic.

The loop follows ``RoundLoop._main_loop`` and ``_round`` step by step (same order of DHT reads
and decisions); a failed round keeps its tokens for the next one, as the node does.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from lowcomm.node import decisions
from lowcomm.node.swarm import PeerRecord, SwarmView, peers_key
from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol.buckets import bucketed_by_plan
from lowcomm.protocol.crossgroup import StepPlan
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import Matchmaker, MatchmakingError, PlanClosed, RoundPeers
from lowcomm.protocol.missed_rounds import KEPT_ROUNDS
from lowcomm.protocol.transport import LoopClock

from .whatif import lagging
from .links import Link
from .transport import JOIN, Server

if TYPE_CHECKING:
    from .engine import World

FINGERPRINT = "sim"


def params_hash(theta: np.ndarray) -> str:
    return hashlib.sha256(theta.tobytes()).hexdigest()


CUTS: Counter = Counter()  # how inner phases ended, over every peer of the process (python -m sim.heartbeat prints it)


class SimPeer:
    def __init__(self, world: "World", index: int, link: Link, dies_at: float, crash: bool,
                 theta: np.ndarray | None, step: int) -> None:
        self.world = world
        cfg = world.config
        self.index = index
        self.peer_id = hashlib.sha256(f"{cfg.seed}/{index}".encode()).hexdigest()[:16]
        self.link = link
        self.dies_at = dies_at
        self.crash = crash  # how it ends at dies_at: a crash, or a graceful leave
        self.rng = np.random.default_rng([cfg.seed, index, 7])
        self.step = step
        self.theta = theta
        self.hash = params_hash(theta) if theta is not None else ""
        self.residual = np.zeros(cfg.dim)
        self.phase = "training" if theta is not None else "catching_up"
        self.tokens_since_round = 0.0
        self.view = SwarmView({}, {}, 0.0)
        self.view_tags: Counter = Counter()  # (step, hash, phase) -> peers, of self.view
        self._published: tuple[PeerRecord, dict] | None = None
        self.view_changed = asyncio.Event()
        self._round_open_seen: tuple[tuple | None, bool] = (None, False)  # round_open's last (counts, answer)
        self.caught_up = theta is not None  # a joiner is counted live once it holds the state
        self.alive = True
        self.tasks: list[asyncio.Task] = []  # the loop and the heartbeat, cancelled when it ends
        self._background: set[asyncio.Task] = set()  # record publications in flight
        self.dht = world.dht.client(self.peer_id, link.rtt, world.propagation(self), lambda: max(self.step, 0))
        self.server = Server(self.peer_id, link)
        self.address = world.network.serve(self.server)
        self.identity = Identity(self.peer_id, FINGERPRINT, "{}")
        # The seams of protocol/transport.py: our transport, the loop's (virtual) clock, seeded group ids.
        self.matchmaker = Matchmaker(
            self.dht, cfg.run, self.identity, self.address, None, cfg.group_size, codec=world.codec.id,
            numel=cfg.numel, reduce_timeout=cfg.reduce_timeout, quorum=cfg.quorum,
            min_straggler_wait=cfg.straggler_wait, transport=world.network.transport(link), clock=LoopClock(),
            random_bytes=random.Random(f"{cfg.seed}/{index}/groups").randbytes,
            wall_clock=LoopClock().monotonic)  # the swarm's common (virtual) time
        self.server.handlers[JOIN] = self.matchmaker.handle_join
        self.gossip = world.gossip_state(self) if cfg.mode == "gossip" else None

    # -- records and views (node/daemon.py) ---------------------------------------------------

    def position(self) -> decisions.Position:
        return decisions.Position(self.peer_id, self.step, self.hash)

    def record(self, leaving: bool = False) -> PeerRecord:
        return PeerRecord(peer_id=self.peer_id, address=self.address, outer_step=self.step, params_sha256=self.hash,
                          bandwidth_bps=self.link.up, tokens_per_second=self.link.speed,
                          protocol_version=PROTOCOL_VERSION, config_fingerprint=FINGERPRINT, phase=self.phase,
                          leaving=leaving, plan_peers=self.matchmaker.plan_behind(self.step))

    async def publish_record(self, leaving: bool = False) -> None:
        ttl = 3 * self.world.config.heartbeat
        record = self.record(leaving)
        if self._published is None or self._published[0] != record:  # to_value is slow (asdict)
            self._published = (record, record.to_value())
        await self.dht.store(peers_key(self.world.config.run), self.peer_id, self._published[1], ttl)

    def publish_soon(self) -> None:
        task = asyncio.create_task(self.publish_record())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def leader_view(self, position: decisions.Position) -> set[str]:
        """RoundPeers.latest of node/averaging.py: the peers expected at our step in the
        heartbeat's view, which a bucket leader or step coordinator looks at while it waits."""
        return decisions.expected_peers(self.view, position)

    def want_view(self) -> None:
        """RoundPeers.watch (SwarmLink.want_view): this heartbeat reads the table at every beat."""

    async def leader_read(self) -> SwarmView:
        """RoundPeers.read_first: a plan member that started its round from the last view leads."""
        return await self.refresh_view()

    async def refresh_view(self) -> SwarmView:
        """node/swarm.py's ``read_swarm`` on the simulated DHT (records parsed once, when stored)."""
        peers, left, self.view_tags = await self.dht.get_records(peers_key(self.world.config.run))
        self.view = SwarmView(peers, {}, asyncio.get_running_loop().time(), left)
        self.view_changed.set()
        return self.view

    def recent_view(self) -> SwarmView | None:
        """node/swarmlink.py's ``recent_view``: this heartbeat reads the table at every beat."""
        return self.view if self.view.peers else None

    def round_open(self, counts: tuple) -> bool:
        """node/swarmlink.py's ``round_open`` on the last view; ``counts`` (the view's peers at
        our step and hash by phase) says whether the view changed what it answers since last time."""
        if self._round_open_seen[0] != counts:
            self._round_open_seen = (counts, decisions.round_opened(self.view, self.position()))
        return self._round_open_seen[1]

    async def heartbeat(self) -> None:
        while True:
            await self.publish_record()
            await self.refresh_view()
            await asyncio.sleep(self.world.config.heartbeat)

    # -- the loop (node/rounds.py RoundLoop._main_loop) ------------------------------------------

    async def live(self) -> None:
        beat = asyncio.create_task(self.heartbeat())
        self.tasks.append(beat)
        while not self.caught_up:
            await self.catch_up()
            if not self.caught_up:
                await asyncio.sleep(1.0)
        while True:
            await self.catch_up()
            await self.inner_phase()
            await self.round()

    async def catch_up(self) -> None:
        cfg = self.world.config
        view = await self.refresh_view()
        window = self.world.gossip_window if self.gossip is not None else None
        if cfg.lag_tolerant:  # what-if (sim/whatif.py): one step behind is caught up by averaging
            window = 1
        plan = decisions.catch_up_target(view, self.position(), gossip_window=window)
        if plan is None:
            return
        before = self.phase
        self.phase = "catching_up"
        donors = [d for d in plan.donors if d.peer_id in self.world.peers][:4]
        kind = "minority" if plan.because_minority else ("joiner" if not self.caught_up else "behind")
        # As the node does (node/catchup.py): a peer whose state some kept rounds started from
        # fetches their encoded averages from one donor instead of the state from several.
        missed = self.missed_rounds_to(plan.step, plan.params_hash) \
            if kind == "behind" and self.gossip is None and not cfg.no_missed_rounds else 0
        if donors:
            if missed:  # from one donor, the fastest (node/catchup.py orders them by declared bandwidth)
                rate = min(self.link.down, max(self.world.peers[d.peer_id].link.up for d in donors))
                nbytes = missed * self.world.codec.encoded_size(cfg.numel)
            else:
                rate = min(self.link.down, sum(self.world.peers[d.peer_id].link.up for d in donors))
                nbytes = self.world.state_bytes
            seconds = max(self.world.peers[d.peer_id].link.latency for d in donors) + self.link.latency + nbytes / rate
            await asyncio.sleep(seconds)
        state = self.world.states.get((plan.step, plan.params_hash))
        if not donors or state is None or all(self.world.peers.get(d.peer_id) is None for d in donors):
            self.phase = before
            return
        if missed:
            self.world.metrics.missed_rounds_applied(plan.step, self.peer_id)
        else:
            self.world.metrics.download(plan.step, self.peer_id, kind, self.world.state_bytes)
        self.step, self.hash, self.theta = plan.step, plan.params_hash, state.copy()
        self.caught_up = True
        self.phase = "training"

    def missed_rounds_to(self, step: int, params_hash: str) -> int:
        """How many group rounds lead from our (step, hash) to (``step``, ``params_hash``), if at
        most KEPT_ROUNDS (protocol/missed_rounds.py); 0 when they do not (a download then)."""
        at = (step, params_hash)
        for rounds in range(1, KEPT_ROUNDS + 1):
            at = self.world.round_bases.get(at)
            if at is None:
                return 0
            if at == (self.step, self.hash):
                return rounds
        return 0

    async def inner_phase(self) -> None:
        """H inner steps at this peer's speed, cut when outpaced or at the join-by time of a
        round seen open (decisions.join_by), checked on every fresh view."""
        cfg = self.world.config
        self.phase = "training"
        self.publish_soon()
        loop = asyncio.get_running_loop()
        per_step = cfg.step_seconds / self.link.speed
        start = loop.time()
        end = start + cfg.inner_steps * per_step
        done = cfg.inner_steps
        outpaced_counts: tuple | None = None
        cut_at = end  # decisions.join_by once we saw the round of our step open
        outpaced = False
        while (remaining := min(end, cut_at) - loop.time()) > 0:
            self.view_changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self.view_changed.wait()
            except TimeoutError:
                if cut_at < end:  # the join-by time came first: the step in progress ends the phase
                    done = max(1, math.ceil((loop.time() - start) / per_step))
                    await asyncio.sleep(start + done * per_step - loop.time())
                break
            steps = int((loop.time() - start) / per_step)
            # outpaced() and round_opened() answer from the peers at our step with our hash, by
            # phase (their docstrings): with the same counts as at the last look the answers are
            # the same, and the O(N) calls are skipped (at N=1024 they were the simulator's
            # largest cost).
            counts = tuple(sorted((phase, n) for (step, digest, phase), n in self.view_tags.items()
                                  if step == self.step and digest == self.hash))
            if cut_at == end and self.round_open(counts):
                cut_at = min(end, decisions.join_by(loop.time(), cfg.matchmaking_timeout, cfg.heartbeat))
            if steps > 0 and counts != outpaced_counts:
                outpaced_counts = counts
                if decisions.outpaced(self.view, self.position(), cfg.quorum):
                    done, outpaced = steps, True
                    break
        CUTS["outpaced" if outpaced else "join_by" if cut_at < end else "all inner steps"] += 1
        self.tokens_since_round += done

    async def round(self) -> None:
        """``RoundLoop._round``: behind check, direct path allowed?, form the group, average."""
        cfg, world = self.world.config, self.world
        loop = asyncio.get_running_loop()
        started = loop.time()
        step = self.step
        self.phase = "averaging"
        self.publish_soon()
        delta = world.delta(self, step)
        if self.gossip is not None:
            await self.gossip.round(step, delta)
            return
        # A follower of a stable group's direct path starts from the heartbeat's view while it
        # shows nobody outside the group (node/averaging.py ``_direct_follower_view``); its
        # leader reads for the group.
        last = self.matchmaker.last_group
        cached = None
        if last is not None and self.matchmaker.follows_directly(step):
            cached = decisions.direct_follower_view(self.recent_view(), self.position(), {m.peer_id for m in last.members})
        # A member of the last step's split plan starts from the heartbeat's view too, and reads
        # the table only once it finds itself leading (node/averaging.py, RoundPeers.read_first).
        read_when_leading = False
        if cached is None and not cfg.single_level and bucketed_by_plan(step, self.matchmaker.last_plan,
                                                                         cfg.group_size):
            cached = self.recent_view()
            read_when_leading = cached is not None
        view = cached if cached is not None else await self.refresh_view()
        if lagging(view, self.position()) if cfg.lag_tolerant else decisions.behind(view, self.position()):
            world.metrics.failed(step, self.peer_id, "behind")
            return
        last = self.matchmaker.last_group
        if last is not None and not decisions.direct_round_allowed(view, self.position(),
                                                                   {m.peer_id for m in last.members}):
            self.matchmaker.last_group = None
        unused_view = [view] if cached is None else []  # only a fresh view seeds the first look

        async def expected_peers() -> set[str]:
            if unused_view:
                return decisions.expected_peers(unused_view.pop(), self.position())
            return decisions.expected_peers(await self.refresh_view(), self.position())

        # As node/averaging.py: a large step matchmakes in buckets (protocol/buckets.py), B from
        # the round-start view, waiting for the peers expected in the heartbeat's latest view.
        position = self.position()
        round_peers = None if cfg.single_level else RoundPeers(
            frozenset(decisions.expected_peers(view, position)),
            latest=lambda: self.leader_view(position),
            plan_of_state=decisions.plan_of_state(view, position),
            read_first=self.leader_read if read_when_leading else None,
            watch=self.want_view)
        try:
            group = await self.matchmaker.form_group(step, self.tokens_since_round, self.link.up, expected_peers,
                                                     cfg.matchmaking_timeout, params_hash=self.hash, numel=cfg.numel,
                                                     round_peers=round_peers)
        except MatchmakingError as err:
            world.metrics.failed(step, self.peer_id, "matchmaking")
            if cfg.catch_up_missed_plan and isinstance(err, PlanClosed):
                await self.await_step_past(step)  # what-if (sim/whatif.py): download instead of training at a stale step
            return
        formed = loop.time() - started
        world.metrics.formed(step, self.peer_id, formed, group, self.matchmaker.led_last_group, world.live_count())
        x = delta + self.residual
        if len(group.members) == 1:
            if not decisions.solo_step_allowed(self.view, self.position()):
                world.metrics.failed(step, self.peer_id, "no_group")
                return
            self.residual[:] = 0
            self.commit(self.theta - x, group_round=False)
            world.metrics.averaged(step, self.peer_id, 1, 0, 0)
            return
        reduce = world.reduce_for(group)
        reduce.vectors[self.peer_id] = x
        result = await reduce.model.join(self.peer_id)
        theta = self.theta.copy()
        for j, (lo, hi) in enumerate(world.coords(group)):
            if result.applied[j]:
                avg = sum(w * reduce.vectors[q][lo:hi] for q, w in result.averages[j].items())
                theta[lo:hi] -= avg
                if result.contributed[j]:
                    self.residual[lo:hi] = 0
                else:
                    self.residual[lo:hi] = x[lo:hi]
            else:
                self.residual[lo:hi] = x[lo:hi]  # skipped: the whole contribution waits for the next round
        plan = StepPlan.of(group)
        if plan is not None:  # a split step (protocol/crossgroup.py): every group commits the step's one average
            theta = world.global_theta.setdefault((step, self.hash, plan.team_key(0)), theta)
        elif cfg.ideal_global:  # what-if: one global average per step, at no cost
            theta = world.global_theta.setdefault((step, self.hash), theta)
        self.commit(theta)
        world.metrics.averaged(step, self.peer_id, len(group.members), result.bytes_sent, result.bytes_received)

    async def await_step_past(self, step: int) -> None:
        """Wait (on heartbeat views, bounded by a reduce timeout and two heartbeats) until a peer is past ``step``."""
        cfg = self.world.config
        try:
            async with asyncio.timeout(cfg.reduce_timeout + 2 * cfg.heartbeat):
                while self.view.max_step <= step:
                    self.view_changed.clear()
                    await self.view_changed.wait()
        except TimeoutError:
            pass

    def commit(self, theta: np.ndarray, group_round: bool = True) -> None:
        self.tokens_since_round = 0.0
        self.theta = theta
        base = (self.step, self.hash)
        self.step += 1
        self.hash = params_hash(theta)
        if group_round:  # the node keeps a group round's averages, not a solo step's
            self.world.round_bases.setdefault((self.step, self.hash), base)
        self.world.states.setdefault((self.step, self.hash), theta.copy())
        self.world.metrics.committed(self.step, self.peer_id, self.hash, theta)
        self.phase = "training"
        self.publish_soon()
