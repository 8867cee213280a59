"""A simulated DHT with the interface the protocol uses (``GroupDHT``: store/get with subkeys
and expirations, as node/swarm.py's ``HivemindDHT`` adapts hivemind's DHT).

Model:
- every call takes the caller's DHT round trips: ``hops`` (Kademlia: about log2(N)/3 with
  hivemind's bucket size) times the caller's round-trip time;
- a stored value becomes visible to everybody ``propagation`` seconds after the store returns
  (a per-peer figure: how far that peer's store has to travel), so readers hold stale views
  (a newer value replaces the older one only once visible);
- a value expires ``ttl`` seconds after it was stored (swarm time = virtual time here);
- each call is counted for the calling peer, at the outer step it is at (reads, writes,
  subkeys returned: how much it downloaded), and for the ``replicas`` live peers nearest to the
  key (XOR of SHA-256 ids), which serve every request of that key: a single ``<run>/peers``
  record of the whole swarm is a hotspot there.

Visibility and expiry happen on ticks of ``TICK`` seconds (a store is visible at the first tick
after its propagation delay), so what a key holds changes at most once per tick and readers in
between share one snapshot: at N=1024 a read then costs nothing, not a copy of N records. For
the peers record the parsed records are kept (live ones, leaving ones, and a count per (outer
step, params hash, phase)), so that a view of N peers costs no N parses. Readers must not
mutate what they get.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Version:
    value: dict
    expires_at: float
    parsed: Any = None  # what the key's parser made of the value (a PeerRecord), computed once


@dataclass
class StepCounters:
    """DHT use per peer at one outer step."""

    reads: Counter
    writes: Counter
    subkeys_read: Counter
    served: Counter  # requests served per replica holder, for callers at this step


TICK = 0.25  # seconds: the granularity of visibility and expiry


def _tick(t: float) -> float:
    return math.ceil(t / TICK) * TICK


def _position(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


class SimDHT:
    """The shared simulated DHT; peers talk to it through ``client(...)``."""

    def __init__(self, replicas: int = 5) -> None:
        self.replicas = replicas
        self._visible: dict[str, dict[str, Version]] = {}
        self._parsers: dict[str, Callable[[str, dict], Any]] = {}
        self._records: dict[str, dict[str, Any]] = {}  # parsed key -> subkey -> live record
        self._left: dict[str, set[str]] = {}  # parsed key -> subkeys whose record says leaving
        self._tags: dict[str, Counter] = {}  # parsed key -> (outer_step, params hash, phase) -> count
        self._values: dict[str, dict[str, dict]] = {}  # key -> what get() returns until the key changes
        self._snapshots: dict[str, tuple] = {}  # parsed key -> what get_records() returns until it changes
        self.steps: dict[int, StepCounters] = defaultdict(lambda: StepCounters(Counter(), Counter(), Counter(), Counter()))
        self._live: dict[str, int] = {}  # peer id -> its XOR position
        self._holders: dict[str, list[str]] = {}  # key -> replica holders (recomputed on churn)

    def parse_with(self, key: str, parser: Callable[[str, dict], Any]) -> None:
        """Values stored under ``key`` are parsed once, when they become visible (PeerRecord.parse:
        records with ``outer_step``, ``params_sha256``, ``phase`` and ``leaving``)."""
        self._parsers[key] = parser
        self._records[key], self._left[key], self._tags[key] = {}, set(), Counter()

    def _index(self, key: str, subkey: str, version: Version | None, sign: int) -> None:
        record = version.parsed if version is not None else None
        if record is None:
            return
        if record.leaving:
            (self._left[key].add if sign > 0 else self._left[key].discard)(subkey)
            return
        if sign > 0:
            self._records[key][subkey] = record
        else:
            self._records[key].pop(subkey, None)
        tag = (record.outer_step, record.params_sha256, record.phase)
        self._tags[key][tag] += sign
        if not self._tags[key][tag]:
            del self._tags[key][tag]

    # -- membership (for replica holders and hop counts) ---------------------------------------

    def add_peer(self, peer_id: str) -> None:
        self._live[peer_id] = _position(peer_id)
        self._holders.clear()

    def remove_peer(self, peer_id: str) -> None:
        self._live.pop(peer_id, None)
        self._holders.clear()

    def holders(self, key: str) -> list[str]:
        found = self._holders.get(key)
        if found is None:
            target = _position(key)
            found = sorted(self._live, key=lambda p: (self._live[p] ^ target, p))[: self.replicas]
            self._holders[key] = found
        return found

    def hops(self) -> int:
        return max(1, math.ceil(math.log2(max(2, len(self._live))) / 3))

    def client(self, peer_id: str, rtt: float, propagation: float, step: Callable[[], int]) -> "DHTClient":
        return DHTClient(self, peer_id, rtt, propagation, step)

    # -- data --------------------------------------------------------------------------------

    def _publish(self, key: str, subkey: str, version: Version) -> None:
        """The stored value reaches the readers now (replacing the older one of that subkey)."""
        parser = self._parsers.get(key)
        if parser is not None:
            version.parsed = parser(subkey, version.value)
        loop = asyncio.get_running_loop()
        if version.expires_at <= loop.time():
            return
        entries = self._visible.setdefault(key, {})
        self._values.pop(key, None)
        self._snapshots.pop(key, None)
        if parser is not None:
            self._index(key, subkey, entries.get(subkey), -1)
            self._index(key, subkey, version, +1)
        entries[subkey] = version
        loop.call_at(_tick(version.expires_at), self._expire, key, subkey, version)

    def _expire(self, key: str, subkey: str, version: Version) -> None:
        entries = self._visible.get(key)
        if entries is not None and entries.get(subkey) is version:
            del entries[subkey]
            self._values.pop(key, None)
            self._snapshots.pop(key, None)
            if key in self._parsers:
                self._index(key, subkey, version, -1)

    def values(self, key: str) -> dict[str, dict]:
        found = self._values.get(key)
        if found is None:
            found = self._values[key] = {subkey: v.value for subkey, v in self._visible.get(key, {}).items()}
        return found

    def records(self, key: str) -> tuple[dict[str, Any], frozenset[str], Counter]:
        """(live parsed records, subkeys leaving, counts per (step, hash, phase)) of a parsed key."""
        found = self._snapshots.get(key)
        if found is None:
            found = self._snapshots[key] = (dict(self._records[key]), frozenset(self._left[key]),
                                            Counter(self._tags[key]))
        return found

    def _serve(self, key: str, counters: StepCounters) -> None:
        for holder in self.holders(key):
            counters.served[holder] += 1


class DHTClient:
    """One peer's handle on the simulated DHT: the ``GroupDHT`` interface, plus parsed reads."""

    def __init__(self, dht: SimDHT, peer_id: str, rtt: float, propagation: float, step: Callable[[], int]) -> None:
        self.dht = dht
        self.peer_id = peer_id
        self.rtt = rtt
        self.propagation = propagation
        self.step = step  # the caller's outer step, for the per-step counters

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        counters = self.dht.steps[self.step()]
        counters.writes[self.peer_id] += 1
        await asyncio.sleep(self.rtt * self.dht.hops())
        self.dht._serve(key, counters)
        loop = asyncio.get_running_loop()
        version = Version(value, loop.time() + ttl)
        loop.call_at(_tick(loop.time() + self.propagation), self.dht._publish, key, subkey, version)
        return True

    async def get(self, key: str) -> dict[str, dict]:
        counters = self.dht.steps[self.step()]
        counters.reads[self.peer_id] += 1
        await asyncio.sleep(self.rtt * self.dht.hops())
        self.dht._serve(key, counters)
        found = self.dht.values(key)
        counters.subkeys_read[self.peer_id] += len(found)
        return found

    async def get_records(self, key: str) -> tuple[dict[str, Any], frozenset[str], Counter]:
        """A read of a parsed key, counted like ``get``: see ``SimDHT.records``."""
        counters = self.dht.steps[self.step()]
        counters.reads[self.peer_id] += 1
        await asyncio.sleep(self.rtt * self.dht.hops())
        self.dht._serve(key, counters)
        found = self.dht.records(key)
        counters.subkeys_read[self.peer_id] += len(found[0]) + len(found[1])
        return found
