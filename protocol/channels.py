"""Client-side gRPC channels and the two one-shot calls of the CLI (`status`, `healthcheck`).

Kept apart from rpc.py (the servicers) because rpc.py imports the all-reduce and with it torch:
`lowcomm-node status` and `healthcheck` (a container's health probe runs it every few seconds)
then spent ~1.8 CPU-seconds importing what they never use; from here they import grpc and the
generated messages only.
"""

from __future__ import annotations

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
]
HEALTH_SERVICE = ""  # the overall server health, as `grpc_health_probe` and our healthcheck ask


def open_channel(address: str, tls: TLSConfig | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """A channel to ``address``: over TLS trusting ``tls.cert_chain`` when given (see auth.py)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS + tls.channel_options(),
                                   interceptors=list(interceptors) or None)


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
