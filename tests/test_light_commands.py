"""`lowcomm-node status` and `healthcheck` stay light: a container's health probe runs
`healthcheck` every few seconds, and importing torch there cost ~1.8 CPU-seconds per call."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

PROBE = """
import asyncio, sys
from lowcomm.node import cli
code = cli.main(["healthcheck", "--target", "127.0.0.1:1", "--timeout", "0.5"])
heavy = sorted(m for m in ("torch", "hivemind", "numpy") if m in sys.modules)
print("exit", code, "heavy", ",".join(heavy) or "-")
"""


def test_healthcheck_against_nobody_fails_cleanly_without_importing_torch() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exit", "1", "heavy", "-"], done.stdout + done.stderr
    assert "no node answered at 127.0.0.1:1" in done.stderr


def test_a_target_without_a_usable_port_is_a_usage_error() -> None:
    # gRPC took a missing port as 443 and 99999 as 34463, and reported a refused connection there.
    from lowcomm.node import cli

    for target in ("127.0.0.1", "127.0.0.1:99999", "127.0.0.1:0", "node:grpc", "::1"):
        with pytest.raises(SystemExit) as exit_info:
            cli.build_parser().parse_args(["status", "--target", target])
        assert exit_info.value.code == 2, target
    for target in ("127.0.0.1:7701", "[::1]:7701", "node-3.example:65535"):
        assert cli.build_parser().parse_args(["healthcheck", "--target", target]).target == target


@pytest.mark.parametrize("target", ["::1:7701", "fe80::1:7701", "[::1:7701"])
def test_an_ipv6_target_without_brackets_says_to_add_them(capsys, target: str) -> None:
    # ::1:7701 passed as HOST:PORT and failed later as "no node answered ... Misformatted domain name".
    from lowcomm.node import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["status", "--target", target])
    assert exit_info.value.code == 2
    host = target.rpartition(":")[0].strip("[]")
    assert f"write an IPv6 address in brackets, as [{host}]:7701" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["http://127.0.0.1:33209", "https://node-3.example:7701", "grpc://[::1]:7701"])
def test_a_target_with_a_scheme_is_a_usage_error_asking_for_host_port(capsys, target: str) -> None:
    # http://127.0.0.1:33209 passed as HOST:PORT (host "http://127.0.0.1") and failed later as an
    # unreachable node.
    from lowcomm.node import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["status", "--target", target])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --target:" in err and "give HOST:PORT without a scheme" in err, err


@pytest.mark.parametrize("command", ["status", "healthcheck"])
def test_help_shows_the_default_target(capsys, monkeypatch, command: str) -> None:
    from lowcomm.node import cli

    monkeypatch.delenv("LOWCOMM_HOST", raising=False)
    monkeypatch.delenv("LOWCOMM_GRPC_PORT", raising=False)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "--target HOST:PORT the node's gRPC address: its --grpc-port (default: 127.0.0.1:7701," in help_text


def test_the_default_target_is_the_node_this_environment_configures() -> None:
    # A container's health check ran `--target 127.0.0.1:$LOWCOMM_GRPC_PORT` and failed for a
    # node that LOWCOMM_HOST put on one address.
    from lowcomm.node.cli import default_target

    assert default_target({}) == "127.0.0.1:7701"
    assert default_target({"LOWCOMM_HOST": "10.0.0.5", "LOWCOMM_GRPC_PORT": "7711"}) == "10.0.0.5:7711"
    assert default_target({"LOWCOMM_HOST": "0.0.0.0"}) == "127.0.0.1:7701"  # every interface: loopback too
    assert default_target({"LOWCOMM_HOST": "::"}) == "[::1]:7701"
    assert default_target({"LOWCOMM_HOST": "fd00::5", "LOWCOMM_GRPC_PORT": "0"}) == "[fd00::5]:7701"  # 0: unknowable


def test_a_refused_connection_says_where_a_node_on_another_address_or_port_is(capsys) -> None:
    from lowcomm.node import cli

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for command in ("status", "healthcheck"):
        assert cli.main([command, "--target", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
        err = capsys.readouterr().err
        assert f"no node answered at 127.0.0.1:{port}: is the node running? One started with --host ADDRESS or " \
               f"--grpc-port P listens there: give --target ADDRESS:P" in err, err


def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(capsys) -> None:
    # --timeout -1 failed at once with "no node answered", as if the node were down.
    from lowcomm.node import cli

    for timeout in ("-1", "0", "nan", "inf", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            cli.build_parser().parse_args(["status", "--timeout", timeout])
        assert exit_info.value.code == 2, timeout
        assert "argument --timeout:" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["healthcheck", "--timeout", "0.5"]).timeout == 0.5


def test_status_says_when_the_nodes_newest_checkpoint_was_not_written(capsys) -> None:
    from lowcomm.node import cli
    from lowcomm.protocol._pb.lowcomm.v1 import node_pb2

    reason = "could not write step-000000005.ckpt in /data/ck: No space left on device; free space there, ..."
    failed = node_pb2.NodeStatus(peer_id="QmNode", outer_step=5, params_sha256="ab" * 32, phase="training",
                                 version="1", mode="allreduce", codec="int8", checkpoint_failure=reason,
                                 checkpoint_failed_step=5)
    info = cli.status_dict(failed)
    assert info["checkpoint_failure"] == {"outer_step": 5, "reason": reason}
    cli._print_status(info)
    assert f"checkpoint NOT WRITTEN at step 5: {reason}\n" in capsys.readouterr().out

    failed.ClearField("checkpoint_failure")  # its writes succeed (again): nothing said
    assert cli.status_dict(failed)["checkpoint_failure"] is None
    cli._print_status(cli.status_dict(failed))
    assert "checkpoint" not in capsys.readouterr().out


def test_status_says_when_peers_could_not_dial_the_node_back(capsys) -> None:
    from lowcomm.node import cli
    from lowcomm.protocol._pb.lowcomm.v1 import node_pb2

    why = "10.0.0.2:7701: QmPeer could not connect (no answer within 5 s (a firewall that drops connections?))"
    status = node_pb2.NodeStatus(peer_id="QmNode", outer_step=5, params_sha256="ab" * 32, phase="averaging",
                                 version="1", mode="allreduce", codec="int8", unreachable=why)
    info = cli.status_dict(status)
    assert info["unreachable"] == why
    cli._print_status(info)
    assert f"gRPC      NOT REACHABLE by peers at {why}\n" in capsys.readouterr().out
    status.ClearField("unreachable")  # reached, or nobody answered yet: nothing said
    assert cli.status_dict(status)["unreachable"] is None
    cli._print_status(cli.status_dict(status))
    assert "REACHABLE" not in capsys.readouterr().out


CORE_INFO = """
import asyncio, sys
from lowcomm.node import cli
if sys.argv[1] == "join":
    cli.main(["join", "--set", "nosuch.key=1"])  # a usage error: join returns before it starts anything
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

async def main():  # a TLS call to a plaintext server: the core logs the failed handshake at INFO
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials()) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        except grpc.aio.AioRpcError as err:
            print("refused", err.code().name, flush=True)
    await server.stop(None)

asyncio.run(main())
"""


def test_join_keeps_grpcs_own_info_lines_out_of_the_nodes_output() -> None:
    # An audit saw "I1207 ... chttp2_transport.cc:1403] ... Got goaway ... ping_timeout" between
    # a node's JSON lines: grpcio's core logs at INFO unless GRPC_VERBOSITY says otherwise.
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    lines = {}
    for before in ("nothing", "join"):  # without join first the line shows: the check can fail
        proc = subprocess.run([sys.executable, "-c", CORE_INFO, before], capture_output=True, text=True, timeout=120,
                              env=env)
        assert "refused UNAVAILABLE" in proc.stdout, proc.stdout + proc.stderr
        lines[before] = [line for line in proc.stderr.splitlines() if "ssl_transport_security" in line]
    assert lines["nothing"] and not lines["join"], lines
