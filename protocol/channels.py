"""Client-side gRPC channels and the two one-shot calls of the CLI (`status`, `healthcheck`).

Kept apart from rpc.py (the servicers) because rpc.py imports the all-reduce and with it torch:
`lowcomm-node status` and `healthcheck` (a container's health probe runs it every few seconds)
then spent ~1.8 CPU-seconds importing what they never use; from here they import grpc and the
generated messages only.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._pb.lowcomm.v1 import node_pb2, node_pb2_grpc
from .auth import TLSConfig

STREAM_CHUNK_BYTES = 2 * 2**20  # DESIGN: stream in 1-4 MiB messages (the all-reduce and state transfer)
# Room for one chunk of twice that plus the message envelope.
MAX_MESSAGE_BYTES = STREAM_CHUNK_BYTES * 2 + 64 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # A peer that restarts on its ports must be reachable again within seconds. gRPC's default
    # backoff grows to 120 s while the peer is away, and a call on a channel waiting out its
    # backoff fails at once ("Connection refused") though the peer listens again: a restarted
    # peer's first rounds lost their shards and stalled the group for a reduce timeout.
    # (Not min_reconnect_backoff_ms: that one is the connect timeout.)
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
# How long a call waits for a channel in reconnect backoff to try once more: the longest backoff
# above with gRPC's 20 % jitter, and time for the connection (and a TLS handshake) over a WAN.
RECONNECT_WAIT_SECONDS = 2.0
HEALTH_SERVICE = ""  # the overall server health, as `grpc_health_probe` and our healthcheck ask


def open_channel(address: str, tls: TLSConfig | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """A channel to ``address``: over TLS trusting ``tls.cert_chain`` when given (see auth.py)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS + tls.channel_options(),
                                   interceptors=list(interceptors) or None)


async def wait_for_reconnect(channel: grpc.aio.Channel, timeout: float) -> float:
    """Seconds spent giving ``channel`` one more connection attempt when its last one failed.

    A channel in TRANSIENT_FAILURE fails every call at once until its backoff ends, even when the
    peer listens again (it restarted, its link came back). Waiting up to RECONNECT_WAIT_SECONDS
    (at most ``timeout``) for the next attempt lets the call reach a peer that is back; a peer
    that is still away costs that wait, and the call then fails with gRPC's reason. Any other
    state returns at once: an idle or connecting channel's call waits for its connection itself.
    """
    if channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        return 0.0
    started = time.monotonic()
    try:
        await asyncio.wait_for(channel.channel_ready(), max(0.0, min(timeout, RECONNECT_WAIT_SECONDS)))
    except asyncio.TimeoutError:
        pass
    return time.monotonic() - started


async def check_health(target: str, timeout: float, tls: TLSConfig | None = None) -> str:
    """The serving status name of the node at ``target`` (raises grpc.aio.AioRpcError if unreachable)."""
    async with open_channel(target, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def fetch_status(target: str, timeout: float, tls: TLSConfig | None = None) -> node_pb2.NodeStatus:
    async with open_channel(target, tls) as channel:
        stub = node_pb2_grpc.NodeInfoStub(channel)
        return await stub.GetStatus(node_pb2.StatusRequest(), timeout=timeout)
