"""grpc.aio servicers (thin adapters over the protocol objects) and client-side channel helpers."""

from __future__ import annotations

import itertools
import logging
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ._pb.lowcomm.v1 import (
    averaging_pb2,
    averaging_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    state_pb2,
    state_pb2_grpc,
)
from .allreduce import CHUNK_BYTES, ReduceRegistry
from .auth import TLSConfig
from .decode import StrictDecodeInterceptor
from .handshake import IncompatiblePeer
from .matchmaking import Matchmaker
from .slots import SlotsBusy
from .state import StateDonor, StateError

log = logging.getLogger(__name__)

# Room for one 4 MiB chunk plus the message envelope.
MAX_MESSAGE_BYTES = CHUNK_BYTES * 2 + 64 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
HEALTH_SERVICE = ""  # the overall server health, as `grpc_health_probe` and our healthcheck ask


class BindError(OSError):
    """The gRPC server could not listen on the requested address."""


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    def __init__(self, matchmaker: Matchmaker, registry: ReduceRegistry) -> None:
        self.matchmaker = matchmaker
        self.registry = registry

    async def JoinGroup(self, request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext) -> averaging_pb2.JoinResponse:
        return await self.matchmaker.handle_join(request, context)

    async def Reduce(self, request_iterator: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        # grpc.aio needs the servicer method itself to be an async generator.
        async for message in self.registry.handle(request_iterator, context):
            yield message


class StateServicer(state_pb2_grpc.StateTransferServicer):
    def __init__(self, donor: StateDonor) -> None:
        self.donor = donor

    async def _check(self, hello, context: grpc.aio.ServicerContext) -> None:
        try:
            self.donor.identity.check(hello)
        except IncompatiblePeer as err:
            log.warning("refused a state request from %s: %s", hello.peer_id or "?", err)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))

    async def GetStateInfo(self, request: state_pb2.StateInfoRequest, context: grpc.aio.ServicerContext) -> state_pb2.StateInfo:
        await self._check(request.hello, context)
        return self.donor.info()

    async def DownloadState(self, request: state_pb2.StateRequest,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[state_pb2.StateChunk]:
        await self._check(request.hello, context)
        try:
            chunks = self.donor.chunks(request.step, request.offset, request.length)
            first = next(chunks, None)  # range errors surface here, before a slot is taken
        except StateError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        try:
            # Donors serve a bounded number of ranges at once, each for a bounded time (slots.py).
            async with self.donor.slots.lease() as lease:
                for chunk in itertools.chain([first] if first is not None else [], chunks):
                    if lease.expired():
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"range not read within {self.donor.slots.lease_seconds:.0f}s; "
                                            f"the slot went to another downloader")
                    yield chunk
        except SlotsBusy as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"donor busy: {err}")


class NodeInfoServicer(node_pb2_grpc.NodeInfoServicer):
    def __init__(self, status: Callable[[], Awaitable[node_pb2.NodeStatus]]) -> None:
        self.status = status

    async def GetStatus(self, request: node_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStatus:
        return await self.status()


def open_channel(address: str, tls: TLSConfig | None = None,
                 interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """A channel to ``address``: over TLS trusting ``tls.cert_chain`` when given (see auth.py)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS + tls.channel_options(),
                                   interceptors=list(interceptors) or None)


class ChannelPool:
    """One reusable channel per peer address; closed together at shutdown.

    ``interceptors`` go on every channel (a secret run's token interceptors, auth.client_interceptors);
    with ``tls`` the channels use TLS.
    """

    def __init__(self, interceptors: Sequence[grpc.aio.ClientInterceptor] = (), tls: TLSConfig | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._interceptors = list(interceptors)
        self._tls = tls

    def __call__(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self._tls, self._interceptors)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


def create_server(
    host: str,
    port: int,
    averaging: AveragingServicer | None,
    state: StateServicer | None,
    node_info: NodeInfoServicer,
    health_servicer: health.aio.HealthServicer,
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
    extra_services: list[Callable[[grpc.aio.Server], None]] = (),
    tls: TLSConfig | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A server with our services; raises BindError when ``host:port`` cannot be bound.

    A secret run passes an ``auth.ServerAuthInterceptor`` in ``interceptors`` (after any that
    should see its refusals, e.g. a counter of status codes); ``tls`` serves TLS only.
    """
    # Interceptors run outermost first. Request bytes are parsed by StrictDecodeInterceptor, placed
    # before the first interceptor that reads messages (``reads_messages``, e.g. auth's sender
    # check) and after those that only observe calls (e.g. the status-code counter, which then
    # counts refused garbage too).
    chain = list(interceptors or [])
    readers = [i for i, interceptor in enumerate(chain) if getattr(interceptor, "reads_messages", False)]
    chain.insert(readers[0] if readers else len(chain), StrictDecodeInterceptor())
    server = grpc.aio.server(
        interceptors=chain,
        options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)],  # a second node on the same port must fail
    )
    if averaging is not None:
        averaging_pb2_grpc.add_AveragingServicer_to_server(averaging, server)
    if state is not None:
        state_pb2_grpc.add_StateTransferServicer_to_server(state, server)
    node_pb2_grpc.add_NodeInfoServicer_to_server(node_info, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add_service in extra_services:  # e.g. gossip mode's own service
        add_service(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(
            address, tls.server_credentials())
    except RuntimeError as err:
        raise BindError(f"cannot listen on {address}: {err}") from None
    if bound == 0:
        raise BindError(f"cannot listen on {address}")
    return server, bound


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
