"""The asyncio node: wiring and lifecycle, catch-up, checkpoints and graceful shutdown (DESIGN §3).

One event loop (uvloop, created by the CLI) runs RPCs, heartbeats and rounds; the model lives in
one dedicated training thread; codec and hashing work goes to a small executor; the DHT runs in
hivemind's own process. Every await that depends on another peer has a deadline.

``Node`` builds the collaborators (DHT client and ``SwarmLink``, gRPC server, matchmaker, reduce
registry, state donor, executors, metrics, the trainer unless one is injected) and hands them to
the ``RoundDriver`` (node/driver.py), which runs the inner phases and rounds. The node itself
starts and stops: restore (node/restore.py), the initial catch-up (node/catchup.py), the
shutdown fold and checkpoint, the status RPC.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import grpc
import hivemind
import torch
from grpc_health.v1 import health, health_pb2

from lowcomm import __version__
from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2, node_pb2
from lowcomm.protocol.aggregation import Aggregation
from lowcomm.protocol.allreduce import ReduceRegistry
from lowcomm.protocol.auth import RunAuth, ServerAuthInterceptor, TLSConfig, client_interceptors
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import Matchmaker
from lowcomm.protocol.rpc import (
    HEALTH_SERVICE,
    AveragingServicer,
    BindError,
    ChannelPool,
    NodeInfoServicer,
    StateServicer,
    create_server,
)
from lowcomm.protocol.reachability import DialBacker
from lowcomm.protocol.state import StateDonor

from . import restore
from .announce import choose_announce_host
from .averaging import Averager
from .cancel import cancel_and_wait
from .catchup import CatchUp
from .commit import Committer
from .config import Config, fingerprint_of
from .dht import swarm_clock
from .driver import RoundDriver, StopSignals
from .errors import FatalError, SettingError
from .executors import TrackedThreadPool, shutdown_without_blocking
from .faults import Faults
from .globalstate import GlobalState
from .gossip_mode import GossipHost, GossipMode
from .grpc_metrics import HandledCounter
from .metrics import NodeMetrics, serve_metrics
from .ports import ReplicaEvaluating, TrainerPort
from .reachability import ReachabilityCheck
from .peerbook import PeerBook, book_path
from .reconnect import Reconnector
from .reports import ReportQueue
from .runstats import RunStats
from .stopsignals import route_stop_signals
from .swarm import HivemindDHT, SwarmView, signed
from .swarmlink import SwarmLink
from .train_thread import TrainThread, lower_priority
from .trainer import Trainer

log = logging.getLogger("lowcomm.node")
T = TypeVar("T")

FORCED_EXIT_SECONDS = 10.0  # after a second stop signal, the process ends within this time
EXIT_FORCED = 130  # exit status when the watchdog had to end the process
EXIT_NOT_SAVED = 1  # exit status of a stop whose checkpoint could not be written


def join_multiaddr(multiaddrs: list[str], announce_host: str) -> str:
    """The multiaddr that the join line shows: the one at the host this node announces for gRPC,
    else the first not on loopback, else the first. On every interface (``--host 0.0.0.0``) the
    DHT lists 127.0.0.1 first, which only this machine can dial."""
    for maddr in multiaddrs:
        if maddr.split("/")[2:3] == [announce_host]:
            return maddr
    loopback = ("/ip4/127.", "/ip6/::1/")
    return next((m for m in multiaddrs if not m.startswith(loopback)), multiaddrs[0])


class Node:
    def __init__(self, config: Config, dht: hivemind.DHT, human: bool, run_secret: bytes | None = None,
                 tls: TLSConfig | None = None, trainer: TrainerPort | None = None) -> None:
        """``trainer``: the training loop to drive (node/ports.py); None builds the daemon's own
        ``Trainer`` from ``config`` (in the training thread, when the node starts)."""
        self.config = config
        self._injected_trainer = trainer
        self.dht = dht
        self.human = human
        self.peer_id = str(dht.peer_id)
        run_config = config.run_config_json()
        self.identity = Identity(self.peer_id, fingerprint_of(run_config), run_config,
                                 on_other_config=lambda _: self.metrics.rejected_contributions.labels(reason="config").inc())
        self.codec = codecs.get_codec(config.sync.codec)
        self.metrics = NodeMetrics()
        self.metrics.set_build_info(config.sync.codec, config.sync.mode)
        # A run secret authenticates every RPC and DHT record (protocol/auth.py); TLS is separate.
        if (run_secret is None) != (config.node.run_secret_file is None):
            raise ValueError("pass the bytes of [node] run_secret_file as run_secret (the CLI reads the file)")
        # Tokens, signed records and DHT expirations run on swarm time: this machine's clock
        # corrected by its offset from the bootstrap peers' (node/clock.py).
        wall_clock = swarm_clock(dht)
        self.auth = RunAuth(run_secret, clock=wall_clock) if run_secret else None
        self.tls = tls
        self.dht_client = signed(HivemindDHT(dht, wall_clock, self.metrics.dht_requests), self.auth)
        # Tokens name our outer step (0 until the state is restored).
        tokens = client_interceptors(self.auth, self.peer_id, lambda: getattr(getattr(self, "state", None), "step", 0)
                                     ) if self.auth else []
        # Bounded (LRU) under churn, with room for a whole group's members plus donors and partners.
        self.channels = ChannelPool(tokens, tls, capacity=max(64, 2 * config.sync.group_size))
        self.train_thread = TrainThread(config.node.compute_niceness)
        # Tracked: an abandoned round's jobs must end before its residual is rolled back (node/driver.py settle_state).
        self.codec_executor = TrackedThreadPool(2, thread_name_prefix="lowcomm-codec")
        # Eval of θ_global and checkpoint writes, one at a time and in commit order, so that the
        # training thread never stops for them.
        self.report_executor = ThreadPoolExecutor(1, thread_name_prefix="lowcomm-report",
                                                  initializer=lower_priority, initargs=(config.node.compute_niceness,))
        self.reports = ReportQueue(self.report_executor)  # newest wins: bounded copies of the state
        self._main_task: asyncio.Task | None = None
        self.stops = StopSignals()
        self.stop_requested = self.stops.requested
        self.force_stop = self.stops.forced  # a second stop signal: no grace period any more
        self.stop_training = self.stops.training  # read by the training thread between inner steps
        self.stats = RunStats()  # written by the round driver, read by our record and status
        self.address = ""
        self.faults = Faults.from_env()  # fault injection for tests (node/faults.py)
        self._must_download = False  # checkpoints exist but none is usable (node/restore.py)
        self.unsaved: str | None = None  # why the stop's checkpoint could not be written, if it could not
        self.checkpoint_failure: tuple[int, str] | None = None  # (step, why) of the last write, if it failed
        self.unreachable = ""  # what peers that tried to dial us back found, when none could (status)
        self.gossip: GossipMode | None = None  # when [sync] mode = "gossip"
        self.link: SwarmLink | None = None  # our record and the swarm view, once the state is known
        self.driver: RoundDriver | None = None  # built once the server runs (_build_rounds)
        self.catchup: CatchUp  # state downloads (node/catchup.py), built with the driver
        self.health = health.aio.HealthServicer()
        # Asked once: DHT calls block on another process, never on the event loop.
        self.multiaddrs = [str(m) for m in dht.get_visible_maddrs()]
        # After a partition heals, hivemind alone never reintroduces the two sides (node/reconnect.py).
        # It pings the peers the DHT started with: --peers, or those the node remembered (node/peerbook.py).
        self.reconnector = Reconnector(dht, self.peer_id, list(getattr(dht, "initial_peers", None) or config.node.peers),
                                       interval=max(10.0, 3 * config.node.heartbeat_interval))
        self.trainer: TrainerPort
        # Eval of θ_global in the report thread; NaN for a trainer that offers no replica.
        self.evaluate_global: Callable[[torch.Tensor, dict[str, torch.Tensor] | None], float] = \
            lambda _params, _buffers: math.nan
        self.state: GlobalState

    # -- small helpers ------------------------------------------------------------------------

    async def in_train_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.train_thread.run(fn, *args)

    async def in_codec_pool(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.codec_executor, fn, *args)

    def request_stop(self) -> None:
        if self.stop_requested.is_set():
            self._force_stop()
            return
        if self.link is None:  # run() checks before it makes the link: the node never joins
            log.info("stop requested during start-up: stopping before joining the swarm")
        elif self.stats.phase == "waiting":  # no round yet: nothing to finish
            log.info("stop requested while waiting for peers to start with: stopping")
        else:
            log.info("stop requested: finishing or abandoning the round in flight (grace %.0fs)",
                     self.config.node.grace_period)
        self.stop_requested.set()
        self.stop_training.set()

    def _force_stop(self) -> None:
        """A second SIGINT/SIGTERM: abandon whatever runs now, save and exit within seconds. A
        watchdog makes sure of it even if something blocks: the DHT process and p2pd die with us
        (node/dht.py) and the checkpoint directory is only ever replaced atomically."""
        if self.force_stop.is_set():
            return
        log.warning("second stop signal: abandoning everything, exiting within %.0fs", FORCED_EXIT_SECONDS)
        self.force_stop.set()
        if self._main_task is not None:
            self._main_task.cancel()
        watchdog = threading.Timer(FORCED_EXIT_SECONDS, os._exit, args=(EXIT_FORCED,))
        watchdog.daemon = True
        watchdog.start()

    def _on_reject(self, reason: str, sender: str, detail: str) -> None:
        self.metrics.rejected_contributions.labels(reason=reason).inc()
        log.warning("rejected a contribution from %s (%s): %s", sender, reason, detail)

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # SIGHUP too, unless under nohup; a copy of the first signal (`timeout` signals the node
        # and its process group) is the same request, not a second one (node/stopsignals.py).
        route_stop_signals(loop, self.request_stop)
        server = None
        metrics_server = None
        try:
            self.trainer = (self._injected_trainer if self._injected_trainer is not None
                            else await self.in_train_thread(Trainer, self.config, self.peer_id))
            self.state = await self.in_train_thread(self._restore)
            if isinstance(self.trainer, ReplicaEvaluating):
                self.evaluate_global = await self.in_train_thread(self.trainer.replica_evaluator)
            self.stats.last_eval = await self.in_train_thread(self.trainer.evaluate)
            self.metrics.eval_loss.set(self.stats.last_eval)
            self.metrics.set_outer_step(self.state.step)
            if self.stop_requested.is_set():  # while the model loaded or evaluated: nothing to save yet
                log.info("stopped during start-up, before joining the swarm (outer step %d)", self.state.step)
                return 0
            link = self.link = SwarmLink(self.config, self.identity, self.state, dht_client=self.dht_client,
                                         reconnector=self.reconnector, metrics=self.metrics, stats=self.stats)
            link.peerbook = PeerBook(book_path(self.config.node.checkpoint_dir), self.peer_id)
            server = await self._start_server(link)
            self.driver = self._build_rounds(link)
            metrics_server, metrics_port = self._start_metrics()
            self.donor.publish(await self.in_codec_pool(self.state.snapshot))
            self._announce(metrics_port)
            heartbeat = asyncio.create_task(link.heartbeat(), name="heartbeat")
            reachability = asyncio.create_task(self._check_reachable(link), name="reachability")
            training = False
            saved = True
            try:
                await self.catchup.run(initial=True)
                await self.health.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
                self.stats.training_since = time.monotonic()
                training = True
                self._main_task = asyncio.create_task(self.driver.run(), name="main-loop")
                try:
                    await self._main_task
                except asyncio.CancelledError:
                    if not self.force_stop.is_set():
                        raise  # cancelled from outside, not by a second signal
            finally:
                await cancel_and_wait(heartbeat, reachability, link.reconnecting)
                if training:  # also after a failure: what the node learnt is saved
                    await self._stop_rounds()
                    await self._reports_written()
                    if self.driver is not None and self.driver.reached_max_rounds():
                        # Here, not when the loop saw it: the last round's line comes first.
                        log.info("completed %d round(s) (--max-rounds); stopping", self.stats.rounds_completed)
                    saved = await self._shutdown(link)
            return 0 if saved else EXIT_NOT_SAVED
        finally:
            if server is not None:
                await self.health.enter_graceful_shutdown()
                await server.stop(grace=1.0)
            if metrics_server is not None:
                metrics_server.shutdown()
            await self.channels.close()
            await asyncio.to_thread(self.train_thread.shutdown)
            await shutdown_without_blocking(self.codec_executor, self.report_executor)

    def _restore(self) -> GlobalState:
        """Training thread: the state to start from (node/restore.py)."""
        restored = restore.restore(self.config, self.trainer)
        self.stats.tokens_total = restored.tokens_total
        self._must_download = restored.must_download
        return restored.state

    async def _start_server(self, link: SwarmLink) -> grpc.aio.Server:
        cfg = self.config.node
        self.registry = ReduceRegistry(self.peer_id, self._on_reject, self.codec_executor,
                                       Aggregation.from_config(self.config.sync))
        self.donor = StateDonor(self.identity)
        # The address is known only after binding; the matchmaker reads it when a round starts.
        self.matchmaker = Matchmaker(
            self.dht_client, self.config.run.name, self.identity, "", self.channels,
            self.config.sync.group_size, int(self.codec.id), self.trainer.numel, self.config.sync.reduce_timeout,
            quorum=self.config.sync.quorum, min_straggler_wait=self.config.sync.straggler_wait,
            schedule={"ring": averaging_pb2.ALL_REDUCE_SCHEDULE_RING, "auto": averaging_pb2.ALL_REDUCE_SCHEDULE_AUTO}.get(
                self.config.sync.schedule, averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY),
        )
        link.plan_behind = self.matchmaker.plan_behind
        serve_peers = not cfg.client_mode
        if self.config.sync.mode == "gossip":
            self.gossip = GossipMode(GossipHost(
                self.peer_id, self.identity, self.config.sync, self.codec, self.trainer.numel, self.state,
                self.channels, self.codec_executor, self.metrics, view=link.last_view,
                refresh_view=link.refresh_view, on_reject=self._on_reject))
        try:
            server, port = create_server(
                cfg.host, cfg.grpc_port,
                AveragingServicer(self.matchmaker, self.registry) if serve_peers else None,
                StateServicer(self.donor) if serve_peers else None,
                NodeInfoServicer(self.status, DialBacker(self.tls)), self.health,
                interceptors=[HandledCounter(self.metrics.grpc_handled)] + ([ServerAuthInterceptor(
                    self.auth, lambda reason, *_: self.metrics.rejected_contributions.labels(reason=reason).inc())]
                    if self.auth else []),
                tls=self.tls,
                extra_services=self.gossip.services() if self.gossip is not None and serve_peers else [],
            )
        except BindError as err:
            if err.errno not in (errno.EADDRINUSE, None):  # e.g. a port below 1024 without root
                raise FatalError(f"{err}: choose another --host or --grpc-port") from None
            # `join` probes it before the DHT starts (cli.check_ports): another process took it since.
            raise SettingError(f"{err}: is gRPC port {cfg.grpc_port} already in use? "
                               f"choose another with --grpc-port (or LOWCOMM_GRPC_PORT), or 0 for any free port"
                               ) from None
        await server.start()
        await self.health.set(HEALTH_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("gRPC server on port %d: %s, %s", port, "TLS" if self.tls else "plaintext",
                 "run secret required (RPCs and DHT records authenticated)" if self.auth else "open run (no secret)")
        if serve_peers:
            self.address = f"{self.announce_host}:{port}"
            self.matchmaker.address = link.address = self.address
            link.dht_address = self.join_address
        self.grpc_port = port
        return server

    def _build_rounds(self, link: SwarmLink) -> RoundDriver:
        """The round driver, its two halves and the catch-up, wired to this node's collaborators."""
        averager = Averager(self.config, self.peer_id, self.state, swarm=link, matchmaker=self.matchmaker,
                            registry=self.registry, channels=self.channels, codec_executor=self.codec_executor,
                            metrics=self.metrics, stats=self.stats, faults=self.faults,
                            stop_training=self.stop_training, gossip=self.gossip)
        self.catchup = CatchUp(self.config, self.identity, self.trainer, self.state, swarm=link, averager=averager,
                               channels=self.channels, donor=self.donor, train_thread=self.train_thread,
                               codec_executor=self.codec_executor, metrics=self.metrics, stats=self.stats,
                               gossip=self.gossip is not None, must_download=self._must_download,
                               stop_requested=self.stop_requested)
        committer = Committer(self.state, self.trainer, swarm=link, donor=self.donor, train_thread=self.train_thread,
                              codec_executor=self.codec_executor, reports=self.reports, metrics=self.metrics,
                              stats=self.stats, codec=self.codec, evaluate_global=self.evaluate_global,
                              write_checkpoint=self._write_checkpoint)
        return RoundDriver(self.config, self.trainer, self.state, averager=averager, committer=committer, swarm=link,
                           catch_up=self.catchup.run, train_thread=self.train_thread,
                           codec_executor=self.codec_executor, metrics=self.metrics,
                           stats=self.stats, faults=self.faults, stops=self.stops, human=self.human)

    def _start_metrics(self) -> tuple[Any, int]:
        cfg = self.config.node
        try:
            return serve_metrics(self.metrics, cfg.host, cfg.metrics_port)
        except OSError as err:
            kind = SettingError if err.errno == errno.EADDRINUSE else FatalError  # a busy port: the user's to change
            raise kind(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port} ({err.strerror}): "
                       f"choose another port with --metrics-port (or LOWCOMM_METRICS_PORT), or 0 for any free port"
                       ) from None

    @functools.cached_property
    def join_address(self) -> str:
        """The DHT multiaddr the join line shows and the peer record carries ("" without any)."""
        return join_multiaddr(self.multiaddrs, self.announce_host) if self.multiaddrs else ""

    @functools.cached_property
    def announce_host(self) -> str:
        """The host other peers reach this node at: ``--announce-host``, else ``--host``, else,
        on every interface, the address chosen by node/announce.py (said once in the log)."""
        cfg = self.config.node
        if cfg.announce_host:
            return cfg.announce_host
        if cfg.host not in ("0.0.0.0", "::", ""):
            return cfg.host
        choice = choose_announce_host(self.multiaddrs, cfg.peers)
        if choice.others:
            log.log(logging.WARNING if choice.ambiguous else logging.INFO,
                    "this machine has several addresses; peers are told %s (%s), not %s: if they cannot reach "
                    "it there, set --announce-host to the address they can", choice.host, choice.why,
                    ", ".join(choice.others),
                    extra={"event": "announce_host", "host": choice.host, "others": list(choice.others)})
        return choice.host

    async def _check_reachable(self, link: SwarmLink) -> None:
        """Ask peers whether they reach our gRPC server (node/reachability.py); a client-mode
        node serves none."""
        if not self.address:
            return
        check = ReachabilityCheck(self.peer_id, self.address, link.last_view, self.channels,
                                  self.metrics.grpc_reachable.set)
        try:
            answers = await check.run()
        except Exception:  # noqa: BLE001 - a hint for the volunteer: never a reason to stop training
            log.debug("reachability check failed", exc_info=True)
            return
        self.unreachable = answers.why_unreachable(self.address)

    def _announce(self, metrics_port: int) -> None:
        maddrs = self.multiaddrs
        reachable = self.join_address
        if not maddrs:
            join_line = ""
        elif self._injected_trainer is not None:  # a lowcomm.Swarm: its peers run the same script
            join_line = f"lowcomm.Swarm(..., peers=[\"{reachable}\"])"
        else:
            join_line = f"lowcomm-node join --peers {reachable}"
        log.info(
            "node %s ready: gRPC %s, metrics :%d; others join with: %s", self.peer_id,
            self.address or f"(client mode, local :{self.grpc_port})", metrics_port, join_line,
            extra={"event": "node_ready", "peer_id": self.peer_id, "multiaddrs": maddrs,
                   "outer_step": self.state.step, "eval_loss": self.stats.last_eval,
                   "grpc_address": self.address, "grpc_port": self.grpc_port, "metrics_port": metrics_port,
                   "join_command": join_line},
        )

    @property
    def view(self) -> SwarmView:
        """The swarm as last read (empty before the node started)."""
        return self.link.view if self.link is not None else SwarmView({}, {}, 0.0)

    # -- stopping -----------------------------------------------------------------------------

    def _write_checkpoint(self, state: dict[str, Any], trainer_state: dict[str, Any], tokens_total: int) -> None:
        try:
            restore.save(self.config, state, trainer_state, tokens_total)
        except OSError as err:  # every checkpoint write goes through here: a round's and the stop's
            self.checkpoint_failure = (int(state["step"]), str(err))
            self.metrics.checkpoint_failures.inc()
            raise
        self.checkpoint_failure = None

    async def _stop_rounds(self) -> None:
        """Whatever round is still in flight (a failure or a forced stop interrupted the loop):
        cancel it, wait for the work it left running and roll it back, so that the shutdown
        checkpoint holds a consistent state."""
        if self._main_task is not None:
            await cancel_and_wait(self._main_task)
        if self.driver is not None:
            await self.driver.abandon()  # before the shutdown fold: no progress counted twice

    async def _reports_written(self) -> None:
        """Wait for the evals and checkpoints of committed rounds still being written (the newest
        checkpoint is always among them: node/reports.py)."""
        await self.reports.flush()

    async def _shutdown(self, link: SwarmLink) -> bool:
        """Fold unsent local progress into the residual, checkpoint, leave the DHT; False when the
        checkpoint could not be written (the DHT is left all the same)."""
        self.stats.phase = "stopping"

        def fold_and_save() -> None:
            self.train_thread.drain()  # an overlapped round's result not yet applied to the local model
            self.state.residual.add_(self.state.params - self.trainer.get_params())
            self.trainer.set_params(self.state.params)
            self._write_checkpoint(self.state.to_checkpoint(), self.trainer.local_state(), self.stats.tokens_total)

        failure: OSError | None = None
        try:
            await self.in_train_thread(fold_and_save)
        except OSError as err:  # a full disk, say: the checkpoints written before stay (atomic writes)
            failure = err
        try:
            async with asyncio.timeout(2.0 if self.force_stop.is_set() else 5.0):
                await link.publish_record(leaving=True)
        except TimeoutError:
            pass
        if failure is not None:
            self.unsaved = (f"stopped at outer step {self.state.step} without saving it: {failure}; a restart resumes "
                            f"from the last checkpoint written, or downloads the swarm's state")
            log.error("%s", self.unsaved,
                      extra={"event": "node_stopped", "outer_step": self.state.step, "saved": False})
            return False
        log.info("stopped cleanly at outer step %d (checkpoint in %s)", self.state.step,
                 self.config.node.checkpoint_dir,
                 extra={"event": "node_stopped", "outer_step": self.state.step, "saved": True})
        return True

    # -- status -------------------------------------------------------------------------------

    async def status(self) -> node_pb2.NodeStatus:
        view = self.view
        records = dict(view.peers)
        if self.link is not None:  # our own line as we are now, not as our last heartbeat published it
            records[self.peer_id] = self.link.record()
        swarm = [
            node_pb2.SwarmPeer(peer_id=p.peer_id, address=p.address, outer_step=p.outer_step,
                               params_sha256=p.params_sha256, tokens_per_second=p.tokens_per_second,
                               client_mode=not p.address, bandwidth_bps=p.bandwidth_bps)
            for p in sorted(records.values(), key=lambda p: p.peer_id)
        ]
        state = getattr(self, "state", None)
        step, digest = state.published() if state else (0, "")
        return node_pb2.NodeStatus(
            peer_id=self.peer_id, outer_step=step,
            params_sha256=digest,
            swarm_peers=len({p.peer_id for p in swarm} | {self.peer_id}), loss=self.stats.last_loss,
            eval_loss=self.stats.last_eval, tokens_total=self.stats.tokens_total, phase=self.stats.phase,
            swarm_outer_step_max=max(view.max_step, step),
            rounds_completed=self.stats.rounds_completed, tokens_per_second=self.stats.tokens_per_second, swarm=swarm,
            multiaddrs=self.multiaddrs, codec=self.config.sync.codec,
            mode=self.config.sync.mode, consensus_distance=self.stats.consensus_distance, version=__version__,
            unreachable=self.unreachable, **self._checkpoint_failure_fields(),
        )

    def _checkpoint_failure_fields(self) -> dict[str, Any]:
        if self.checkpoint_failure is None:
            return {}
        step, why = self.checkpoint_failure
        return {"checkpoint_failure": why, "checkpoint_failed_step": step}
