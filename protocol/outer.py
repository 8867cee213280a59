"""The outer optimizer: Nesterov SGD applied to averaged pseudo-gradients (DiLoCo).

The pseudo-gradient is ``Δ = θ_global − θ_local``; with lr 1 and no momentum the step would move
θ_global exactly onto the (averaged) local weights. Steps can be restricted to slices: a shard
whose average did not arrive is left alone (its momentum too) so that all members stay identical.

**Bit-identical on every CPU.** Every member applies the same decoded average to the same state
and must get the same bits, whatever its CPU kernels (torch's generic, AVX2, AVX-512 or NEON
code, chosen per machine or by ``ATEN_CPU_CAPABILITY``) and its thread count. So the step is
written as separate float32 multiplies and adds on CPU tensors, each an IEEE operation rounded
once, which every kernel computes identically and elementwise (no reduction, nothing whose order
depends on threads). Fused forms are avoided on purpose: ``add/sub(..., alpha=a)`` with ``a != 1``
(and ``addcmul``, ``lerp``, ``addcdiv``) are one fused multiply-add, rounded once, in the
vectorised kernels but a multiply and an add, rounded twice, in the generic ones, so peers on
different kernels would drift apart by an ulp per round and fall into a minority. The price is
that the result is no longer bit-equal to ``torch.optim.SGD(nesterov=True)`` on vectorised CPUs
(which uses those fused forms); it is equal to the same formula with two roundings
(tests/test_outer.py checks both).

**SparseLoCo's outer rule** (``[sync] method = "sparseloco"``) is this class with momentum 0 and
lr α: buf ← 0·buf + g = g exactly (0·finite is ±0, and ±0 + g is g), θ ← θ − α·g. Its momentum
lives in the codec's decayed error feedback instead (protocol/codecs/sparseloco.py).
"""

from __future__ import annotations

import torch


def _check_cpu_float32(name: str, t: torch.Tensor) -> None:
    # CUDA would round (and fuse) differently again: θ_global and its momentum stay on CPU.
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


class NesterovOuter:
    def __init__(self, lr: float, momentum: float, momentum_buffer: torch.Tensor) -> None:
        _check_cpu_float32("the momentum buffer", momentum_buffer)
        self.lr = lr
        self.momentum = momentum
        self.buffer = momentum_buffer

    @classmethod
    def zeros(cls, lr: float, momentum: float, numel: int) -> "NesterovOuter":
        return cls(lr, momentum, torch.zeros(numel, dtype=torch.float32))

    def _update(self, buf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``lr · (g + m·buf)`` for the new ``buf``, as a new tensor: three roundings, one per op."""
        update = buf.mul(self.momentum)
        update.add_(grad)
        update.mul_(self.lr)
        return update

    def preview_slice(self, params_slice: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """The step ``step_slice`` would take, applied to ``params_slice`` only: the momentum
        buffer is not changed (eager overlap uses it to guess the next θ_global)."""
        _check_cpu_float32("the parameters", params_slice)
        buf = self.buffer[start:start + grad.numel()].mul(self.momentum)
        buf.add_(grad)
        params_slice.sub_(self._update(buf, grad))

    def step_slice(self, params: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """Apply one step to ``params[start:start+len(grad)]`` in place.

        PyTorch's SGD(nesterov=True) with every multiply and add rounded on its own:
        buf ← round(round(m·buf) + g); θ ← round(θ − round(lr · round(g + round(m·buf)))).
        """
        _check_cpu_float32("the parameters", params)
        end = start + grad.numel()
        buf = self.buffer[start:end]
        buf.mul_(self.momentum)
        buf.add_(grad)
        params[start:end].sub_(self._update(buf, grad))
