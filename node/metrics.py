"""Every Prometheus metric of a node, defined in one place.

Rules (checked by ``promtool check metrics`` in the suite): prefix ``lowcomm_``, base units
(seconds, bytes), counters end in ``_total``, no peer-id or round labels, no ``_created`` series.
Each node owns its registry, so several nodes can live in one test process.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client import disable_created_metrics, start_http_server

from lowcomm import __version__

# Rounds take from tens of milliseconds (tiny model on loopback) to minutes (GPT-2 on slow links).
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)

# Why a round failed; a bounded set so the label stays cheap.
FAILURE_REASONS = ("no_group", "matchmaking", "behind", "shard_skipped", "aborted", "diverged")
# "unauthenticated": an RPC refused for lacking a valid run-secret token (protocol/auth.py).
REJECTION_REASONS = ("codec", "length", "non_finite", "norm", "unknown_sender", "late", "config", "unauthenticated")

disable_created_metrics()


class NodeMetrics:
    """The metrics of one node; attributes are prometheus_client metric objects."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        # process_* (CPU, memory, start time) and python_info, as a default registry would have.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Info("lowcomm_build", "Version and sync settings of this node.", registry=r)
        self.outer_step = Gauge("lowcomm_outer_step", "Committed outer step of this node's global parameters.", registry=r)
        self.swarm_outer_step_max = Gauge(
            "lowcomm_swarm_outer_step_max", "Highest outer step published in the DHT by any live peer.", registry=r
        )
        self._own_step = self._published_step_max = 0  # set_outer_step, set_swarm_outer_step_max
        self.swarm_peers = Gauge("lowcomm_swarm_peers", "Live peers in the DHT, this node included, as of the node's last "
                                 "full read of the peer table (every ceil(peers / 16) heartbeats at most).",
                                 registry=r)
        self.dht_rebootstraps = Counter(
            "lowcomm_dht_rebootstraps", "Times peers vanished from the swarm view and the DHT was re-bootstrapped.",
            ["outcome"], registry=r,
        )
        self.round_group_size = Gauge("lowcomm_round_group_size", "Members of this node's last averaging group.", registry=r)
        self.rounds = Counter("lowcomm_rounds", "Outer rounds this node completed.", registry=r)
        self.round_failures = Counter(
            "lowcomm_round_failures", "Outer rounds that failed or skipped shards, by reason.", ["reason"], registry=r
        )
        self.checkpoint_failures = Counter(
            "lowcomm_checkpoint_failures", "Checkpoints of committed rounds the node could not write (a full disk, "
            "no write permission); training goes on without them.", registry=r
        )
        self.round_duration = Histogram(
            "lowcomm_round_duration_seconds", "Wall time of one round: matchmaking, all-reduce and outer step.",
            buckets=ROUND_BUCKETS, registry=r,
        )
        self.matchmaking_duration = Histogram(
            "lowcomm_matchmaking_duration_seconds", "Wall time from registering for a round to a closed group.",
            buckets=ROUND_BUCKETS, registry=r,
        )
        self.allreduce_duration = Histogram(
            "lowcomm_allreduce_duration_seconds", "Wall time of the butterfly all-reduce of one round.",
            buckets=ROUND_BUCKETS, registry=r,
        )
        self.last_sync_timestamp = Gauge(
            "lowcomm_last_sync_timestamp_seconds", "Unix time of the last successful outer round.", registry=r
        )
        self.bytes_sent = Counter("lowcomm_bytes_sent", "Payload bytes this node sent in rounds.", registry=r)
        self.bytes_received = Counter("lowcomm_bytes_received", "Payload bytes this node received in rounds.", registry=r)
        self.compression_ratio = Gauge(
            "lowcomm_compression_ratio", "float32 bytes divided by encoded bytes of the last round's payload.", registry=r
        )
        self.inner_steps = Counter("lowcomm_inner_steps", "Inner optimizer steps this node ran.", registry=r)
        self.inner_phase_cuts = Counter(
            "lowcomm_inner_phase_cuts", "Inner phases ended early to join a round the swarm was already in.", registry=r
        )
        self.tokens = Counter("lowcomm_tokens", "Tokens this node trained on.", registry=r)
        self.train_loss = Gauge("lowcomm_train_loss", "Mean training loss of the last inner phase.", registry=r)
        self.eval_loss = Gauge("lowcomm_eval_loss", "Held-out loss of the global parameters after the last round.", registry=r)
        self.compute_utilization = Gauge(
            "lowcomm_compute_utilization_ratio", "Share of wall time spent in inner steps since the node started training.",
            registry=r,
        )
        self.rejected_contributions = Counter(
            "lowcomm_rejected_contributions", "Received contributions left out of an average, by reason "
            "(config: a peer of another run config refused).", ["reason"],
            registry=r,
        )
        self.state_downloads = Counter("lowcomm_state_downloads", "Global states downloaded from peers.", registry=r)
        self.state_download_bytes = Counter(
            "lowcomm_state_download_bytes", "Bytes of global state downloaded from peers.", registry=r
        )
        self.missed_rounds_applied = Counter(
            "lowcomm_missed_rounds_applied",
            "Rounds this node caught up with by applying a peer's kept averages instead of downloading the state.",
            registry=r)
        self.missed_rounds_bytes = Counter(
            "lowcomm_missed_rounds_bytes", "Bytes of kept round averages downloaded from peers to catch up.", registry=r)
        self.consensus_distance = Gauge(
            "lowcomm_consensus_distance", "Relative L2 distance of this node's global parameters to its gossip partners.",
            registry=r,
        )
        self.grpc_reachable = Gauge(
            "lowcomm_grpc_reachable",
            "1 when a peer reached this node's gRPC server by dialling it back, 0 when peers tried and could not "
            "(a firewall, NAT without a forwarded port, a wrong --announce-host), NaN until a peer answered.",
            registry=r)
        self.round_waits = Counter(
            "lowcomm_round_waits", "Times the training thread had to wait for a background round (overlap mode).",
            registry=r,
        )
        self.round_wait_seconds = Counter(
            "lowcomm_round_wait_seconds", "Seconds the training thread waited for background rounds.", registry=r,
        )
        self.grpc_handled = Counter(
            "grpc_server_handled", "RPCs completed on the server, by method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"], registry=r,
        )
        self.dht_requests = Counter(
            "lowcomm_dht_requests", "DHT calls this node made (peers table, matchmaking), by operation.", ["op"],
            registry=r,
        )
        # Label values known in advance are created up front so that rates start at zero, not absent.
        # Unknown until measured: NaN renders as a gap in Grafana instead of a misleading 0.
        for gauge in (self.train_loss, self.eval_loss, self.compression_ratio, self.consensus_distance,
                      self.grpc_reachable):
            gauge.set(float("nan"))
        for op in ("store", "get"):
            self.dht_requests.labels(op=op)
        for reason in FAILURE_REASONS:
            self.round_failures.labels(reason=reason)
        for reason in REJECTION_REASONS:
            self.rejected_contributions.labels(reason=reason)

    def set_outer_step(self, step: int) -> None:
        """This node's committed outer step; the swarm's highest is never below it."""
        self._own_step = step
        self.outer_step.set(step)
        self.swarm_outer_step_max.set(max(self._published_step_max, step))

    def set_swarm_outer_step_max(self, published_max: int) -> None:
        """The highest outer step the DHT showed at the last read (heartbeats), or our own if
        higher: a commit raises it at once, where it used to trail our step until the next
        read and a dashboard's lag (max - own) went negative. A read may lower it (the leading
        peer left)."""
        self._published_step_max = published_max
        self.swarm_outer_step_max.set(max(published_max, self._own_step))

    def set_build_info(self, codec: str, mode: str) -> None:
        self.build_info.info({"version": __version__, "codec": codec, "mode": mode})


def serve_metrics(metrics: NodeMetrics, host: str, port: int) -> tuple[object, int]:
    """Start the /metrics HTTP endpoint in a daemon thread; returns (server, bound port)."""
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    assert isinstance(thread, threading.Thread)
    return server, server.server_port
