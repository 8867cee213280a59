"""``lowcomm-node export``: the θ_global of a node's newest checkpoint as a model its users load.

A checkpoint holds θ_global as one flat float32 vector (with the outer momentum, residuals and
the inner optimizer's state, which only a node resuming needs). Export builds the run's model
from its ``[model]`` section, as a node does, copies θ_global into it and writes what the model's
own tools load:

* a Hugging Face model (``hf_config``, ``hf_pretrained``): a ``save_pretrained`` folder, which
  ``AutoModelForCausalLM.from_pretrained`` and a later run's ``[model] hf_pretrained`` load;
* a factory or preset model: ``model.pt``, the ``state_dict`` of the module (the factory's own
  module, without lowcomm's wrapper), for ``module.load_state_dict(torch.load(path))``;

and beside it ``lowcomm.json`` (the outer step, the params hash that ``lowcomm-node status``
shows, the run, the checkpoint) and the run's ``tokenizer.json`` when ``[data] tokenizer`` names
one. Buffers (BatchNorm's statistics...) are not averaged: they are the checkpointing peer's own
(node/buffers.py), or the model's initial ones in checkpoints written before they were saved.

Only the model has to match: the checkpoint's model description and sequence length are compared
with the config's, not its [train] or [sync] keys. The folder appears whole or not at all (written
beside it, then renamed), and reading a running node's checkpoints is safe: they are replaced by
renames, never rewritten in place.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowcomm import __version__

from ..protocol.handshake import describe_difference
from ..protocol.snapshot import params_sha256
from . import checkpoint
from .averaged_params import TrainableSplit
from .buffers import load_buffers
from .config import Config
from .trainer import copy_flat_into

# Top-level keys of a run config that describe the run rather than the model's weights.
NOT_THE_MODEL = ("run", "data", "train", "sync")


class ExportError(Exception):
    """Why nothing was exported, and what to change."""


@dataclass(frozen=True)
class Exported:
    out: Path
    outer_step: int
    params_sha256: str
    checkpoint: Path
    weights: str  # the file or folder users load


def model_part(run_config: dict[str, Any]) -> dict[str, Any]:
    """What of a run config fixes the model and what its ids mean: its model description, the
    sequence length (a preset's position embeddings) and the tokenizer (its content hash: an
    export without the run's tokenizer said "bytes" in lowcomm.json and wrote no tokenizer.json)."""
    part = {key: value for key, value in run_config.items() if key not in NOT_THE_MODEL}
    part["data"] = dict(run_config.get("data") or {"seq_len": None})
    return part


def checkpoint_preset(payload: dict[str, Any]) -> Config | None:
    """The run config's model as the checkpoint describes it, when that is all an export needs:
    a preset model with the byte tokenizer (its name, dropout and sequence length fix every
    shape). None for other models, whose files (a config.json, a tokenizer.json, a factory's
    module) the checkpoint names only by their content."""
    made_with = payload.get("run_config")
    if not isinstance(made_with, str):
        return None
    run = json.loads(made_with)
    model, data = run.get("model") or {}, run.get("data") or {}
    if set(model) != {"preset", "dropout"} or set(data) != {"seq_len"}:
        return None
    return Config.model_validate({"model": model, "data": data})


def _check_same_model(payload: dict[str, Any], config: Config, path: Path, described: bool) -> None:
    """``described``: the config says which model it is (--config, model or data settings, or a
    preset taken from the checkpoint)."""
    made_with = payload.get("run_config")
    if not isinstance(made_with, str):
        raise ExportError(f"{path} was written by a lowcomm too old to say which model it holds; export it with "
                          f"the lowcomm version that wrote it")
    theirs = model_part(json.loads(made_with))
    if (theirs.get("model") or {}).get("kind") == "external":
        raise ExportError(
            f"{path} was written by a lowcomm.Swarm for a model of its own (no [model] section), which only that "
            f"script can build: after its `with lowcomm.Swarm(...)` block the model holds θ_global, or load "
            f"swarm.state_dict()['params'] into it with torch.nn.utils.vector_to_parameters")
    if not described and (kind := (theirs.get("model") or {}).get("kind")) is not None:
        # Not how the default config differs from the run's: what to give.
        raise ExportError(f"the checkpoints in {path.parent} hold a model of [model] kind = {kind!r}, which export "
                          f"builds from the run's own settings and files: give the run config the node ran with "
                          f"(--config run.toml, or the same --set model.* and data.* flags)")
    ours = model_part(config.run_config())
    if theirs != ours:
        differs = describe_difference(json.dumps(theirs), json.dumps(ours), "checkpoint", "config")
        raise ExportError(f"the checkpoints in {path.parent} hold another model than the config describes ({differs}); "
                          f"give the run config the node ran with (--config, --set)")


def _free_folder(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty folder; choose a new one (nothing was written)")
    if out.parent.exists() and not out.parent.is_dir():
        raise ExportError(f"--out {out}: {out.parent} is a file, not a folder")
    if not out.parent.is_dir():
        raise ExportError(f"--out {out}: its parent folder {out.parent} does not exist")


def _write(model: torch.nn.Module, config: Config, folder: Path) -> str:
    """Write the model's weights into ``folder``; the name of what users load."""
    kind = config.model.kind
    if kind in ("hf_config", "hf_pretrained"):
        model.net.save_pretrained(folder)  # config.json and model.safetensors
        return "."
    module = model.net if kind == "factory" else model  # the user's own module, not our wrapper
    torch.save(module.state_dict(), folder / "model.pt")
    return "model.pt"


def _model_section(config: Config) -> dict[str, Any]:
    """The [model] keys that say what was exported (paths as the config gives them)."""
    section = config.model
    if section.kind == "preset":
        return {"preset": section.preset, "dropout": section.dropout}
    if section.kind == "factory":
        return {"factory": section.factory, "factory_kwargs": section.factory_kwargs or {}}
    return {section.kind: getattr(section, section.kind)}


def export(config: Config, out: Path, model_given: bool = True) -> Exported:
    """Export the newest usable checkpoint of ``config.node.checkpoint_dir`` into ``out``.
    ``model_given`` False: the config does not describe the model (no --config, no [model] or
    [data] settings), and a preset model is taken from the checkpoint's own run config."""
    from .models import build_model_for

    directory = config.node.checkpoint_dir
    _free_folder(out)
    if directory.is_file():  # a checkpoint file given for its folder: "no checkpoint in" it said no more
        raise ExportError(f"--checkpoint-dir {directory} is a file; give the folder that holds the node's "
                          f"checkpoints (--checkpoint-dir {directory.parent}): the newest usable one is exported")
    if not checkpoint.list_checkpoints(directory):
        raise ExportError(f"no checkpoint in {directory} (a node writes one after each round and when it stops); "
                          f"give the folder with --checkpoint-dir")

    def parse(payload: dict[str, Any]) -> dict[str, Any]:
        params = payload["params"]
        if not isinstance(params, torch.Tensor) or params_sha256(params) != payload.get("params_sha256"):
            raise ValueError("its parameters do not match the hash stored with them")
        return payload

    found = checkpoint.load_newest(directory, parse)
    if found is None:
        raise ExportError(f"no usable checkpoint in {directory}: every one is damaged (see the lines above)")
    payload, path = found
    described = None if model_given else checkpoint_preset(payload)
    if described is not None:
        config = config.model_copy(update={"model": described.model, "data": described.data})
    _check_same_model(payload, config, path, described=model_given or described is not None)
    model = build_model_for(config)
    params = payload["params"]
    copy_flat_into(TrainableSplit(model).averaged, params)  # a factory's frozen base: as the factory built it
    trainer_state = payload.get("trainer")
    if isinstance(trainer_state, dict) and "buffers" in trainer_state:
        # The peer's own buffers (BatchNorm's statistics: node/buffers.py); older checkpoints hold
        # none, and the model keeps its initial ones.
        try:
            load_buffers(model, trainer_state["buffers"])
        except ValueError as err:
            raise ExportError(f"checkpoint {path}: {err}; export with the run config that wrote it") from None

    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        partial.mkdir()
        weights = _write(model, config, partial)
        tokenizer = config.data.tokenizer
        if tokenizer != "bytes":
            shutil.copyfile(Path(tokenizer).expanduser(), partial / "tokenizer.json")
        about = {
            "outer_step": int(payload["step"]), "params_sha256": payload["params_sha256"],
            "run": config.run.name, "model": _model_section(config),
            "seq_len": config.data.seq_len, "tokenizer": "bytes" if tokenizer == "bytes" else "tokenizer.json",
            "weights": weights, "tokens_total": int(payload.get("tokens_total", 0)),
            "checkpoint": str(path), "lowcomm_version": __version__,
        }
        (partial / "lowcomm.json").write_text(json.dumps(about, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        partial.rename(out)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        reason = checkpoint.system_error(err) if isinstance(err, Exception) else None
        if reason is not None:
            raise ExportError(f"could not write {out}: {reason.strerror or reason}; nothing was exported") from err
        raise
    return Exported(out, int(payload["step"]), payload["params_sha256"], path,
                    str(out) if weights == "." else str(out / weights))
