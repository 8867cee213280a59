"""How a shard owner turns the contributions of one round into one average (DESIGN §4 "Trust").

Pure functions over a list of contributions ``(sender, weight, x)``: ``x`` a flat float32 tensor
(the decoded part of one member's Δ for this shard), ``weight`` > 0 (tokens since the last round).
Nothing here touches the network or the event loop; the owner runs ``aggregate`` in its codec
executor when the shard's deadline has passed or every member has sent.

Notation: n contributions x_1..x_n with weights w_1..w_n, W = Σ w_i, r_i = ‖x_i‖₂ (accumulated in
float64), and med(r) the *lower* median of the norms: the ⌈n/2⌉-th smallest. The lower median
is used so that in a group of two the smaller contribution is the reference: a single peer can
never raise the bar by itself, and with a majority of honest members med(r) is an honest norm.

1. **Finite values.** A contribution holding NaN or ±inf is dropped (reason ``non_finite``).
   Remote contributions are checked on arrival already; this also covers the owner's own.

2. **Norm bound** (``norm_bound_factor`` = β > 1, or ``None`` for none). Norms are compared at
   equal weight: ρ_i = r_i · med(w) / w_i, with med(w) the lower median weight (ρ_i = r_i when
   the weights are equal). A member that trained more inner steps brings a larger weight and a
   longer Δ: in a group of two, a peer that joined an overlapped round after 1 of 10 steps
   made the reference, and the other's honest 10-step Δ (23× longer, weight capped at 4×)
   was dropped. With med(ρ) over the finite contributions, every x_i with ρ_i > β·med(ρ) is
   dropped (reason ``norm``). The weights are bounded before they get here (at most
   ``accumulator.MAX_WEIGHT_RATIO`` × the median), so a member claiming a larger weight buys at
   most that factor of norm, as it buys at most that factor of pull on the mean. The median
   contribution itself always passes (β > 1), so the bound never empties a round. The
   survivors' weights are renormalised by the rules below (they divide by the sum of the kept
   weights).

3. **Rule** over the m kept contributions (W now their weight sum):

   * ``mean``:          a = Σ w_i x_i / W.
   * ``clipped_mean``:  τ = c·med(r) over the kept ones (c = ``clip_factor``);
     a = Σ w_i · min(1, τ / r_i) · x_i / W. Every clipped term has norm ≤ τ, so ‖a‖ ≤ τ, and a
     contribution's pull on the average, w_i/W · min(r_i, τ), no longer grows with its norm:
     scaling one contribution by 100 or by 10⁶ gives the same average once r_i ≥ τ.
   * ``trimmed_mean``:  k = ⌊f·m⌋ (f = ``trim_fraction`` < ½). Coordinate by coordinate, the
     k smallest and the k largest of the m values are dropped and the remaining m − 2k are
     averaged with their weights. With at most k arbitrary (finite) contributions, every
     coordinate of the result lies between the smallest and the largest honest value of that
     coordinate: whatever the outliers, at most k of them sit on either side of the honest
     range, so the trimming removes any that fall outside it. Ties are broken by the order of
     the contributions (sorted by sender), so the result is deterministic.

   Sums run in float64 and the result is rounded once to float32; with k = 0 the trimmed mean,
   and with τ above every norm the clipped mean, are the plain mean.

   The sums are elementwise, in sender order, one multiply and one add per term (no fused
   multiply-add, no reduction across coordinates), so ``mean`` and ``trimmed_mean`` give the same
   bits on every CPU kernel and thread count. Only the norms r_i are reductions whose last bits
   may depend on the owner's kernel; they decide the norm bound and the clipping factor. That
   cannot split a group: the average is computed by its one owner, and every member, the owner
   too, applies the *decoded* bytes the owner encoded (DESIGN §4).

Contributions are aggregated in the order of their senders' ids, not in their order of arrival,
so that the same inputs give the same bits whatever the network did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from .validate import ContributionRejected, check_contribution, check_norm, contribution_norm

RULES = ("mean", "clipped_mean", "trimmed_mean")

#: Coordinates sorted at once by the trimmed mean: bounds its scratch memory to a few MiB per member.
TRIM_CHUNK = 1 << 16

Contribution = tuple[str, float, torch.Tensor]  # (sender peer id, weight, flat float32 values)


@dataclass(frozen=True)
class Aggregation:
    """How a shard owner combines contributions; the defaults mirror ``[sync]``'s."""

    rule: str = "mean"
    clip_factor: float = 2.0
    trim_fraction: float = 0.2
    norm_bound_factor: float | None = 20.0  # None: no norm bound

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregation rule {self.rule!r} is not one of {', '.join(RULES)}")
        if not (self.clip_factor > 0 and math.isfinite(self.clip_factor)):
            raise ValueError(f"clip_factor must be a positive number, got {self.clip_factor}")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if self.norm_bound_factor is not None and not self.norm_bound_factor > 1.0:
            raise ValueError(f"norm_bound_factor must be > 1 (or None for no bound), got {self.norm_bound_factor}")

    @classmethod
    def from_config(cls, sync: Any) -> "Aggregation":
        """From a ``[sync]`` section (``node.config.SyncSection``)."""
        return cls(rule=sync.aggregation, clip_factor=sync.clip_factor, trim_fraction=sync.trim_fraction,
                   norm_bound_factor=sync.norm_bound_factor)


@dataclass
class Rejection:
    sender: str
    reason: str  # "non_finite" or "norm" (label values of node.metrics.REJECTION_REASONS)
    detail: str


@dataclass
class Aggregated:
    average: torch.Tensor | None  # float32; None when no contribution was left
    used: list[str]  # senders whose contribution entered the average, sorted
    rejected: list[Rejection] = field(default_factory=list)


def lower_median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of nothing")
    return ordered[(len(ordered) - 1) // 2]


def _checked(contributions: Sequence[Contribution]) -> tuple[list[Contribution], list[Rejection]]:
    """Sorted by sender, non-finite ones dropped; also refuses malformed input outright."""
    kept: list[Contribution] = []
    rejected: list[Rejection] = []
    senders = [s for s, _, _ in contributions]
    if len(set(senders)) != len(senders):
        raise ValueError(f"duplicate senders in {senders}")
    numels = {x.numel() for _, _, x in contributions}
    if len(numels) > 1:
        raise ValueError(f"contributions of different lengths {sorted(numels)}")
    for sender, weight, x in sorted(contributions, key=lambda c: c[0]):
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight of {sender} must be a positive number, got {weight}")
        try:
            check_contribution(x)
        except ContributionRejected as err:
            rejected.append(Rejection(sender, err.reason, str(err)))
            continue
        kept.append((sender, float(weight), x.reshape(-1).to(torch.float32)))
    return kept, rejected


def apply_norm_bound(contributions: Sequence[Contribution], factor: float | None,
                     norms: dict[str, float] | None = None) -> tuple[list[Contribution], list[Rejection]]:
    """Drop every contribution whose norm at the median weight exceeds ``factor`` × the lower
    median of those norms (rule 2 of this module's docstring)."""
    if factor is None or not contributions:
        return list(contributions), []
    norms = norms if norms is not None else {s: contribution_norm(x) for s, _, x in contributions}
    median_weight = lower_median(w for _, w, _ in contributions)
    at_median_weight = {s: norms[s] * (median_weight / w) for s, w, _ in contributions}
    median = lower_median(at_median_weight.values())
    kept, rejected = [], []
    for contribution in contributions:
        sender, weight = contribution[0], contribution[1]
        try:
            check_norm(at_median_weight[sender], median, factor)
        except ContributionRejected as err:
            detail = str(err) if weight == median_weight or err.reason != "norm" else (
                f"norm {norms[sender]:.4g} at {weight / median_weight:.3g} x the median weight "
                f"({at_median_weight[sender]:.4g} at the median weight) exceeds {factor:g} x the median "
                f"{median:.4g} of this shard's contributions at the median weight")
            rejected.append(Rejection(sender, err.reason, detail))
            continue
        kept.append(contribution)
    return kept, rejected


def weighted_mean(contributions: Sequence[Contribution]) -> torch.Tensor:
    """Σ w_i x_i / Σ w_i (float64 sums, one rounding to float32)."""
    return _scaled_mean([(w, 1.0, x) for _, w, x in contributions])


def clipped_mean(contributions: Sequence[Contribution], clip_factor: float,
                 norms: dict[str, float] | None = None) -> torch.Tensor:
    """Weighted mean after scaling every contribution down to a norm of at most clip_factor × median."""
    norms = norms if norms is not None else {s: contribution_norm(x) for s, _, x in contributions}
    tau = clip_factor * lower_median(norms[s] for s, _, _ in contributions)
    return _scaled_mean([(w, min(1.0, tau / norms[s]) if norms[s] > 0 else 1.0, x) for s, w, x in contributions])


def trimmed_mean(contributions: Sequence[Contribution], trim_fraction: float) -> torch.Tensor:
    """Coordinate-wise: drop the ⌊f·n⌋ smallest and largest values, weighted mean of the rest."""
    n = len(contributions)
    if n == 0:
        raise ValueError("trimmed mean of nothing")
    k = math.floor(trim_fraction * n)
    if k == 0:
        return weighted_mean(contributions)
    if n - 2 * k < 1:
        raise ValueError(f"trim_fraction {trim_fraction} leaves nothing of {n} contributions")
    numel = contributions[0][2].numel()
    weights = torch.tensor([w for _, w, _ in contributions], dtype=torch.float64)
    out = torch.empty(numel, dtype=torch.float32)
    for start in range(0, numel, TRIM_CHUNK):
        end = min(numel, start + TRIM_CHUNK)
        block = torch.stack([x[start:end] for _, _, x in contributions])  # (n, chunk)
        values, order = torch.sort(block, dim=0, stable=True)
        kept_values = values[k:n - k].to(torch.float64)
        kept_weights = weights[order[k:n - k]]
        # Row by row rather than .sum(0): a reduction's order may follow the SIMD width.
        total, weight_sum = kept_values[0].mul(kept_weights[0]), kept_weights[0].clone()
        for row in range(1, n - 2 * k):
            total.add_(kept_values[row].mul(kept_weights[row]))
            weight_sum.add_(kept_weights[row])
        out[start:end] = total.div_(weight_sum)
    return out


MEAN_BLOCK = 1 << 15  # values per block of _scaled_mean: its float64 buffers stay in the L2 cache


def _scaled_mean(terms: Sequence[tuple[float, float, torch.Tensor]]) -> torch.Tensor:
    """Σ w_i s_i x_i / Σ w_i over (w_i, s_i, x_i).

    Block by block (the float64 sums of a block stay in cache instead of a full-size float64
    tensor being read and written once per term; ~3x less CPU), with the same operations in
    the same order per value as one pass over whole tensors: start from +0, add each term
    (x_i converted to float64 exactly, times w_i s_i unless that is 1, which changes no bit),
    divide once, round to float32 once."""
    if not terms:
        raise ValueError("mean of nothing")
    numel = terms[0][2].numel()
    weight_sum = 0.0
    for weight, _, _ in terms:
        weight_sum += weight
    factors = [weight * scale for weight, scale, _ in terms]
    flat = [x.reshape(-1) for _, _, x in terms]
    out = torch.empty(numel, dtype=torch.float32)
    total = torch.empty(min(numel, MEAN_BLOCK), dtype=torch.float64)
    scratch = torch.empty_like(total)
    for start in range(0, numel, MEAN_BLOCK):
        end = min(numel, start + MEAN_BLOCK)
        block, term = total[:end - start].zero_(), scratch[:end - start]
        for factor, x in zip(factors, flat):
            if factor == 1.0:
                block.add_(x[start:end])  # float32 into float64: converted exactly, then one add
            else:
                # A multiply, then an add: ``add_(x, alpha=)`` is one fused multiply-add in the
                # vectorised kernels and two roundings in the generic one (see protocol/outer.py).
                block.add_(term.copy_(x[start:end]).mul_(factor))
        out[start:end] = block.div_(weight_sum)
    return out


def aggregate(contributions: Sequence[Contribution], settings: Aggregation = Aggregation()) -> Aggregated:
    """Validate (finite values, norm bound) and combine ``contributions`` by ``settings.rule``.

    ``average`` is None only when nothing is left (every contribution was non-finite). It may
    still hold ±inf when finite inputs overflow float32 (possible without a norm bound): the
    caller must check it before publishing it.
    """
    kept, rejected = _checked(contributions)
    if not kept:
        return Aggregated(None, [], rejected)
    # Norms only where a rule reads them: a float64 pass per contribution otherwise wasted.
    needs_norms = settings.norm_bound_factor is not None or settings.rule == "clipped_mean"
    norms = {s: contribution_norm(x) for s, _, x in kept} if needs_norms else None
    kept, bounded = apply_norm_bound(kept, settings.norm_bound_factor, norms)
    rejected += bounded
    if settings.rule == "clipped_mean":
        average = clipped_mean(kept, settings.clip_factor, norms)
    elif settings.rule == "trimmed_mean":
        average = trimmed_mean(kept, settings.trim_fraction)
    else:
        average = weighted_mean(kept)
    return Aggregated(average, [s for s, _, _ in kept], rejected)
