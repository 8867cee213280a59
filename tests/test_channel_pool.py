"""protocol/rpc.py ChannelPool: bounded (LRU) under churn, evicted channels closed safely."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from lowcomm.protocol.rpc import ChannelPool


class Grace:
    """The pool's clock: every grace period ends when the test says so."""

    def __init__(self) -> None:
        self.over = asyncio.Event()
        self.waiting = 0

    async def sleep(self, seconds: float) -> None:
        self.waiting += 1
        try:
            await self.over.wait()
        finally:
            self.waiting -= 1


def closed(channel: grpc.aio.Channel) -> bool:
    return channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN


async def settle() -> None:
    """Let the pool's close tasks run (a closed channel's close returns at once)."""
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro):
    async def bounded():
        async with asyncio.timeout(20):
            return await coro
    return asyncio.run(bounded())


def test_churn_keeps_the_pool_bounded_evicting_the_least_recently_used() -> None:
    async def scenario() -> None:
        grace = Grace()
        pool = ChannelPool(capacity=3, evicted_grace=0.0, sleep=grace.sleep)
        first = pool("127.0.0.1:1")
        opened = [first] + [pool(f"127.0.0.1:{port}") for port in range(2, 4)]
        assert pool("127.0.0.1:1") is first  # used again: now the most recent
        for port in range(4, 54):  # fifty peers come and go
            opened.append(pool(f"127.0.0.1:{port}"))
            assert len(pool) == 3
        assert pool("127.0.0.1:53") is opened[-1]
        await settle()
        assert grace.waiting == 3  # evicted channels wait their grace, at most `capacity` of them
        assert not any(closed(c) for c in opened[-3:])
        assert all(closed(c) for c in opened[:-6])  # older evictions were closed without waiting
        grace.over.set()
        await settle()
        assert all(closed(c) for c in opened[:-3]) and not any(closed(c) for c in opened[-3:])
        await pool.close()
        assert all(closed(c) for c in opened)

    run(scenario())


def test_an_evicted_channel_serves_its_calls_until_the_grace_ends_and_can_be_taken_back() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            grace = Grace()
            pool = ChannelPool(capacity=1, evicted_grace=5.0, sleep=grace.sleep)
            live = pool(f"127.0.0.1:{port}")
            stub = health_pb2_grpc.HealthStub(live)  # a caller holding a stub across calls
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            pool("127.0.0.1:1")  # evicts the server's channel
            assert len(pool) == 1 and not closed(live)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)  # still works in its grace period
            assert pool(f"127.0.0.1:{port}") is live  # taken back: its close is called off
            grace.over.set()
            await settle()
            assert not closed(live)
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            other = pool("127.0.0.1:2")
            await settle()
            assert not closed(other)
            await pool.close()
            assert closed(live) and closed(other)
        finally:
            await server.stop(grace=None)

    run(scenario())
