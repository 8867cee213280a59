"""Can other peers reach this node's gRPC server? Asked of a peer, which dials back.

A node behind a firewall, or behind NAT without a forwarded port, or announcing an address that
is not its own, can dial every peer while no peer can dial it. Its rounds then stall for their
deadline and its peers leave its shards out, but every error lands in the *other* peers' logs. So
a node asks a peer to dial it back (``NodeInfo/DialBack``): the peer connects to the announced
address and calls its health check, the way a round's members would connect to it.

The peer dials only an address whose host is the host the call came from (an IP address, or a
name that resolves to it), and one at a time: a caller can make it probe itself, never a third
machine (no port scanner for hire). Behind NAT a node announces its public address and calls from
it, so the check still runs there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import grpc

from ._pb.lowcomm.v1 import node_pb2, node_pb2_grpc
from .auth import TLSConfig
from .channels import check_health

DIAL_TIMEOUT_SECONDS = 5.0  # a connection, a TLS handshake where used, and one health check over a WAN


def host_of_peer(peer: str) -> str:
    """The host of a grpc ``context.peer()`` string: "ipv4:10.0.0.2:5000" -> "10.0.0.2",
    "ipv6:[::1]:5000" -> "::1" (percent-encoded zones decoded); "" for other transports."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]").replace("%25", "%")
    return ""


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


async def resolves_to(host: str, observed: str) -> bool:
    """Whether ``host`` (an IP address or a name) is, or resolves to, the address ``observed``."""
    try:
        want = ipaddress.ip_address(observed)
    except ValueError:
        return False
    try:
        return ipaddress.ip_address(host) == want
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(ipaddress.ip_address(info[4][0].split("%")[0]) == want for info in infos)


class DialBackBusy(Exception):
    """This node is dialling another caller back (answered RESOURCE_EXHAUSTED)."""


class DialBacker:
    """The server's half: dial the caller back, one caller at a time."""

    def __init__(self, tls: TLSConfig | None = None, timeout: float = DIAL_TIMEOUT_SECONDS) -> None:
        self.tls = tls
        self.timeout = timeout
        self._busy = asyncio.Lock()

    async def dial_back(self, address: str, peer: str) -> node_pb2.DialBackReply:
        observed = host_of_peer(peer)
        reply = node_pb2.DialBackReply(observed_host=observed)
        try:
            host, _ = split_address(address)
        except ValueError as err:
            reply.error = str(err)
            return reply
        if not await resolves_to(host, observed):
            reply.error = f"the address's host {host} is not {observed}, the host the call came from"
            return reply
        if self._busy.locked():
            raise DialBackBusy("another dial-back is under way here; ask another peer or again later")
        async with self._busy:
            reply.checked = True
            try:
                await check_health(address, self.timeout, self.tls)
            except grpc.aio.AioRpcError as err:
                reply.error = (f"no answer within {self.timeout:.0f} s (a firewall that drops connections?)"
                               if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED else
                               f"{err.code().name}: {err.details()}")
            else:
                reply.reachable = True
        return reply


async def ask_dial_back(channel: grpc.aio.Channel, address: str, timeout: float) -> node_pb2.DialBackReply:
    """Ask the peer at the other end of ``channel`` to dial ``address`` (ours) back; raises
    grpc.aio.AioRpcError where the call itself fails (UNIMPLEMENTED: a peer of an older version)."""
    stub = node_pb2_grpc.NodeInfoStub(channel)
    return await stub.DialBack(node_pb2.DialBackRequest(address=address), timeout=timeout)
