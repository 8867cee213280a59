"""Socket-free fakes for the protocol's seams (protocol/transport.py): a virtual-time event loop
whose clock is the protocol's clock, an executor that runs inline, an in-memory DHT on that
clock, and a network that routes JoinGroup, Reduce and ReportShards to the callee's serving
methods. Used by tests/test_matchmaking_unit.py and tests/test_allreduce_unit.py.

Under ``VirtualTimeLoop`` a test that waits 300 s of protocol time takes milliseconds, and,
with no threads and no sockets, every run schedules the same callbacks in the same order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from contextlib import suppress
from typing import AsyncIterator, Awaitable, Callable, Coroutine, TypeVar

from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import ReduceRegistry
from lowcomm.protocol.matchmaking import Matchmaker
from lowcomm.protocol.transport import CallFailed, Code, Refused

T = TypeVar("T")


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time jumps to the next timer whenever nothing is ready to run.

    Nothing here does I/O or runs threads, so "nothing ready" means every task waits for a
    timer: jumping there is exactly what waiting would have done, minus the wait."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self.clock = _LoopTime(self)  # what the tests inject as the protocol's Clock

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:  # CPython's loop step; ``_ready``/``_scheduled`` are its queues
        if not self._ready:
            due = min((h.when() for h in self._scheduled if not h.cancelled()), default=None)
            if due is not None and due > self._now:
                self._now = due
        super()._run_once()


class _LoopTime:
    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def monotonic(self) -> float:
        return self._loop.time()


def run_virtual(make: Callable[[VirtualTimeLoop], Coroutine[object, object, T]], limit: float = 3600.0) -> T:
    """Run ``make(loop)`` on a fresh virtual-time loop, bounded by ``limit`` virtual seconds."""
    loop = VirtualTimeLoop()

    async def bounded() -> T:
        async with asyncio.timeout(limit):
            return await make(loop)

    try:
        return loop.run_until_complete(bounded())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


class InlineExecutor(concurrent.futures.Executor):
    """Runs the submitted function at once on the calling thread (no threads: virtual time stays exact)."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting caller, as a thread pool does
            future.set_exception(err)
        return future


class FakeDHT:
    """``store``/``get`` with expirations on the loop's clock (the two calls matchmaking makes)."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop
        self.data: dict[str, dict[str, tuple[dict, float]]] = {}
        self.reads = 0
        self.keys_read: list[str] = []

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.data.setdefault(key, {})[subkey] = (dict(value), self.loop.time() + ttl)
        return True

    async def get(self, key: str) -> dict[str, dict]:
        self.reads += 1
        self.keys_read.append(key)
        now = self.loop.time()
        return {k: dict(v) for k, (v, expires) in self.data.get(key, {}).items() if expires > now}


def _copy(message: T) -> T:
    """A message as the callee would parse it off the wire: never the caller's object."""
    return type(message).FromString(message.SerializeToString())


class FakeNet:
    """The transport of every peer (MatchmakingTransport and ReduceTransport): a call reaches
    the serving method of the peer at ``address`` after ``latency`` seconds each way.

    ``down`` addresses refuse at once (UNAVAILABLE, a dead process); ``silent`` ones take the
    call and never answer (a hung process: the caller's timeout ends it). A Refused raised by
    the callee reaches the caller as CallFailed with its code; the caller's timeout cancels the
    callee's handler, as gRPC cancels a server call whose client went away."""

    def __init__(self, latency: float = 0.001) -> None:
        self.latency = latency
        self.matchmakers: dict[str, Matchmaker] = {}
        self.registries: dict[str, ReduceRegistry] = {}
        self.down: set[str] = set()
        self.silent: set[str] = set()
        self.calls: list[tuple[str, str]] = []  # (method, callee address), in call order
        self.joins: list[tuple[str, averaging_pb2.JoinRequest]] = []  # (callee address, request) of every JoinGroup
        # Per peer id, the bytes/s of its link (both ways): a Reduce stream's chunks then arrive
        # at the slower of the sender's and the owner's rates (one flow at a time per link: no sharing).
        self.link_bps: dict[str, float] = {}

    async def _unary(self, method: str, address: str, request, timeout: float,
                     handler: Callable[[object], Awaitable[object]] | None):
        self.calls.append((method, address))
        try:
            async with asyncio.timeout(timeout):
                await asyncio.sleep(self.latency)
                if handler is None or address in self.down:
                    raise CallFailed(Code.UNAVAILABLE, f"{address}: connection refused")
                if address in self.silent:
                    await asyncio.Event().wait()
                response = await handler(_copy(request))
                await asyncio.sleep(self.latency)
                return _copy(response)
        except Refused as err:
            raise CallFailed(err.code, err.detail) from None
        except TimeoutError:
            raise CallFailed(Code.DEADLINE_EXCEEDED, f"{method} to {address}: deadline exceeded") from None

    async def join(self, address: str, request: averaging_pb2.JoinRequest,
                   timeout: float) -> averaging_pb2.JoinResponse:
        matchmaker = self.matchmakers.get(address)
        self.joins.append((address, _copy(request)))
        return await self._unary("JoinGroup", address, request, timeout,
                                 matchmaker.handle_join if matchmaker is not None else None)

    async def report_shards(self, address: str, report: averaging_pb2.ShardReport,
                            timeout: float) -> averaging_pb2.ShardReport:
        registry = self.registries.get(address)
        return await self._unary("ReportShards", address, report, timeout,
                                 registry.handle_report if registry is not None else None)

    async def reduce(self, address: str, requests: AsyncIterator[averaging_pb2.ReduceMessage],
                     timeout: float) -> AsyncIterator[averaging_pb2.ReduceMessage]:
        """The owner serves the stream in its own task (as a server does); its messages come
        back through a queue, the caller's deadline bounding the whole call."""
        self.calls.append(("Reduce", address))
        end = asyncio.get_running_loop().time() + timeout
        await asyncio.sleep(self.latency)
        registry = self.registries.get(address)
        if registry is None or address in self.down:
            raise CallFailed(Code.UNAVAILABLE, f"{address}: connection refused")
        answers: asyncio.Queue = asyncio.Queue()
        owner = registry.peer_id

        async def paced() -> AsyncIterator[averaging_pb2.ReduceMessage]:
            sender = ""
            async for message in requests:
                if message.HasField("header"):
                    sender = message.header.sender_peer_id
                elif message.HasField("chunk") and self.link_bps:
                    rate = min(self.link_bps.get(sender, math.inf), self.link_bps.get(owner, math.inf))
                    await asyncio.sleep(len(message.chunk) / rate)
                yield message

        async def serve() -> None:
            if address in self.silent:
                await asyncio.Event().wait()
            try:
                async for message in registry.handle(paced()):
                    await answers.put(("message", _copy(message)))
                await answers.put(("end", None))
            except Refused as err:
                await answers.put(("refused", err))

        server = asyncio.create_task(serve())
        try:
            while True:
                try:
                    async with asyncio.timeout(max(0.0, end - asyncio.get_running_loop().time())):
                        kind, value = await answers.get()
                except TimeoutError:
                    raise CallFailed(Code.DEADLINE_EXCEEDED, f"Reduce to {address}: deadline exceeded") from None
                if kind == "end":
                    return
                if kind == "refused":
                    raise CallFailed(value.code, value.detail)
                yield value
        finally:
            server.cancel()  # the call is over, or its caller went away: so is the owner's handler
            with suppress(asyncio.CancelledError):
                await server
