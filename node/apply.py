"""The outer step of an all-reduce round on θ_global: one function, so that the node's rounds
(node/averaging.py) and the in-process swarm tests (tests/swarm_harness.py) run the same code.
"""

from __future__ import annotations

from lowcomm.protocol.allreduce import AllReduceResult
from lowcomm.protocol.missed_rounds import AppliedAverage

from .globalstate import GlobalState


def apply_averages(state: GlobalState, fragment: slice, result: AllReduceResult) -> int:
    """Apply the outer step to θ_global[fragment] (and its outer momentum) with every shard
    average of ``result``, the all-reduce of the Δ of ``fragment``; returns how many shards were
    skipped. A skipped shard (None) is not updated this round, on every member alike (DESIGN §4).
    Runs in the codec pool: a step on whole tensors is too slow for the event loop."""
    skipped = 0
    for average, shard in zip(result.averages, result.slices, strict=True):
        if average is None:
            skipped += 1
            continue
        state.outer.step_slice(state.params, fragment.start + shard.start, average)
    return skipped


def applied_averages(fragment: slice, result: AllReduceResult) -> tuple[AppliedAverage, ...]:
    """The shard averages ``apply_averages`` applies, as encoded bytes at their place in the flat
    parameters: what a peer that missed the round needs to take the same step (missed_rounds.py)."""
    return tuple(AppliedAverage(fragment.start + shard.start, shard.stop - shard.start, payload)
                 for average, payload, shard in zip(result.averages, result.payloads, result.slices, strict=True)
                 if average is not None and payload is not None)
