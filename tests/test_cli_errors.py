"""Bad input through the real CLI: one clear line, the right exit code, nothing lost."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from lowcomm.node.checkpoint import list_checkpoints
from lowcomm.node.localswarm import node_command

from .conftest import FAST

pytestmark = pytest.mark.multiprocess

# A syntactically valid peer id nobody runs.
STRANGER = "QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN"


def run_join(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--torch-threads", "1",
           "--log-format", "json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowcomm-node: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in {result.stderr!r}"
    return errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unanswered_peers_fail_fast_naming_the_address(tmp_path):
    maddr = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{STRANGER}"
    started = time.monotonic()
    result = run_join(tmp_path, "--peers", maddr, timeout=60)
    assert time.monotonic() - started < 30
    assert_one_line_error(result, maddr)


def test_malformed_multiaddr_is_a_clear_error(tmp_path):
    result = run_join(tmp_path, "--peers", "not-a-multiaddr")
    assert_one_line_error(result, "not-a-multiaddr")


def test_malformed_config_names_file_key_and_expectation(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[sync]\ncodec = "int9"\n')
    result = run_join(tmp_path, "--config", str(config))
    assert result.returncode == 2
    assert_one_line_error(result, str(config), "[sync] codec", "'int8'")

    config.write_text("[train]\ninner_step = 5\n")
    assert_one_line_error(run_join(tmp_path, "--config", str(config)), str(config), "inner_step", "inner_steps")

    config.write_text("[train\n")
    assert_one_line_error(run_join(tmp_path, "--config", str(config)), str(config), "not valid TOML")


def test_busy_grpc_port_names_the_port_and_the_flag(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_join(tmp_path, "--grpc-port", str(port))
    assert_one_line_error(result, str(port), "--grpc-port")


def test_busy_metrics_port_names_the_port_and_the_flag(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_join(tmp_path, "--metrics-port", str(port))
    assert_one_line_error(result, str(port), "--metrics-port")


def test_corrupted_checkpoint_falls_back_to_the_previous_one(tmp_path):
    first = run_join(tmp_path, *FAST, "--max-rounds", "2")
    assert first.returncode == 0, first.stderr
    files = list_checkpoints(tmp_path / "ckpt")
    assert [f.name for f in files] == ["step-000000001.ckpt", "step-000000002.ckpt"]
    newest = files[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write

    second = run_join(tmp_path, *FAST, "--max-rounds", "1")
    assert second.returncode == 0, second.stderr
    assert "skipping checkpoint step-000000002.ckpt" in second.stdout
    assert "resumed from checkpoint" in second.stdout and "step-000000001.ckpt" in second.stdout


def test_peer_with_another_run_config_is_refused_on_both_sides(swarm, tmp_path):
    first = swarm.start(0)
    first.ready()
    result = run_join(tmp_path, *FAST, "--set", "sync.codec=int4", "--peers", first.multiaddr, timeout=120)
    assert_one_line_error(result, "[sync] codec", "int4", "int8")
    first.wait_for(lambda e: e.get("level") == "warning" and "[sync] codec" in e.get("msg", ""), 30)
