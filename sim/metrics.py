"""Per-round figures of a simulated run, one JSON object per outer step.

A "round" is an outer step r: everything peers did while at step r (forming its groups,
averaging, the DHT reads and writes they made, the RPCs they received for it) and the state
downloads that round r caused (a minority at step r+1 downloading the majority's state).
``live`` is the number of live peers holding the state when the first group of round r closed
(joiners still downloading do not count); ``share_averaged`` is the share of them that averaged
in a group of two or more (gossip: that reached a partner).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from .dht import SimDHT


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q, method="lower"))


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), digits)


@dataclass
class _Step:
    live: int | None = None
    form_seconds: list[float] = field(default_factory=list)
    groups: dict[bytes, int] = field(default_factory=dict)
    averaged: set[str] = field(default_factory=set)
    solo: set[str] = field(default_factory=set)
    failed: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)  # peer -> bytes sent + received
    rpcs: Counter = field(default_factory=Counter)  # receiving peer -> calls
    rpc_kinds: dict = field(default_factory=lambda: defaultdict(Counter))  # receiving peer -> method -> calls
    joins: Counter = field(default_factory=Counter)  # receiving peer -> JoinGroup calls
    skipped: int = 0
    downloads: Counter = field(default_factory=Counter)  # kind -> count (minority: caused by this round)
    missed_rounds: int = 0  # peers that caught up with this step by the averages of the rounds they missed
    committed: dict[str, str] = field(default_factory=dict)  # peer -> hash committed at step r+1
    thetas: dict[str, np.ndarray] = field(default_factory=dict)
    partner_distance: list[float] = field(default_factory=list)
    commit_times: list[float] = field(default_factory=list)

    @property
    def last_commit_at(self) -> float:
        return max(self.commit_times, default=0.0)


class Metrics:
    def __init__(self, dht: SimDHT, now) -> None:
        self.dht = dht
        self.now = now
        self.steps: dict[int, _Step] = defaultdict(_Step)
        self.initial_distance = 0.0

    @staticmethod
    def distance(thetas: list[np.ndarray]) -> float:
        """The consensus distance: mean ||θ_i − θ̄|| / ||θ̄|| over the peers."""
        stack = np.stack(thetas)
        mean = stack.mean(axis=0)
        return float(np.mean(np.linalg.norm(stack - mean, axis=1))) / (float(np.linalg.norm(mean)) or 1.0)

    # -- events -------------------------------------------------------------------------------

    def formed(self, step: int, peer: str, seconds: float, group, led: bool, live: int, size: int | None = None) -> None:
        s = self.steps[step]
        if s.live is None:
            s.live = live
        s.form_seconds.append(seconds)
        if group is not None:
            s.groups[group.group_id] = len(group.members)

    def failed(self, step: int, peer: str, reason: str) -> None:
        self.steps[step].failed[reason] += 1

    def averaged(self, step: int, peer: str, size: int, sent: int, received: int, alone: bool = False) -> None:
        s = self.steps[step]
        if size > 1 and not alone:
            s.averaged.add(peer)
        else:
            s.solo.add(peer)
        s.bytes[peer] += sent + received

    def traffic(self, peer: str, step: int, sent: int = 0, received: int = 0) -> None:
        self.steps[step].bytes[peer] += sent + received

    def committed(self, new_step: int, peer: str, digest: str, theta: np.ndarray) -> None:
        s = self.steps[new_step - 1]
        s.committed[peer] = digest
        s.thetas[peer] = theta.copy()
        s.commit_times.append(self.now())

    def download(self, step: int, peer: str, kind: str, nbytes: int) -> None:
        # A minority download at step r+1 is caused by round r; others count where they land.
        self.steps[step - 1 if kind == "minority" else step].downloads[kind] += 1

    def missed_rounds_applied(self, step: int, peer: str) -> None:
        self.steps[step].missed_rounds += 1

    def rpc(self, step: int, receiver: str, method: str, count: int = 1) -> None:
        s = self.steps[step]
        s.rpcs[receiver] += count
        s.rpc_kinds[receiver][method] += count
        if method == "JoinGroup":
            s.joins[receiver] += count

    def reduced(self, step: int, skipped: int, rpcs: dict[str, Counter]) -> None:
        s = self.steps[step]
        s.skipped += skipped
        for peer, kinds in rpcs.items():
            s.rpcs[peer] += sum(kinds.values())
            s.rpc_kinds[peer].update(kinds)

    def gossiped(self, step: int, peer: str, distance: float, partners: int, inbox: int) -> None:
        if not math.isnan(distance):
            self.steps[step].partner_distance.append(distance)

    # -- summaries ----------------------------------------------------------------------------

    def round_line(self, step: int) -> dict:
        s = self.steps[step]
        d = self.dht.steps.get(step)
        active = set(d.reads) | set(d.writes) if d is not None else set()
        n_active = max(1, len(active))
        sizes = sorted(s.groups.values())
        live = s.live or 0
        line = {
            "round": step,
            "live": live,
            "averaged": len(s.averaged),
            "share_averaged": _r(len(s.averaged) / live if live else None),
            "form_p50_s": _r(_pct(s.form_seconds, 50)),
            "form_p95_s": _r(_pct(s.form_seconds, 95)),
            "groups": len(sizes),
            "group_size_min": sizes[0] if sizes else None,
            "group_size_median": sizes[len(sizes) // 2] if sizes else None,
            "group_size_max": sizes[-1] if sizes else None,
            "dht_reads_per_peer": _r(sum(d.reads.values()) / n_active if d else 0.0, 2),
            "dht_writes_per_peer": _r(sum(d.writes.values()) / n_active if d else 0.0, 2),
            "dht_subkeys_read_per_peer": _r(sum(d.subkeys_read.values()) / n_active if d else 0.0, 1),
            "dht_busiest_holder_requests": max(d.served.values(), default=0) if d else 0,
            "busiest_peer_rpcs": max(s.rpcs.values(), default=0),
            "busiest_peer_joins": max(s.joins.values(), default=0),
            # What the busiest peer's calls were, by method (Team: stage-2 parts of a split step).
            "busiest_peer_rpc_kinds": dict(sorted(s.rpc_kinds[max(s.rpcs, key=s.rpcs.get)].items())) if s.rpcs else {},
            "bytes_per_peer_mb": _r(sum(s.bytes.values()) / max(1, len(s.bytes)) / 1e6, 2),
            "skipped_shards": s.skipped,
            "failed": dict(sorted(s.failed.items())),
            "solo": len(s.solo),
            "downloads_minority": s.downloads["minority"],
            "downloads_behind": s.downloads["behind"],
            "downloads_joiner": s.downloads["joiner"],
            "missed_rounds_applied": s.missed_rounds,
            # Averaged into the step's most committed hash: what the step's θ is made of (a second
            # plan of the same step averages too, but its peers then download the majority's state).
            "share_majority": _r(max(Counter(s.committed.values()).values(), default=0) / live if live else None),
            "hashes": len(set(s.committed.values())),
            "committed": len(s.committed),
            "t_end_s": _r(s.last_commit_at, 1),
            # How far apart the step's peers committed it (p5 to p95): the next round's first
            # members start its matchmaking deadline that much before its last ones can arrive.
            "commit_spread_s": _r(_pct(s.commit_times, 95) - _pct(s.commit_times, 5), 1) if s.commit_times else None,
        }
        if s.thetas:
            line["consensus_distance"] = _r(self.distance([s.thetas[p] for p in sorted(s.thetas)]), 6)
        if s.partner_distance:
            line["partner_distance"] = _r(float(np.mean(s.partner_distance)), 6)
        return line
