"""What a received tensor must satisfy before it touches an accumulator or θ_global.

Checks, in the order a contribution meets them (DESIGN §4 "Trust"):

1. **codec and length**: the stream header must name the group's codec, the shard's numel and
   exactly the codec's encoded size for it (``ReduceRegistry._check_header``); the payload must
   decode (``codecs.CodecError`` → reason ``codec``) and be exactly as long as declared
   (reason ``length``).
2. **finite values** (``check_contribution``, reason ``non_finite``): one NaN or infinity would
   poison every member's parameters.
3. **norm bound** (``check_norm``, reason ``norm``): relative to the other contributions of the
   same shard in the same round, at equal weight, so it can only be applied once they are all
   in; the shard owner applies it when it computes the average (``aggregation.apply_norm_bound``).

Every rejected contribution is left out of the average (weights renormalised), counted by reason
and logged with its sender by the registry's ``on_reject`` callback. The reasons used here
(``codec``, ``length``, ``non_finite``, ``norm``) are label values of
``lowcomm_rejected_contributions_total`` (``node.metrics.REJECTION_REASONS``).
"""

from __future__ import annotations

import math

import torch

class ContributionRejected(ValueError):
    """A decoded contribution that must be left out; ``reason`` is a bounded label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_contribution(values: torch.Tensor) -> None:
    """Refuse NaN and infinities: one bad value would poison every member's parameters."""
    if values.numel() == 0:
        return
    # The smallest and largest values are both finite exactly when all are: min and max propagate
    # NaN and an infinity is an extreme. One pass without a mask (isfinite().all() is ~25x slower).
    low, high = torch.aminmax(values.reshape(-1))
    if not (math.isfinite(float(low)) and math.isfinite(float(high))):
        bad = int((~torch.isfinite(values)).sum())
        raise ContributionRejected("non_finite", f"{bad} of {values.numel()} values are NaN or infinite")


def contribution_norm(values: torch.Tensor) -> float:
    """L2 norm, accumulated in float64: finite for every finite float32 tensor (float32 would
    overflow to inf from values around 1e19 on, which would defeat a bound on it)."""
    if values.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def check_norm(norm: float, median: float, factor: float) -> None:
    """Refuse a contribution whose norm exceeds ``factor`` × the median norm of its shard's round.

    Strict ``>``: a shard where every contribution is zero (an empty shard, or coordinates that
    nobody changed) rejects nothing, and one where the median is zero rejects every non-zero one.
    """
    if not math.isfinite(norm):
        raise ContributionRejected("non_finite", f"norm {norm} is not finite")
    if norm > factor * median:
        raise ContributionRejected(
            "norm", f"norm {norm:.4g} exceeds {factor:g} x the median norm {median:.4g} of this shard's contributions")
