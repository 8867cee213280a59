"""The model plug-ins of node/models: presets, factories and Hugging Face causal LMs.

Everything runs on the CPU from files the tests write; nothing reaches a hub.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lowcomm.node.cli import main
from lowcomm.node.config import ConfigError, load_config
from lowcomm.node.data import DataError
from lowcomm.node.models import ModelError, build_model_for
from lowcomm.node.trainer import Trainer
from lowcomm.protocol.handshake import describe_difference

from .hf_assets import TINY_LLAMA, stdlib_text, write_byte_tokens, write_llama_config

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

SMALL = ["data.seq_len=32", "train.batch_size=4", "data.eval_batches=2", "node.device=cpu", "train.warmup_steps=0"]


def config(*overrides: str):
    return load_config(overrides=[*SMALL, *overrides], environ={})


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


@pytest.fixture
def tokens(tmp_path: Path) -> Path:
    return write_byte_tokens(tmp_path / "train.bin", 400_000)


@pytest.fixture
def text(tmp_path: Path) -> str:
    """A small text corpus (the default one, the whole standard library, takes seconds to read)."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(stdlib_text(300_000))
    return f"data.path={path}"


# -- Hugging Face models ---------------------------------------------------------------------------


def test_hf_config_model_is_identical_for_a_seed_and_trains(tmp_path, tokens):
    path = write_llama_config(tmp_path / "llama" / "config.json")
    base = [f"model.hf_config={path}", "data.format=tokens", f"data.path={tokens}"]
    one, two = (build_model_for(config(*base)) for _ in range(2))
    assert torch.equal(flat(one), flat(two))  # every peer starts from the same weights
    assert not torch.equal(flat(one), flat(build_model_for(config(*base, "train.seed=1"))))
    assert flat(one).numel() == json.loads(config(*base).run_config_json())["model"]["parameters"]

    trainer = Trainer(config(*base, "train.lr=3e-3"), "peer-a")
    before = trainer.evaluate()
    stats = trainer.train_phase(25, lambda: False)
    assert stats.steps == 25 and trainer.evaluate() < before - 0.5  # it learns the bytes' statistics


def test_hf_pretrained_loads_the_saved_weights_from_a_local_directory(tmp_path, tokens):
    path = write_llama_config(tmp_path / "llama" / "config.json")
    saved = build_model_for(config(f"model.hf_config={path}", "train.seed=5"))
    with torch.no_grad():
        for param in saved.parameters():
            param.add_(0.25)  # weights no seed would draw
    saved.net.save_pretrained(tmp_path / "weights")
    loaded = build_model_for(config(f"model.hf_pretrained={tmp_path / 'weights'}"))
    assert torch.equal(flat(loaded), flat(saved))


def test_a_hub_name_instead_of_a_path_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not a local directory.*no hub"):
        config("model.hf_pretrained=someone/some-model")
    code = main(["join", "--checkpoint-dir", str(tmp_path / "c"), "--set", "model.hf_pretrained=someone/some-model"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    # The command it names is the one huggingface_hub installs now (`huggingface-cli` was retired).
    assert err.startswith("lowcomm-node: error:") and "`hf download someone/some-model --local-dir DIR`" in err


def test_only_one_kind_of_model_at_a_time(tmp_path):
    path = write_llama_config(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="set one of preset, factory, hf_config"):
        config(f"model.hf_config={path}", "model.factory=tests.factory_model:build")
    with pytest.raises(ConfigError, match="neither a config.json"):
        config(f"model.hf_config={tmp_path / 'missing.json'}")


def test_seq_len_beyond_the_models_positions_is_refused(tmp_path):
    path = write_llama_config(tmp_path / "config.json", max_position_embeddings=16)
    with pytest.raises(ModelError, match="max_position_embeddings 16"):
        build_model_for(config(f"model.hf_config={path}"))


# -- the fingerprint --------------------------------------------------------------------------------


def test_fingerprint_follows_the_model_not_its_path_or_formatting(tmp_path):
    a = write_llama_config(tmp_path / "a" / "config.json")
    # Same model written elsewhere, with other key order, whitespace and writer version.
    b = tmp_path / "b" / "config.json"
    b.parent.mkdir()
    b.write_text(json.dumps({"transformers_version": "0.0", **dict(reversed(list(TINY_LLAMA.items())))}))
    assert config(f"model.hf_config={a}").run_fingerprint() == config(f"model.hf_config={b.parent}").run_fingerprint()

    wider = write_llama_config(tmp_path / "c" / "config.json", hidden_size=96)
    ours, theirs = config(f"model.hf_config={a}"), config(f"model.hf_config={wider}")
    assert ours.run_fingerprint() != theirs.run_fingerprint()
    difference = describe_difference(ours.run_config_json(), theirs.run_config_json(), "A", "B")
    assert "[hf_config] hidden_size: A 64, B 96" in difference
    assert "[model] parameters" in difference and "[model] shapes_sha256" in difference
    # A preset and an HF model, or two factories, differ in a named key too.
    assert "[model]" in describe_difference(config().run_config_json(), ours.run_config_json())


def test_factory_fingerprint_covers_name_arguments_and_shapes():
    plain = config("model.factory=tests.factory_model:build")
    body = json.loads(plain.run_config_json())["model"]
    assert body["factory"] == "tests.factory_model:build" and body["parameters"] > 0
    wider = config("model.factory=tests.factory_model:build", "model.factory_kwargs={ width = 48 }")
    difference = describe_difference(plain.run_config_json(), wider.run_config_json())
    assert "factory_kwargs" in difference and "shapes_sha256" in difference


# -- factories --------------------------------------------------------------------------------------


@pytest.mark.parametrize("factory", ["tests.factory_model:build", "tests.factory_model:build_pair"])
def test_factory_models_are_seeded_and_train(factory, text):
    cfg = config(f"model.factory={factory}", "train.lr=1e-2", text)
    assert torch.equal(flat(build_model_for(cfg)), flat(build_model_for(cfg)))
    rng = torch.get_rng_state()
    trainer = Trainer(cfg, "peer-a")
    assert torch.equal(torch.get_rng_state(), rng)  # building did not move the process's RNG
    before = trainer.evaluate()
    trainer.train_phase(20, lambda: False)
    assert trainer.evaluate() < before


@pytest.mark.parametrize("factory, message", [
    ("tests.factory_model:build_half", "torch.float16 parameters"),
    ("tests.factory_model:build_nothing", "returned int"),
    ("tests.factory_model:missing", "has no function missing"),
    ("math:pi", r"math.pi is a float, not a function that builds the model"),
    ("tests.no_such_module:build", "cannot import tests.no_such_module"),
    ("tests.factory_model:build_logits_only",
     r"the module's forward\(inputs\) cannot be called as \(inputs, targets\).*"
     r"return \(module, loss_fn\)"),
    ("tests.factory_model:build_unary_loss",
     r"loss_fn\(logits\) cannot be called as \(output, targets\)"),
])
def test_factories_that_break_the_contract_say_how(factory, message):
    with pytest.raises(ModelError, match=message):
        build_model_for(config(f"model.factory={factory}"))


@pytest.mark.parametrize("overrides, message", [
    (["model.factory=tests.factory_model:build_buggy"],
     r"factory 'tests.factory_model:build_buggy' raised ValueError when called with factory_kwargs \{\}: a bug"),
    (["model.factory=tests.factory_model:build", "model.factory_kwargs={ widht = 48 }"],
     r"raised TypeError when called with factory_kwargs \{'widht': 48\}: .*unexpected keyword argument 'widht'"),
])
def test_a_factory_that_raises_is_one_model_error_naming_the_call(overrides, message):
    # The run fingerprint (the shapes, on meta then for real) and the build both call the factory:
    # either way the node ends with one line, not the user's traceback twice.
    with pytest.raises(ModelError, match=message):
        build_model_for(config(*overrides))
    with pytest.raises(ModelError, match=message):
        config(*overrides).run_fingerprint()


def test_a_factory_that_exits_is_one_model_error_not_a_silent_exit(capsys):
    # argparse in the factory read the node's argv and exited: `join` ended with code 2 and
    # argparse's usage line of another program, and a sys.exit(0) in it ended the node with 0, silently.
    with pytest.raises(ModelError, match=r"'tests.factory_model:build_parsing_argv' called exit\(2\) .*must not "
                                         r"parse the command line"):
        build_model_for(config("model.factory=tests.factory_model:build_parsing_argv"))


@pytest.mark.parametrize("source, message", [
    ("x = 1 / 0\n", r"importing broken_model raised ZeroDivisionError at .*broken_model.py:1: division by zero"),
    ("def build(:\n", r"importing broken_model raised SyntaxError at .*broken_model.py:1: invalid syntax"),
    ("import argparse\nargparse.ArgumentParser(prog='x').parse_args(['--zz'])\n",
     r"importing broken_model called exit\(2\); .* under `if __name__ == \"__main__\":`"),
])
def test_a_factory_module_whose_import_fails_is_one_model_error_naming_the_line(tmp_path, monkeypatch, capsys,
                                                                                source, message):
    # Only an ImportError was caught: a bug at the module's top level reached the user as a traceback.
    (tmp_path / "broken_model.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelError, match=message):
        build_model_for(config("model.factory=broken_model:build"))
    with pytest.raises(ModelError, match=message):
        config("model.factory=broken_model:build").run_fingerprint()


def test_token_ids_beyond_an_unlabelled_embedding_name_the_embedding():
    # No vocab_size attribute: the ids reach the embedding, whose IndexError alone said nothing of why.
    model = build_model_for(config("model.factory=tests.factory_model:build_unlabelled"))
    ids = torch.tensor([[3, 255, 7]])
    with pytest.raises(ModelError, match=r"token id 255, but embedding '0' holds 100 ids.*vocab_size"):
        model(ids, ids)
    assert model(ids % 100, ids % 100)[1].ndim == 0  # ids within its vocabulary train


def test_a_factory_whose_loss_is_not_a_scalar_is_named():
    cfg = config("model.factory=tests.factory_model:build_pair")
    model = build_model_for(cfg)
    model.loss_fn = lambda logits, targets: logits  # type: ignore[assignment]
    with pytest.raises(ModelError, match="scalar float tensor, got a \\(2, 4, 256\\)"):
        model(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


# -- gradient accumulation and vocabularies ---------------------------------------------------------


def test_micro_batches_accumulate_and_count_their_tokens(text):
    one = Trainer(config("train.micro_batches=1", text), "peer-a")
    three = Trainer(config("train.micro_batches=3", text), "peer-a")
    stats = three.train_phase(2, lambda: False)
    assert stats.steps == 2 and stats.tokens == 2 * 3 * 4 * 32
    assert three.inner_steps_done == 2
    # The accumulated gradient is that of the three batches together (mean of the means).
    batches = [one.sampler.next_batch() for _ in range(3)]
    one.model.zero_grad()
    for inputs, targets in batches:
        (one.model(inputs, targets)[1] / 3).backward()
    accumulated = [p.grad.clone() for p in one.params]
    one.model.zero_grad()
    inputs, targets = (torch.cat(parts) for parts in zip(*batches))
    one.model(inputs, targets)[1].backward()
    for got, want in zip(accumulated, (p.grad for p in one.params)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_data_outside_the_models_vocabulary_is_refused(tmp_path):
    path = write_llama_config(tmp_path / "config.json", vocab_size=128)
    ids = tmp_path / "ids.bin"
    (np.arange(200_000) % 251).astype(np.uint16).tofile(ids)  # ids up to 250: every window has some >= 128
    with pytest.raises(DataError, match="outside the model's vocabulary of 128"):
        Trainer(config(f"model.hf_config={path}", "data.format=tokens", f"data.path={ids}"), "peer-a")
    text = tmp_path / "corpus.txt"
    text.write_bytes(stdlib_text(100_000))
    with pytest.raises(DataError, match=r"vocabulary of 256, more than the model's 128: set \"vocab_size\" to 256 or "
                                        r"more in the config.json of \[model\] hf_config"):
        Trainer(config(f"model.hf_config={path}", f"data.path={text}"), "peer-a")
