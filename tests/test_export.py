"""`lowcomm-node export`: the θ_global of a node's newest checkpoint as the model its users load
(a save_pretrained folder, or a state_dict), through the real CLI against checkpoints written by
the node's own writer (node/restore.py ``save``). tests/test_hf_cli.py exports the checkpoint of
a real swarm's peer."""

from __future__ import annotations

import errno
import json
import subprocess
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parameters_to_vector

from lowcomm.node import restore
from lowcomm.node.config import load_config
from lowcomm.node.export import ExportError, export
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.localswarm import node_command
from lowcomm.node.models import build_model_for
from lowcomm.protocol.snapshot import params_sha256

from .hf_assets import stdlib_text, train_tokenizer, write_llama_config

REPO = Path(__file__).resolve().parents[1]


def write_trained_checkpoint(run: list[str], directory: Path, step: int = 3) -> str:
    """A checkpoint of outer step ``step`` whose θ_global is not the initial weights (so that an
    export of the initial model would be told apart); returns its params hash."""
    config = load_config(overrides=[*run, f"node.checkpoint_dir={directory}"], environ={})
    initial = parameters_to_vector(build_model_for(config).parameters()).detach()
    trained = initial + 0.01 * torch.randn(initial.numel(), generator=torch.Generator().manual_seed(1))
    state = GlobalState.fresh(trained, config.sync.outer_lr, config.sync.outer_momentum)
    for _ in range(step):
        state.commit()
    restore.save(config, state.to_checkpoint(), {}, tokens_total=4096)
    return state.params_hash


def cli_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*node_command(), "export", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def sets(run: list[str]) -> list[str]:
    return [flag for key in run for flag in ("--set", key)]


def test_a_hugging_face_model_exports_as_a_folder_that_from_pretrained_and_a_new_run_load(tmp_path) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    tokenizer = train_tokenizer(tmp_path / "tokenizer.json", [stdlib_text(50_000).decode()], vocab_size=300)
    config_json = write_llama_config(tmp_path / "llama" / "config.json", vocab_size=320)
    run = [f"model.hf_config={config_json}", f"data.tokenizer={tokenizer}", "data.seq_len=64",
           "train.inner_steps=7"]
    digest = write_trained_checkpoint(run, tmp_path / "ck")

    done = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "model"), *sets(run))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"exported outer step 3 (params {digest[:12]}) from {tmp_path}/ck/step-000000003.ckpt "
                           f"to {tmp_path}/model; load {tmp_path}/model\n")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert params_sha256(parameters_to_vector(loaded.parameters()).detach()) == digest
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    about = json.loads((tmp_path / "model" / "lowcomm.json").read_text())
    assert about["outer_step"] == 3 and about["params_sha256"] == digest and about["tokens_total"] == 4096
    assert about["model"] == {"hf_config": str(config_json)} and about["tokenizer"] == "tokenizer.json"

    # Without the run's tokenizer the ids of the export would mean bytes: refused (it said "bytes").
    without = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "m2"),
                         *sets([key for key in run if not key.startswith("data.tokenizer")]))
    assert without.returncode == 1 and "[data] tokenizer_sha256: checkpoint '" in without.stderr, without.stderr
    assert not (tmp_path / "m2").exists()

    # A new run starts from it: [model] hf_pretrained builds θ_global's weights.
    again = load_config(overrides=[f"model.hf_pretrained={tmp_path / 'model'}", "data.seq_len=64"], environ={})
    assert params_sha256(parameters_to_vector(build_model_for(again).parameters()).detach()) == digest


@pytest.mark.parametrize("model", [["model.factory=tests.factory_model:build_pair",
                                    "model.factory_kwargs={ vocab_size = 256, width = 16 }"],
                                   ["model.preset=tiny"]], ids=["factory", "preset"])
def test_a_factory_or_preset_model_exports_its_own_modules_state_dict(tmp_path, model) -> None:
    run = [*model, "data.seq_len=64", "sync.codec=int4"]  # [sync] does not matter to an export
    digest = write_trained_checkpoint(run, tmp_path / "ck")
    done = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "model"),
                      *sets([*model, "data.seq_len=64"]))
    assert done.returncode == 0, done.stderr
    if "factory" in model[0]:  # without the run's settings: say so, not how the defaults differ from them
        bare = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "other"))
        assert (bare.returncode, bare.stderr) == (1, (
            f"lowcomm-node: error: the checkpoints in {tmp_path}/ck hold a model of [model] kind = 'factory', which "
            f"export builds from the run's own settings and files: give the run config the node ran with "
            f"(--config run.toml, or the same --set model.* and data.* flags)\n"))
    state = torch.load(tmp_path / "model" / "model.pt", weights_only=True)
    if "factory" in model[0]:
        from tests.factory_model import build_pair

        module, _ = build_pair(vocab_size=256, width=16)
        assert not any(name.startswith("net.") for name in state)  # the user's module, not our wrapper
    else:
        module = build_model_for(load_config(overrides=run, environ={}))
    module.load_state_dict(state)
    assert params_sha256(parameters_to_vector(module.parameters()).detach()) == digest
    assert json.loads((tmp_path / "model" / "lowcomm.json").read_text())["weights"] == "model.pt"


def test_a_preset_model_exports_without_its_run_config_from_what_the_checkpoint_says(tmp_path) -> None:
    run = ["model.preset=small", "model.dropout=0.1", "data.seq_len=64", "train.inner_steps=7"]
    digest = write_trained_checkpoint(run, tmp_path / "ck")
    done = cli_export("--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    module = build_model_for(load_config(overrides=run, environ={}))
    module.load_state_dict(torch.load(tmp_path / "model" / "model.pt", weights_only=True))
    assert params_sha256(parameters_to_vector(module.parameters()).detach()) == digest
    about = json.loads((tmp_path / "model" / "lowcomm.json").read_text())
    assert (about["model"], about["seq_len"]) == ({"preset": "small", "dropout": 0.1}, 64)


def test_mistakes_are_one_line_that_says_what_to_change_and_write_nothing(tmp_path) -> None:
    write_trained_checkpoint(["data.seq_len=64"], tmp_path / "ck")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    cases = {
        ("--out", str(tmp_path / "taken"), "--set", "data.seq_len=64"):
            f"--out {tmp_path}/taken exists and is not an empty folder; choose a new one (nothing was written)",
        ("--out", str(tmp_path / "m"), "--set", "data.seq_len=32"):
            f"the checkpoints in {tmp_path}/ck hold another model than the config describes ([data] seq_len: "
            f"checkpoint 64, config 32); give the run config the node ran with (--config, --set)",
        ("--out", str(tmp_path / "m"), "--checkpoint-dir", str(tmp_path / "none")):
            f"no checkpoint in {tmp_path}/none (a node writes one after each round and when it stops); "
            f"give the folder with --checkpoint-dir",
        ("--out", str(tmp_path / "no" / "m"), "--set", "data.seq_len=64"):
            f"--out {tmp_path}/no/m: its parent folder {tmp_path}/no does not exist",
        # Both said only "no checkpoint in" and "parent folder ... does not exist" of paths that exist.
        ("--out", str(tmp_path / "taken" / "notes.txt" / "m"), "--set", "data.seq_len=64"):
            f"--out {tmp_path}/taken/notes.txt/m: {tmp_path}/taken/notes.txt is a file, not a folder",
        ("--out", str(tmp_path / "m"), "--checkpoint-dir", str(tmp_path / "ck" / "step-000000003.ckpt")):
            f"--checkpoint-dir {tmp_path}/ck/step-000000003.ckpt is a file; give the folder that holds the node's "
            f"checkpoints (--checkpoint-dir {tmp_path}/ck): the newest usable one is exported",
    }
    for args, message in cases.items():
        if "--checkpoint-dir" not in args:
            args = (*args, "--checkpoint-dir", str(tmp_path / "ck"))
        done = cli_export(*args)
        assert (done.returncode, done.stderr) == (1, f"lowcomm-node: error: {message}\n"), args
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "taken"]
    done = cli_export("--checkpoint-dir", str(tmp_path / "ck"))  # no --out: argparse's usage line
    assert done.returncode == 2 and "the following arguments are required: --out" in done.stderr


def test_a_checkpoint_of_a_swarm_with_its_own_model_says_how_to_get_its_weights(tmp_path) -> None:
    from lowcomm.api_config import resolve_config

    model = torch.nn.Linear(4, 2)
    config = resolve_config({"node": {"checkpoint_dir": str(tmp_path / "ck")}}, None, model)
    params = parameters_to_vector(model.parameters()).detach()
    restore.save(config, GlobalState.fresh(params, 0.7, 0.9).to_checkpoint(), {}, tokens_total=1)
    with pytest.raises(ExportError, match=r"written by a lowcomm.Swarm for a model of its own \(no \[model\] "
                                          r"section\).*vector_to_parameters"):
        export(load_config(overrides=[f"node.checkpoint_dir={tmp_path / 'ck'}"], environ={}), tmp_path / "out")


def test_a_damaged_newest_checkpoint_exports_the_one_before(tmp_path) -> None:
    run = ["data.seq_len=64"]
    older = write_trained_checkpoint(run, tmp_path / "ck", step=2)
    write_trained_checkpoint(run, tmp_path / "ck", step=3)
    newest = tmp_path / "ck" / "step-000000003.ckpt"
    newest.write_bytes(newest.read_bytes()[:-100])  # cut short
    config = load_config(overrides=[*run, f"node.checkpoint_dir={tmp_path / 'ck'}"], environ={})
    done = export(config, tmp_path / "out")
    assert (done.outer_step, done.params_sha256) == (2, older)


def test_a_disk_that_refuses_the_write_leaves_no_partial_folder(tmp_path, monkeypatch) -> None:
    from lowcomm.node import export as export_module

    write_trained_checkpoint(["data.seq_len=64"], tmp_path / "ck")

    def full_disk(*_args) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from OSError(
            errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module.torch, "save", full_disk)
    config = load_config(overrides=["data.seq_len=64", f"node.checkpoint_dir={tmp_path / 'ck'}"], environ={})
    with pytest.raises(ExportError, match=f"could not write {tmp_path}/out: No space left on device; nothing was "
                                          f"exported"):
        export(config, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
