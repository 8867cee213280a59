"""The swarm as the DHT sees it: this peer's heartbeat record and everybody else's.

hivemind's DHT runs in its own process; its methods return MPFutures that we await on our
event loop (always with a timeout, so that a stuck DHT never hangs a round).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass

import hivemind
from hivemind.utils import get_dht_time

log = logging.getLogger(__name__)

DHT_TIMEOUT = 10.0


class HivemindDHT:
    """hivemind.DHT adapted to the two calls the protocol needs (``GroupDHT``)."""

    def __init__(self, dht: hivemind.DHT) -> None:
        self.dht = dht

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        future = self.dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(future, DHT_TIMEOUT))
        except asyncio.TimeoutError:
            log.warning("DHT store of %s timed out", key)
            return False

    async def get(self, key: str) -> dict[str, dict]:
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(future, DHT_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("DHT get of %s timed out", key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(subkey): item.value for subkey, item in found.value.items() if isinstance(item.value, dict)}


@dataclass(frozen=True)
class PeerRecord:
    """What every peer publishes under ``<run>/peers`` (refreshed by its heartbeat)."""

    peer_id: str
    address: str  # "" for client-mode peers
    outer_step: int
    params_sha256: str
    bandwidth_bps: float
    tokens_per_second: float
    protocol_version: int
    config_fingerprint: str
    phase: str
    leaving: bool = False

    @classmethod
    def parse(cls, peer_id: str, value: dict) -> "PeerRecord | None":
        try:
            return cls(
                peer_id=peer_id, address=str(value.get("address", "")), outer_step=int(value["outer_step"]),
                params_sha256=str(value.get("params_sha256", "")), bandwidth_bps=float(value.get("bandwidth_bps", 0)),
                tokens_per_second=float(value.get("tokens_per_second", 0)),
                protocol_version=int(value.get("protocol_version", 0)),
                config_fingerprint=str(value.get("config_fingerprint", "")), phase=str(value.get("phase", "")),
                leaving=bool(value.get("leaving", False)),
            )
        except (KeyError, TypeError, ValueError):
            return None  # a malformed record from a stranger must not break the view

    def to_value(self) -> dict:
        value = asdict(self)
        del value["peer_id"]
        return value


def peers_key(run: str) -> str:
    return f"{run}/peers"


@dataclass
class SwarmView:
    """A snapshot of the peer records, filtered to live peers of our run config."""

    peers: dict[str, PeerRecord]
    foreign: dict[str, PeerRecord]  # live peers whose protocol or config differs
    taken_at: float

    @property
    def max_step(self) -> int:
        return max((p.outer_step for p in self.peers.values()), default=-1)

    def at_step(self, step: int) -> list[PeerRecord]:
        return [p for p in self.peers.values() if p.outer_step == step]

    def majority_hash(self, step: int) -> tuple[str | None, int]:
        """The params hash most peers at ``step`` published, with how many published it."""
        counts = Counter(p.params_sha256 for p in self.at_step(step) if p.params_sha256)
        if not counts:
            return None, 0
        (digest, count), *rest = counts.most_common()
        if rest and rest[0][1] == count:  # a tie: no majority, prefer the lexicographically smallest
            digest = min(h for h, c in counts.items() if c == count)
        return digest, count


async def read_swarm(dht: HivemindDHT, run: str, fingerprint: str, protocol_version: int) -> SwarmView:
    raw = await dht.get(peers_key(run))
    peers, foreign = {}, {}
    for peer_id, value in raw.items():
        record = PeerRecord.parse(peer_id, value)
        if record is None or record.leaving:
            continue
        compatible = record.config_fingerprint == fingerprint and record.protocol_version == protocol_version
        (peers if compatible else foreign)[peer_id] = record
    return SwarmView(peers, foreign, time.monotonic())
