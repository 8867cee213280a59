"""Which of a model's parameters a swarm averages: the ones that train.

A model may hold parameters that do not train (``requires_grad=False``: the base weights of a
LoRA or adapter fine-tune, frozen embeddings). Their Δ is zero at every round, yet averaging
them would send the whole base at every round and hold θ_global, the outer momentum and a
snapshot of it in memory: for a fine-tune whose adapters are 1 % of the model, a hundred times
the bytes that matter. So a swarm averages the trainable parameters only, and the frozen ones
may be of any dtype (a bf16 base halves its memory; averaged parameters stay float32).

Which ones train is part of the run: every peer must average the same set, so the set comes
from the run's definition of the model, taken once (``averaged_mask``, in ``parameters()``
order):

* ``lowcomm-node``: the model the config's ``[model]`` section builds, as built (a ``factory``
  may freeze a base; the presets and Hugging Face models train everything). The fingerprint
  names the frozen parameters (their count and a digest of names and shapes:
  ``frozen_shapes``); their values, like the factory's code, are the run's to keep equal.
* ``lowcomm.Swarm`` without ``[model]``: the model given, as it is when the Swarm is made. No
  state download carries the frozen parameters, so a digest of their names, dtypes, shapes and
  values joins the fingerprint (``frozen_definition``): a peer with another base is refused.
* ``lowcomm.Swarm`` with ``[model]``: the config's model's set, as ``lowcomm-node`` peers of it
  average (lowcomm/api_config.py); a parameter the given model freezes beyond it is averaged
  with a zero Δ.

A parameter outside the set that trains later would drift apart between peers unnoticed, so
``TrainableSplit.check`` runs at every round boundary and stops the node with a message that
says so. The other way round (a parameter of the set frozen later, as when embeddings are frozen
after a warm-up) is harmless: its Δ is zero and it stays averaged.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from .errors import FatalError
from .models import shapes_digest


class TrainableSetChanged(FatalError):
    """A parameter the swarm does not average was unfrozen (see the module docstring)."""


def trainable_mask(model: nn.Module) -> list[bool]:
    """``requires_grad`` of each of the model's parameters, in ``parameters()`` order."""
    return [p.requires_grad for p in model.parameters()]


class TrainableSplit:
    """The model's parameters in ``parameters()`` order, split by ``averaged_mask`` (default:
    which require grad now) into the averaged ones and the frozen rest."""

    def __init__(self, model: nn.Module, averaged_mask: list[bool] | None = None) -> None:
        named = list(model.named_parameters())
        mask = trainable_mask(model) if averaged_mask is None else list(averaged_mask)
        if len(mask) != len(named):
            raise ValueError(f"a mask of {len(mask)} parameters for a model of {len(named)}")
        self.model = model
        self.averaged_mask = mask
        self.averaged_named = [(name, p) for (name, p), keep in zip(named, mask) if keep]
        self.averaged = [p for _, p in self.averaged_named]
        self.frozen = [(name, p) for (name, p), keep in zip(named, mask) if not keep]

    def select(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averaged ones of ``params``, the parameters of a copy of the model in the same
        order (``copy.deepcopy`` keeps it): the evaluator's replica."""
        return [p for p, keep in zip(params, self.averaged_mask) if keep]

    def check(self) -> None:
        """Raise ``TrainableSetChanged`` if a parameter outside the averaged set requires grad."""
        for name, param in self.frozen:
            if param.requires_grad:
                raise TrainableSetChanged(
                    f"parameter {name} was unfrozen, but the swarm does not average it (it was frozen when the run's "
                    f"set of averaged parameters was taken), so each peer would train it apart: keep it frozen, or "
                    f"start a new run (a new lowcomm.Swarm, or a [model] that trains it) to train it")


def frozen_shapes(frozen: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The fingerprint's words on parameters that are not averaged, by names and shapes only
    (a model built on the meta device has no values): their count and ``shapes_digest``. Empty
    when none is frozen, so the fingerprint of a model that trains everything is as before."""
    if not frozen:
        return {}
    count, digest = shapes_digest((name, tuple(param.shape)) for name, param in frozen)
    return {"frozen_parameters": count, "frozen_shapes_sha256": digest}


def frozen_definition(frozen: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The fingerprint's words on parameters that are not averaged, values included: their count
    and a SHA-256 of their names, dtypes, shapes and values (peers with other base weights
    differ). Empty when none is frozen."""
    if not frozen:
        return {}
    digest = hashlib.sha256()
    count = 0
    for name, param in frozen:
        data = param.detach()
        digest.update(f"{name}:{data.dtype}:{'x'.join(map(str, data.shape))};".encode())
        # Bytes of any dtype (bf16 has no numpy twin): one flat uint8 view of a CPU copy.
        digest.update(data.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
        count += data.numel()
    return {"frozen_parameters": count, "frozen_sha256": digest.hexdigest()}
