"""A user's own model for ``[model] factory`` (tests/test_models.py, tests/test_hf_cli.py).

``build`` returns a module whose forward gives the loss; ``build_pair`` returns a module and a
separate loss function. Both draw their initial weights from torch's global RNG only, as the
factory contract asks, so every peer builds the same weights from the run's seed.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bigram(nn.Module):
    """Next-token logits from the current token and a learned mix of the previous one."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab_size)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        here = self.embed(inputs)
        before = torch.cat([torch.zeros_like(here[:, :1]), here[:, :-1]], dim=1)
        return self.head(torch.tanh(self.mix(torch.cat([here, before], dim=-1))))


class BigramLoss(Bigram):
    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class BigramLogits(Bigram):
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.logits(inputs)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build(vocab_size: int = 256, width: int = 32) -> nn.Module:
    return BigramLoss(vocab_size, width)


def build_pair(vocab_size: int = 256, width: int = 32) -> tuple[nn.Module, object]:
    return BigramLogits(vocab_size, width), next_token_loss


class NormalizedBigram(BigramLoss):
    """A Bigram whose mix is batch-normalized: a model with running statistics (buffers)."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__(vocab_size, width)
        self.norm = nn.BatchNorm1d(width)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        here = self.embed(inputs)
        before = torch.cat([torch.zeros_like(here[:, :1]), here[:, :-1]], dim=1)
        mixed = self.norm(self.mix(torch.cat([here, before], dim=-1)).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(mixed))


def build_normalized(vocab_size: int = 256, width: int = 16) -> nn.Module:
    return NormalizedBigram(vocab_size, width)


def build_unlabelled(vocab_size: int = 100, width: int = 16) -> tuple[nn.Module, object]:
    """A model without a ``vocab_size`` attribute, so the node cannot check the data's ids up front."""
    net = nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))
    return net, next_token_loss


def build_half() -> nn.Module:
    """Breaks the contract: half-precision parameters."""
    return BigramLoss(256, 8).half()


def build_nothing() -> int:
    """Breaks the contract: not a module."""
    return 3


def build_logits_only() -> nn.Module:
    """Breaks the contract: a module whose forward takes only the inputs, without its loss function."""
    return BigramLogits(256, 8)


def build_unary_loss() -> tuple[nn.Module, object]:
    """Breaks the contract: a loss function that does not take the targets."""
    def loss(logits: torch.Tensor) -> torch.Tensor:
        return logits.mean()

    return BigramLogits(256, 8), loss


def build_buggy() -> nn.Module:
    """Breaks the contract: the function itself fails (a bug in the user's code)."""
    raise ValueError("a bug in the user's factory")


def build_parsing_argv() -> nn.Module:
    """Breaks the contract: parses the command line (the node's, there) and so exits."""
    import argparse

    argparse.ArgumentParser(prog="my_model").parse_args(["--no-such-flag"])
    return BigramLoss(256, 8)


class Exploding(BigramLoss):
    """Trains to non-finite weights within one inner step, every time: its loss is infinite."""

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().forward(inputs, targets) * torch.tensor(float("inf"))


def build_exploding() -> nn.Module:
    """An unstable model: a local model that diverges in every round (the node stops, saying so)."""
    return Exploding(256, 8)


def build_held(marker: str, release: str, timeout: float = 60.0) -> nn.Module:
    """``build``'s model, whose real build (not the meta-device one the run's fingerprint makes)
    writes ``marker`` and then waits until ``release`` exists (at most ``timeout`` seconds): a
    start-up that lasts as long as the test wants (tests/test_cli_errors.py)."""
    model = build()
    if torch.empty(0).device.type != "meta":
        Path(marker).touch()
        deadline = time.monotonic() + timeout
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return model


def build_frozen_embed(vocab_size: int = 256, width: int = 32) -> nn.Module:
    """A Bigram whose embedding is frozen, as a fine-tune's pretrained part (tests/test_frozen_params.py):
    the swarm averages the rest only."""
    model = BigramLoss(vocab_size, width)
    model.embed.requires_grad_(False)
    return model
