"""grpc.aio servicers (thin adapters over the protocol objects) and client-side channel helpers."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from typing import AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from . import wire
from ._pb.lowcomm.v1 import (
    averaging_pb2,
    averaging_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    state_pb2,
    state_pb2_grpc,
)
from .allreduce import ReduceRegistry
from .auth import TLSConfig
from .bindprobe import bind_probe_error
# Re-exported: the daemon and tests import them from here.
from .channels import (  # noqa: F401
    CHANNEL_OPTIONS, HEALTH_SERVICE, MAX_MESSAGE_BYTES, check_health, fetch_status, open_channel,
)
from .decode import StrictDecodeInterceptor
from .grpc_transport import abort
from .handshake import IncompatiblePeer
from .matchmaking import Matchmaker
from .missed_rounds import MissedRoundsError, RoundLog
from .reachability import DialBackBusy, DialBacker
from .slots import SlotsBusy
from .state import StateDonor, StateError
from .transport import Refused

log = logging.getLogger(__name__)



class BindError(OSError):
    """The gRPC server could not listen on the requested address (``errno`` says why, where known)."""


class AveragingServicer(averaging_pb2_grpc.AveragingServicer):
    """The Averaging service over the protocol's serving methods: a ``Refused`` they raise
    ends the call with its code and detail (``context.abort``)."""

    def __init__(self, matchmaker: Matchmaker, registry: ReduceRegistry) -> None:
        self.matchmaker = matchmaker
        self.registry = registry

    async def JoinGroup(self, request: averaging_pb2.JoinRequest, context: grpc.aio.ServicerContext) -> averaging_pb2.JoinResponse:
        try:
            return await self.matchmaker.handle_join(request, context)
        except Refused as refused:
            await abort(context, refused)

    async def Reduce(self, request_iterator: AsyncIterator[averaging_pb2.ReduceMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        # grpc.aio needs the servicer method itself to be an async generator.
        try:
            async for message in self.registry.handle(request_iterator, context):
                yield message
        except Refused as refused:
            await abort(context, refused)

    async def ReportShards(self, request: averaging_pb2.ShardReport,
                           context: grpc.aio.ServicerContext) -> averaging_pb2.ShardReport:
        try:
            return await self.registry.handle_report(request, context)
        except Refused as refused:
            await abort(context, refused)


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
                    if lease.expired() and self.donor.slots.crowded():
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            f"range not read within {self.donor.slots.lease_seconds:.0f}s; "
                                            f"the slot went to another downloader")
                    yield chunk
        except SlotsBusy as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"donor busy: {err}")


    async def GetMissedRounds(self, request: state_pb2.MissedRoundsRequest,
                              context: grpc.aio.ServicerContext) -> AsyncIterator[state_pb2.MissedRoundsMessage]:
        await self._check(request.hello, context)
        try:
            records = self.donor.rounds.chain(request.from_step, request.params_sha256, request.to_step)
        except MissedRoundsError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        try:  # a few MB at most (the encoded model per round): the same slots as state ranges
            async with self.donor.slots.lease():
                for message in RoundLog.messages(records):
                    yield message
        except SlotsBusy as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"donor busy: {err}")


class NodeInfoServicer(node_pb2_grpc.NodeInfoServicer):
    def __init__(self, status: Callable[[], Awaitable[node_pb2.NodeStatus]],
                 dial_backer: DialBacker | None = None) -> None:
        """``dial_backer``: None dials back without TLS (a run that uses TLS passes its own)."""
        self.status = status
        self.dial_backer = dial_backer or DialBacker()

    async def GetStatus(self, request: node_pb2.StatusRequest, context: grpc.aio.ServicerContext) -> node_pb2.NodeStatus:
        return await self.status()

    async def DialBack(self, request: node_pb2.DialBackRequest,
                       context: grpc.aio.ServicerContext) -> node_pb2.DialBackReply:
        try:
            return await self.dial_backer.dial_back(request.address, context.peer())
        except DialBackBusy as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))


def add_averaging_service(servicer: AveragingServicer, server: grpc.aio.Server) -> None:
    """The Averaging service as the generated ``add_AveragingServicer_to_server`` registers it,
    except that Reduce streams parse and frame their chunks without protobuf's copies (wire.py;
    the bytes on the wire are the same)."""
    messages = averaging_pb2
    handlers = {
        "JoinGroup": grpc.unary_unary_rpc_method_handler(
            servicer.JoinGroup, request_deserializer=messages.JoinRequest.FromString,
            response_serializer=messages.JoinResponse.SerializeToString),
        "Reduce": grpc.stream_stream_rpc_method_handler(
            servicer.Reduce, request_deserializer=wire.parse, response_serializer=wire.serialize),
        "ReportShards": grpc.unary_unary_rpc_method_handler(
            servicer.ReportShards, request_deserializer=messages.ShardReport.FromString,
            response_serializer=messages.ShardReport.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("lowcomm.v1.Averaging", handlers),))
    server.add_registered_method_handlers("lowcomm.v1.Averaging", handlers)


class ChannelPool:
    """Reusable channels to peer addresses, at most ``capacity`` of them, closed together at shutdown.

    A node meets new peers all the time (churn, joiners, gossip partners), and every channel
    holds a connection, its buffers and a share of gRPC's threads: beyond ``capacity`` the least
    recently used channel is evicted. Eviction must not break a call that still uses it (a
    caller may hold the channel, or a stub on it, across several calls), so an evicted channel
    stays usable for ``evicted_grace`` seconds, then is closed with as much grace again for the
    calls still running; asking for its address meanwhile takes it back. At most ``capacity``
    evicted channels wait to close: beyond that the oldest is closed at once (with its grace for
    calls in flight), so at most 2 x ``capacity`` channels take new calls.

    ``interceptors`` go on every channel (a secret run's token interceptors, auth.client_interceptors);
    with ``tls`` the channels use TLS. ``sleep`` is the clock of the grace period (tests inject one).
    """

    def __init__(self, interceptors: Sequence[grpc.aio.ClientInterceptor] = (), tls: TLSConfig | None = None,
                 capacity: int = 64, evicted_grace: float = 30.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if capacity < 1:
            raise ValueError("a channel pool needs room for at least one channel")
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()  # least recently used first
        self._evicted: OrderedDict[str, tuple[grpc.aio.Channel, asyncio.Task[None]]] = OrderedDict()
        self._closing: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # evicted channels being closed
        self._interceptors = list(interceptors)
        self._tls = tls
        self.capacity = capacity
        self.evicted_grace = evicted_grace
        self._sleep = sleep

    def __len__(self) -> int:
        """Channels in use (not counting evicted ones waiting to close)."""
        return len(self._channels)

    def __call__(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        evicted = self._evicted.pop(address, None)
        if evicted is not None:  # still in its grace period: used again, so not closed after all
            channel, waiting = evicted
            waiting.cancel()
        else:
            channel = open_channel(address, self._tls, self._interceptors)
        self._channels[address] = channel
        while len(self._channels) > self.capacity:
            self._evict(*self._channels.popitem(last=False))
        return channel

    def _evict(self, address: str, channel: grpc.aio.Channel) -> None:
        loop = asyncio.get_running_loop()  # grpc.aio channels live on the running loop
        self._evicted[address] = (channel, loop.create_task(self._close_after_grace(address, channel),
                                                            name=f"close-channel-{address}"))
        while len(self._evicted) > self.capacity:
            old_address, (old, waiting) = next(iter(self._evicted.items()))
            del self._evicted[old_address]
            waiting.cancel()
            self._close_soon(old)

    async def _close_after_grace(self, address: str, channel: grpc.aio.Channel) -> None:
        await self._sleep(self.evicted_grace)
        if self._evicted.get(address, (None,))[0] is channel:  # nothing awaited since the sleep
            del self._evicted[address]
            self._close_soon(channel)

    def _close_soon(self, channel: grpc.aio.Channel) -> None:
        """Close ``channel``, giving the calls still on it ``evicted_grace`` seconds to finish."""
        task = asyncio.get_running_loop().create_task(channel.close(grace=self.evicted_grace), name="close-channel")
        self._closing[task] = channel
        task.add_done_callback(lambda done: self._closing.pop(done, None))

    async def close(self) -> None:
        """Close every channel now, evicted ones too (shutdown: calls in flight are cancelled)."""
        channels = [*self._channels.values(), *(channel for channel, _ in self._evicted.values()),
                    *self._closing.values()]
        waiting = [task for _, task in self._evicted.values()] + list(self._closing)
        self._channels, self._evicted = OrderedDict(), OrderedDict()
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
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
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    refused = bind_probe_error(host, port) if port else None  # port 0: any free one
    if refused is not None:  # gRPC's core would log its own error line on stderr first
        error = BindError(f"cannot listen on {address} ({refused.strerror})")
        error.errno = refused.errno
        raise error
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
        add_averaging_service(averaging, server)
    if state is not None:
        state_pb2_grpc.add_StateTransferServicer_to_server(state, server)
    node_pb2_grpc.add_NodeInfoServicer_to_server(node_info, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add_service in extra_services:  # e.g. gossip mode's own service
        add_service(server)
    try:
        bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(
            address, tls.server_credentials())
    except RuntimeError as err:
        raise BindError(f"cannot listen on {address}: {err}") from None
    if bound == 0:
        raise BindError(f"cannot listen on {address}")
    return server, bound
