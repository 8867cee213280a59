"""gRPC adapters of the protocol's transport interfaces (transport.py): the client side of the
JoinGroup, Reduce and ReportShards calls over grpc.aio channels, and the mapping between
``Refused``/``CallFailed`` and gRPC status codes that the servicers in rpc.py use."""

from __future__ import annotations

from typing import AsyncIterator, Callable

import grpc

from . import wire
from .channels import wait_for_reconnect
from ._pb.lowcomm.v1 import averaging_pb2, averaging_pb2_grpc
from .transport import CallFailed, Code, Refused

ChannelFor = Callable[[str], grpc.aio.Channel]
REDUCE_METHOD = "/lowcomm.v1.Averaging/Reduce"


def to_status(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def from_status(status: grpc.StatusCode) -> Code:
    return Code.__members__.get(status.name, Code.UNKNOWN)


def call_failed(err: grpc.aio.AioRpcError) -> CallFailed:
    return CallFailed(from_status(err.code()), err.details() or "")


async def abort(context: grpc.aio.ServicerContext, refused: Refused) -> None:
    """End the call being served with the refusal's status (raises, as context.abort does)."""
    await context.abort(to_status(refused.code), refused.detail)


class GrpcMatchmakingTransport:
    """JoinGroup over the channels of ``channel_for`` (read at every call: callers may swap it)."""

    def __init__(self, channel_for: Callable[[], ChannelFor]) -> None:
        self._channel_for = channel_for

    async def join(self, address: str, request: averaging_pb2.JoinRequest,
                   timeout: float) -> averaging_pb2.JoinResponse:
        # No wait for a reconnect: matchmaking moves on from a leader it cannot reach (it may be
        # dead, and its record stays in the DHT until it expires), and the channel retries within a
        # second for the next round (channels.py).
        stub = averaging_pb2_grpc.AveragingStub(self._channel_for()(address))
        try:
            return await stub.JoinGroup(request, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise call_failed(err) from None


class GrpcReduceTransport:
    """The Reduce stream and ReportShards over the channels of ``channel_for``."""

    def __init__(self, channel_for: ChannelFor) -> None:
        self._channel_for = channel_for

    async def reduce(self, address: str, requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        # Not the generated stub: chunks go out and come in as views, without protobuf's copies (wire.py).
        # The owner was alive when the group formed: a channel backing off now most likely lost a
        # peer that restarted or a link that dropped for a moment, so it gets one more attempt.
        channel = self._channel_for(address)
        timeout -= await wait_for_reconnect(channel, timeout)
        reduce = channel.stream_stream(REDUCE_METHOD, request_serializer=wire.serialize, response_deserializer=wire.parse)
        call = reduce(requests, timeout=max(timeout, 0.001))
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as err:
            raise call_failed(err) from None
        finally:
            if not call.done():  # the caller stopped reading (a broken answer): end the stream now
                call.cancel()

    async def report_shards(self, address: str, report: averaging_pb2.ShardReport,
                            timeout: float) -> averaging_pb2.ShardReport:
        # No wait for a reconnect here: a member of this round whose channel is backing off failed
        # in this round already (it is dead, or its link is), and the exchange must not wait for it.
        try:
            return await averaging_pb2_grpc.AveragingStub(self._channel_for(address)).ReportShards(
                report, timeout=timeout)
        except grpc.aio.AioRpcError as err:
            raise call_failed(err) from None
