"""The round driver's decisions, as plain functions of (swarm view, our step and hash, config).

Each answers one question a node asks between inner phases or at a round's start. They read
nothing but their arguments (no clock, no network, no node attributes), so they are unit-tested
without sockets and the simulator can call the same code for a thousand peers.

``view`` is a ``SwarmView`` (node/swarm.py): the live, compatible peers' records. Our own record
may or may not be in it (it is whatever the DHT returned); every function leaves it out.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .swarm import PeerRecord, SwarmView


@dataclass(frozen=True)
class Position:
    """Where this peer stands: its id, committed outer step and params hash."""

    peer_id: str
    step: int
    params_hash: str


def others(view: SwarmView, me: Position) -> list[PeerRecord]:
    return [p for p in view.peers.values() if p.peer_id != me.peer_id]


def swarm_training(view: SwarmView, me: Position) -> bool:
    """Whether another peer trains or averages: the swarm has started (a peer that waits for
    others to start with, ``[node] wait_for_peers``, joins it then rather than waiting on)."""
    return any(p.phase in ("training", "averaging") for p in others(view, me))


def same_state(view: SwarmView, me: Position) -> list[PeerRecord]:
    """The other peers at our step with our parameters: those a round of ours can average with."""
    return [p for p in others(view, me) if p.outer_step == me.step and p.params_sha256 == me.params_hash]


def majority_elsewhere(view: SwarmView, me: Position) -> str | None:
    """The params hash that wins at our step when it is not ours, else None.

    Peers at one step can hold different parameters after a round split into several groups
    (or after a partial failure); the hash most peers hold wins (ties: the smallest hash), and
    the others adopt it, so the swarm never drifts apart. We count ourselves for our own hash.
    """
    counts: dict[str, int] = {me.params_hash: 1}
    for peer in others(view, me):
        if peer.outer_step == me.step and peer.params_sha256:
            counts[peer.params_sha256] = counts.get(peer.params_sha256, 0) + 1
    winner = min(counts, key=lambda digest: (-counts[digest], digest))
    return None if winner == me.params_hash else winner


def behind(view: SwarmView, me: Position, gossip: bool = False) -> bool:
    """Whether averaging now would fork a competing state: a peer is past our step, or (in
    all-reduce mode, where members must agree) a majority holds other parameters at our step.
    In gossip mode parameters differ by design, so only steps count."""
    if any(p.outer_step > me.step for p in others(view, me)):
        return True
    return not gossip and majority_elsewhere(view, me) is not None


def outpaced(view: SwarmView, me: Position, quorum: float) -> bool:
    """Whether the peers at our step with our parameters that are already averaging make,
    together with us, a quorum of those peers: the leader may then close the round at any
    moment, and a slower peer should end its inner phase and join with the steps it did."""
    peers = same_state(view, me)
    averaging = sum(p.phase == "averaging" for p in peers)
    needed = max(1, math.ceil(quorum * (len(peers) + 1)) - 1)
    return bool(peers) and averaging >= needed


def round_opened(view: SwarmView, me: Position) -> bool:
    """Whether some other peer at our step with our parameters is averaging already: the round
    of our step has opened, and its leader's matchmaking deadline is running."""
    return any(p.phase == "averaging" for p in same_state(view, me))


JOIN_BY_SHARE = 0.5  # of the matchmaking timeout, after the round was first seen open


def join_by(first_seen_open: float, matchmaking_timeout: float, heartbeat: float) -> float:
    """When a peer still in its inner phase must cut it to make a round it first saw open at
    ``first_seen_open`` (its own clock).

    ``outpaced`` waits for a quorum of the step's peers to be averaging. In a large swarm with
    uneven compute speeds the fastest of N peers arrives far ahead of that quorum, and the round
    closes by its first member's deadline, one matchmaking timeout after *it* arrived: the peers
    that had waited for a quorum missed the round, found the swarm past their step and downloaded
    the whole state (the ``behind`` cascade, sim/README.md). So a peer also cuts at a fixed point
    of the first averager's deadline, early enough that its join gets through: we see a round
    open up to one heartbeat after it opened, and the cut, the round-start read and the bucketed
    matchmaking (leader election, then the step coordinator) all come before the deadline.
    """
    return first_seen_open + max(0.0, JOIN_BY_SHARE * matchmaking_timeout - heartbeat)


def expected_peers(view: SwarmView, me: Position) -> set[str]:
    """The peers a leader waits for: live, compatible, at our step with our parameters (and us)."""
    return {p.peer_id for p in view.at_step(me.step) if p.params_sha256 == me.params_hash} | {me.peer_id}


def plan_of_state(view: SwarmView, me: Position) -> int:
    """How many peers the split step plan that made our parameters held, as the peers at our
    step with our hash publish it (``PeerRecord.plan_peers``), or 0 when none says so.

    The members of one plan all publish the same number and take the next step's B from it
    (protocol/buckets.py ``next_bucket_count``); a peer that was not in the plan reads it here so
    that it picks the same B instead of counting its own view. Near a threshold of B the view
    and the plan differ by a peer or two, and a peer whose B differed landed in a bucket of its
    own, reached the step coordinator after the plan closed and failed its round, step after
    step (in the simulator at 33 peers in groups of 8, one peer missed 4 steps in a row)."""
    sizes = Counter(p.plan_peers for p in same_state(view, me) if p.plan_peers > 0)
    return min(sizes, key=lambda n: (-sizes[n], n)) if sizes else 0


def solo_step_allowed(view: SwarmView, me: Position) -> bool:
    """Alone in a group, a peer takes its own outer step only when nobody else is in the swarm:
    with others present (perhaps still catching up to us) it waits for them by not moving on,
    and its progress goes into the next round."""
    return not others(view, me)


def direct_round_allowed(view: SwarmView, me: Position, last_group: set[str]) -> bool:
    """Whether a stable group may meet directly (protocol/direct.py): only when every live peer
    of the swarm was in our last group. A peer outside it, at any step (a joiner catching up, a
    slower peer one step behind), must find the round through the DHT and get the leader's wait
    for stragglers; otherwise a fast stable pair would close every round before it arrives."""
    return {p.peer_id for p in others(view, me)} <= last_group


def direct_follower_view(recent: SwarmView | None, me: Position, last_group: set[str]) -> SwarmView | None:
    """The view a follower of a stable group's direct path starts its round from: the
    heartbeat's (``recent``; None when its marks ask for a read), while it too has nobody outside
    the last group. None: read the table (a split step's coordinator waits for the expected
    peers of a fresh view)."""
    return recent if recent is not None and direct_round_allowed(recent, me, last_group) else None


@dataclass(frozen=True)
class CatchUp:
    """A state download to make: the step and params hash to fetch, and from whom."""

    step: int
    params_hash: str | None
    donors: list[PeerRecord]
    because_minority: bool  # at our own step, but the majority holds other parameters


def catch_up_target(view: SwarmView, me: Position, gossip_window: int | None = None) -> CatchUp | None:
    """What to download, if anything: the newest step any peer committed, with the hash most
    peers hold there; at our own step only when we are in a minority. ``gossip_window`` (gossip
    mode): a swarm at most that many steps ahead is caught up with by mixing, not downloading.
    Donors are the peers that serve state (they have an address) at that step and hash."""
    peers = others(view, me)
    if not peers:
        return None
    target = max(p.outer_step for p in peers)
    if target < me.step:
        return None
    if gossip_window is not None:
        if target - me.step <= gossip_window:
            return None
        digest, _ = view.majority_hash(target)
        minority = False
    elif target == me.step:
        digest = majority_elsewhere(view, me)
        if digest is None:
            return None
        minority = True
    else:
        digest, _ = view.majority_hash(target)
        minority = False
    donors = [p for p in peers if p.outer_step == target and p.params_sha256 == digest and p.address]
    if not donors:
        return None
    return CatchUp(target, digest, donors, minority)


def fragment(numel: int, fragments: int, step: int) -> slice:
    """The part of the flat parameters the round of ``step`` syncs (Streaming DiLoCo): all of
    them, or fragment (step mod K) of K contiguous, nearly equal ones. Every peer at a step
    picks the same slice, so the members of a round agree on it without asking."""
    bounds = [numel * i // fragments for i in range(fragments + 1)]
    index = step % fragments
    return slice(bounds[index], bounds[index + 1])


def phase_steps(inner_steps: int, fragments: int) -> int:
    """Inner steps between two rounds: H, or H/K with K fragments (each fragment is then synced
    every H steps, the fragments at staggered times); at least one."""
    return max(1, round(inner_steps / fragments))


# A peer declares the median of its last few rounds' estimates: one round's estimate can be far
# off (with two or three uploads per round, one that an owner timed too fast after reading its
# header late: 185 Mbit/s declared on a 50 Mbit/s link through the real CLI, bench/analysis.md).
BANDWIDTH_SAMPLES = 5


def bandwidth_sample(upload_bps: float, ring: bool, bytes_sent: int, seconds: float) -> float | None:
    """What an all-reduce round says of this peer's uplink, bytes/s, or None (nothing): its
    uploads as the owners timed them (``AllReduceResult.upload_bps``). Bytes over the whole round
    would not do: a round lasts as long as its slowest member's part, so every member of a group
    with one slow link would declare about the same rate and keep the same share. A ring round
    says nothing of our own link either (every hop moves at the slowest link's pace). Owners
    that time nothing (an older version): bytes over the round, as before."""
    if upload_bps > 0:
        return upload_bps
    if not ring and bytes_sent and seconds > 0:
        return bytes_sent / seconds
    return None


def declared_bandwidth(samples: Sequence[float]) -> float:
    """The bandwidth a peer declares (heartbeat, JoinGroup), by which the next leader sizes its
    shard (protocol/layout.py): the median of its last BANDWIDTH_SAMPLES samples, 0 (unknown)
    before the first."""
    recent = list(samples)[-BANDWIDTH_SAMPLES:]
    return statistics.median(recent) if recent else 0.0
