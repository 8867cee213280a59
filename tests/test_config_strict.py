"""A config file's values have the types it writes; keys that the chosen kind ignores are said;
--peers and --data mistakes name where they came from and exit as usage errors (node/config.py,
node/config_sections.py, node/cli.py)."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from lowcomm.node import cli, dht
from lowcomm.node.config import ConfigError, ignored_settings, load_config, read_layers, validate_layers

PEER = "/ip4/127.0.0.1/tcp/4242/p2p/QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.fixture
def no_start(monkeypatch):
    """`join` run in this process must stop at its config: should the mistake go unnoticed, it
    fails the test at its next step instead of starting a node here."""
    def started(*args, **kwargs):
        pytest.fail("the mistake went unnoticed: join went on to start the node")

    monkeypatch.setattr(cli, "read_credentials", started)


def load_error(path: Path, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, environ=kwargs.pop("environ", {}), **kwargs)
    return str(info.value)


# -- 1. types as written ---------------------------------------------------------------------------


@pytest.mark.parametrize("toml, line", [
    ('[train]\ninner_steps = "5"\n', '[train] inner_steps: expected an integer, got the string "5" (write it without quotes)'),
    ('[train]\nlr = "1e-3"\n', '[train] lr: expected a number, got the string "1e-3" (write it without quotes)'),
    ('[train]\nlr = "1"\n', '[train] lr: expected a number, got the string "1" (write it without quotes)'),
    ('[node]\nclient_mode = "true"\n',
     '[node] client_mode: expected a boolean (true or false), got the string "true" (write it without quotes)'),
    ('[node]\nmax_rounds = "3"\n', '[node] max_rounds: expected an integer, got the string "3" (write it without quotes)'),
    ('[sync]\nstate_sync = {exp_avg = "3"}\n',
     '[sync] state_sync: exp_avg: expected an integer, got the string "3" (write it without quotes)'),
    # Without a quoted number to unquote, no such advice.
    ('[train]\ninner_steps = "many"\n', '[train] inner_steps: expected an integer, got the string "many"'),
    ('[train]\nlr = "inf"\n', '[train] lr: expected a number, got the string "inf"'),
    ('[node]\nclient_mode = "yes"\n', '[node] client_mode: expected a boolean (true or false), got the string "yes"'),
    ('[node]\nclient_mode = 1\n', '[node] client_mode: expected a boolean (true or false), got the number 1'),
])
def test_a_value_of_the_wrong_type_in_a_file_is_one_line_naming_file_key_and_what_was_given(tmp_path, toml, line):
    # pydantic's lax mode ran `inner_steps = "5"` as 5, and `client_mode = "true"` as true.
    path = write(tmp_path, toml)
    assert load_error(path) == f"invalid configuration: {path}: {line}"


def test_join_refuses_a_quoted_number_in_its_config_file_as_a_usage_error(tmp_path, capsys, no_start):
    path = write(tmp_path, '[train]\ninner_steps = "5"\n')
    assert cli.main(["join", "--config", str(path), "--checkpoint-dir", str(tmp_path / "ckpt")]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"lowcomm-node: error: invalid configuration: {path}: [train] inner_steps: "
                                       f"expected an integer, got the string \"5\" (write it without quotes)\n")


def test_values_given_as_text_still_convert():
    # Variables, flags and --set hand over text: "5" is 5 there, as before.
    config = load_config(
        flags={"max_rounds": "3", "torch_threads": 2, "heartbeat_interval": "0.5"},
        overrides=["train.inner_steps=5", 'train.lr="1e-3"', 'sync.quorum="0.5"', "node.client_mode=true"],
        environ={"LOWCOMM_GRPC_PORT": "0", "LOWCOMM_CLIENT_MODE": "true", "LOWCOMM_PEERS": PEER,
                 "LOWCOMM_MAX_CLOCK_OFFSET": "10"})
    assert (config.node.max_rounds, config.node.torch_threads, config.node.heartbeat_interval) == (3, 2, 0.5)
    assert (config.train.inner_steps, config.train.lr, config.sync.quorum) == (5, 1e-3, 0.5)
    assert (config.node.grpc_port, config.node.client_mode, config.node.max_clock_offset) == (0, True, 10.0)


def test_a_file_value_overridden_from_text_is_read_as_text(tmp_path):
    path = write(tmp_path, '[train]\ninner_steps = "5"\n[node]\nmax_rounds = "3"\n')
    config = load_config(path, overrides=["train.inner_steps=6"], environ={"LOWCOMM_MAX_ROUNDS": "4"})
    assert (config.train.inner_steps, config.node.max_rounds) == (6, 4)
    assert load_config(path, overrides=['train.inner_steps="7"', "node.max_rounds=2"], environ={}).train.inner_steps == 7


def test_an_integer_for_a_float_in_a_file_stays_accepted(tmp_path):
    path = write(tmp_path, "[train]\nlr = 1\n[sync]\nouter_lr = 2\n[node]\nheartbeat_interval = 1\n")
    config = load_config(path, environ={})
    assert (config.train.lr, config.sync.outer_lr, config.node.heartbeat_interval) == (1.0, 2.0, 1.0)


def test_a_dict_given_to_a_swarm_writes_its_types_as_a_file_does():
    nn = pytest.importorskip("torch.nn")
    from lowcomm.api_config import SwarmError, resolve_config

    with pytest.raises(SwarmError, match=r'^invalid configuration: config: \[train\] inner_steps: expected an '
                                         r'integer, got the string "5" \(write it without quotes\)$'):
        resolve_config({"train": {"inner_steps": "5"}}, None, nn.Linear(2, 2))
    assert resolve_config({"train": {"inner_steps": 5, "lr": 1}}, None, nn.Linear(2, 2)).train.lr == 1.0


# -- 3. [node] peers in a file -----------------------------------------------------------------------


def test_peers_as_a_string_in_a_file_says_to_write_a_list(tmp_path):
    # It was "invalid --peers multiaddr notalist": another source (no flag was given), another cause.
    path = write(tmp_path, '[node]\npeers = "notalist"\n')
    assert load_error(path) == (f'invalid configuration: {path}: [node] peers: expected a list of multiaddrs, got the '
                                f'string "notalist": write peers = ["/ip4/<address>/tcp/<port>/p2p/<peer id>"]')
    path = write(tmp_path, f'[node]\npeers = "{PEER}"\n')
    assert load_error(path).endswith(f'got the string "{PEER}": write peers = ["{PEER}"]')
    # The environment hands over one string, split on commas and spaces, as before.
    assert load_config(environ={"LOWCOMM_PEERS": f"{PEER}, {PEER}"}).node.peers == [PEER, PEER]
    assert load_config(overrides=[f"node.peers={PEER}"], environ={}).node.peers == [PEER]


def test_a_bad_multiaddr_in_a_file_names_the_file_and_key_and_exits_2(tmp_path, capsys, monkeypatch, no_start):
    ckpt = tmp_path / "ckpt"
    path = write(tmp_path, f'[node]\npeers = ["notamultiaddr"]\ncheckpoint_dir = "{ckpt}"\n')
    assert cli.main(["join", "--config", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"lowcomm-node: error: {path}: [node] peers: invalid multiaddr notamultiaddr: it must end "
                          f"in /p2p/<peer id>; ")
    assert "--peers multiaddr" not in err and err.count("\n") == 1
    monkeypatch.setenv("LOWCOMM_PEERS", "/ip4/1.2.3/tcp/1/p2p/QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN")
    monkeypatch.delenv("LOWCOMM_CONFIG", raising=False)
    assert cli.main(["join", "--checkpoint-dir", str(tmp_path / "ckpt")]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith(
        "lowcomm-node: error: environment variable LOWCOMM_PEERS: [node] peers: invalid multiaddr /ip4/1.2.3/")


# -- 4. usage errors exit 2 ---------------------------------------------------------------------------


def test_a_bad_peers_flag_exits_2_before_anything_starts(tmp_path, capsys, no_start):
    # It exited 1, as a peer that does not answer does; other config mistakes exit 2.
    code = cli.main(["join", "--checkpoint-dir", str(tmp_path / "ckpt"), "--peers", "not-a-multiaddr"])
    assert code == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("lowcomm-node: error: invalid --peers multiaddr not-a-multiaddr: it must "
                                              "end in /p2p/<peer id>")
    assert not (tmp_path / "ckpt").exists()


class FakeDHT:
    """Stands in for hivemind's DHT: starts at once, or raises ``error``."""

    error: Exception | None = None

    def __init__(self, **kwargs) -> None:
        if FakeDHT.error is not None:
            raise FakeDHT.error
        self.clock = self

    def log_offset(self) -> None:
        pass


@pytest.fixture
def fake_dht(monkeypatch):
    monkeypatch.setattr(dht, "SupervisedDHT", FakeDHT)
    FakeDHT.error = None
    yield FakeDHT
    FakeDHT.error = None


def test_a_multiaddr_hivemind_refuses_is_a_usage_error_naming_its_source(tmp_path, fake_dht):
    fake_dht.error = ValueError("bad multiaddr")
    layers = read_layers(write(tmp_path, f'[node]\npeers = ["{PEER}"]\ndht_port = 0\n'),
                         flags={"checkpoint_dir": tmp_path / "ckpt"}, environ={})
    with pytest.raises(cli.UsageError, match=rf"^{tmp_path / 'run.toml'}: \[node\] peers: invalid multiaddr: bad "):
        cli.start_dht(validate_layers(layers), layers.sources)
    with pytest.raises(cli.UsageError, match="^invalid --peers multiaddr: bad multiaddr"):  # lowcomm.Swarm's wording
        cli.start_dht(validate_layers(layers))


@pytest.mark.multiprocess
def test_a_data_path_that_matches_nothing_exits_2(tmp_path):
    # Found once the node runs (node/data.py), it exited 1, as a failed round does.
    from lowcomm.node.localswarm import node_command

    cmd = [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0", "--metrics-port",
           "0", "--checkpoint-dir", str(tmp_path / "ckpt"), "--torch-threads", "1", "--log-format", "json",
           "--data", str(tmp_path / "no-such-corpus.txt")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowcomm-node: error:")]
    assert len(errors) == 1 and "no-such-corpus.txt" in errors[0] and "matches no files" in errors[0], result.stderr


# -- 2. keys the chosen kind ignores ------------------------------------------------------------------


@pytest.mark.parametrize("toml, line", [
    ('[data]\nfield = "text"\n', '[data] field is ignored: it names the text field of format = "jsonl" files (the '
                                 'column of format = "hf"), and format is "text"'),
    ('[data]\nformat = "jsonl"\npath = "x.jsonl"\ntoken_dtype = "uint32"\n',
     '[data] token_dtype is ignored: it is the id type of format = "tokens" files, and format is "jsonl"'),
    ('[model]\nfactory = "tests.factory_model:build"\ndropout = 0.1\n',
     "[model] dropout is ignored: it is the dropout of lowcomm's preset models, and this [model] sets factory"),
    ('[train]\nmtdao_slow_weight = 0.7\n',
     '[train] mtdao_slow_weight is ignored: it tunes optimizer = "mtdao", and optimizer is "adamw"'),
    ('[sync]\ngossip_partners = 4\n',
     '[sync] gossip_partners is ignored: it is the partner count of mode = "gossip", and mode is "allreduce"'),
    ('[sync]\nclip_factor = 3.0\n',
     '[sync] clip_factor is ignored: it applies to aggregation = "clipped_mean", and aggregation is "mean"'),
    ('[sync]\naggregation = "clipped_mean"\ntrim_fraction = 0.1\n',
     '[sync] trim_fraction is ignored: it applies to aggregation = "trimmed_mean", and aggregation is "clipped_mean"'),
    ('[sync]\noverlap_apply = "boundary"\n',
     '[sync] overlap_apply is ignored: it applies to overlap = "delayed" or "eager", and overlap is "none"'),
    ('[sync]\nstate_codec = "fp32"\n',
     '[sync] state_codec is ignored: it encodes the optimizer states of state_sync, and state_sync is empty'),
])
def test_a_key_the_chosen_kind_ignores_is_named_with_its_source_and_why(tmp_path, toml, line):
    # They were accepted without a word: `field = "text"` with format = "text" read nothing.
    path = write(tmp_path, toml)
    layers = read_layers(path, environ={})
    assert ignored_settings(validate_layers(layers), layers.sources) == [f"{path}: {line}"]
    assert ignored_settings(validate_layers(layers)) == [line]  # lowcomm.Swarm's config: no sources kept


def test_keys_at_their_default_or_the_methods_value_or_in_use_are_not_reported(tmp_path):
    # `init-config` writes every key (token_dtype, dropout, gossip_partners ... at their defaults).
    assert ignored_settings(load_config(write(tmp_path, cli.render_default_config()), environ={})) == []
    for overrides in (["sync.method=sparseloco", "sync.aggregation=mean"],  # clip_factor = 1.0 is the method's
                      ["data.format=jsonl", "data.path=x.jsonl", "data.field=body"],
                      ["data.format=tokens", "data.path=x.bin", "data.token_dtype=uint32"],
                      ["train.optimizer=mtdao", "train.mtdao_slow_weight=0.7"],
                      ["sync.mode=gossip", "sync.gossip_partners=4"],
                      ["sync.overlap=delayed", "sync.overlap_apply=boundary"],
                      ["sync.method=desloc", "sync.state_codec=fp32"],
                      ["model.dropout=0.1"]):
        assert ignored_settings(load_config(overrides=overrides, environ={})) == [], overrides


def test_the_node_warns_once_per_ignored_key_through_the_lowcomm_logger(tmp_path, fake_dht):
    # As lowcomm.Swarm prints the node's lines: a handler on the "lowcomm" logger, not the root's.
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("lowcomm")
    before = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        layers = read_layers(write(tmp_path, '[data]\nfield = "text"\n[sync]\ngossip_partners = 3\n'),
                             flags={"checkpoint_dir": tmp_path / "ckpt", "dht_port": 0}, environ={})
        cli.start_dht(validate_layers(layers), layers.sources)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]
    warned = [(r.levelno, r.getMessage()) for r in records if getattr(r, "event", None) == "config_key_ignored"]
    assert [level for level, _ in warned] == [logging.WARNING, logging.WARNING]
    assert [message.split(" is ignored")[0] for _, message in warned] == [
        f"{tmp_path / 'run.toml'}: [data] field", f"{tmp_path / 'run.toml'}: [sync] gossip_partners"]
