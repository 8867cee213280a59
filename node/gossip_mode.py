"""Gossip mode on the node: partner choice, the round at a peer's boundary, mixing into θ_global.

A gossip round (``[sync] mode = "gossip"``) never waits for a group. At its boundary a peer

1. takes its own outer step with its own Δ (plus what its residual carried), exactly, as a
   lone all-reduce peer would;
2. picks ``[sync] gossip_partners`` (k) partners at random among the live peers of the run that
   have an address and whose outer step is within ``STEP_WINDOW`` of its own, and runs a
   push-pull ``Exchange`` with each (protocol/gossip.py): its new θ goes out encoded with the run's
   gossip codec and its parameter error-feedback residual, each partner's θ comes back. A partner
   that fails, refuses or misses the deadline (``[sync] reduce_timeout`` for the whole exchange
   phase) is replaced by the next candidate while time is left;
3. mixes: θ_global ← the equal-weight mean of its own θ, the θ of the partners it reached and the
   θ that peers who chose *it* as partner left in its inbox since its last boundary;
4. reports the consensus distance before mixing: the mean over reached partners of
   ||θ − θ_partner|| / ||θ|| (NaN without a partner), in ``status``, the
   ``lowcomm_consensus_distance`` gauge and a ``gossip_round`` log event.

What the mode needs of its node comes in a ``GossipHost`` (identity, codec, state, view, channels,
executor, metrics); the round returns the consensus distance and the traffic in its report.

The daemon then commits the round like any other (step + 1, model ← θ_global). A peer that
reaches nobody still commits its own outer step: a gossip peer never waits for others (the round
counts as ``no_group`` in ``lowcomm_round_failures`` when there were peers to reach).

Mixing a partner's θ that arrived through our servicer is deferred to our next boundary, so
θ_global never changes under the training thread. At the boundary Δ has already been taken
from θ_global and the daemon resets the local model to the mixed θ_global when it commits, so
the mixing shifts both by the same amount and no Δ is disturbed. Everything a round computes
goes into θ_global in one swap at its end: a round abandoned before that leaves the state as it
was (the daemon then folds the unsent progress into the residual as usual).

Steps: in gossip mode a step counts a peer's own rounds. Partners are at most ``STEP_WINDOW``
steps apart (a peer much further ahead or behind has a state too old or too new to average
with); a peer more than ``STEP_WINDOW`` steps behind the swarm's furthest peer downloads state
like a joiner instead of mixing (``needs_download``; the catch-up decides it with node/decisions.py).

Codec: the run's codec, except that ``topk`` gossips in int8: sparsifying suits pseudo-gradients,
whose coordinates are mostly small, but not parameters, where every coordinate matters.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

import torch

from lowcomm.protocol import codecs
from lowcomm.protocol.gossip import (
    GossipError,
    GossipResponder,
    Inbox,
    Traffic,
    exchange,
    service,
)
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.outer import NesterovOuter
from lowcomm.protocol.rpc import ChannelPool

from .averaging import RoundReport
from .globalstate import GlobalState
from .metrics import NodeMetrics

if TYPE_CHECKING:
    from .config import SyncSection
    from .swarm import PeerRecord, SwarmView

log = logging.getLogger("lowcomm.node.gossip")
T = TypeVar("T")

STEP_WINDOW = 4  # partners' outer steps differ by at most this much


def gossip_codec(codec: codecs.Codec) -> codecs.Codec:
    """The codec parameters travel in: the run's, but dense (top-k would zero most weights)."""
    return codecs.get_codec("int8") if codec.id == codecs.CodecId.TOPK else codec


@dataclass
class GossipHost:
    """What gossip mode uses of its node."""

    peer_id: str
    identity: Identity
    sync: "SyncSection"  # gossip_partners, reduce_timeout
    codec: codecs.Codec  # the run's (``gossip_codec`` picks the one parameters travel in)
    numel: int
    state: GlobalState
    channels: ChannelPool
    executor: Executor  # the codec pool
    metrics: NodeMetrics
    view: Callable[[], "SwarmView"]  # the last swarm view read
    refresh_view: Callable[[], Awaitable["SwarmView"]]  # read it afresh
    on_reject: Callable[[str, str, str], None]  # (reason, sender, detail) of a refused contribution


class GossipMode:
    def __init__(self, host: GossipHost) -> None:
        self.host = host
        sync = host.sync
        self.k = sync.gossip_partners
        self.timeout = sync.reduce_timeout
        self.codec = gossip_codec(host.codec)
        self.numel = host.numel
        self.residual = torch.zeros(self.numel)  # error feedback of the parameters this peer sends
        self.inbox = Inbox(capacity=max(4, 2 * self.k))
        self._lock = asyncio.Lock()  # serializes θ_global swaps and uses of the residual
        self._rng = random.Random()
        self.responder = GossipResponder(
            host.identity, self.codec, self.numel, host.executor, self.inbox,
            step=lambda: host.state.step, reply=self._reply, on_reject=host.on_reject,
            step_window=STEP_WINDOW, timeout=self.timeout, on_traffic=self._served,
        )

    def services(self) -> list[Callable]:
        return [service(self.responder)]

    def needs_download(self, target_step: int) -> bool:
        """Whether a swarm at ``target_step`` is too far ahead to catch up with by mixing."""
        return target_step - self.host.state.step > STEP_WINDOW

    # -- helpers --------------------------------------------------------------------------------

    async def _exclusive(self, fn: Callable[[], T], result_stands: bool = False) -> T:
        """Run ``fn`` in the codec pool holding the lock, and keep the lock until it returned.

        A thread cannot be interrupted, so a cancellation waits for the job, through every
        further cancellation (``cancel_and_wait`` repeats them every 0.1 s), before it unlocks
        and is raised. With ``result_stands`` the finished job's result is returned instead:
        for ``mix``, which swaps θ_global, the round must end as done so that the swap is
        committed (a cancelled round would leave θ_global swapped under its old hash)."""
        async with self._lock:
            job = asyncio.get_running_loop().run_in_executor(self.host.executor, fn)
            cancelled = False
            while not job.done():
                try:
                    await asyncio.wait([job])
                except asyncio.CancelledError:
                    cancelled = True
            if cancelled and not result_stands:
                raise asyncio.CancelledError
            return job.result()

    async def _reply(self) -> bytes:
        """Our current θ_global for a partner that called us, encoded with error feedback."""
        return await self._exclusive(
            lambda: codecs.encode_with_feedback(self.codec, self.host.state.params, self.residual)[0])

    def _served(self, received: int, sent: int) -> None:
        self.host.metrics.bytes_received.inc(received)
        self.host.metrics.bytes_sent.inc(sent)

    def _candidates(self, step: int) -> list["PeerRecord"]:
        host = self.host
        found = [p for p in host.view().peers.values()
                 if p.peer_id != host.peer_id and p.address and abs(p.outer_step - step) <= STEP_WINDOW]
        found.sort(key=lambda p: p.peer_id)
        self._rng.shuffle(found)
        return found

    # -- the round ------------------------------------------------------------------------------

    async def round(self, step: int, delta: torch.Tensor, weight: float) -> RoundReport | None:
        """The round at our boundary; None only when our own outer step cannot be taken.

        ``weight`` (tokens since the last round) is not used: gossip mixes with equal weights.
        The report carries the consensus distance and the exchange phase's traffic and time.
        """
        host, state = self.host, self.host.state

        def own_step() -> tuple[torch.Tensor, torch.Tensor, bytes]:
            params, momentum = state.params.clone(), state.outer.buffer.clone()
            NesterovOuter(state.outer.lr, state.outer.momentum, momentum).step_slice(
                params, 0, delta + state.residual)
            payload, _ = codecs.encode_with_feedback(self.codec, params, self.residual)
            return params, momentum, payload

        try:
            params, momentum, payload = await self._exclusive(own_step)
        except codecs.CodecError as err:  # Δ was finite, so only an exploding outer step gets here
            log.error("global parameters after the outer step are not finite (%s); skipping the round", err)
            host.metrics.round_failures.labels(reason="diverged").inc()
            return None

        try:
            await host.refresh_view()
        except Exception:  # a DHT hiccup costs this round its fresh view, never the node
            log.warning("could not refresh the swarm view; choosing partners from the last one", exc_info=True)
        candidates = self._candidates(step)
        others = [p for p in host.view().peers.values() if p.peer_id != host.peer_id]
        exchange_started = time.monotonic()
        partners, traffic = await self._exchange_all(candidates, step, payload)
        exchange_seconds = time.monotonic() - exchange_started

        inbox = self.inbox.drain()

        def mix() -> float:
            norm = float(params.norm()) or 1.0
            distance = (sum(float((params - theta).norm()) for theta in partners.values()) / (norm * len(partners))
                        if partners else math.nan)
            mixed = [*partners.values(), *inbox.values()]
            for theta in mixed:
                params.add_(theta)
            params.div_(1 + len(mixed))
            # The swap: θ_global, its momentum and the spent residual change together.
            state.params = params
            state.outer.buffer = momentum
            state.residual.zero_()
            return distance

        distance = await self._exclusive(mix, result_stands=True)

        m = host.metrics
        m.consensus_distance.set(distance)
        m.bytes_sent.inc(traffic.sent)
        m.bytes_received.inc(traffic.received)
        m.compression_ratio.set(4 * self.numel / max(len(payload), 1))
        if not partners and others:
            m.round_failures.labels(reason="no_group").inc()
        log.info(
            "gossip at step %d: %d partner(s), %d from the inbox, consensus distance %.4f", step, len(partners),
            len(inbox), distance,
            extra={"event": "gossip_round", "outer_step": step + 1, "consensus_distance": distance,
                   "partners": sorted(partners), "inbox": sorted(inbox), "candidates": len(candidates),
                   "bytes_sent": traffic.sent, "bytes_received": traffic.received,
                   "exchange_seconds": exchange_seconds},
        )
        return RoundReport(group_size=1 + len(partners), seconds=0.0, bytes_sent=traffic.sent,
                           bytes_received=traffic.received, skipped_shards=0, allreduce_seconds=exchange_seconds,
                           consensus_distance=distance)

    async def _exchange_all(self, candidates: list["PeerRecord"], step: int,
                            payload: bytes) -> tuple[dict[str, torch.Tensor], Traffic]:
        """Exchange with up to k candidates (a failed one is replaced by the next), by one deadline."""
        host = self.host
        queue = list(candidates)
        partners: dict[str, torch.Tensor] = {}
        traffic = Traffic()
        deadline = time.monotonic() + self.timeout

        async def worker() -> None:
            while queue:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                peer = queue.pop()
                try:
                    got = await exchange(host.channels(peer.address), host.identity, self.codec, step, payload,
                                         self.numel, host.executor, remaining, STEP_WINDOW, traffic)
                except GossipError as err:
                    if err.reason is not None:
                        host.on_reject(err.reason, peer.peer_id, str(err))
                    else:
                        log.info("gossip partner %s left out: %s", peer.peer_id, err)
                    continue
                partners[peer.peer_id] = got.theta
                return

        async with asyncio.TaskGroup() as tasks:
            for _ in range(min(self.k, len(queue))):
                tasks.create_task(worker())
        return partners, traffic
