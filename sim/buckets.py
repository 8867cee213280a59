"""Prototype of issue 15 item 4's fix, in the simulator only: group buckets per step.

Today every peer at (step r, hash h) registers under one key and follows its lowest
registrant, so one leader receives the JoinGroup of the whole swarm and polls the whole
``<run>/peers`` table on every wake-up. With buckets:

- at the start of round r a peer counts the peers it expects (``decisions.expected_peers`` on
  the view it just read for the behind check) and splits them into B = 2^floor(log2(n / g))
  buckets (g = group_size; a power of two, so that peers whose stale views differ a little
  still agree on B), and its bucket is sha256(r, peer id) mod B: a new mix every step, as
  Moshpit's grid;
- it matchmakes under the bucket's own key (the real ``Matchmaker`` with ``run`` set to
  ``<run>/b<B>.<bucket>``, so the key is ``<run>/b<B>.<bucket>/round/<r>/<h>``): B leaders work
  in parallel, each receiving about g JoinGroup calls;
- the leader's "expected peers" are the bucket's members of the round-start view that are
  still in the heartbeat's latest view: no extra read of the whole table while it waits (the
  registrations it polls are the bucket's key, about g subkeys).

The heartbeat still reads the whole table every ``heartbeat`` seconds (what the node needs
for "behind" and the majority vote); that part stays O(N) per peer and is reported as such.

``lag_tolerant`` (the second half of the prototype, measured because the sweep showed that
``behind`` dominates once groups run in parallel): node/decisions.py's ``behind`` sends a peer to
download the whole state as soon as *any* peer is past its step, so with many groups the first
group to commit turns every peer whose round has not started yet into a downloader. With
``lag_tolerant`` a peer one step behind still averages at its own step (with the other late
peers of its bucket); it downloads only when the swarm is two steps ahead (the real
``catch_up_target`` with ``gossip_window=1``) or its hash is in a minority at its step. This only
makes sense with one global average per step (``ideal_global``), where a late group of step r
ends with the same parameters as the early ones.

``ideal_global`` (a what-if, labelled so in every output): every group of a step ends with the
same parameters, as item 3's global average across groups would make it, at no extra cost;
it shows what the figures would be once the groups of a step no longer diverge.
"""

from __future__ import annotations

import hashlib
import math
from typing import Awaitable, Callable

from lowcomm.node import decisions
from lowcomm.node.swarm import SwarmView


def lagging(view: SwarmView, me: decisions.Position) -> bool:
    """``behind`` of the prototype: a peer two steps ahead, or a majority elsewhere at our step."""
    return (any(p.outer_step > me.step + 1 for p in decisions.others(view, me))
            or decisions.majority_elsewhere(view, me) is not None)


def bucket_count(expected: int, group_size: int) -> int:
    if expected < 2 * group_size:
        return 1
    return 2 ** int(math.floor(math.log2(expected / group_size)))


def bucket_of(step: int, peer_id: str, buckets: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{step}/{peer_id}".encode()).digest()[:8], "big") % buckets


def bucketed(run: str, view: SwarmView, me: decisions.Position, group_size: int,
             latest_view: Callable[[], SwarmView]) -> tuple[str, Callable[[], Awaitable[set[str]]]]:
    """(the matchmaker's run name for this round, its expected-peers callback)."""
    expected = decisions.expected_peers(view, me)
    count = bucket_count(len(expected), group_size)
    mine = bucket_of(me.step, me.peer_id, count)
    members = {p for p in expected if bucket_of(me.step, p, count) == mine}

    async def expected_peers() -> set[str]:
        live = latest_view().peers
        return {p for p in members if p in live or p == me.peer_id}

    return f"{run}/b{count}.{mine}", expected_peers
