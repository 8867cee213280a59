"""`lowcomm-node status` and `healthcheck` against the wrong kind of server: one error line that
names the likely mistake (TLS or not, the wrong certificate, a port that is not gRPC), and no
raw gRPC log line above it.

The servers run in this process (a health service, plaintext or TLS, and an HTTP server as the
node's metrics port would be); the commands run as the CLI does, in a process of their own,
where gRPC's C core writes its log lines straight to stderr.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from .test_auth import self_signed

TLS_HINT = "the node may serve TLS: pass --tls-cert with the run's certificate"
PLAINTEXT_HINT = "the node serves plaintext gRPC: drop --tls-cert"
WRONG_CERT_HINT = "the node's certificate is not the one (or not signed by the CA) given in --tls-cert"
NOT_GRPC_HINT = ("is not a gRPC port: the node's gRPC port is its --grpc-port (default 7701), not its "
                 "--metrics-port or --dht-port")


NOT_A_NODE_HINT = "is not a lowcomm node (it does not serve the node's methods): give the node's --grpc-port"


class Servers:
    """Addresses of the servers the commands are pointed at, and the certificates to pass."""

    def __init__(self, tls: str, plaintext: str, http: str, cert: Path, other_cert: Path, bare: str = "") -> None:
        self.tls, self.plaintext, self.http, self.bare = tls, plaintext, http, bare
        self.cert, self.other_cert = cert, other_cert


def _health_server(credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # SERVING by default
    port = (server.add_secure_port("127.0.0.1:0", credentials) if credentials is not None
            else server.add_insecure_port("127.0.0.1:0"))
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    folder = tmp_path_factory.mktemp("certs")
    cert, key = self_signed("lowcomm-run")
    other, _ = self_signed("lowcomm-run")  # the same name, another key: not the node's
    (folder / "cert.pem").write_bytes(cert)
    (folder / "other.pem").write_bytes(other)
    tls_server, tls_target = _health_server(grpc.ssl_server_credentials([(key, cert)]))
    plain_server, plain_target = _health_server(None)
    bare_server = grpc.server(futures.ThreadPoolExecutor(1))  # another program's gRPC server: no node methods
    bare_target = f"127.0.0.1:{bare_server.add_insecure_port('127.0.0.1:0')}"
    bare_server.start()
    # Answers the HTTP/2 preface with an HTTP/1 "400 Bad Request", as the node's /metrics does.
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        yield Servers(tls_target, plain_target, f"127.0.0.1:{web.server_address[1]}",
                      folder / "cert.pem", folder / "other.pem", bare_target)
    finally:
        web.shutdown()
        web.server_close()
        tls_server.stop(None)
        plain_server.stop(None)
        bare_server.stop(None)


def light_command(*args: str) -> subprocess.CompletedProcess:
    # Without the variables a user may have set: the commands' own defaults are under test.
    env = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE", "LOWCOMM_TLS_CERT")}
    return subprocess.run([sys.executable, "-m", "lowcomm.node.cli", *args, "--timeout", "10"],
                          capture_output=True, text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)


def assert_one_error_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    # Before, gRPC's own "I1207 04:21:32.914164 30579 ssl_transport_security.cc:2563] Handshake
    # failed with error SSL_ERROR_SSL: ..." came first.
    assert len(lines) == 1 and lines[0].startswith("lowcomm-node: error: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_a_tls_node_called_without_its_certificate_hints_at_tls(servers: Servers, command: str) -> None:
    # It said "no node answered at ...: UNAVAILABLE ... Socket closed" only.
    line = assert_one_error_line(light_command(command, "--target", servers.tls),
                                 f"no node answered at {servers.tls}", TLS_HINT)
    assert PLAINTEXT_HINT not in line and WRONG_CERT_HINT not in line


@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_a_certificate_for_a_plaintext_node_says_to_drop_it_without_grpc_log_lines(servers: Servers,
                                                                                     command: str) -> None:
    assert_one_error_line(light_command(command, "--target", servers.plaintext, "--tls-cert", str(servers.cert)),
                          f"no node answered at {servers.plaintext}", PLAINTEXT_HINT)


@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_a_certificate_the_node_does_not_use_is_named_without_grpc_log_lines(servers: Servers,
                                                                            command: str) -> None:
    assert_one_error_line(light_command(command, "--target", servers.tls, "--tls-cert", str(servers.other_cert)),
                          f"no node answered at {servers.tls}", WRONG_CERT_HINT)


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls-cert"])
@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_a_port_that_is_not_grpc_is_named_so(servers: Servers, command: str, tls: bool) -> None:
    # "Failed parsing HTTP/2 (Expected SETTINGS frame ..., got frame type 79)": the metrics (or
    # DHT) port given as --target; with --tls-cert it is not "a plaintext node" either.
    flags = ["--tls-cert", str(servers.cert)] if tls else []
    line = assert_one_error_line(light_command(command, "--target", servers.http, *flags),
                                 f"{servers.http} {NOT_GRPC_HINT}")
    assert PLAINTEXT_HINT not in line and TLS_HINT not in line


@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_a_grpc_server_that_is_not_a_node_is_named_so(servers: Servers, command: str) -> None:
    # It said "no node answered at ...: UNIMPLEMENTED Method not found!": something did answer.
    assert_one_error_line(light_command(command, "--target", servers.bare), f"{servers.bare} {NOT_A_NODE_HINT}")


def test_status_of_a_server_with_a_health_service_alone_is_not_a_node_either(servers: Servers) -> None:
    assert_one_error_line(light_command("status", "--target", servers.plaintext),
                          f"{servers.plaintext} {NOT_A_NODE_HINT}")


def test_the_right_certificate_still_answers(servers: Servers) -> None:
    done = light_command("healthcheck", "--target", servers.tls, "--tls-cert", str(servers.cert))
    assert done.returncode == 0 and done.stdout == f"{servers.tls}: SERVING\n" and done.stderr == "", done
