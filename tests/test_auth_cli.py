"""A secret run through the real CLI: peers with the secret average, a wrong secret gets nowhere
(it stops with one line that says so)."""

from __future__ import annotations

import asyncio
import base64
import os
import time
import urllib.request

import pytest

from lowcomm.protocol.rpc import check_health, fetch_status

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # make test-slow: make test stays under 15 min

ROUND_WAIT = 90  # generous bound for one round on a loaded 2-core machine


def wait_any(nodes, predicate, timeout):
    """(node, event): the first of ``nodes`` to log an event matching ``predicate``."""
    deadline = time.monotonic() + timeout
    while True:
        for node in nodes:
            try:
                return node, node.wait_for(predicate, 0.2)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


def rejected_unauthenticated(node) -> float:
    port = node.ready()["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    line = next(line for line in text.splitlines()
                if line.startswith('lowcomm_rejected_contributions_total{reason="unauthenticated"}'))
    return float(line.split()[-1])


def test_peers_sharing_the_secret_average_and_a_wrong_secret_contributes_nothing(swarm, tmp_path):
    secret, wrong = tmp_path / "run.secret", tmp_path / "wrong.secret"
    for path in (secret, wrong):
        path.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    first = swarm.start(0, extra=["--run-secret-file", str(secret)])
    second = swarm.start(1, [first.multiaddr], extra=["--run-secret-file", str(secret)])
    # The stranger knows where the swarm is: it joins the (open) DHT through both honest peers.
    stranger = swarm.start(2, [first.multiaddr, second.multiaddr], extra=["--run-secret-file", str(wrong)])
    honest = (first, second)

    # The two peers with the secret average together (the second downloaded the state first,
    # through authenticated StateTransfer calls), bit-identically.
    done = second.wait_for(lambda e: e.get("event") == "round_done" and e["group_size"] == 2, ROUND_WAIT * 2)
    mirror = first.wait_for(lambda e: e.get("event") == "round_done" and e["outer_step"] == done["outer_step"],
                            ROUND_WAIT)
    assert mirror["params_sha256"] == done["params_sha256"] and mirror["group_size"] == 2

    # The stranger sees only records it cannot verify, says so, asks one of the peers it sees
    # once, is refused, and stops with one line that names the flag to fix (it used to train
    # alone, of no use to anyone, with only the warning to say why).
    stranger_id = stranger.ready()["peer_id"]
    stranger.wait_event("dht_unsigned", ROUND_WAIT)
    refused_by, warning = wait_any(
        honest, lambda e: e.get("event") == "rpc_unauthenticated" and e.get("sender") == stranger_id, ROUND_WAIT)
    assert "not signed with this run's secret" in warning["detail"]
    assert rejected_unauthenticated(refused_by) >= 1
    assert stranger.wait_exit(ROUND_WAIT) == 1
    errors = [line for line in stranger.raw_lines if line.startswith("lowcomm-node: error:")]
    assert len(errors) == 1, stranger.raw_lines[-5:]
    assert "refused by the swarm" in errors[0] and "not signed with this run's secret" in errors[0], errors[0]
    assert "--run-secret-file" in errors[0], errors[0]
    assert not any("Traceback" in line for line in stranger.raw_lines)
    assert stranger.rounds() == []  # never in a round, not even alone
    assert all(e["group_size"] <= 2 for node in honest for e in node.rounds())

    # Health and status stay reachable without the secret (what `healthcheck` and `status` call).
    address = first.ready()["grpc_address"]
    assert asyncio.run(check_health(address, 30.0)) == "SERVING"
    assert asyncio.run(fetch_status(address, 30.0)).peer_id == first.ready()["peer_id"]


def test_joiners_that_cannot_call_the_swarm_stop_with_one_line_instead_of_training_alone(swarm, tmp_path):
    # Each used to train on alone, at step 0 (a download failing every few seconds with "Socket
    # closed" or a certificate error) or at its own steps beside the open run (its unsigned
    # records ignored), exit 0.
    from .test_auth import self_signed

    secret = tmp_path / "run.secret"
    secret.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    for name in ("run", "other"):
        cert, key = self_signed("lowcomm-run")
        (tmp_path / f"{name}.pem").write_bytes(cert)
        (tmp_path / f"{name}.key").write_bytes(key)
    tls = ["--tls-cert", str(tmp_path / "run.pem"), "--tls-key", str(tmp_path / "run.key")]
    wrong_tls = ["--tls-cert", str(tmp_path / "other.pem"), "--tls-key", str(tmp_path / "other.key")]
    open_run = swarm.start(0)
    tls_run = swarm.start(1, extra=tls)
    joiners = {
        "with a secret, to an open run": (swarm.start(2, [open_run.multiaddr], extra=["--run-secret-file", str(secret)]),
                                          "run without a run secret (their records are unsigned)"),
        "with TLS, to a plaintext run": (swarm.start(3, [open_run.multiaddr], extra=tls),
                                         "serve plaintext gRPC and this node TLS: start it without --tls-cert"),
        "plaintext, to a TLS run": (swarm.start(4, [tls_run.multiaddr]),
                                    "serve gRPC over TLS and this node plaintext: start it with the run's certificate"),
        "with another certificate, to a TLS run": (swarm.start(5, [tls_run.multiaddr], extra=wrong_tls),
                                                   "is not trusted (CERTIFICATE_VERIFY_FAILED"),
    }
    for case, (node, needle) in joiners.items():
        assert node.wait_exit(ROUND_WAIT) == 1, case
        errors = [line for line in node.raw_lines if line.startswith("lowcomm-node: error:")]
        assert len(errors) == 1 and "refused by the swarm" in errors[0] and needle in errors[0], (case, errors)
        assert node.rounds() == [], case
        assert not any("Traceback" in line for line in node.raw_lines), case
    assert tls_run.proc.poll() is None and open_run.proc.poll() is None  # the swarms train on
