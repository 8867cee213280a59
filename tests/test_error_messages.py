"""User-facing error messages that must stay one short, readable line: a config.json transformers
rejects, an unknown model_type, and a run-config difference where a whole section is one-sided."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lowcomm.node.config import load_config
from lowcomm.node.localswarm import node_command
from lowcomm.node.models import ModelError
from lowcomm.protocol.handshake import describe_difference

from .hf_assets import write_llama_config

SMALL = ["data.seq_len=32", "train.batch_size=4", "node.device=cpu"]


def config(*overrides: str):
    return load_config(overrides=[*SMALL, *overrides], environ={})


def model_error(path: Path) -> str:
    """The ModelError of the run fingerprint (the first thing the daemon computes) of ``path``."""
    with pytest.raises(ModelError) as info:
        config(f"model.hf_config={path}").run_config_json()
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


# -- a config.json transformers rejects ---------------------------------------------------------------


def test_a_config_json_transformers_rejects_is_one_model_error_with_its_reason(tmp_path):
    pytest.importorskip("transformers")
    path = write_llama_config(tmp_path / "bad.json", num_attention_heads=5)
    # Was huggingface_hub's StrictDataclassClassValidationError, which no handler caught: a traceback.
    assert model_error(path) == (f"[model] {path}: The hidden size (64) is not a multiple of the number of "
                                 f"attention heads (5)")


@pytest.mark.parametrize("changes, reason", [
    ({"hidden_size": "abc"}, "expected int, got str"),  # a field validator's TypeError
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "Missing required keys"),  # a KeyError
    ({"rope_scaling": {"rope_type": "bogus"}}, "'bogus'"),  # passes validation, fails building
])
def test_other_config_json_mistakes_are_one_model_error(tmp_path, changes, reason):
    pytest.importorskip("transformers")
    path = write_llama_config(tmp_path / "bad.json", **changes)
    message = model_error(path)
    assert message.startswith(f"[model] {path}: ") and reason in message, message


@pytest.mark.multiprocess
def test_the_cli_prints_a_rejected_config_json_as_one_line(tmp_path):
    pytest.importorskip("transformers")
    path = write_llama_config(tmp_path / "bad.json", num_attention_heads=5)
    result = subprocess.run(
        [*node_command(), "join", "--host", "127.0.0.1", "--dht-port", "0", "--grpc-port", "0", "--metrics-port", "0",
         "--torch-threads", "1", "--checkpoint-dir", str(tmp_path / "ckpt"), "--set", f"model.hf_config={path}"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lowcomm-node: error:")]
    assert errors == [f"lowcomm-node: error: [model] {path}: The hidden size (64) is not a multiple of the number "
                      f"of attention heads (5)"], result.stderr


# -- an unknown model_type ---------------------------------------------------------------------------


def test_an_unknown_model_type_is_named_without_listing_every_known_one(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = write_llama_config(tmp_path / "x.json", model_type="notamodel")
    # Was transformers' error: 12 KB naming every model type it knows.
    assert model_error(path) == (f"[model] {path}: model_type 'notamodel' is not one transformers "
                                 f"{transformers.__version__} knows")


def test_a_misspelt_model_type_suggests_the_close_ones(tmp_path):
    pytest.importorskip("transformers")
    message = model_error(write_llama_config(tmp_path / "x.json", model_type="Lama"))
    assert "model_type 'Lama' is not one transformers" in message and "did you mean 'llama'" in message, message


# -- run-config differences --------------------------------------------------------------------------


def test_a_section_on_one_side_only_is_one_item():
    ours = {"model": {"kind": "hf_config"}, "hf_config": {f"key{i}": i for i in range(15)}}
    theirs = {"model": {"kind": "preset"}}
    difference = describe_difference(json.dumps(ours), json.dumps(theirs), "checkpoint", "now")
    assert difference == "[hf_config]: only checkpoint has this section; [model] kind: checkpoint 'hf_config', now 'preset'"
    assert describe_difference(json.dumps(theirs), json.dumps(ours), "A", "B").startswith(
        "[hf_config]: only B has this section;")


def test_a_long_difference_names_the_first_six_and_counts_the_rest():
    ours = {"train": {f"k{i}": i for i in range(10)}}
    theirs = {"train": {f"k{i}": i + 1 for i in range(10)}}
    difference = describe_difference(json.dumps(ours), json.dumps(theirs), "A", "B")
    assert difference.startswith("[train] k0: A 0, B 1; [train] k1: A 1, B 2;")
    assert difference.count("[train]") == 6 and difference.endswith("; and 4 more"), difference


def test_ordinary_key_differences_read_as_before():
    ours = {"sync": {"codec": "int8"}, "train": {"inner_steps": 50, "lr": 0.001}}
    theirs = {"sync": {"codec": "int4"}, "train": {"inner_steps": 3, "lr": 0.001}}
    assert describe_difference(json.dumps(ours), json.dumps(theirs), "A", "B") == \
        "[sync] codec: A 'int8', B 'int4'; [train] inner_steps: A 50, B 3"


def test_a_preset_config_against_an_hf_checkpoint_stays_short(tmp_path):
    pytest.importorskip("transformers")
    hf = config(f"model.hf_config={write_llama_config(tmp_path / 'config.json')}").run_config_json()
    difference = describe_difference(hf, config().run_config_json(), "checkpoint", "now")
    # Was every [hf_config] key against None: 1.3 KB that buried the point.
    assert difference.startswith("[hf_config]: only checkpoint has this section; [model] ")
    assert "hidden_size" not in difference and difference.endswith(" more") and len(difference) < 600, difference


def test_a_node_refused_for_its_run_config_is_told_which_side_it_is_and_what_to_change():
    # The handshake names both sides by peer id (the other peer gets the same words); a volunteer
    # who pasted the join line without the swarm's --set flags could not tell which one was theirs.
    from lowcomm.node.errors import refused_by_the_swarm
    from lowcomm.protocol.handshake import Identity

    ours = Identity("QmMe", "f1", json.dumps({"data": {"seq_len": 128}}))
    theirs = Identity("QmThem", "f2", json.dumps({"data": {"seq_len": 64}}))
    with pytest.raises(Exception) as info:
        ours.check(theirs.hello())
    error = refused_by_the_swarm(str(info.value), "QmMe")
    assert str(error) == ("refused by the swarm: peer QmThem runs a different run config than peer QmMe: [data] "
                          "seq_len: QmMe 128, QmThem 64 (this node is QmMe: start it with the swarm's run config, "
                          "the same config file and overrides as its peers)")
    other = refused_by_the_swarm("peer QmThem speaks protocol version 3, this node speaks 4; run the same lowcomm "
                                 "release on both", "QmMe")
    assert "this node is" not in str(other)
