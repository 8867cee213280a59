"""Labelled what-ifs of the simulator: changes to the node's decisions that are measured here
before anything changes in node/ (every output that uses one says so in its variant name).

``lagging`` (``--lag-tolerant``): node/decisions.py's ``behind`` sends a peer to download the
whole state as soon as *any* peer is past its step, so with many groups the first group to
commit turns every peer whose round has not started yet into a downloader. With it a peer one
step behind still averages at its own step (with the other late peers of the step), and
downloads only when the swarm is two steps ahead (the real ``catch_up_target`` with
``gossip_window=1``) or its hash is in a minority at its step.

``catch_up_missed_plan`` (``--catch-up-missed-plan``, in sim/peer.py): a peer whose round failed
with ``PlanClosed`` (its bucket reached the step coordinator after the step's one plan closed)
knows that the swarm is about to be one step ahead: it waits for the first record past its step
and goes straight to the catch-up, instead of training H inner steps at the stale step and
finding itself ``behind`` one round later (what node/rounds.py does today).

``ideal_global`` (``--ideal-global``, in sim/peer.py): every group of a step ends with the same
parameters at no cost, as if the step's groups never diverged.

The bucketed matchmaking that these were first measured with is no longer a what-if: it is
protocol/buckets.py, which the simulator runs for real.
"""

from __future__ import annotations

from lowcomm.node import decisions
from lowcomm.node.swarm import SwarmView


def lagging(view: SwarmView, me: decisions.Position) -> bool:
    """``behind`` of the what-if: a peer two steps ahead, or a majority elsewhere at our step."""
    return (any(p.outer_step > me.step + 1 for p in decisions.others(view, me))
            or decisions.majority_elsewhere(view, me) is not None)
