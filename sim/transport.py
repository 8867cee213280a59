"""Simulated links behind the protocol's transport seam (protocol/transport.py).

``SimNet.join`` is the ``MatchmakingTransport`` the simulated peers' real ``Matchmaker`` uses.
A call

- copies the request (real protobuf bytes, so the callee never shares the caller's object),
  travels the two access latencies and finds the callee: a dead or unknown peer fails the call
  with ``UNAVAILABLE`` (connection refused);
- runs the callee's serving method (``Matchmaker.handle_join``); its ``Refused(code, detail)``
  reaches the caller as ``CallFailed(code, detail)``, after the way back;
- fails with ``DEADLINE_EXCEEDED`` when the caller's timeout passes first (the serving side is
  then cancelled, as gRPC cancels a call whose client went away), and with ``UNAVAILABLE`` when
  the callee crashes meanwhile (its in-flight calls are cancelled).

Every call is counted for the receiving peer (``on_rpc``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.transport import CallFailed, Code, Refused

from .links import Link, one_way

JOIN = "JoinGroup"


@dataclass
class Server:
    """A simulated peer's serving side: its methods and the calls it is serving."""

    peer_id: str
    link: Link
    handlers: dict[str, Callable[[object], Awaitable[object]]] = field(default_factory=dict)
    inflight: set[asyncio.Task] = field(default_factory=set)
    alive: bool = True

    def crash(self) -> None:
        self.alive = False
        for task in list(self.inflight):
            task.cancel()


class SimNet:
    """Who is reachable at which address, and a caller's view of the network."""

    def __init__(self, on_rpc: Callable[[str, str, object], None]) -> None:
        self.servers: dict[str, Server] = {}
        self.on_rpc = on_rpc

    @staticmethod
    def address_of(peer_id: str) -> str:
        return f"sim://{peer_id}"

    def serve(self, server: Server) -> str:
        address = self.address_of(server.peer_id)
        self.servers[address] = server
        return address

    def transport(self, caller: Link) -> "PeerTransport":
        return PeerTransport(self, caller)

    async def call(self, caller: Link, address: str, method: str, request, timeout: float):
        try:
            async with asyncio.timeout(timeout):
                return await self._deliver(caller, address, method, request)
        except TimeoutError:
            raise CallFailed(Code.DEADLINE_EXCEEDED, "no answer in time") from None

    async def _deliver(self, caller: Link, address: str, method: str, request):
        server = self.servers.get(address)
        await asyncio.sleep(one_way(caller, server.link) if server is not None else 2 * caller.latency)
        if server is None or not server.alive:
            raise CallFailed(Code.UNAVAILABLE, "connection refused")
        handler = server.handlers.get(method)
        if handler is None:
            raise CallFailed(Code.UNKNOWN, f"method {method} not served")
        copy = type(request).FromString(request.SerializeToString())
        self.on_rpc(server.peer_id, method, copy)
        task = asyncio.get_running_loop().create_task(handler(copy))
        server.inflight.add(task)
        try:
            await asyncio.wait([task])
        finally:
            if not task.done():  # the caller's deadline passed: the serving side is cancelled too
                task.cancel()
            server.inflight.discard(task)
        if task.cancelled():
            raise CallFailed(Code.UNAVAILABLE, "the peer went away during the call")
        error = task.exception()
        await asyncio.sleep(one_way(server.link, caller))
        if isinstance(error, Refused):
            raise CallFailed(error.code, error.detail)
        if error is not None:
            raise CallFailed(Code.UNKNOWN, f"unexpected error while serving: {error!r}")
        response = task.result()
        return type(response).FromString(response.SerializeToString())


class PeerTransport:
    """One peer's ``MatchmakingTransport``."""

    def __init__(self, net: SimNet, caller: Link) -> None:
        self.net = net
        self.caller = caller

    async def join(self, address: str, request: averaging_pb2.JoinRequest,
                   timeout: float) -> averaging_pb2.JoinResponse:
        return await self.net.call(self.caller, address, JOIN, request, timeout)
