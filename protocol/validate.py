"""What a received tensor must satisfy before it touches an accumulator or θ_global."""

from __future__ import annotations

import torch


class ContributionRejected(ValueError):
    """A decoded contribution that must be left out; ``reason`` is a bounded label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_contribution(values: torch.Tensor) -> None:
    """Refuse NaN and infinities: one bad value would poison every member's parameters."""
    if values.numel() and not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise ContributionRejected("non_finite", f"{bad} of {values.numel()} values are NaN or infinite")
