"""A plain bind of a server's address before the server binds it, to name a busy or foreign address.

gRPC's core and p2pd each report a failed bind in their own words (a C++ log line on stderr, a Go
log line in an exception); a plain socket bound the way they bind gives the system's reason first.
Kept apart from rpc.py so that the CLI can use it without importing gRPC before hivemind forks.
"""

from __future__ import annotations

import socket


def bind_probe_error(host: str, port: int) -> OSError | None:
    """The error a plain bind of ``host:port`` gives, as our servers bind (address reuse, no port
    sharing), or None: a busy or foreign address is then named with the system's reason before a
    server's own library logs its own line about it."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        return OSError(err.errno, err.strerror)
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            probe.bind(sockaddr)
        except OSError as err:
            return err
    return None
