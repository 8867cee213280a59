"""The four ways a run defines its model, behind one interface.

* ``preset``: lowcomm's byte-level GPT (node/model.py);
* ``factory``: the user's own torch module, built by ``package.module:function`` (factory.py);
* ``hf_config`` / ``hf_pretrained``: a Hugging Face transformers causal LM from a local
  config.json (random init) or a local weights directory (hf.py).

Every kind comes out of ``build_model_for`` as a ``torch.nn.Module`` called as
``model(inputs, targets) -> (logits or None, loss)``, the calling convention of the preset GPT, so the
trainer, the evaluator replica and the benchmarks drive all kinds the same way. Its parameters are
float32 (θ_global is a flat float32 vector); bf16 autocast on CUDA gives the speed.

``model_definition`` is what the run fingerprint says about the model: peers compare it before
they average, so two peers with different models are refused with the keys that differ.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from ..errors import FatalError

if TYPE_CHECKING:
    from ..config import Config, ModelSection


class ModelError(FatalError):
    """The configured model cannot be built; the message says why and what to change."""


def shapes_digest(named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[int, str]:
    """(parameter count, SHA-256 over the parameters' names and shapes in order): equal for two
    models exactly when their flat parameter vectors line up."""
    digest = hashlib.sha256()
    total = 0
    for name, shape in named_shapes:
        digest.update(f"{name}:{'x'.join(map(str, shape))};".encode())
        count = 1
        for size in shape:
            count *= size
        total += count
    return total, digest.hexdigest()


def model_definition(section: "ModelSection") -> dict[str, dict[str, Any]]:
    """Sections of the run config that describe the model (``model``, and ``hf_config`` for the
    Hugging Face kinds, so a difference is named key by key, e.g. ``[hf_config] hidden_size``)."""
    return _definition_cached(section.model_dump_json())


@functools.lru_cache(maxsize=8)
def _definition_cached(section_json: str) -> dict[str, dict[str, Any]]:
    # Cached: the fingerprint is asked for at start-up and at every checkpoint, and the
    # definition may build the model on the meta device or call the user's factory.
    from ..config import ModelSection

    section = ModelSection.model_validate_json(section_json)
    if section.kind == "preset":
        # The preset name and the sequence length ([data] seq_len) fix every shape.
        return {"model": {"preset": section.preset, "dropout": section.dropout}}
    if section.kind == "factory":
        from .factory import factory_definition

        return {"model": factory_definition(section)}
    from .hf import hf_definition

    return hf_definition(section)


def build_model_for(config: "Config") -> torch.nn.Module:
    """The run's initial model on the CPU: identical on every peer with the same run config."""
    section, seed = config.model, config.train.seed
    if section.kind == "preset":
        from ..model import build_model, preset

        return build_model(preset(section.preset, config.data.seq_len, section.dropout), seed)
    if section.kind == "factory":
        from .factory import build_factory_model

        return build_factory_model(section, seed)
    from .hf import build_hf_model

    return build_hf_model(section, seed, config.data.seq_len)


def vocab_size_of(model: torch.nn.Module) -> int | None:
    """Token ids the model accepts (its embedding rows), or None where it does not say."""
    vocab = getattr(model, "vocab_size", None)
    if vocab is None and hasattr(model, "config"):
        vocab = getattr(model.config, "vocab_size", None)
    return int(vocab) if vocab is not None else None


def check_float32(model: torch.nn.Module, what: str, averaged: list[torch.Tensor] | None = None) -> None:
    """θ_global is one flat float32 vector: other dtypes of the ``averaged`` parameters (default:
    all of the model's) would be rounded at every round."""
    every = list(model.parameters())
    params = every if averaged is None else averaged
    others = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if others:
        some_frozen = len(params) < len(every)
        which = "trainable parameters" if some_frozen else "parameters"
        raise ModelError(f"{what} has {', '.join(others)} {which}; lowcomm trains float32 parameters "
                         "(and uses bf16 autocast on CUDA): build the model in float32"
                         + (" (its frozen parameters, requires_grad=False, may keep any dtype)" if some_frozen else ""))
    if not params:
        if every:
            raise ModelError(f"every parameter of {what} has requires_grad=False, so nothing would train or be "
                             f"averaged: unfreeze the parameters to train (param.requires_grad_(True)) before "
                             f"making the Swarm")
        raise ModelError(f"{what} has no parameters to train")


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """A block in which torch's global CPU RNG starts from ``seed`` and is restored after, so that
    building a model neither depends on nor disturbs any other random draw of the process.
    Models are built on the CPU, so the CUDA generators play no part in the initial weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
