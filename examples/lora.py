"""LoRA adapters on a frozen model, for your own loop and for ``lowcomm-node`` as a ``[model] factory``.

A swarm averages the parameters that train and nothing else (README, "Frozen parameters"), so a
fine-tune with adapters sends the adapters' Δ alone. Two ways to use this module:

* in your own loop (examples/finetune_lora.py): ``add_lora(model, rank)`` freezes the model and
  returns the adapters, which your optimizer steps;
* through the CLI: ``build`` loads a Hugging Face causal LM from a local folder (what
  ``save_pretrained`` or ``lowcomm-node export`` wrote), freezes it and adds the adapters, under
  the factory contract (``forward(inputs, targets)`` returns the loss). From the repository root::

      lowcomm-node join --set model.factory=examples.lora:build \\
          --set 'model.factory_kwargs={ pretrained = "path/to/model", rank = 8 }' \\
          --set data.tokenizer=path/to/model/tokenizer.json

  Every peer must load the same weights: the run fingerprint names the frozen parameters but
  does not hash a factory's values (as it does not hash its code). ``lowcomm-node export`` (with
  the same ``--set`` flags) writes the trained module's state_dict; to get a plain Hugging Face
  model of it::

      module = build("path/to/model", rank=8)
      module.load_state_dict(torch.load("trained/model.pt"))
      merge_lora(module.lm).save_pretrained("trained/merged")
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LoRALinear(nn.Module):
    """``base(x) + up(down(x)) · alpha / rank``: a frozen linear layer plus a trainable low-rank
    update that starts at zero (``up`` does), so training starts from the base model itself."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.up.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


def add_lora(model: nn.Module, rank: int = 8, targets: Iterable[str] = ("q_proj", "v_proj"),
             alpha: float = 16.0) -> list[nn.Parameter]:
    """Freeze ``model`` and put an adapter on every ``nn.Linear`` whose attribute name is one of
    ``targets`` (Llama's attention projections by default); returns the adapters' parameters."""
    targets = set(targets)
    model.requires_grad_(False)
    wrapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                wrapped += 1
    if not wrapped:
        raise ValueError(f"no nn.Linear named one of {sorted(targets)} in the model: name the layers to adapt "
                         f"in targets")
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base layer (``W + up·down · scale``) and put the plain
    ``nn.Linear`` back in its place: the model computes what it did, without adapters, and saves
    as the architecture it came from (``save_pretrained``). Returns ``model``, changed in place."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                base = child.base
                base.weight += (child.up.weight @ child.down.weight).to(base.weight.dtype) * child.scale
                setattr(module, name, base)
    return model


class CausalLMLoss(nn.Module):
    """A transformers causal LM under the factory contract: ``forward(inputs, targets)`` is the
    mean next-token loss (``targets`` are ``inputs`` shifted by one, as the node makes them)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.vocab_size = int(lm.config.vocab_size)  # checked against the data's tokenizer

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=inputs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(pretrained: str, rank: int = 8, targets: list[str] | None = None, alpha: float = 16.0) -> nn.Module:
    """``[model] factory = "examples.lora:build"``: the model in ``pretrained`` (a local folder),
    frozen, with rank-``rank`` adapters on ``targets`` (default: ``q_proj`` and ``v_proj``)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its bars on stderr would garble the node's log lines
    # float32: the adapters are averaged as float32, and the base computes with them
    lm = transformers.AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32, local_files_only=True)
    add_lora(lm, rank, targets or ("q_proj", "v_proj"), alpha)
    return CausalLMLoss(lm)
