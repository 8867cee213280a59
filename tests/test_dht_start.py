"""``start_dht`` (node/cli.py): a bootstrap peer that is reachable but too busy to answer the DHT's
ping in time costs a retry, not the node (one of 32 nodes started at once on 2 cores exited
there); other failures are not retried."""

from __future__ import annotations

import logging

import pytest

from lowcomm.node import cli, dht
from lowcomm.node.config import load_config

PEER = "/ip4/127.0.0.1/tcp/4242/p2p/QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN"
UNANSWERED = ("DHTNode bootstrap failed: none of the initial_peers responded to a ping. "
              "(set ensure_bootstrap_success=False to ignore)")


class FlakyDHT:
    """Fails the first ``failures`` constructions the way hivemind does, then starts."""

    made = 0
    failures = 0
    error = RuntimeError(UNANSWERED)

    def __init__(self, **kwargs) -> None:
        type(self).made += 1
        if type(self).made <= type(self).failures:
            raise type(self).error
        self.kwargs = kwargs
        self.clock = self

    def log_offset(self) -> None:
        pass


@pytest.fixture
def flaky(monkeypatch, tmp_path):
    pauses: list[float] = []
    monkeypatch.setattr(dht, "SupervisedDHT", FlakyDHT)
    monkeypatch.setattr(cli, "_sleep", pauses.append)
    FlakyDHT.made, FlakyDHT.error = 0, RuntimeError(UNANSWERED)
    # dht_port 0: start_dht checks a fixed port is free before it starts the (here fake) DHT.
    config = load_config(None, {"peers": [PEER], "checkpoint_dir": tmp_path / "ckpt", "dht_port": 0}, [])
    return config, pauses


def test_unanswered_pings_are_retried_after_growing_pauses_until_the_dht_starts(flaky, caplog):
    config, pauses = flaky
    FlakyDHT.failures = 2
    with caplog.at_level(logging.WARNING, logger="lowcomm.node"):
        started = cli.start_dht(config)
    assert isinstance(started, FlakyDHT) and FlakyDHT.made == 3
    assert pauses == list(cli.BOOTSTRAP_RETRY_PAUSES[:2])
    assert [r.getMessage() for r in caplog.records] == [
        "none of the peers answered the DHT's ping (try 1 of 4); trying again in 2 s",
        "none of the peers answered the DHT's ping (try 2 of 4); trying again in 4 s"]


def test_a_peer_that_never_answers_ends_in_one_line_naming_it_not_hiveminds_advice(flaky):
    config, pauses = flaky
    FlakyDHT.failures = 99
    with pytest.raises(RuntimeError) as raised:
        cli.start_dht(config)
    assert FlakyDHT.made == len(cli.BOOTSTRAP_RETRY_PAUSES) + 1 and pauses == list(cli.BOOTSTRAP_RETRY_PAUSES)
    message = str(raised.value)
    assert PEER in message and "4 tries" in message and "ensure_bootstrap_success" not in message
    assert "\n" not in message


def test_other_start_failures_are_not_retried(flaky):
    config, pauses = flaky
    FlakyDHT.failures, FlakyDHT.error = 1, ValueError("bad multiaddr")
    with pytest.raises(RuntimeError, match="invalid --peers multiaddr"):
        cli.start_dht(config)
    assert FlakyDHT.made == 1 and pauses == []
