"""Which of a ``lowcomm.Swarm`` model's parameters the swarm averages: the ones that train.

A model given to ``lowcomm.Swarm`` without a ``[model]`` section may hold parameters that do not
train (``requires_grad=False``: the base weights of a LoRA or adapter fine-tune, frozen
embeddings). Their Δ is zero at every round, yet averaging them would send the whole base at
every round and hold θ_global, the outer momentum and a snapshot of it in memory: for a
fine-tune whose adapters are 1 % of the model, a hundred times the bytes that matter. So such a
run averages its trainable parameters only, and the frozen ones may be of any dtype (a bf16 base
halves its memory; averaged parameters stay float32).

No state download carries the frozen parameters, so they must be equal on every peer: a digest
of their names, dtypes, shapes and values joins the run fingerprint (``frozen_definition``), and
a peer whose base weights differ is refused by the fingerprint check like any other run-config
difference. The split is taken when the Swarm is made; a parameter frozen or unfrozen after that
would drift apart between peers unnoticed, so ``TrainableSplit.check`` runs at every round
boundary and stops the node with a message that says so.

A run with a ``[model]`` section averages every parameter, frozen or not: it is the CLI's run,
and ``lowcomm-node`` peers of the same config train all of them.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from .errors import FatalError


class TrainableSetChanged(FatalError):
    """A parameter's ``requires_grad`` changed after the Swarm was made (see the module docstring)."""


class TrainableSplit:
    """The model's parameters in ``model.parameters()`` order, split into the averaged ones and
    the rest, as they were when the split was taken."""

    def __init__(self, model: nn.Module, every_parameter: bool) -> None:
        self.model = model
        self.every_parameter = every_parameter
        named = list(model.named_parameters())
        self.averaged_mask = [every_parameter or p.requires_grad for _, p in named]
        self.averaged_named = [(name, p) for (name, p), keep in zip(named, self.averaged_mask) if keep]
        self.averaged = [p for _, p in self.averaged_named]
        self.frozen = [(name, p) for (name, p), keep in zip(named, self.averaged_mask) if not keep]
        self._requires_grad = [p.requires_grad for _, p in named]

    def select(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The averaged ones of ``params``, the parameters of a copy of the model in the same
        order (``copy.deepcopy`` keeps it): the evaluator's replica."""
        return [p for p, keep in zip(params, self.averaged_mask) if keep]

    def check(self) -> None:
        """Raise ``TrainableSetChanged`` if a parameter was frozen or unfrozen since the split."""
        if self.every_parameter:
            return  # every parameter is averaged whatever trains
        for (name, param), before in zip(self.model.named_parameters(), self._requires_grad):
            if param.requires_grad != before:
                now = "unfrozen" if param.requires_grad else "frozen"
                what = ("it is not averaged, so each peer would train it apart" if param.requires_grad
                        else "peers still average it, but no longer train it")
                raise TrainableSetChanged(
                    f"parameter {name} was {now} after the lowcomm.Swarm was made ({what}); the swarm averages the "
                    f"parameters that require grad when the Swarm is made: set requires_grad before making it, and "
                    f"make a new Swarm (a new run) to train other parameters")


def frozen_definition(frozen: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """What the run fingerprint says about parameters that are not averaged: their count and a
    SHA-256 of their names, dtypes, shapes and values (peers with other base weights differ).
    Empty when none is frozen, so the fingerprint of a model that trains everything is as before."""
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
