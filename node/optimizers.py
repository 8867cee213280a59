"""Inner optimizers beyond torch's AdamW: MT-DAO (multi-timescale distributed adaptive optimizer).

MT-DAO keeps two first moments of the gradient, a fast one (β_fast ≈ 0.9, the usual Adam
momentum) and a slow one (β_slow ≈ 0.99..0.999, a horizon of hundreds of steps, longer than an
inner phase), and Adam's second moment. Its step combines the two quasi-hyperbolically:

    m_f ← β_f·m_f + (1−β_f)·g          m_s ← β_s·m_s + (1−β_s)·g          v ← β2·v + (1−β2)·g²
    u   = (1−ω)·m_f/(1−β_f^t) + ω·m_s/(1−β_s^t)
    θ   ← θ·(1 − lr·wd) − lr · u / (√(v/(1−β2^t)) + ε)

with ω the slow moment's weight. The slow moment is what is worth averaging across the swarm
(``[sync] state_sync``, node/state_sync.py): over a short inner phase it moves little, so its
swarm-wide mean is a long-horizon direction every peer then follows, while the fast moment
tracks this peer's own recent gradients.

Below it: an inner optimizer's whole state read out as flat vectors and installed into another
optimizer, which is how a joiner of a state-sync run receives its donor's (``capture_states``,
``install_states``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol, runtime_checkable

import torch

from lowcomm.protocol.snapshot import OptimizerStates

from .config import STATE_NAMES  # the states [sync] state_sync may name, per [train] optimizer

if TYPE_CHECKING:
    from .config import Config

# States that must stay non-negative after a lossy average (a square's running mean).
NON_NEGATIVE = frozenset({"exp_avg_sq"})


class MTDAO(torch.optim.Optimizer):
    """Adam with a fast and a slow first moment mixed quasi-hyperbolically (module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, beta_fast: float = 0.9,
                 beta_slow: float = 0.99, beta2: float = 0.95, slow_weight: float = 0.5, eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        for name, value in (("beta_fast", beta_fast), ("beta_slow", beta_slow), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"MTDAO: {name} must be in [0, 1), got {value}")
        if not 0.0 <= slow_weight <= 1.0:
            raise ValueError(f"MTDAO: slow_weight must be in [0, 1], got {slow_weight}")
        if lr <= 0.0 or eps <= 0.0 or weight_decay < 0.0:
            raise ValueError("MTDAO: lr and eps must be positive, weight_decay non-negative")
        defaults = dict(lr=lr, beta_fast=beta_fast, beta_slow=beta_slow, beta2=beta2, slow_weight=slow_weight,
                        eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd, omega = group["lr"], group["eps"], group["weight_decay"], group["slow_weight"]
            b_f, b_s, b2 = group["beta_fast"], group["beta_slow"], group["beta2"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    for name in STATE_NAMES["mtdao"]:
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"]
                m_f, m_s, v = state["exp_avg_fast"], state["exp_avg_slow"], state["exp_avg_sq"]
                m_f.mul_(b_f).add_(grad, alpha=1 - b_f)
                m_s.mul_(b_s).add_(grad, alpha=1 - b_s)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                direction = m_f.mul((1 - omega) / (1 - b_f ** t)).add_(m_s, alpha=omega / (1 - b_s ** t))
                denom = (v / (1 - b2 ** t)).sqrt_().add_(eps)
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(direction, denom, value=-lr)
        return loss


# -- the inner optimizer's state as a joiner receives it (protocol/snapshot.py) ----------------------
#
# In runs that sync optimizer state, a donor serves its inner optimizer's whole state with every
# snapshot, taken at the round boundary (after the round's state sync): the synced states are then
# the group's bit-identical averages, the others this donor's own. All of it, not only the synced
# states: Adam's moments only make sense together and with their step count. A swarm first moment
# under a fresh (zero) second moment would step several times too far until the second moment
# fills up, and a step count of zero would divide the served moments by their early-step bias
# corrections (10× for β = 0.9).


@runtime_checkable
class OptimizerOwning(Protocol):
    """A trainer whose inner optimizer lowcomm may read and replace (the daemon's ``Trainer``)."""

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]


def served_state_names(config: "Config") -> tuple[str, ...]:
    """The optimizer states a run's snapshots carry: all of its optimizer's when it syncs
    optimizer state (``[sync] state_sync``), none otherwise (format 1, as before)."""
    return STATE_NAMES[config.train.optimizer] if config.sync.state_sync else ()


def capture_served(trainer: object, names: tuple[str, ...]) -> OptimizerStates | None:
    """Training thread: ``capture_states`` of ``trainer``'s optimizer, or None when the run serves
    no optimizer state (or the trainer is not lowcomm's: the round driver refuses state sync then)."""
    if not names or not isinstance(trainer, OptimizerOwning):
        return None
    return capture_states(trainer.optimizer, trainer.params, names)


def capture_states(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                   names: tuple[str, ...]) -> OptimizerStates:
    """The optimizer's states ``names`` as flat float32 CPU copies (zeros for a parameter without
    state yet), and its step count (the largest of its parameters'; they step together)."""
    step = 0
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for param in params:
        state = optimizer.state.get(param, {})
        if "step" in state:
            step = max(step, int(state["step"]))
        for name in names:
            value = state.get(name)
            parts[name].append(torch.zeros(param.numel()) if value is None
                               else value.detach().reshape(-1).to("cpu", torch.float32, copy=True))
    return OptimizerStates(step, {name: torch.cat(chunks) if chunks else torch.zeros(0)
                                  for name, chunks in parts.items()})


def install_states(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], states: OptimizerStates) -> None:
    """Make ``states`` the optimizer's state, creating it for parameters that have none yet (a
    fresh joiner's optimizer has no state before its first step)."""
    numel = sum(p.numel() for p in params)
    if any(value.numel() != numel for value in states.tensors.values()):
        raise ValueError(f"optimizer states of {[v.numel() for v in states.tensors.values()]} values for a "
                         f"model of {numel} parameters")
    offset = 0
    with torch.no_grad():
        for param in params:
            count = param.numel()
            state = optimizer.state[param]
            state["step"] = _step_like(optimizer, state.get("step"), states.step)
            for name, flat in states.tensors.items():
                state[name] = flat[offset:offset + count].view_as(param).to(param.device, param.dtype, copy=True)
            offset += count


def _step_like(optimizer: torch.optim.Optimizer, current: object, step: int) -> object:
    """``step`` in the type the optimizer keeps its step count in: MT-DAO an int, torch's AdamW a
    0-d float tensor (as its ``_init_group`` creates it), like the one it already has."""
    if isinstance(current, torch.Tensor):
        return torch.tensor(float(step), dtype=current.dtype, device=current.device)
    if isinstance(current, int) or isinstance(optimizer, MTDAO):
        return step
    return torch.tensor(float(step), dtype=torch.float32)
