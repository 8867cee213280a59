"""Which of this machine's addresses a node tells other peers, when it listens on all of them.

With ``--host 0.0.0.0`` (the default) the DHT lists every address of every interface, and peers
must be told one for the node's gRPC server and one for the join line. The first that is not
loopback is often the wrong one: a Docker bridge (172.17.0.1) or a VPN sorts before a LAN's
192.168.x, and peers that dial it never arrive, so the node's rounds stall without a word in
its own log. The address that works is the one the kernel sends from towards the peers: towards
the first ``--peers`` host, else along the default route (as a browser's or an SSH client's
packets would leave). ``--announce-host`` overrides all of this.

A route is looked up with a UDP socket's ``connect``, which sends no packet.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable

# Any global unicast address takes the default route; this one (TEST-NET-1, RFC 5737) is never
# given a route of its own, and nothing is sent to it.
DEFAULT_ROUTE_PROBE = "192.0.2.1"

RouteLookup = Callable[[str], "str | None"]


def source_address_towards(destination: str) -> str | None:
    """The local IPv4 address the kernel would send from to reach ``destination``, or None
    where there is no route (or ``destination`` is not an IPv4 address)."""
    try:
        ipaddress.IPv4Address(destination)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((destination, 9))  # UDP: sets the route, sends nothing
            return probe.getsockname()[0]
        except OSError:  # ENETUNREACH: no route (a machine with no default route)
            return None


def ipv4_hosts(multiaddrs: list[str]) -> list[str]:
    """The IPv4 hosts of ``/ip4/<host>/...`` multiaddrs, in order, each once."""
    hosts = [parts[2] for parts in (m.split("/") for m in multiaddrs) if len(parts) > 2 and parts[1] == "ip4"]
    return list(dict.fromkeys(hosts))


@dataclass(frozen=True)
class Choice:
    host: str
    why: str  # for the log line: how it was chosen
    ambiguous: bool  # several addresses and no route chose among them: worth a warning
    others: tuple[str, ...] = ()  # the other addresses not on loopback, passed over


def choose_announce_host(local_multiaddrs: list[str], peer_multiaddrs: list[str],
                         route: RouteLookup = source_address_towards) -> Choice:
    """The address to tell peers, of those in ``local_multiaddrs`` (the DHT's, on every
    interface): the only one not on loopback; else the one routed towards the first reachable
    host of ``peer_multiaddrs``, else the one on the default route; else the first."""
    candidates = [h for h in ipv4_hosts(local_multiaddrs) if not h.startswith("127.")]
    if not candidates:
        return Choice("127.0.0.1", "no address but loopback", ambiguous=False)
    if len(candidates) == 1:
        return Choice(candidates[0], "the only address not on loopback", ambiguous=False)
    def chosen(host: str, why: str, ambiguous: bool = False) -> Choice:
        return Choice(host, why, ambiguous, tuple(h for h in candidates if h != host))

    for peer in ipv4_hosts(peer_multiaddrs):
        source = route(peer)
        if source in candidates:
            return chosen(source, f"the address routed towards the peer at {peer}")
    source = route(DEFAULT_ROUTE_PROBE)
    if source in candidates:
        return chosen(source, "the address on the default route")
    return chosen(candidates[0], "the first, since no route chose one", ambiguous=True)
