"""Hugging Face transformers causal LMs from local files: a config.json (random initial weights
drawn from the run's seed) or a directory written by ``save_pretrained`` (its weights).

Nothing here reaches the hub: ``HF_HUB_OFFLINE`` is set before transformers is imported and
weights load with ``local_files_only``. Remote code (``auto_map`` architectures) is not run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ModelError, check_float32, seeded, shapes_digest

if TYPE_CHECKING:
    from ..config import ModelSection

# config.json keys that do not change the model lowcomm trains: the writer's version and path,
# the storage dtype (parameters are always loaded as float32) and the inference-only KV cache.
IGNORED_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"})


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the import: the hub client reads it once
    try:
        import transformers
    except ImportError:
        raise ModelError("[model] hf_config / hf_pretrained need the transformers package: "
                         "pip install 'lowcomm[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # bars on stderr would garble the node's log lines
    return transformers


def config_path(section: "ModelSection") -> Path:
    raw = Path(section.hf_config or section.hf_pretrained or "").expanduser()
    return raw / "config.json" if raw.is_dir() else raw


def read_config(section: "ModelSection") -> dict[str, Any]:
    path = config_path(section)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"[model] cannot read {path}: {err}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelError(f"[model] {path} is not a transformers config.json (it has no model_type)")
    return data


def load_config(section: "ModelSection") -> Any:
    """The transformers ``PretrainedConfig`` of ``section``'s config.json."""
    transformers = _transformers()
    data = read_config(section)
    path = config_path(section)
    model_type = data["model_type"]
    known = transformers.CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in known:
        # Checked here: transformers' own error lists all of its ~800 model types on one line.
        close = difflib.get_close_matches(str(model_type).lower(), list(known.keys()), n=3, cutoff=0.7)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ModelError(f"[model] {path}: model_type {model_type!r} is not one transformers "
                         f"{transformers.__version__} knows{hint}")
    try:
        return transformers.AutoConfig.for_model(**data)
    except Exception as err:  # noqa: BLE001 - whatever the config class raises, the config.json is at fault
        raise ModelError(f"[model] {path}: {_reason(err)}") from None


def _reason(err: BaseException, limit: int = 300) -> str:
    """The sentence that says what is wrong with a config: the cause under huggingface_hub's
    validation wrappers ("Class validation error for validator ...:"), on one line, without the
    final full stop, at most ``limit`` characters (some list every allowed value)."""
    while err.__cause__ is not None and type(err).__module__.startswith("huggingface_hub"):
        err = err.__cause__
    arg = err.args[0] if len(err.args) == 1 else None
    if isinstance(err, KeyError) and isinstance(arg, str) and " " in arg:
        text = arg  # a sentence in a KeyError: str() would quote it
    elif isinstance(err, KeyError):
        text = f"{type(err).__name__} {arg!r}"  # a bare key alone says nothing
    else:
        text = str(err) or type(err).__name__
    text = " ".join(text.split()).rstrip(".")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def hf_definition(section: "ModelSection") -> dict[str, dict[str, Any]]:
    """The run-config sections of a Hugging Face model: ``model`` (kind, hashes, parameter count)
    and ``hf_config`` (the config.json keys, so that a difference is named key by key)."""
    data = {key: value for key, value in read_config(section).items() if key not in IGNORED_KEYS}
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    transformers = _transformers()
    config = load_config(section)
    # The meta device gives every shape without allocating (or initialising) a single weight.
    with torch.device("meta"):
        try:
            net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except Exception as err:  # noqa: BLE001 - a config may validate yet not build (an unknown rope_type)
            raise ModelError(f"[model] {config_path(section)}: transformers cannot build the model: "
                             f"{_reason(err)}") from None
    parameters, shapes = shapes_digest((name, tuple(p.shape)) for name, p in net.named_parameters())
    model = {"kind": section.kind, "model_type": data["model_type"],
             "config_sha256": hashlib.sha256(canonical.encode()).hexdigest(),
             "parameters": parameters, "shapes_sha256": shapes}
    return {"model": model, "hf_config": json.loads(canonical)}


class CausalLM(nn.Module):
    """A transformers causal LM under the preset GPT's calling convention.

    The targets are the inputs shifted by one token already (node/data.py), so the loss is a plain
    cross-entropy over every position, in float32 (logits may be bf16 under autocast), and not the
    model's own ``labels=`` loss, which would shift a second time.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.vocab_size = int(net.get_input_embeddings().num_embeddings)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.net(input_ids=inputs, use_cache=False).logits
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def check_seq_len(section: "ModelSection", seq_len: int) -> None:
    """Refuse a ``[data] seq_len`` beyond the positions of ``section``'s model, from its config.json
    alone: the CLI asks before anything starts, where building the model found it only after the
    DHT's start (and building it here would start torch's threads before the DHT process forks)."""
    _check_positions(load_config(section), section, seq_len)


def _check_positions(config: Any, section: "ModelSection", seq_len: int) -> None:
    # The attribute, not the config.json key: transformers maps each model type's own name for
    # it (GPT-2's n_positions) onto max_position_embeddings.
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise ModelError(f"[data] seq_len {seq_len} is longer than the model's max_position_embeddings "
                         f"{positions} ({config_path(section)}): set seq_len to {positions} or less "
                         f"(--set data.seq_len={positions}), or use a model with more positions")


def build_hf_model(section: "ModelSection", seed: int, seq_len: int) -> CausalLM:
    transformers = _transformers()
    config = load_config(section)
    _check_positions(config, section, seq_len)
    auto = transformers.AutoModelForCausalLM
    # Seeded in both cases: from_pretrained initialises whatever the checkpoint lacks (a tied or
    # new head), and that must come out the same on every peer too.
    with seeded(seed):
        try:
            if section.kind == "hf_config":
                net = auto.from_config(config, dtype=torch.float32)
            else:
                net = auto.from_pretrained(str(Path(section.hf_pretrained or "").expanduser()), config=config,
                                           local_files_only=True, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise ModelError(f"[model] cannot load {section.hf_config or section.hf_pretrained}: {err}") from None
    model = CausalLM(net)
    check_float32(model, f"the model of {config_path(section)}")
    return model
