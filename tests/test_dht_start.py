"""``start_dht`` (node/cli.py): a bootstrap peer that is reachable but too busy to answer the DHT's
ping in time costs a retry, not the node (one of 32 nodes started at once on 2 cores exited
there); other failures are not retried."""

from __future__ import annotations

import logging

import pytest
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

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


# -- the peers a node remembers (node/peerbook.py) ----------------------------------------------

OTHER = "/ip4/127.0.0.1/tcp/4343/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


class SelectiveDHT(FlakyDHT):
    """Starts when its initial peers include one of ``answering``, or when it has none; else
    fails as hivemind does when no initial peer answers its ping."""

    answering: set[str] = set()
    tried: list[list[str]] = []
    error: Exception = RuntimeError(UNANSWERED)

    def __init__(self, **kwargs) -> None:
        peers = list(kwargs["initial_peers"])
        type(self).tried.append(peers)
        if peers and not set(peers) & type(self).answering:
            raise type(self).error
        self.kwargs = kwargs
        self.clock = self


@pytest.fixture
def remembering(monkeypatch, tmp_path):
    """A node whose checkpoint folder remembers OTHER; returns (config maker, pauses)."""
    pauses: list[float] = []
    monkeypatch.setattr(dht, "SupervisedDHT", SelectiveDHT)
    monkeypatch.setattr(cli, "_sleep", pauses.append)
    SelectiveDHT.answering, SelectiveDHT.tried, SelectiveDHT.error = set(), [], RuntimeError(UNANSWERED)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "known_peers.txt").write_text(f"# comment\n{OTHER}\nnot a multiaddr\n")

    def config(peers: list[str]):
        return load_config(None, {"peers": peers, "checkpoint_dir": folder, "dht_port": 0}, [])

    return config, pauses


def test_a_node_without_peers_joins_through_the_peers_it_remembers(remembering, caplog):
    config, _ = remembering
    SelectiveDHT.answering = {OTHER}
    with caplog.at_level(logging.INFO, logger="lowcomm.node"):
        started = cli.start_dht(config([]))
    assert started.kwargs["initial_peers"] == [OTHER] and SelectiveDHT.tried == [[OTHER]]
    assert any(getattr(r, "event", "") == "joined_through_remembered_peers" for r in caplog.records)


def test_a_first_peer_whose_remembered_peers_are_gone_starts_alone_at_once(remembering, caplog):
    config, pauses = remembering
    with caplog.at_level(logging.INFO, logger="lowcomm.node"):
        started = cli.start_dht(config([]))
    assert started.kwargs["initial_peers"] == [] and SelectiveDHT.tried == [[OTHER], []]
    assert pauses == []  # no retries for remembered peers: a swarm that is gone costs one try
    assert any("starting as the first peer" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("refused", [False, True], ids=["busy", "gone"])
def test_peers_that_do_not_answer_fall_back_to_the_remembered_ones(remembering, caplog, refused):
    config, pauses = remembering
    SelectiveDHT.answering = {OTHER}
    if refused:  # p2pd could not connect to any bootstrap peer: not retried
        SelectiveDHT.error = P2PDaemonError("Daemon failed to start: failed to connect to bootstrap peers")
    with caplog.at_level(logging.WARNING, logger="lowcomm.node"):
        started = cli.start_dht(config([PEER]))
    assert started.kwargs["initial_peers"] == [OTHER]
    tries_of_peer = 1 if refused else len(cli.BOOTSTRAP_RETRY_PAUSES) + 1
    assert SelectiveDHT.tried == [[PEER]] * tries_of_peer + [[OTHER]]
    warning = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "peers_did_not_answer"]
    assert len(warning) == 1 and PEER in warning[0] and "known_peers.txt" in warning[0]


def test_when_neither_answers_the_error_names_both(remembering):
    config, _ = remembering
    with pytest.raises(RuntimeError) as raised:
        cli.start_dht(config([PEER]))
    message = str(raised.value)
    assert PEER in message and "nor did any of the 1 peer(s) this node saw on its last run" in message
    assert "known_peers.txt" in message and "\n" not in message


def test_a_given_peer_is_not_tried_twice_as_a_remembered_one(remembering):
    config, _ = remembering
    SelectiveDHT.answering = {OTHER}
    started = cli.start_dht(config([OTHER]))
    assert started.kwargs["initial_peers"] == [OTHER] and SelectiveDHT.tried == [[OTHER]]
