"""Evaluating θ_global on a replica of the model, in a thread of its own.

Every committed round is evaluated (the eval-loss gauge, ``status`` and the ``round_done``
event). In the training thread that would stop training at every boundary for a few percent of
an inner phase (4 eval batches against 20 inner steps of the tiny preset: about 6 %); on its
replica (parameters only, no optimizer state) it runs while training goes on. The replica
costs one more copy of the parameters.
"""

from __future__ import annotations

import copy

import torch

from .buffers import load_buffers
from .trainer import Trainer, copy_flat_into, mean_eval_loss


class Evaluator:
    """Eval loss of flat parameter vectors; call it from one thread (the node's report thread)."""

    def __init__(self, trainer: Trainer) -> None:
        # Built in the training thread while it is idle: the copy must not see a half-done step.
        self.model = copy.deepcopy(trainer.model)
        self.model.requires_grad_(False)
        self.params = trainer.split.select(list(self.model.parameters()))  # frozen ones stay the model's
        self.eval_set = trainer.eval_set  # read-only tensors, shared with the trainer
        self.device = trainer.device

    @torch.no_grad()
    def evaluate(self, flat: torch.Tensor, buffers: dict[str, torch.Tensor] | None = None) -> float:
        """``buffers``: the model's as the round left them (node/buffers.py), else the replica's."""
        copy_flat_into(self.params, flat)
        if buffers is not None:
            load_buffers(self.model, buffers)
        return mean_eval_loss(self.model, self.eval_set, self.device)
