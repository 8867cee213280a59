"""Compatibility check between peers: same protocol version, same run config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from . import PROTOCOL_VERSION
from ._pb.lowcomm.v1 import handshake_pb2


class IncompatiblePeer(Exception):
    """The other peer speaks another protocol version or runs another run config."""


@dataclass(frozen=True)
class Identity:
    """Who this peer is, as it introduces itself in every Hello."""

    peer_id: str
    config_fingerprint: str
    run_config_json: str
    # Called with the other peer's id whenever ``check`` refuses it for another run config (the
    # node counts these: lowcomm_rejected_contributions_total{reason="config"}).
    on_other_config: Callable[[str], None] | None = field(default=None, compare=False)

    def hello(self) -> handshake_pb2.Hello:
        return handshake_pb2.Hello(
            protocol_version=PROTOCOL_VERSION,
            config_fingerprint=self.config_fingerprint,
            run_config_json=self.run_config_json,
            peer_id=self.peer_id,
        )

    def check(self, theirs: handshake_pb2.Hello) -> None:
        """Raise ``IncompatiblePeer`` naming the difference when ``theirs`` does not match us."""
        if theirs.protocol_version != PROTOCOL_VERSION:
            raise IncompatiblePeer(
                f"peer {theirs.peer_id or '?'} speaks protocol version {theirs.protocol_version}, "
                f"this node speaks {PROTOCOL_VERSION}; run the same lowcomm release on both"
            )
        if theirs.config_fingerprint != self.config_fingerprint:
            # Both sides are named by peer id: the message travels to the other peer (in the
            # gRPC status) and is printed there too, where "ours" would mean the wrong side.
            other = theirs.peer_id or "?"
            if self.on_other_config is not None:
                self.on_other_config(other)
            raise IncompatiblePeer(
                f"peer {other} runs a different run config than peer {self.peer_id}: "
                f"{describe_difference(self.run_config_json, theirs.run_config_json, self.peer_id, other)}"
            )


# How many differences a summary names before "and N more": it ends up in one log or error line.
MAX_LISTED = 6


def describe_difference(ours: str, theirs: str, ours_label: str = "ours", theirs_label: str = "theirs") -> str:
    """Human summary of how two canonical run configs differ, e.g. ``[sync] codec: ours 'int8', theirs 'int4'``."""
    try:
        mine, other = json.loads(ours), json.loads(theirs)
    except (TypeError, ValueError):
        return "the other side sent no readable run config"
    if not isinstance(mine, dict) or not isinstance(other, dict):
        return "the other side sent no readable run config"
    diffs = []
    for section in sorted(set(mine) | set(other)):
        if (section in mine) != (section in other):
            # One item, not every key against None: a checkpoint of an hf_config model has an
            # [hf_config] section that a preset config lacks, and its 15 keys would bury the point.
            diffs.append(f"[{section}]: only {ours_label if section in mine else theirs_label} has this section")
            continue
        a, b = mine.get(section) or {}, other.get(section) or {}
        if not isinstance(a, dict) or not isinstance(b, dict):
            diffs.append(f"[{section}]")
            continue
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"[{section}] {key}: {ours_label} {a.get(key)!r}, {theirs_label} {b.get(key)!r}")
    if not diffs:
        return "fingerprints differ but the configs read the same"
    more = f"; and {len(diffs) - MAX_LISTED} more" if len(diffs) > MAX_LISTED else ""
    return "; ".join(diffs[:MAX_LISTED]) + more
