"""A peer that restarts on its ports is reached again at once (protocol/channels.py
wait_for_reconnect, used by the Reduce call in protocol/grpc_transport.py, and the channels'
reconnect backoff capped at a second).

The walkthrough's defect: peer B was killed and restarted on the same ports. A's channel to B
sat in gRPC's reconnect backoff (grown to tens of seconds while B was away), so A's Reduce call to
the restarted B failed at once with "Connection refused" though B listened: A gave up B's shard
and B waited its reduce timeout for A. These tests restart a real gRPC server on its port and call
it through the same channel straight away.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import grpc
import pytest

from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.channels import open_channel
from lowcomm.protocol.grpc_transport import REDUCE_METHOD, GrpcReduceTransport
from lowcomm.protocol.transport import CallFailed, Code


async def _report(request: averaging_pb2.ShardReport, context: grpc.aio.ServicerContext) -> averaging_pb2.ShardReport:
    return averaging_pb2.ShardReport(group_id=request.group_id)


async def _reduce(requests: AsyncIterator[averaging_pb2.ReduceMessage],
                  context: grpc.aio.ServicerContext) -> AsyncIterator[averaging_pb2.ReduceMessage]:
    async for _ in requests:
        pass
    yield averaging_pb2.ReduceMessage(chunk=b"averaged")


async def start_server(port: int = 0) -> tuple[grpc.aio.Server, int]:
    """A server with the Reduce and ReportShards calls of the Averaging service, on ``port`` (0: any)."""
    handlers = {
        "ReportShards": grpc.unary_unary_rpc_method_handler(
            _report, request_deserializer=averaging_pb2.ShardReport.FromString,
            response_serializer=averaging_pb2.ShardReport.SerializeToString),
        "Reduce": grpc.stream_stream_rpc_method_handler(
            _reduce, request_deserializer=averaging_pb2.ReduceMessage.FromString,
            response_serializer=averaging_pb2.ReduceMessage.SerializeToString),
    }
    assert REDUCE_METHOD == "/lowcomm.v1.Averaging/Reduce"
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("lowcomm.v1.Averaging", handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    assert bound, f"port {port} could not be bound again"
    await server.start()
    return server, bound


async def until_backing_off(channel: grpc.aio.Channel) -> None:
    """Return once the channel's connection attempt failed (it then waits out its backoff)."""
    while (state := channel.get_state(try_to_connect=True)) is not grpc.ChannelConnectivity.TRANSIENT_FAILURE:
        await channel.wait_for_state_change(state)


async def one_reduce(transport: GrpcReduceTransport, address: str) -> list[averaging_pb2.ReduceMessage]:
    async def requests() -> AsyncIterator[averaging_pb2.ReduceMessage]:
        yield averaging_pb2.ReduceMessage(chunk=b"mine")

    return [message async for message in transport.reduce(address, requests(), timeout=20.0)]


def run(coro):
    async def bounded():
        async with asyncio.timeout(60):
            return await coro
    return asyncio.run(bounded())


def test_a_peer_restarted_on_its_port_is_reached_by_the_next_reduce() -> None:
    async def scenario() -> None:
        server, port = await start_server()
        address = f"127.0.0.1:{port}"
        channel = open_channel(address)
        reduce = GrpcReduceTransport(lambda _: channel)

        async def the_call() -> bytes:
            return (await one_reduce(reduce, address))[0].chunk

        expected = b"averaged"
        try:
            assert await the_call() == expected
            await server.stop(None)  # the peer is killed ...
            with pytest.raises(CallFailed) as failed:
                await the_call()
            assert failed.value.code is Code.UNAVAILABLE
            await until_backing_off(channel)
            server, _ = await start_server(port)  # ... and restarted on the same port
            assert await the_call() == expected  # without the wait: UNAVAILABLE, Connection refused
        finally:
            await channel.close()
            await server.stop(None)

    run(scenario())


def test_a_peer_still_away_fails_the_call_with_grpcs_reason() -> None:
    async def scenario() -> None:
        server, port = await start_server()
        await server.stop(None)
        channel = open_channel(f"127.0.0.1:{port}")
        try:
            with pytest.raises(CallFailed):  # first attempt: refused, no wait (the channel was new)
                await GrpcReduceTransport(lambda _: channel).report_shards(
                    f"127.0.0.1:{port}", averaging_pb2.ShardReport(), timeout=20.0)
            await until_backing_off(channel)
            with pytest.raises(CallFailed) as failed:  # backing off: one more attempt, then gRPC's reason
                await one_reduce(GrpcReduceTransport(lambda _: channel), f"127.0.0.1:{port}")
            assert failed.value.code is Code.UNAVAILABLE
            assert "connect" in failed.value.detail.lower()
        finally:
            await channel.close()

    run(scenario())
