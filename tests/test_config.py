"""Config layering, error messages and the run fingerprint (node/config.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from lowcomm.node.cli import render_default_config
from lowcomm.node.config import CODEC_CHOICES, Config, ConfigError, ConfigLayers, load_config, parse_override

A_PEER = "/ip4/127.0.0.1/tcp/7700/p2p/QmXRFQRfTWsEXpbA9u6eaaWzmMBrx6k2vW1ppoC8ot9rtN"  # client mode needs one


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- precedence ---------------------------------------------------------------------------------


def test_defaults_without_any_source():
    assert load_config(environ={}) == Config()


def test_precedence_defaults_file_env_flags_set(tmp_path):
    path = write(tmp_path, """
[sync]
codec = "int4"
group_size = 4
[node]
grpc_port = 1111
metrics_port = 1112
dht_port = 1113
max_rounds = 7
log_level = "warning"
""")
    env = {"LOWCOMM_METRICS_PORT": "2222", "LOWCOMM_DHT_PORT": "2223", "LOWCOMM_MAX_ROUNDS": "8"}
    flags = {"dht_port": 3333, "max_rounds": 9, "grpc_port": None}  # None: flag not given
    cfg = load_config(path, flags=flags, overrides=["node.max_rounds=10"], environ=env)
    assert cfg.sync.codec == "int4"  # file over default
    assert cfg.sync.group_size == 4
    assert cfg.sync.outer_lr == 1.0  # default kept
    assert cfg.node.grpc_port == 1111  # file; the None flag does not override
    assert cfg.node.log_level == "warning"
    assert cfg.node.metrics_port == 2222  # env over file
    assert cfg.node.dht_port == 3333  # flag over env
    assert cfg.node.max_rounds == 10  # --set over flag


def test_set_overrides_file_and_parses_toml_values(tmp_path):
    path = write(tmp_path, '[sync]\ncodec = "int4"\n[train]\ninner_steps = 3\n')
    cfg = load_config(path, overrides=["sync.codec=fp16", "train.inner_steps=11", "train.lr=0.5",
                                       "node.client_mode=true", f"node.peers=['{A_PEER}']"], environ={})
    assert cfg.sync.codec == "fp16"  # bare word: a string
    assert cfg.train.inner_steps == 11
    assert cfg.train.lr == 0.5
    assert cfg.node.client_mode is True


def test_config_file_from_environment(tmp_path):
    path = write(tmp_path, '[sync]\ncodec = "topk"\n')
    assert load_config(environ={"LOWCOMM_CONFIG": str(path)}).sync.codec == "topk"
    # An explicit file wins over the variable.
    other = write(tmp_path, '[sync]\ncodec = "bf16"\n', "other.toml")
    assert load_config(other, environ={"LOWCOMM_CONFIG": str(path)}).sync.codec == "bf16"


def test_env_values_are_typed_and_empty_is_unset():
    cfg = load_config(environ={
        "LOWCOMM_CLIENT_MODE": "true", "LOWCOMM_PEERS": A_PEER, "LOWCOMM_GRPC_PORT": "0", "LOWCOMM_HEARTBEAT_INTERVAL": "0.5",
        "LOWCOMM_CHECKPOINT_DIR": "/tmp/x", "LOWCOMM_DATA": "corpus/*.txt", "LOWCOMM_MAX_ROUNDS": "",
    })
    assert cfg.node.client_mode is True
    assert cfg.node.grpc_port == 0
    assert cfg.node.heartbeat_interval == 0.5
    assert cfg.node.checkpoint_dir == Path("/tmp/x")
    assert cfg.data.path == "corpus/*.txt"  # the `data` alias
    assert cfg.node.max_rounds is None


def test_a_home_folder_in_node_paths_is_expanded_from_a_file_and_the_environment(tmp_path, monkeypatch):
    # No shell expands ~ there: "~/ckpt" made a folder named "~" in the current directory.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home"
    path = write(tmp_path, '[node]\ncheckpoint_dir = "~/ckpt"\nidentity = "~/id.key"\nrun_secret_file = "~/secret"\n'
                           'tls_cert = "~/c.pem"\ntls_key = "~/k.pem"\n')
    node = load_config(path).node
    assert (node.checkpoint_dir, node.identity, node.run_secret_file, node.tls_cert, node.tls_key) == (
        home / "ckpt", home / "id.key", home / "secret", home / "c.pem", home / "k.pem")
    assert load_config(environ={"LOWCOMM_CHECKPOINT_DIR": "~/elsewhere"}).node.checkpoint_dir == home / "elsewhere"


@pytest.mark.parametrize("value", ["/ip4/1.2.3.4/tcp/1/p2p/A,/ip4/5.6.7.8/tcp/2/p2p/B",
                                   "/ip4/1.2.3.4/tcp/1/p2p/A /ip4/5.6.7.8/tcp/2/p2p/B",
                                   " /ip4/1.2.3.4/tcp/1/p2p/A ,\n\t/ip4/5.6.7.8/tcp/2/p2p/B , "])
@pytest.mark.parametrize("var", ["LOWCOMM_PEERS", "LOWCOMM_INITIAL_PEERS"])
def test_peers_from_env_split_on_commas_and_spaces(var, value):
    cfg = load_config(environ={var: value})
    assert cfg.node.peers == ["/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/5.6.7.8/tcp/2/p2p/B"]


def test_peers_flag_overrides_env_peers():
    cfg = load_config(flags={"peers": ["/ip4/9.9.9.9/tcp/9/p2p/C"]}, environ={"LOWCOMM_PEERS": "/ip4/1.1.1.1/tcp/1/p2p/A"})
    assert cfg.node.peers == ["/ip4/9.9.9.9/tcp/9/p2p/C"]


# -- errors -------------------------------------------------------------------------------------


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[sync\ncodec = 'int8'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(path) in str(info.value)
    assert "not valid TOML" in str(info.value)


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(path, environ={})


def test_unknown_key_names_file_section_key_and_known_keys(tmp_path):
    path = write(tmp_path, "[sync]\ncodecs = 'int8'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert str(path) in message
    assert "[sync]" in message and "'codecs'" in message
    for known in ("codec", "group_size", "outer_lr", "reduce_timeout"):
        assert known in message


def test_unknown_section_is_named(tmp_path):
    path = write(tmp_path, "[synk]\ncodec = 'int8'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(path) in str(info.value) and "[synk]" in str(info.value) and "[sync]" in str(info.value)


def test_top_level_key_outside_a_table(tmp_path):
    path = write(tmp_path, "codec = 'int8'\n")
    with pytest.raises(ConfigError, match=r"'codec' is set outside any section, but it is a key of \[sync\]"):
        load_config(path, environ={})
    path = write(tmp_path, "codex = 'int8'\n")  # no section has such a key
    with pytest.raises(ConfigError, match=r"'codex' must be a table like \[codex\], got str"):
        load_config(path, environ={})


def test_a_known_key_outside_its_section_names_the_section(tmp_path):
    # It said "'inner_steps' must be a table like [inner_steps]": a section that does not exist.
    path = write(tmp_path, "inner_steps = 20\n[sync]\ncodec = 'int8'\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == (f"{path}: 'inner_steps' is set outside any section, but it is a key of [train]: in a "
                               f"TOML file write it under the [train] header, in a dict as "
                               f"{{'train': {{'inner_steps': ...}}}}")


def test_an_empty_unknown_section_is_named_too(tmp_path):
    # Validation sees sections only through their keys: an empty [trian] passed unnoticed.
    path = write(tmp_path, "[trian]\n[train]\ninner_steps = 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == f"{path}: unknown section [trian] (known: [run], [model], [data], [train], [sync], [node])"


def test_a_dict_whose_names_are_not_strings_is_refused_with_what_to_write():
    # A Swarm's config is a dict, which can hold any key: {"train": {1: 2}} was blamed on
    # "defaults" ("[train] 1 = 1 is invalid: Keys should be strings"), and {1: {}} passed.
    cases = {
        "key": ({"train": {1: 2}}, "config: 1 in [train] is not a key name (int, not a string); its keys are: "
                                    "inner_steps, batch_size"),
        "section": ({1: {}}, "config: 1 is not a section name (int, not a string); the sections are [run], [model]"),
        "both": ({"trian": {1: 2}}, "config: unknown section [trian] (known: [run]"),
    }
    for what, (data, expected) in cases.items():
        with pytest.raises(ConfigError) as info:
            ConfigLayers().merge_file(data, "config")
        assert str(info.value).startswith(expected), what


def test_a_dotted_name_as_a_dict_key_says_to_nest_it():
    layers = ConfigLayers()
    with pytest.raises(ConfigError) as info:
        layers.merge_file({"train.inner_steps": 20}, "config")
    assert str(info.value) == ("config: 'train.inner_steps' is not a section: in a dict write "
                               "{'train': {'inner_steps': ...}}, in a TOML file `inner_steps = ...` under [train]")


def test_wrong_value_names_file_key_and_allowed_values(tmp_path):
    path = write(tmp_path, '[sync]\ncodec = "int9"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    message = str(info.value)
    assert str(path) in message
    assert "[sync] codec" in message and "int9" in message
    for allowed in CODEC_CHOICES:
        assert f"'{allowed}'" in message


def test_wrong_type_names_the_key(tmp_path):
    path = write(tmp_path, '[train]\ninner_steps = "many"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(path) in str(info.value) and "[train] inner_steps" in str(info.value)


def test_a_boolean_for_a_number_is_refused_and_numbers_as_strings_still_convert(tmp_path):
    # pydantic's lax mode took true as 1 and false as 0: one inner step a round, seed 0.
    path = write(tmp_path, "[train]\ninner_steps = true\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert str(info.value) == (f"invalid configuration: {path}: [train] inner_steps = true is invalid: "
                               "expected a number, got the boolean true")
    for override in ("train.seed=false", "train.lr=true", "node.max_rounds=true"):  # int, float, int | None
        with pytest.raises(ConfigError, match="got the boolean"):
            load_config(overrides=[override], environ={})
    config = load_config(overrides=["node.client_mode=true", "train.inner_steps=50.0"],
                         environ={"LOWCOMM_METRICS_PORT": "9100", "LOWCOMM_PEERS": A_PEER})
    assert (config.node.client_mode, config.train.inner_steps, config.node.metrics_port) == (True, 50, 9100)



def test_a_boolean_for_a_period_in_a_table_of_numbers_is_refused(tmp_path):
    # state_sync = {exp_avg = true} synced exp_avg every round (true read as 1).
    path = write(tmp_path, "[sync]\nstate_sync = {exp_avg = true}\n")
    with pytest.raises(ConfigError, match="exp_avg = true: expected a number, got a boolean"):
        load_config(path, environ={})
    assert load_config(write(tmp_path, "[sync]\nstate_sync = {exp_avg = 3}\n"), environ={}).sync.state_sync == {
        "exp_avg": 3}


def test_a_list_in_factory_kwargs_is_one_error_naming_the_key(tmp_path):
    # pydantic reported one line per type of the union (string, integer, number, boolean), none
    # naming the key.
    path = write(tmp_path, '[model]\nfactory = "tests.factory_model:build"\nfactory_kwargs = {width = 48, '
                           'sizes = [1, 2]}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "\n" not in str(info.value)
    assert "sizes = [1, 2]: a keyword's value must be a string, number or boolean" in str(info.value)

@pytest.mark.parametrize("host", ["localhost", "node-1.example", "127.0.0.1:7700"])
def test_a_listen_host_that_is_not_an_ip_address_is_refused_naming_what_to_give(host):
    # p2pd takes no name in its listen multiaddr: `--host localhost` was its Go log line.
    with pytest.raises(ConfigError, match=r"\[node\] host = .* is invalid: not an IP address: give an address of this "
                                          r"machine \(127.0.0.1 for loopback, 0.0.0.0 for every interface\)"):
        load_config(overrides=[f"node.host={host}"], environ={})
    for address in ("127.0.0.1", "0.0.0.0", "::1", "::"):
        assert load_config(overrides=[f"node.host={address}"], environ={}).node.host == address

@pytest.mark.parametrize("host", ["bad host", "node-1.example:7701", "http://node-1.example", "-node.example",
                                  "node..example", "10.0.0.256", "a" * 64 + ".example", "[node.example]"])
def test_an_announce_host_peers_cannot_dial_is_refused_naming_what_to_give(host):
    # `--announce-host 'bad host'` was announced to peers as "bad host:34713", which none could reach.
    with pytest.raises(ConfigError, match=r"\[node\] announce_host = .* is invalid: not a host name or IP address: "
                                          r"give the DNS name or address other peers reach this node at"):
        load_config(overrides=[f"node.announce_host={host!r}"], environ={})
    with pytest.raises(ConfigError, match="announce_host"):
        load_config(environ={"LOWCOMM_ANNOUNCE_HOST": host})


def test_announce_host_takes_names_and_addresses_and_brackets_ipv6():
    for host in ("node-1.example", "node-1.example.", "localhost", "lowcomm_peer_1", "10.0.0.5", "xn--bcher-kva.ch"):
        assert load_config(overrides=[f"node.announce_host={host!r}"], environ={}).node.announce_host == host
    # Announced as "<host>:<grpc port>": "::1:7701" would not read as an address and a port.
    for host in ("::1", "[::1]", "2001:db8::7"):
        announced = load_config(overrides=[f"node.announce_host={host!r}"], environ={}).node.announce_host
        assert announced == "[" + host.strip("[]") + "]"
    assert load_config(environ={}).node.announce_host is None


@pytest.mark.parametrize("override", ["sync.outer_lr=inf", "train.lr=nan", "sync.reduce_timeout=inf",
                                      "train.weight_decay=inf", "sync.quorum=nan"])
def test_inf_and_nan_are_refused(override):
    # sync.outer_lr=inf committed NaN global parameters to the checkpoint; train.lr=nan trained NaN.
    with pytest.raises(ConfigError, match=r"= (inf|nan) is invalid: Input should be a finite number"):
        load_config(overrides=[override], environ={})


def test_learning_rates_that_can_only_blow_up_are_refused_and_say_why():
    # lr=1e308 was a traceback from torch's Adam step; weight_decay=1e308 diverged every round, forever.
    for override in ("train.lr=1e308", "sync.outer_lr=11"):
        with pytest.raises(ConfigError, match="less than or equal to 10"):
            load_config(overrides=[override], environ={})
    with pytest.raises(ConfigError, match=r"lr × weight_decay is 1\.5: each step scales the weights by 1 − lr·weight_decay"):
        load_config(overrides=["train.lr=0.5", "train.weight_decay=3"], environ={})
    assert load_config(overrides=["train.lr=0.5", "train.weight_decay=1.9"], environ={}).train.weight_decay == 1.9


def test_out_of_range_value(tmp_path):
    path = write(tmp_path, "[sync]\ngroup_size = 1\n")
    with pytest.raises(ConfigError, match=r"\[sync\] group_size"):
        load_config(path, environ={})


@pytest.mark.parametrize("var,value,key", [("LOWCOMM_GRPC_PORT", "seventy", "grpc_port"),
                                           ("LOWCOMM_GRPC_PORT", "70000", "grpc_port"),
                                           ("LOWCOMM_CLIENT_MODE", "perhaps", "client_mode"),
                                           ("LOWCOMM_LOG_FORMAT", "xml", "log_format")])
def test_bad_env_value_names_the_variable(var, value, key):
    with pytest.raises(ConfigError) as info:
        load_config(environ={var: value})
    assert f"environment variable {var}" in str(info.value)
    assert f"[node] {key}" in str(info.value)


def test_bad_flag_value_names_the_flag():
    with pytest.raises(ConfigError, match="flag --metrics-port"):
        load_config(flags={"metrics_port": -1}, environ={})


@pytest.mark.parametrize("text", ["sync.codec", "codec=int4", ".codec=int4", "sync.=int4", "=int4"])
def test_bad_set_syntax(text):
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        parse_override(text)
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        load_config(overrides=[text], environ={})


def test_bad_set_value_names_the_override():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["sync.codec=int9"], environ={})
    assert "--set sync.codec=int9" in str(info.value)
    with pytest.raises(ConfigError, match=r"unknown key 'nope' in \[sync\]"):
        load_config(overrides=["sync.nope=1"], environ={})


def test_all_problems_reported_at_once(tmp_path):
    path = write(tmp_path, '[sync]\ncodec = "int9"\ngroup_size = 0\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "codec" in str(info.value) and "group_size" in str(info.value)
    assert str(info.value).startswith("invalid configuration:\n  ")  # one line per problem


def test_a_single_problem_is_one_line(tmp_path):
    # The CLI's error line said only "invalid configuration:", the key on a second line.
    path = write(tmp_path, '[train]\ninner_steps = 0\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"invalid configuration: {path}: [train] inner_steps = 0 is invalid: ")


# -- fingerprint --------------------------------------------------------------------------------


def fingerprint(*overrides: str) -> str:
    return load_config(overrides=list(overrides), environ={}).run_fingerprint()


def test_fingerprint_ignores_node_and_sync_timeouts():
    base = fingerprint()
    assert fingerprint("node.grpc_port=1", "node.client_mode=true", f"node.peers=['{A_PEER}']",
                       "node.log_level=debug") == base
    assert fingerprint("sync.matchmaking_timeout=3", "sync.reduce_timeout=4") == base
    assert load_config(environ={"LOWCOMM_METRICS_PORT": "0"}).run_fingerprint() == base


@pytest.mark.parametrize("override", ["sync.codec=int4", "train.inner_steps=51", "sync.group_size=3",
                                      "sync.outer_lr=0.5", "model.preset=small", "run.name=other",
                                      "data.seq_len=64", "train.seed=1"])
def test_fingerprint_changes_with_run_config(override):
    assert fingerprint(override) != fingerprint()


def test_fingerprint_is_the_hash_of_the_canonical_json():
    import hashlib
    import json

    cfg = load_config(overrides=["sync.codec=int4"], environ={})
    text = cfg.run_config_json()
    assert json.loads(text)["sync"]["codec"] == "int4"
    assert "node" not in json.loads(text)
    assert cfg.run_fingerprint() == hashlib.sha256(text.encode()).hexdigest()


# -- init-config --------------------------------------------------------------------------------


def test_rendered_default_config_round_trips(tmp_path):
    text = render_default_config()
    parsed = tomllib.loads(text)
    assert set(parsed) == {"run", "model", "data", "train", "sync", "node"}
    assert parsed["sync"]["codec"] == Config().sync.codec
    path = write(tmp_path, text)
    assert load_config(path, environ={}) == Config()


def test_rendered_config_documents_the_model_and_data_plug_ins(tmp_path):
    text = render_default_config()
    for key in ("factory", "factory_kwargs", "hf_config", "hf_pretrained", "format", "tokenizer", "token_dtype",
                "field", "micro_batches"):
        assert f"{key} = " in text, key
    # The rendered file names preset = "tiny" explicitly; adding a model of another kind still works.
    model_json = tmp_path / "config.json"
    model_json.write_text('{"model_type": "llama"}')
    path = write(tmp_path, text.replace('[model]\n', f'[model]\nhf_config = "{model_json}"\n', 1))
    assert load_config(path, environ={}).model.kind == "hf_config"


# -- the ring schedule --------------------------------------------------------------------------


def test_ring_schedule_enters_the_fingerprint_and_the_default_keeps_old_ones():
    assert "schedule" not in load_config(environ={}).run_config()["sync"]
    assert fingerprint("sync.schedule=butterfly") == fingerprint()
    assert fingerprint("sync.schedule=ring") != fingerprint()
    assert fingerprint("sync.schedule=auto") not in (fingerprint(), fingerprint("sync.schedule=ring"))


@pytest.mark.parametrize("schedule", ["ring", "auto"])
@pytest.mark.parametrize("override,needle", [("sync.aggregation=clipped_mean", "aggregation = \"mean\""),
                                             ("sync.codec=sparseloco", "sparse codec"),
                                             ("sync.mode=gossip", "mode = \"allreduce\"")])
def test_a_ring_needs_the_plain_mean_a_dense_codec_and_allreduce(schedule, override, needle):
    with pytest.raises(ConfigError, match=f"schedule = \"{schedule}\"") as err:
        load_config(overrides=[f"sync.schedule={schedule}", override], environ={})
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides, needle", [
    # Each fragment is synced once every inner_steps steps: a larger K synced empty fragments
    # (K beyond the parameter count) and, at K = 1e8, built a list of K bounds every round.
    (["sync.fragments=51"], "[sync] fragments = 51 is more than [train] inner_steps = 50"),
    (["train.inner_steps=4", "sync.fragments=8"], "[sync] fragments = 8 is more than [train] inner_steps = 4"),
    # Gossip takes the plain mean of its partners' parameters: it ran without the robust
    # aggregation asked for and said nothing.
    (["sync.mode=gossip", "sync.aggregation=trimmed_mean"], "mode = \"gossip\" averages its partners' parameters"),
    (["sync.mode=gossip", "sync.aggregation=clipped_mean"], "set aggregation = \"mean\" or mode = \"allreduce\""),
])
def test_settings_that_would_be_ignored_or_empty_are_refused(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, environ={})
    assert needle in str(err.value)
    load_config(overrides=["sync.fragments=50"], environ={})  # K = H: a round after every inner step


def test_a_rule_across_keys_names_the_sources_of_the_keys_it_relates(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[sync]\nmode = \"gossip\"\n")
    # Across sections: it used to say "config: [?] is invalid".
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides=["sync.overlap=delayed"], environ={})
    assert f"{path}, --set sync.overlap=delayed: [sync] overlap and fragments work with" in str(err.value)
    assert "[?]" not in str(err.value)
    # Within a section: it named the file only, which held neither value; then every source of
    # the section, the file with its unrelated quorum too.
    path.write_text("[sync]\nquorum = 1.0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides=["sync.schedule=ring", "sync.codec=topk"], environ={})
    assert "configuration: --set sync.schedule=ring, --set sync.codec=topk: [sync] is invalid: schedule" in str(err.value)
    # Flags of the same section that the rule does not relate are not blamed either.
    with pytest.raises(ConfigError) as err:
        load_config(flags={"client_mode": True, "grpc_port": 0, "dht_port": 0, "max_rounds": 1}, environ={})
    assert "invalid configuration: flag --client-mode: [node] is invalid: client_mode needs peers" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(flags={"grpc_port": 7777, "dht_port": 7777, "max_rounds": 2}, environ={})
    assert "invalid configuration: flag --grpc-port, flag --dht-port: [node] is invalid: dht_port and grpc_port " \
           "are both 7777" in str(err.value)


def test_two_servers_on_one_port_are_a_config_error():
    # The second server failed to bind with "is gRPC port 7700 already in use?", sending the user
    # looking for another process.
    with pytest.raises(ConfigError, match="dht_port and grpc_port are both 7700: the DHT, gRPC and metrics servers"):
        load_config(overrides=["node.grpc_port=7700"], environ={})
    load_config(overrides=["node.grpc_port=0", "node.dht_port=0", "node.metrics_port=0"], environ={})  # free ones


def test_client_mode_without_peers_is_refused_saying_what_to_give():
    # A client accepts no connection: alone it waited at step 0 forever ("no group formed").
    for source in ({"overrides": ["node.client_mode=true"], "environ": {}},
                   {"environ": {"LOWCOMM_CLIENT_MODE": "1"}}):
        with pytest.raises(ConfigError, match="client_mode needs peers: .* give --peers the multiaddr of a reachable node"):
            load_config(**source)
    assert load_config(environ={"LOWCOMM_CLIENT_MODE": "1", "LOWCOMM_PEERS": A_PEER}).node.client_mode


def test_a_relative_model_path_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch):
    # A path in a TOML file is read from the current directory, not the file's: say so.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["model.hf_config=mymodel/config.json"], environ={})
    assert str(err.value).endswith("is neither a config.json file nor a directory holding one (relative paths, "
                                   f"also in a config file, are read from the current directory: {tmp_path})")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"model.hf_config={tmp_path}/mymodel/config.json"], environ={})
    assert str(err.value).endswith("is neither a config.json file nor a directory holding one")
