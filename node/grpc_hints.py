"""Why `lowcomm-node status` or `healthcheck` got no answer, in words a user can act on.

gRPC's details are all a user got: "Socket closed" from a TLS node called in plaintext, an
OpenSSL code for a TLS mismatch, an HTTP/2 parse error from a port that is not gRPC. Light on
purpose: these commands run every few seconds as a container's health probe, so nothing here
imports torch or hivemind, and grpc only once the environment below is set.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the commands run, after quiet_grpc
    import grpc

    from lowcomm.protocol.auth import TLSConfig

# gRPC's C core logs a failed TLS handshake itself ("I1207 ... ssl_transport_security.cc:2563]
# Handshake failed with error SSL_ERROR_SSL: ...") above the one error line these commands print,
# which already says what failed. The core reads the variable once, when grpc is first imported:
# the commands set it before their import. A GRPC_VERBOSITY of the user's (debugging) is kept.
QUIET_GRPC = {"GRPC_VERBOSITY": "NONE"}


def quiet_grpc() -> None:
    for name, value in QUIET_GRPC.items():
        os.environ.setdefault(name, value)


_NOT_GRPC = ("{target} is not a gRPC port: the node's gRPC port is its --grpc-port (default 7701), not its "
             "--metrics-port or --dht-port")


def unreachable_hint(err: "grpc.aio.AioRpcError", target: str, tls: "TLSConfig | None",
                     timeout: float) -> str | None:
    """The likely mistake behind a call to ``target`` that failed with ``err``, or None. gRPC's
    details are all a user got: "Socket closed" from a TLS node called in plaintext, an OpenSSL
    code for a TLS mismatch, an HTTP/2 parse error from a port that is not gRPC."""
    details = err.details() or ""
    if "Failed parsing HTTP/2" in details:
        return _NOT_GRPC.format(target=target)
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return "the node's certificate is not the one (or not signed by the CA) given in --tls-cert"
    if "WRONG_VERSION_NUMBER" in details:
        # No TLS there: a plaintext node, or no gRPC server at all (the metrics or DHT port). One
        # plaintext call tells which; the server just answered, so it answers again at once.
        return _NOT_GRPC.format(target=target) if _not_grpc(target, min(timeout, 2.0)) else (
            "the node serves plaintext gRPC: drop --tls-cert")
    if err.code().name == "UNIMPLEMENTED":  # "Method not found!": the server answered, but it is no node
        return (f"the gRPC server at {target} is not a lowcomm node (it does not serve the node's methods): give "
                f"the node's --grpc-port (default 7701)")
    if tls is None and "Socket closed" in details:  # a TLS server hangs up on a plaintext HTTP/2 preface
        return "the node may serve TLS: pass --tls-cert with the run's certificate (or set LOWCOMM_TLS_CERT)"
    if "Connection refused" in details:  # a node on one address (--host) or another port listens elsewhere
        return ("is the node running? One started with --host ADDRESS or --grpc-port P listens there: give "
                "--target ADDRESS:P")
    return None


def _not_grpc(target: str, timeout: float) -> bool:
    """Whether a plaintext call to ``target`` fails because no gRPC server is there."""
    import grpc

    from lowcomm.protocol.channels import check_health

    try:
        asyncio.run(check_health(target, timeout))
    except grpc.aio.AioRpcError as err:
        return "Failed parsing HTTP/2" in (err.details() or "")
    return False
