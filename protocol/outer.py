"""The outer optimizer: Nesterov SGD applied to averaged pseudo-gradients (DiLoCo).

The pseudo-gradient is ``Δ = θ_global − θ_local``; with lr 1 and no momentum the step would move
θ_global exactly onto the (averaged) local weights. Everything runs on CPU in float32 with
elementwise ops, so every peer that applies the same Δ to the same state gets bit-identical
results. Steps can be restricted to slices: a shard whose average did not arrive is left alone
(its momentum too) so that all members stay identical.
"""

from __future__ import annotations

import torch


class NesterovOuter:
    def __init__(self, lr: float, momentum: float, momentum_buffer: torch.Tensor) -> None:
        self.lr = lr
        self.momentum = momentum
        self.buffer = momentum_buffer

    @classmethod
    def zeros(cls, lr: float, momentum: float, numel: int) -> "NesterovOuter":
        return cls(lr, momentum, torch.zeros(numel, dtype=torch.float32))

    def preview_slice(self, params_slice: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """The step ``step_slice`` would take, applied to ``params_slice`` only: the momentum
        buffer is not changed (eager overlap uses it to guess the next θ_global)."""
        buf = self.buffer[start:start + grad.numel()].mul(self.momentum).add_(grad)
        params_slice.sub_(grad.add(buf, alpha=self.momentum), alpha=self.lr)

    def step_slice(self, params: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """Apply one step to ``params[start:start+len(grad)]`` in place."""
        end = start + grad.numel()
        buf = self.buffer[start:end]
        # PyTorch's SGD(nesterov=True): buf = m*buf + g; update = g + m*buf.
        buf.mul_(self.momentum).add_(grad)
        update = grad.add(buf, alpha=self.momentum)
        params[start:end].sub_(update, alpha=self.lr)
