"""A model's buffers (BatchNorm's running statistics, ...): each peer's own state.

Peers average parameters only: DiLoCo's pseudo-gradient is the change of the parameters, and a
buffer such as BatchNorm's running mean follows the batches a peer saw. So buffers stay local,
as the inner optimizer's state does: they are checkpointed with the trainer's state, restored at
a resume, exported with the model, and given to the replica that evaluates θ_global. Without
that, the replica (a copy of the model made at start) evaluated every θ_global with the initial
statistics: a BatchNorm model's eval losses were wrong, and a resumed run started its statistics
over. A joiner that downloads the swarm's state starts from its model's initial buffers.

Only persistent buffers, those ``state_dict`` holds: the model rebuilds non-persistent ones
(rotary frequencies, causal masks) itself.
"""

from __future__ import annotations

from typing import Mapping

import torch


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name (the live tensors, not copies)."""
    saved = model.state_dict(keep_vars=True)
    return {name: buffer for name, buffer in model.named_buffers() if name in saved}


def load_buffers(model: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Copy ``buffers`` (``persistent_buffers`` of the same kind of model) into ``model``'s own.
    Raises ValueError naming the first difference; nothing is copied then."""
    own = persistent_buffers(model)
    if set(own) != set(buffers):
        missing, extra = sorted(set(own) - set(buffers)), sorted(set(buffers) - set(own))
        parts = ([f"this model's {', '.join(missing[:3])} not in it"] if missing else []) + \
                ([f"its {', '.join(extra[:3])} not in this model"] if extra else [])
        raise ValueError(f"the saved buffers are another model's ({'; '.join(parts)})")
    for name, buffer in own.items():
        if buffer.shape != buffers[name].shape:
            raise ValueError(f"buffer {name} has shape {tuple(buffers[name].shape)} saved, "
                             f"{tuple(buffer.shape)} in this model")
    with torch.no_grad():
        for name, buffer in own.items():
            buffer.copy_(buffers[name])
