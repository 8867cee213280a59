"""In which order members upload their parts and owners send their averages back: the
staggered butterfly (issue 17).

If every member uploads to every owner at once, N−1 flows share each owner's downlink and its
small queue drops packets (incast); the same happens to every member's downlink when all owners
send their averages back at once. Staggered, member i uploads at stage k to the owner k shards
after its own (shard index modulo the number of shards), and owner j sends its average at stage
k to the member k places after itself: when the group has as many owners as members, each
downlink has one sender per stage, and every uplink one receiver. A client-mode member (no
shard of its own) counts from its index in the member list.

Stages are not a barrier: a member's stage k starts when its stage k−1 part has nearly
*arrived* (the owner's receipt, the first message of its answer, sent once all but the part's
last message are in: ``receipt_point``) or failed, or after a budget
(``stage_budget`` per stage: stage k by k budgets after the round's start) even if neither
happened. Arrival, not the end of the upload, because gRPC and the kernel take about a
megabyte at once: "taken" comes long before the bytes are off a slow uplink, and a stage that
started then shares the link with the previous one (protocol version 6; before, stages
overlapped that way). An owner's first result stage waits until its own parts have arrived
(its uplink is then free for the average, and no shard still waits for a part of ours behind
it), its stage k until its stage k−1 average is sent, each by k + 1 ``result_budget`` after the
average was made at the latest. So one slow or dead peer delays the later stages by at most a
budget each, never past the owners' deadlines. (Result stages gated on the member's receipt
of the average were measured and not kept: at 20 Mbit/s the owners' uplinks then idled while
the averages' downlinks were shared; bench/analysis.md.) The
results come back over the same streams whenever the owners finalize, and skip-on-failure,
deadlines and the shard agreement are the same as without stages. Owners aggregate in the order
of sender ids (aggregation.py), not of arrival, so the schedule never changes a bit of the
result.
"""

from __future__ import annotations

import math

from ._pb.lowcomm.v1 import averaging_pb2

PART_MESSAGES = 4  # a part goes up in at least this many messages: the owner's receipt comes before the last
STAGES_WITHIN = 0.5  # every upload stage has started by this fraction of the reduce timeout at the latest
RESULTS_WITHIN = 0.125  # every result stage by this fraction of it after the owner's average exists


def upload_order(group: averaging_pb2.Group, peer_id: str) -> list[int]:
    """The indices of the shards ``peer_id`` does not own, in the order it uploads to them."""
    members = [m.peer_id for m in group.members]
    owners = [members[i] for i in group.shard_owners]
    shards = len(owners)
    rank = owners.index(peer_id) if peer_id in owners else members.index(peer_id)
    remote = [s for s in range(shards) if owners[s] != peer_id]
    return sorted(remote, key=lambda s: (s - rank) % shards)


def part_message_bytes(payload_bytes: int, chunk_bytes: int) -> int:
    """The size of the messages a member's part of ``payload_bytes`` goes up in (at most
    ``chunk_bytes``, and at least PART_MESSAGES of them for a part that small)."""
    return min(chunk_bytes, max(1, math.ceil(payload_bytes / PART_MESSAGES)))


def receipt_point(payload_bytes: int, chunk_bytes: int) -> int:
    """Bytes of a part after which its owner sends the receipt: all but the last message, so that
    the member's next stage starts while that message is still on the way and the receipt's
    trip back costs the member's uplink no idle time."""
    return max(0, payload_bytes - part_message_bytes(payload_bytes, chunk_bytes))


def stage_budget(group: averaging_pb2.Group, stages: int) -> float:
    """Seconds a stage waits for the previous one's upload before it starts anyway."""
    return STAGES_WITHIN * group.reduce_timeout_s / max(1, stages)


def _rank(group: averaging_pb2.Group, peer_id: str) -> int:
    members = [m.peer_id for m in group.members]
    owners = [members[i] for i in group.shard_owners]
    return owners.index(peer_id) if peer_id in owners else members.index(peer_id)


def result_order(group: averaging_pb2.Group, owner_id: str) -> list[str]:
    """The members other than ``owner_id``, in the order that owner sends them its average."""
    size = len(group.members)
    own = _rank(group, owner_id)
    others = [m.peer_id for m in group.members if m.peer_id != owner_id]
    return sorted(others, key=lambda p: ((_rank(group, p) - own) % size, p))


def result_budget(group: averaging_pb2.Group, stages: int) -> float:
    """Seconds an owner's result stage waits for the previous one before it starts anyway."""
    return RESULTS_WITHIN * group.reduce_timeout_s / max(1, stages)
