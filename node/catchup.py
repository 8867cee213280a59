"""Catching up with the swarm: the handshake with a swarm of another run, and state downloads.

Before its first phase and between rounds a node checks the swarm view (node/decisions.py
``catch_up_target``): when peers committed a newer step, or hold other parameters than the
majority at ours, it downloads the swarm's state from donors at that step and hash
(protocol/state.py). Its own local progress since θ_global is not lost: it goes into the
residual, to be sent with its next contribution. In gossip mode a swarm a few steps ahead is
caught up with by mixing instead (``GOSSIP_STEP_WINDOW``). In runs that sync the inner
optimizer's state (``[sync] state_sync``) the snapshot carries that state too, and the node
loads it into its optimizer: it then holds its donor's optimizer state bit for bit, whose synced
states are the group's averages (node/optimizers.py says why all of it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
import torch

from lowcomm.protocol._pb.lowcomm.v1 import state_pb2, state_pb2_grpc
from lowcomm.protocol.handshake import Identity, IncompatiblePeer
from lowcomm.protocol.rpc import ChannelPool
from lowcomm.protocol.missed_rounds import KEPT_ROUNDS, MissedRoundsError, apply_missed_rounds, fetch_missed_rounds
from lowcomm.protocol.state import Donor, OptimizerStates, Snapshot, StateDonor, StateError, download_state, state_bytes

from . import decisions, joincheck
from .averaging import Averager
from .cancel import cancel_and_wait
from .commit import human_bytes
from .config import Config
from .errors import FatalError, refused_by_the_swarm
from .globalstate import GlobalState
from .gossip_mode import STEP_WINDOW as GOSSIP_STEP_WINDOW
from .metrics import NodeMetrics
from .optimizers import OptimizerOwning, capture_states, install_states, served_state_names
from .ports import SwarmPort, TrainerPort
from .runstats import RunStats
from .swarm import SwarmView
from .train_thread import TrainThread

T = TypeVar("T")
log = logging.getLogger("lowcomm.node")


# Catch-ups in a row after a download that the swarm outpaced (CatchUp._catch_up), and the
# pause before the next try when every one was outpaced: doubling from the first to the most.
MORE_CATCH_UPS = 2
OUTPACED_PAUSE_FIRST = 60.0
OUTPACED_PAUSE_MAX = 900.0
# How often a state download in progress says how far it is.
PROGRESS_EVERY_SECONDS = 15.0


class DownloadProgress:
    """Says how a state download goes: a line as it starts, then one every
    PROGRESS_EVERY_SECONDS with the bytes, the rate and the time left; counts the bytes into
    ``counter`` as they arrive (a download of minutes was silent, its metric still at 0)."""

    def __init__(self, step: int, total: int, donors: int, counter, clock=time.monotonic) -> None:
        self.step, self.total, self.counter, self.clock = step, total, counter, clock
        self.started = self.last_said = clock()
        self.received = 0
        log.info("downloading the swarm's state of step %d (%s) from %d donor(s)", step, human_bytes(total), donors,
                 extra={"event": "state_download_started", "outer_step": step, "total_bytes": total,
                        "donors": donors})

    def __call__(self, received: int, total: int) -> None:
        self.counter.inc(max(0, received - self.received))
        self.received, self.total = max(self.received, received), total
        now = self.clock()
        if now - self.last_said >= PROGRESS_EVERY_SECONDS and self.received < total:
            self.last_said = now
            rate = self.received / max(now - self.started, 1e-9)
            log.info("downloading step %d: %s, %s/s, about %.0f s left", self.step, self.said(), human_bytes(rate),
                     (total - self.received) / max(rate, 1e-9),
                     extra={"event": "state_download_progress", "outer_step": self.step,
                            "bytes_received": self.received, "total_bytes": total, "bytes_per_second": rate})

    def said(self) -> str:
        """What came so far, as in "3.2MB of 26.1MB (12 %)"."""
        share = 100.0 * min(self.received, self.total) / self.total if self.total else 0.0
        return f"{human_bytes(self.received)} of {human_bytes(self.total)} ({share:.0f} %)"


class CatchUp:
    """The node's state downloads; ``must_download`` when no checkpoint was usable at start."""

    def __init__(self, config: Config, identity: Identity, trainer: TrainerPort, state: GlobalState, *,
                 swarm: SwarmPort, averager: Averager, channels: ChannelPool, donor: StateDonor,
                 train_thread: TrainThread, codec_executor: Executor, metrics: NodeMetrics, stats: RunStats,
                 gossip: bool, must_download: bool, stop_requested: asyncio.Event) -> None:
        self.config = config
        self.identity = identity
        self.trainer = trainer
        self.state = state
        self.swarm = swarm
        self.averager = averager  # its last contribution goes back into the residual if outvoted
        self.channels = channels
        self.donor = donor
        self.train_thread = train_thread
        self.codec_executor = codec_executor
        self.metrics = metrics
        self.stats = stats
        self.gossip = gossip
        self.must_download = must_download
        # A stop abandons a download in flight (a large model's takes minutes): the node then
        # stops from the state it had, which its checkpoint already holds.
        self.stop_requested = stop_requested
        self.outpaced = 0  # catch-up chains in a row that the swarm outpaced (``_give_way``)
        self.retry_at = 0.0  # monotonic time before which an outpaced node tries no catch-up

    async def run(self, initial: bool = False) -> None:
        """Download the swarm's state when it is ahead of us or we are in a minority at our step.
        ``initial`` (before the first phase): wait a moment for the records, refuse another run."""
        # Between rounds the last view serves unless the progress record says the swarm moved
        # (node/swarmpace.py): at N=1024 a full read is ~200 kB.
        view = await (self.swarm.refresh_view() if initial else self.swarm.current_view())

        def nobody_else(view: SwarmView) -> bool:  # our own record is in the view from our announce on
            return not decisions.others(view, self.swarm.position()) and not view.foreign

        if initial and self.config.node.peers and nobody_else(view):
            # Right after joining, the records may take a moment to reach us.
            for _ in range(8):
                await asyncio.sleep(0.5)
                view = await self.swarm.refresh_view()
                if not nobody_else(view):
                    break
            else:
                # Records are kept under the run's name: a mistyped [run] name trained alone
                # beside the swarm it was pointed at, without a word.
                log.warning("no peer of run %r is in the DHT joined through --peers: either the peers there run "
                            "another run (give the [run] name of its run config: the DHT holds each run's records "
                            "under its name) or they have all left; training alone until a peer of this run "
                            "comes", self.config.run.name)
        if initial:
            await self._refuse_a_swarm_out_of_reach(view)
            await self._handshake(view)
        if initial and self.must_download and not decisions.others(view, self.swarm.position()):
            raise FatalError(
                f"no usable checkpoint in {self.config.node.checkpoint_dir} and no peer to download the swarm's "
                f"state from: join a live swarm with --peers, or move the damaged checkpoint files away to "
                f"start over from the initial weights")
        plan = decisions.catch_up_target(view, self.swarm.position(),
                                         gossip_window=GOSSIP_STEP_WINDOW if self.gossip else None)
        if plan is None:
            return
        if not initial and not self.must_download and time.monotonic() < self.retry_at:
            return  # outpaced: said once with the time of the next try (``_give_way``)
        if plan.because_minority:
            log.warning("our params at step %d differ from the majority of the swarm; re-downloading", plan.step)
        self.stats.phase = "catching_up"
        await self._catch_up(plan)

    async def _catch_up(self, plan: decisions.CatchUp) -> None:
        """Reach ``plan``'s step by the missed rounds or a download. A download long enough for
        the swarm to go on meanwhile is followed at once by the next catch-up (at most
        MORE_CATCH_UPS times): a joiner on a slow link trained a whole phase from the state it had
        just got and found itself behind again at the boundary. A node the swarm outpaces every
        time says so and waits before it tries again (``outpaced_pause``): it cannot take part
        until a download is shorter than about KEPT_ROUNDS of the swarm's steps, and downloading
        on and on only kept its donors busy."""
        downloads = 0
        while True:
            started = time.monotonic()
            # The missed rounds come from one donor: the one with the fastest declared link first.
            fastest = [Donor(p.peer_id, p.address) for p in sorted(plan.donors, key=lambda p: -p.bandwidth_bps)]
            if not plan.because_minority and await self._apply_missed_rounds(plan.step, plan.params_hash, fastest):
                return
            donors = [Donor(p.peer_id, p.address) for p in plan.donors]
            if not await self._download(plan.step, plan.params_hash, donors) or self.stop_requested.is_set():
                return
            downloads += 1
            took = time.monotonic() - started
            view = await self.swarm.refresh_view()
            later = decisions.catch_up_target(view, self.swarm.position(),
                                              gossip_window=GOSSIP_STEP_WINDOW if self.gossip else None)
            if later is None or later.because_minority:
                self.outpaced = 0
                return
            gap = later.step - self.state.step
            if gap > KEPT_ROUNDS and downloads > MORE_CATCH_UPS:
                self._give_way(gap, took)
                return
            if gap > KEPT_ROUNDS:
                log.warning("the swarm made %d step(s) during this %.0f s state download, more than the %d rounds a "
                            "donor keeps for a peer that fell behind: downloading again", gap, took, KEPT_ROUNDS,
                            extra={"event": "download_outpaced", "outer_step": later.step, "steps_behind": gap})
            plan = later

    def _give_way(self, gap: int, took: float) -> None:
        """The swarm outpaced every download of a chain: say why and until when no more is tried."""
        self.outpaced += 1
        pause = min(OUTPACED_PAUSE_MAX, OUTPACED_PAUSE_FIRST * 2 ** (self.outpaced - 1))
        self.retry_at = time.monotonic() + pause
        log.warning("this node cannot keep up with the swarm: a state download takes about %.0f s, in which the swarm "
                    "makes %d steps, and a donor keeps only the last %d rounds for a peer that fell behind; it can "
                    "take part with a link about %.0fx faster (or in a swarm with longer inner phases, [train] "
                    "inner_steps). Training on alone and trying again in %.0f s", took, gap, KEPT_ROUNDS,
                    gap / KEPT_ROUNDS, pause,
                    extra={"event": "download_outpaced", "steps_behind": gap, "retry_in_seconds": pause})

    async def _refuse_a_swarm_out_of_reach(self, view: SwarmView) -> None:
        """End the node (one line saying which flag to change) when the swarm it joined serves
        the other kind of gRPC, or a certificate it does not trust, or is an open run while this
        node has a secret (node/joincheck.py)."""
        me, tls = self.identity.peer_id, self.config.node.tls_cert is not None
        why = joincheck.transport_mismatch(view, me, tls)
        if why is None and tls:
            why = await joincheck.untrusted_certificate(view, me, self.channels, self.identity.hello())
        if why is None and self.config.node.run_secret_file is not None:
            peer = joincheck.open_run_peer(view, me, self.identity.config_fingerprint)
            why = joincheck.open_run_message(peer, self.config.run.name) if peer is not None else None
        if why is not None:
            raise FatalError(f"refused by the swarm: {why}")

    async def _handshake(self, view: SwarmView) -> None:
        """Refuse to run next to a swarm of another run config or another run secret, naming
        the difference. Only when no peer this node can average with is in sight: it would
        otherwise train alone, of no use to anyone, with nothing but a warning to say why."""
        me = self.identity.peer_id
        # A record still "starting" is no peer to average with: a joiner refused a moment ago
        # leaves one in the DHT for a few heartbeats, and the same command run again (a launcher
        # that restarts it) then skipped this check and trained alone, with no word, exit code 0.
        settled = [p for p in (*view.peers.values(), *view.foreign.values()) if p.peer_id != me and p.phase != "starting"]
        candidates = [p for p in settled if p.address]
        if not candidates or view.peers.keys() & {p.peer_id for p in settled}:
            return
        peer = candidates[0]
        stub = state_pb2_grpc.StateTransferStub(self.channels(peer.address))
        try:
            await stub.GetStateInfo(state_pb2.StateInfoRequest(hello=self.identity.hello()), timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise refused_by_the_swarm(err.details() or "", me) from None
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise FatalError(
                    f"refused by the swarm: peer {peer.peer_id} refused this node ({err.details()}) and no peer "
                    f"of the run it can average with is in sight: start it with the swarm's secret in "
                    f"--run-secret-file") from None

    async def _download(self, step: int, digest: str | None, donors: list[Donor]) -> bool:
        """Download and adopt the state of ``step``; whether it was adopted."""
        started = time.monotonic()
        states = served_state_names(self.config)
        progress = DownloadProgress(step, state_bytes(self.trainer.numel, states), len(donors),
                                    self.metrics.state_download_bytes)
        download = await self._unless_stopped(download_state(
            donors, step, digest, self.identity, self.channels, timeout=max(60.0, self.config.sync.reduce_timeout),
            expected_numel=self.trainer.numel,  # the run config's size, not a donor's
            expected_states=states, progress=progress))
        if download is None:
            log.info("stop requested: the state download of step %d is abandoned (staying at step %d)", step,
                     self.state.step)
            return False
        try:
            got = download.result()
        except StateError as err:
            log.warning("state download of step %d failed after %s in %.0f s: %s; training on from our state at "
                        "step %d and trying again at the next round boundary", step, progress.said(),
                        time.monotonic() - started, err, self.state.step)
            return False
        except IncompatiblePeer as err:
            raise refused_by_the_swarm(str(err), self.identity.peer_id) from None
        state_hashes = await self._adopt(got.step, got.params, got.momentum, got.optimizer)
        self.metrics.state_downloads.inc()
        log.info("caught up: downloaded step %d (%d bytes from %d donor(s) in %.1fs)%s", got.step, got.bytes_downloaded,
                 got.donors_used, time.monotonic() - started,
                 f", with the inner optimizer's {', '.join(state_hashes)}" if state_hashes else "",
                 extra={"event": "state_downloaded", "outer_step": got.step, "params_sha256": self.state.params_hash,
                        "bytes_downloaded": got.bytes_downloaded, "state_sha256": state_hashes,
                        "optimizer_step": got.optimizer.step if got.optimizer is not None else None})
        await self.swarm.publish_record()
        return True

    async def _apply_missed_rounds(self, step: int, digest: str | None, donors: list[Donor]) -> bool:
        """Catch up with the swarm at (``step``, ``digest``) by the averages of the rounds we
        missed (protocol/missed_rounds.py) when our state is the one those rounds started from;
        False (nothing changed) when that cannot be done, and the caller downloads the state;
        True too when a stop abandoned the fetch (nothing changed, nothing more to do)."""
        from_step, base = self.state.published()
        if (self.gossip or served_state_names(self.config) or digest is None
                or not 0 < step - from_step <= KEPT_ROUNDS or self.must_download):
            return False
        started = time.monotonic()
        fetch = await self._unless_stopped(fetch_missed_rounds(
            donors, from_step, base, step, digest, self.identity, self.channels,
            timeout=max(60.0, self.config.sync.reduce_timeout), numel=self.trainer.numel))
        if fetch is None:
            log.info("stop requested: fetching the missed rounds of steps %d-%d is abandoned (staying at step %d)",
                     from_step, step - 1, self.state.step)
            return True  # nothing more to do: the caller must not download the state instead
        try:
            fetched = fetch.result()
            params, momentum = await asyncio.get_running_loop().run_in_executor(
                self.codec_executor, apply_missed_rounds, self.state.params, self.state.outer, fetched.records)
        except MissedRoundsError as err:
            log.info("cannot catch up from step %d to %d by the missed rounds (%s); downloading the state",
                     from_step, step, err)
            return False
        await self._adopt(step, params, momentum, None)
        for record in fetched.records:  # served on to other peers that missed them
            self.donor.rounds.add(record)
        self.metrics.missed_rounds_applied.inc(len(fetched.records))
        self.metrics.missed_rounds_bytes.inc(fetched.bytes_downloaded)
        log.info("caught up: applied the %d missed round(s) of steps %d-%d (%d bytes from %s in %.1fs) instead of "
                 "downloading the state", len(fetched.records), from_step, step - 1, fetched.bytes_downloaded,
                 fetched.donor, time.monotonic() - started,
                 extra={"event": "missed_rounds_applied", "outer_step": step, "from_step": from_step,
                        "params_sha256": self.state.params_hash, "bytes_downloaded": fetched.bytes_downloaded,
                        "donor": fetched.donor})
        await self.swarm.publish_record()
        return True

    async def _unless_stopped(self, fetch: Coroutine[Any, Any, T]) -> asyncio.Future[T] | None:
        """Run a fetch from the swarm until it ends (its finished future, to read its result or
        error from) or a stop is requested (None: the fetch is cancelled at once)."""
        task = asyncio.ensure_future(fetch)
        stop = asyncio.ensure_future(self.stop_requested.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled: nothing of the fetch runs on
            abandoned = not task.done()
            await cancel_and_wait(stop, task)
        return None if abandoned else task

    async def _adopt(self, step: int, params: torch.Tensor, momentum: torch.Tensor,
                     optimizer: OptimizerStates | None) -> dict[str, str]:
        """Make the swarm's (``step``, θ, outer momentum, optimizer state) ours and serve it;
        returns the hashes of the optimizer states loaded (empty without)."""
        state, averager = self.state, self.averager

        def adopt() -> None:
            # Our local progress since θ_global is not lost: it goes into the residual, to be sent
            # with our next contribution. When the state we replace is the result of our own last
            # round (our group lost the majority vote), what we contributed to that round was not
            # applied in the swarm's state either, so all of it goes back into the residual.
            last = averager.last_contribution
            if last is not None and last[0] == state.step == step:
                state.residual.copy_(last[1])
            state.residual.add_(state.params - self.trainer.get_params())
            averager.last_contribution = None
            loaded = None
            if optimizer is not None and isinstance(self.trainer, OptimizerOwning):
                install_states(self.trainer.optimizer, self.trainer.params, optimizer)
                # What the optimizer holds now (read back), served to the next joiner as we got it.
                loaded = capture_states(self.trainer.optimizer, self.trainer.params, optimizer.names)
            state.adopt(step, params, momentum, loaded)
            self.trainer.set_params(state.params)

        def snapshot_and_hashes() -> tuple[Snapshot, dict[str, str]]:
            loaded = state.optimizer_states if optimizer is not None else None
            return state.snapshot(), loaded.hashes() if loaded is not None else {}

        await self.train_thread.run(adopt)
        snapshot, state_hashes = await asyncio.get_running_loop().run_in_executor(self.codec_executor,
                                                                                 snapshot_and_hashes)
        self.donor.publish(snapshot)
        self.must_download = False
        self.metrics.set_outer_step(state.step)
        return state_hashes
