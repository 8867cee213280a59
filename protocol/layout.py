"""How a leader lays out a closed round: which peers go into which group, and which owner
averages which shard of the parameters (pure functions of what the leader knows)."""

from __future__ import annotations

import hashlib
import math
from typing import Callable

from . import codecs
from ._pb.lowcomm.v1 import averaging_pb2, tensor_pb2


def split_into_groups(members: list[averaging_pb2.Member], group_size: int, step: int) -> list[list[averaging_pb2.Member]]:
    """Balanced groups of at most ``group_size``, re-mixed every step, each with a reachable owner.

    Reachable peers are dealt round-robin first (every group needs at least one shard owner),
    then client-mode peers; the order is a hash of (step, peer id), different every round.
    """
    def order(member: averaging_pb2.Member) -> bytes:
        return hashlib.sha256(f"{step}/{member.peer_id}".encode()).digest()

    reachable = sorted((m for m in members if m.address), key=order)
    clients = sorted((m for m in members if not m.address), key=order)
    # ceil(n / size) balanced groups never exceed `size`; no group may be left with one member
    # (with size 2 and an odd count one group gets three instead).
    count = max(1, min(math.ceil(len(members) / group_size), len(reachable), len(members) // 2))
    groups: list[list[averaging_pb2.Member]] = [[] for _ in range(count)]
    for index, member in enumerate(reachable + clients):
        groups[index % count].append(member)
    return [sorted(g, key=lambda m: m.peer_id) for g in groups]


# Declared bandwidths within this factor of the group's median count as the median. A member's
# estimate of its uplink (protocol/member.py ``AllReduceResult.upload_bps``) moves by ±30 % from
# round to round on the same link, and members on equal links declared up to 1.7× apart in one
# round (8 peers at 100 Mbit/s, bench/analysis.md): cut by those figures, the shares were up to
# 1.5× the equal one and the round 10 % slower than with equal shares. A slow volunteer among
# fast peers declares several times less, and gets its smaller share.
BANDWIDTH_NOISE = 2.0


def effective_bandwidths(declared: list[float]) -> list[float]:
    """The bandwidths a leader plans with: what the members declared, where an unknown one (0,
    infinite, NaN) and one within BANDWIDTH_NOISE of the median count as the median (1.0 each
    when nobody declared one)."""
    # A follower's bandwidth is whatever it declared, hence the checks; the weights are scaled
    # down by shard_layout when their sum overflows (two 1e308 would overflow).
    default = median_declared(declared) or 1.0
    weights = [b if b > 0 and math.isfinite(b) else default for b in declared]
    return [default if default / BANDWIDTH_NOISE <= w <= default * BANDWIDTH_NOISE else w for w in weights]


# No owner averages more than this many times an equal share: a member that declares a huge
# bandwidth (by mistake or to see most of the others' parts) still owns at most 2/k of the
# parameters, and an owner that fails costs the round at most that much.
MAX_SHARE_FACTOR = 2.0


def owner_shares(bandwidths: list[float], members: int | None = None) -> list[float]:
    """The share of the parameters each owner averages, for owners with these bandwidths (positive,
    finite: ``effective_bandwidths``) in a butterfly of ``members`` members (default: the owners),
    chosen to make the round as short as the links allow.

    Member i moves S·(1 + (N−2)·s_i) over its link each way (its parts to the others' shards, S·(1
    − s_i), and its average of s_i to N − 1 members; a non-owner S), so a round takes at least
    τ = max_i (1 + (N−2)·s_i)/B_i (in units of S), and owner i may take s_i ≤ (τ·B_i − 1)/(N − 2)
    without making it longer. The shares are those of the least τ whose caps (each also at most
    MAX_SHARE_FACTOR equal shares) add up to 1, spread as evenly as the caps allow. So a member
    so slow that S alone takes it longer than the others' whole round owns nothing (without a
    share cap the least τ is max(1/min B, (N − 2 + k)/ΣB) for k owners). Equal bandwidths give
    equal shares; with N ≤ 2 every member moves S whatever the shares, which then follow the
    bandwidths."""
    count = len(bandwidths)
    n = max(members or count, count)
    if count == 0:
        return []
    if len(set(bandwidths)) == 1:
        return [1.0 / count] * count
    top = max(bandwidths)
    rates = [b / top for b in bandwidths]  # in units of the fastest: no overflow, same shares
    if n <= 2:
        return [r / sum(rates) for r in rates]
    most = min(1.0, MAX_SHARE_FACTOR / count)

    def caps(tau: float) -> list[float]:
        return [min(most, max(0.0, (tau * r - 1.0) / (n - 2))) for r in rates]

    # Bisection on τ: from the least any shares allow to what equal shares take (always feasible).
    low = max(1.0 / min(rates), (n - 2 + count) / sum(rates))
    high = max((1.0 + (n - 2) / count) / r for r in rates)
    if sum(caps(low)) < 1.0:
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if sum(caps(middle)) < 1.0 else (low, middle)
        low = high
    limits = caps(low)
    level, remaining = math.inf, 1.0  # the largest share: fill the caps evenly from below
    for index, cap in enumerate(sorted(limits)):
        left = count - index
        if cap * left >= remaining:
            level = remaining / left
            break
        remaining -= cap
    shares = [min(cap, level) for cap in limits]
    total = sum(shares)
    return [share / total for share in shares]


def shard_layout(numel: int, owners_bandwidth: list[float], members: int | None = None) -> list[int]:
    """Shard bounds over ``numel`` parameters, one shard per owner, sized by ``owner_shares``
    (a shard may be empty: that owner owns nothing this round).

    Owners that report no bandwidth (0) count as the median of the others, or all equal; so do
    owners within BANDWIDTH_NOISE of the median (the estimates' noise, not their links).
    """
    if not owners_bandwidth:
        return [0, numel]
    bandwidths = effective_bandwidths(owners_bandwidth)
    # Equal links: whole-number weights, so equal shards come out as exactly as they always did.
    weights = [1.0] * len(bandwidths) if len(set(bandwidths)) == 1 else owner_shares(bandwidths, members)
    total = sum(weights)
    bounds, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        bounds.append(min(numel, round(numel * acc / total)))
    bounds.append(numel)
    return bounds


MIN_PIECE_BYTES = 1 << 17  # encoded bytes per piece at least (128 KiB, the smallest measured to pay off)
# Seconds a piece takes on the owners' links at least: on a fast link a piece's calls and codec
# jobs cost more CPU than the overlap saves (the 1 Gbit/s rows of bench/analysis.md "Pieces").
MIN_PIECE_SECONDS = 0.02
MAX_PIECES = 8  # pieces per owner at most
# Pieces were measured up to 8 owners (4 pieces each); a larger group keeps one shard per owner,
# where more calls per owner (the busiest peer's RPCs, issue 15) were not shown to pay off.
MAX_PIECE_OWNERS = 8
MAX_PIECE_STREAMS = 28  # pieces × (owners − 1) at most: the Reduce streams an owner receives per round


def pieces_per_owner(payload_bytes: int, owners: int, link_bytes_per_second: float) -> int:
    """Into how many pieces a single group's leader cuts each owner's share (``piece_layout``),
    for a round whose whole encoded Δ is ``payload_bytes`` over links of the given rate (the
    owners' median declared bandwidth; 0 when none is known yet: then one piece): as many as
    size and time allow (``ring_pieces``), within the Reduce streams an owner receives."""
    if owners > MAX_PIECE_OWNERS:
        return 1
    return max(1, min(ring_pieces(payload_bytes, owners, link_bytes_per_second),
                      MAX_PIECE_STREAMS // max(1, owners - 1)))


# Codecs a ring runs with: dense ones, whose running sum re-encoded at each hop keeps its mass
# (a sparse codec's would not; ring.py).
RING_CODECS = frozenset({tensor_pb2.CODEC_FP32, tensor_pb2.CODEC_FP16, tensor_pb2.CODEC_BF16,
                         tensor_pb2.CODEC_INT8, tensor_pb2.CODEC_INT4})


def ring_problem_of_members(members: list[averaging_pb2.Member], codec_id: int) -> str:
    """Why a single group of ``members`` cannot run as a ring ("" when it can; ring.py
    ``ring_problem`` checks the whole group message with this): a leader makes it a butterfly."""
    if len(members) < 2:
        return "a ring needs two members or more"
    if codec_id not in RING_CODECS:
        return f"codec {codec_id} is not a dense codec (fp32, fp16, bf16, int8, int4)"
    if any(not m.address for m in members):
        return "every member of a ring must be reachable (a client-mode member cannot receive)"
    return ""


# The share of its bound each schedule reached in the transport grid on links it had to itself
# (bench/RESULTS.md section 3, reno, 2026-12-03: medians over 18 configurations): a ring's one
# flow per link against a butterfly's upload and result stages to receivers busy with others.
RING_EFFICIENCY = 0.93
BUTTERFLY_EFFICIENCY = 0.78
# schedule = "auto": every AUTO_PROBE_EVERY-th step is a butterfly whatever the estimates say. Its
# owners time every upload, which refreshes the members' declared bandwidths; a ring cannot (every
# hop moves at the slowest link's pace), so a link that got slower during ring rounds shows then.
AUTO_PROBE_EVERY = 10


def predicted_seconds(schedule: int, payload_bytes: int, bandwidths: list[float]) -> float:
    """Seconds a group's all-reduce of ``payload_bytes`` (each member's encoded Δ) takes over
    links of ``bandwidths`` (bytes/s, one per member, all known), at the efficiency measured for
    the schedule. Ring: every link carries 2·(N−1)/N·S, so the slowest sets the pace. Butterfly
    with the leader's shares (``owner_shares``): member i sends S − s_i of parts and N − 1
    copies of its average of s_i, S + (N − 2)·s_i in all, and receives as much."""
    n = len(bandwidths)
    if schedule == averaging_pb2.ALL_REDUCE_SCHEDULE_RING:
        return 2 * (n - 1) / n * payload_bytes / min(bandwidths) / RING_EFFICIENCY
    shares = owner_shares(bandwidths)
    return max((payload_bytes + (n - 2) * payload_bytes * s) / b for s, b in zip(shares, bandwidths)) / BUTTERFLY_EFFICIENCY


def choose_schedule(step: int, payload_bytes: int, declared: list[float]) -> int:
    """``schedule = "auto"``: a ring or a butterfly for a single group whose members can form a
    ring, from their declared bandwidths (the figures ``shard_layout`` cuts shares by): the one
    ``predicted_seconds`` says is faster. A butterfly while any member's bandwidth is unknown
    (it measures them) and every AUTO_PROBE_EVERY-th step (it refreshes them). With equal links
    the ring wins (0.93 against 0.78 of the same bound); with one member several times slower the
    butterfly does, as it gives that member a small share or none while a ring runs at its pace
    (bench/RESULTS.md section 3b)."""
    known = [b for b in declared if b > 0 and math.isfinite(b)]
    if len(known) < len(declared) or len(declared) < 2 or step % AUTO_PROBE_EVERY == 0:
        return averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY
    bandwidths = effective_bandwidths(declared)
    ring = predicted_seconds(averaging_pb2.ALL_REDUCE_SCHEDULE_RING, payload_bytes, bandwidths)
    butterfly = predicted_seconds(averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY, payload_bytes, bandwidths)
    return averaging_pb2.ALL_REDUCE_SCHEDULE_RING if ring <= butterfly else averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY


def ring_pieces(payload_bytes: int, members: int, link_bytes_per_second: float) -> int:
    """Into how many pieces each member's share is cut by size and time alone: pieces of at
    least MIN_PIECE_BYTES and MIN_PIECE_SECONDS on the link, at most MAX_PIECES; one piece when
    no bandwidth is known. A ring's leader cuts this many (a ring member has one stream whatever
    the pieces), so that a hop forwards one piece while the next arrives."""
    if not (link_bytes_per_second > 0 and math.isfinite(link_bytes_per_second)):
        return 1
    piece = max(MIN_PIECE_BYTES, link_bytes_per_second * MIN_PIECE_SECONDS)
    return max(1, min(MAX_PIECES, int(payload_bytes // (max(1, members) * piece))))


def median_declared(bandwidths: list[float]) -> float:
    """The median of the known (positive, finite) declared bandwidths, 0 if none is known."""
    known = sorted(b for b in bandwidths if b > 0 and math.isfinite(b))
    return known[len(known) // 2] if known else 0.0


def piece_layout(numel: int, owners_bandwidth: list[float], pieces: int, members: int | None = None,
                 drop_empty: bool = True) -> tuple[list[int], list[int]]:
    """Shard bounds and, per shard, the index of its owner in ``owners_bandwidth``: each owner's
    share (``shard_layout``, by bandwidth, in a group of ``members``) cut into ``pieces``
    near-equal pieces, ordered piece by piece (piece 0 of every owner, then piece 1, ...). An
    owner whose share is empty gets no shard: it takes part as a client-mode member does (with
    ``drop_empty`` false it keeps an empty one, as a ring needs every member to own a chunk).

    Why pieces (issue 17): an owner averages a shard once every member's part of it is in, and
    sends the average back while the members still upload their next pieces, so the all-gather
    runs under the reduce-scatter instead of after it (schedule.py uploads piece by piece).
    Measured in bench/analysis.md ("Pieces")."""
    shares = shard_layout(numel, owners_bandwidth, members)
    owners = max(1, len(owners_bandwidth))
    widths = [shares[k + 1] - shares[k] for k in range(owners)]
    # No empty piece: an owner with a share of a few values (a tiny declared bandwidth) caps them.
    pieces = max(1, min([pieces, *(w for w in widths if w > 0)]))
    cuts = [[shares[k] + widths[k] * p // pieces for p in range(pieces + 1)] for k in range(owners)]
    bounds, owner_of = [0], []
    for p in range(pieces):
        for k in range(owners):
            if widths[k] == 0 and drop_empty and numel > 0:
                continue
            bounds.append(bounds[-1] + cuts[k][p + 1] - cuts[k][p])
            owner_of.append(k)
    return bounds, owner_of


def encoded_size(codec_id: int, numel: int) -> int:
    """Bytes of ``numel`` values in the round's codec (4 per value for a codec this peer does not know)."""
    try:
        return codecs.get_codec(codec_id).encoded_size(numel)
    except ValueError:
        return 4 * numel


def declared_bandwidth(bandwidth: dict[str, float], peer_id: str) -> float:
    """What ``peer_id`` declared, or 0 (unknown) for nothing, zero, infinity or NaN."""
    b = bandwidth.get(peer_id, 0.0)
    return b if b > 0 and math.isfinite(b) else 0.0


def split_step_layout(numel: int, groups: list[list[averaging_pb2.Member]],
                      bandwidth: dict[str, float]) -> tuple[list[int], list[list[int]]]:
    """One shard layout for every group of a split step (crossgroup.py), and each group's owners.

    K = the smallest group's number of reachable members; the K shards have equal sizes (the
    layout must be the same in every group, and a shard's pace is set by its team reducer, not
    by one group's owner), and each group's owners are its K reachable members with the highest
    declared bandwidth (ties by member order), listed in member order; the others only send.
    """
    reachable = [[i for i, m in enumerate(g) if m.address] for g in groups]
    shards = min(len(r) for r in reachable)
    if shards == 0:
        raise ValueError("every group of a split step needs a reachable member")

    def speed(group: list[averaging_pb2.Member], i: int) -> float:
        return declared_bandwidth(bandwidth, group[i].peer_id)

    owners = [sorted(sorted(r, key=lambda i, g=g: (-speed(g, i), i))[:shards]) for g, r in zip(groups, reachable)]
    return shard_layout(numel, [0.0] * shards), owners


def close_groups(parts: list[list[averaging_pb2.Member]], bandwidth: dict[str, float], numel: int,
                 template: averaging_pb2.Group, random_bytes: Callable[[int], bytes]) -> list[averaging_pb2.Group]:
    """The Group messages a leader sends for the groups ``parts`` (``split_into_groups``).

    ``template`` carries what every group shares (step, codec, reduce timeout, schedule). One
    group: its shard layout by bandwidth over its reachable members, each member's share in
    pieces (``piece_layout``); as a ring (ring.py) when the template asks for one (or for AUTO
    and ``choose_schedule`` picks one) and the group can be one (``ring_problem_of_members``),
    with equal shares, else as a butterfly. Several: the same
    layout and the step plan in every one of them (``split_step_layout``, crossgroup.py), always
    a butterfly. Group ids are drawn in
    group order, one ``random_bytes(16)`` each.
    """
    ids = [random_bytes(16) for _ in parts]
    groups = []
    if len(parts) == 1:
        owners = [i for i, m in enumerate(parts[0]) if m.address]
        group = averaging_pb2.Group()
        group.CopyFrom(template)
        group.group_id = ids[0]
        declared = [bandwidth[parts[0][i].peer_id] for i in owners]
        link = median_declared(declared)
        wanted = template.schedule
        if wanted == averaging_pb2.ALL_REDUCE_SCHEDULE_AUTO:
            wanted = choose_schedule(template.step, encoded_size(template.codec, numel), declared)
        if wanted == averaging_pb2.ALL_REDUCE_SCHEDULE_RING and not ring_problem_of_members(parts[0], template.codec):
            group.schedule = averaging_pb2.ALL_REDUCE_SCHEDULE_RING
            # Every chunk crosses every link of a ring: equal chunks, whatever the bandwidths.
            bounds, owner_of = piece_layout(numel, [0.0] * len(owners), ring_pieces(encoded_size(template.codec, numel),
                                                                                    len(owners), link), drop_empty=False)
        else:
            group.schedule = averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY
            bounds, owner_of = piece_layout(numel, declared, pieces_per_owner(encoded_size(template.codec, numel),
                                                                              len(owners), link), len(parts[0]))
        group.shard_bounds.extend(bounds)
        group.members.extend(parts[0])
        group.shard_owners.extend(owners[k] for k in owner_of)
        return [group]
    bounds, owner_lists = split_step_layout(numel, parts, bandwidth)
    plan = [averaging_pb2.StepGroup(group_id=i, members=g, shard_owners=o) for i, g, o in zip(ids, parts, owner_lists)]
    reducers = team_reducers(parts, owner_lists, bandwidth)
    subreducers = team_subreducers(parts, owner_lists, bandwidth)
    for index, (group_id, group_members) in enumerate(zip(ids, parts)):
        group = averaging_pb2.Group()
        group.CopyFrom(template)
        group.schedule = averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY  # teams across groups are the butterfly's
        group.group_id, group.group_index = group_id, index
        group.members.extend(group_members)
        group.shard_bounds.extend(bounds)
        group.shard_owners.extend(owner_lists[index])
        group.step_groups.extend(plan)
        group.team_reducers.extend(reducers)
        group.team_subreducers.extend(subreducers)
        groups.append(group)
    return groups


def team_reducers(groups: list[list[averaging_pb2.Member]], owners: list[list[int]],
                  bandwidth: dict[str, float]) -> list[int]:
    """For every shard k of a split step, the group whose owner of k reduces team k: the owner
    with the highest declared bandwidth; ties (and owners that declared none) go to the first
    group from k on (k mod G, k + 1 mod G, ...), so that equal links spread the teams' reducers
    over the groups and one failed group costs one team, not all of them. A reducer receives
    every other group's part of its shard and sends each of them the result, (G − 1) times an
    owner's traffic, so in a swarm of residential links and a few datacenter ones its link sets
    the pace of the whole step (sim/README.md)."""
    return [min(range(len(groups)), key=_team_order(bandwidth, groups, owners, k)) for k in range(len(owners[0]))]


TREE_FROM_GROUPS = 9  # a step of this many groups or more reduces each team in a tree of two levels


def team_fanin(groups: int) -> int:
    """Groups per subteam when a team of ``groups`` owners is a two-level tree (0: flat, one
    reducer). A flat reducer receives G − 1 parts, one per group; with subteams of F = ⌈√G⌉
    groups the top reducer receives F − 1 parts and ⌈G/F⌉ − 1 partial averages, and a
    subreducer F − 1 parts: about 2·√G calls and parts at the busiest owner instead of G − 1,
    for one more hop on the way up and down."""
    return math.isqrt(groups - 1) + 1 if groups >= TREE_FROM_GROUPS else 0


def _team_order(bandwidth: dict[str, float], groups: list[list[averaging_pb2.Member]], owners: list[list[int]],
                k: int) -> Callable[[int], tuple[float, int]]:
    """The order in which the owners of shard ``k`` are preferred as its reducers: the highest
    declared bandwidth first, ties from group k on (k mod G, k + 1 mod G, ...)."""
    def key(g: int) -> tuple[float, int]:
        return -declared_bandwidth(bandwidth, groups[g][owners[g][k]].peer_id), (g - k) % len(groups)
    return key


def team_subreducers(groups: list[list[averaging_pb2.Member]], owners: list[list[int]],
                     bandwidth: dict[str, float]) -> list[int]:
    """Group.team_subreducers: for every shard k and every subteam of ``team_fanin`` groups, the
    group whose owner of k reduces the subteam, chosen as ``team_reducers`` chooses among the
    whole team (so the reducer's subteam gets the reducer). Empty when teams are flat."""
    fanin = team_fanin(len(groups))
    if not fanin:
        return []
    out = []
    for k in range(len(owners[0])):
        order = _team_order(bandwidth, groups, owners, k)
        out.extend(min(range(start, min(start + fanin, len(groups))), key=order)
                   for start in range(0, len(groups), fanin))
    return out


def groups_of_step(group: averaging_pb2.Group) -> dict[str, averaging_pb2.Group]:
    """Every member's Group message of the step ``group`` belongs to, rebuilt from its step plan
    (exactly the messages ``close_groups`` made); a single group's members all get ``group``.

    A bucket leader answers its bucket's members with these (buckets.py): the step coordinator
    sends it only its own group, whose ``step_groups`` list every group of the step."""
    if not group.step_groups:
        return {m.peer_id: group for m in group.members}
    out: dict[str, averaging_pb2.Group] = {}
    for index, planned in enumerate(group.step_groups):
        rebuilt = averaging_pb2.Group(step=group.step, codec=group.codec, reduce_timeout_s=group.reduce_timeout_s)
        rebuilt.group_id, rebuilt.group_index = planned.group_id, index
        rebuilt.members.extend(planned.members)
        rebuilt.shard_bounds.extend(group.shard_bounds)
        rebuilt.shard_owners.extend(planned.shard_owners)
        rebuilt.step_groups.extend(group.step_groups)
        rebuilt.team_reducers.extend(group.team_reducers)
        rebuilt.team_subreducers.extend(group.team_subreducers)
        out.update((m.peer_id, rebuilt) for m in planned.members)
    return out
