"""The swarm as the DHT sees it: this peer's heartbeat record and everybody else's.

hivemind's DHT runs in its own process; its methods return MPFutures that we await on our
event loop (always with a timeout, so that a stuck DHT never hangs a round).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

import hivemind

from lowcomm.protocol.auth import RunAuth

if TYPE_CHECKING:
    import prometheus_client

log = logging.getLogger(__name__)

DHT_TIMEOUT = 10.0


class HivemindDHT:
    """hivemind.DHT adapted to the two calls the protocol needs (``GroupDHT``).

    ``clock``: wall time as the DHT process reads it, swarm time on a node whose clock is off
    (node/clock.py), so that expirations mean the same on every peer.
    """

    def __init__(self, dht: hivemind.DHT, clock: Callable[[], float] = time.time,
                 requests: prometheus_client.Counter | None = None) -> None:
        self.dht = dht
        self.clock = clock
        self.requests = requests  # lowcomm_dht_requests: DHT operations per peer (issue 15's scale figures)

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        if self.requests is not None:
            self.requests.labels(op="store").inc()
        future = self.dht.store(key, value, expiration_time=self.clock() + ttl, subkey=subkey, return_future=True)
        try:
            async with asyncio.timeout(DHT_TIMEOUT):  # not wait_for: it can lose a cancel (node/cancel.py)
                return bool(await future)
        except TimeoutError:
            log.warning("DHT store of %s timed out", key)
            return False

    async def get(self, key: str) -> dict[str, dict]:
        if self.requests is not None:
            self.requests.labels(op="get").inc()
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            async with asyncio.timeout(DHT_TIMEOUT):
                found = await future
        except TimeoutError:
            log.warning("DHT get of %s timed out", key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(subkey): item.value for subkey, item in found.value.items() if isinstance(item.value, dict)}


UNSIGNED_NAMED = 3  # subkeys a warning about unsigned records names


class SignedDHT:
    """The ``GroupDHT`` of a secret run: signs what it stores, returns only what this run signed.

    It wraps the adapter the protocol uses, so peer records and matchmaking registrations alike
    are signed (auth.RunAuth.sign_record) and unsigned or badly signed values are invisible to
    matchmaking. hivemind's DHT itself stays open; only our values are authenticated.
    """

    def __init__(self, inner, auth: RunAuth) -> None:
        self.inner = inner
        self.auth = auth
        self._warned: dict[str, float] = {}  # subkey -> when we last warned about it

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        return await self.inner.store(key, subkey, self.auth.sign_record(key, subkey, value, ttl), ttl)

    async def get(self, key: str) -> dict[str, dict]:
        return (await self.get_checked(key))[0]

    async def get_checked(self, key: str) -> tuple[dict[str, dict], dict[str, dict]]:
        """(values signed by this run, the others as found): the others are logged, rate-limited."""
        verified, unverified = {}, {}
        for subkey, value in (await self.inner.get(key)).items():
            plain = self.auth.verify_record(key, subkey, value)
            if plain is not None:
                verified[subkey] = plain
            elif not (isinstance(value, dict) and value.get("leaving")):
                unverified[subkey] = value
        now = time.monotonic()
        fresh = [s for s in unverified if now - self._warned.get(s, -math.inf) > 60.0]
        if fresh:
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned.update((s, now) for s in fresh)
            # A few names: the progress key of an open run holds thousands of marks (a 6 kB line).
            named = sorted(fresh)[:UNSIGNED_NAMED]
            more = f" and {len(fresh) - len(named)} more" if len(fresh) > len(named) else ""
            log.warning("ignoring %d DHT record(s) under %s without a valid run-secret signature (from %s%s): peers "
                        "without the run secret or with another one (if they are your swarm, compare "
                        "--run-secret-file)", len(fresh), key, ", ".join(named), more,
                        extra={"event": "dht_unsigned", "key": key, "senders": named, "records": len(fresh)})
        return verified, unverified


def signed(dht, auth: RunAuth | None):
    """``dht`` wrapped in SignedDHT when the run has a secret, else ``dht`` itself."""
    return dht if auth is None else SignedDHT(dht, auth)


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
    # Peers in the split step's plan that made this step's parameters (0: none, or a state that
    # was downloaded). Every member of one plan publishes the same number, so a peer that was not
    # in it (a joiner, a peer that missed the step) takes the next step's B from it as the
    # members do (protocol/buckets.py ``next_bucket_count``).
    plan_peers: int = 0
    # The peer serves gRPC over TLS (and calls its peers over TLS): a run is all TLS or all
    # plaintext, and a joiner on the other side is told so instead of failing every call.
    tls: bool = False
    # The multiaddr of the peer's DHT (its join line's), "" for client-mode peers: peers remember
    # it so that a restart finds the swarm without its --peers (node/peerbook.py).
    dht_address: str = ""

    @classmethod
    def parse(cls, peer_id: str, value: dict) -> "PeerRecord | None":
        try:
            return cls(
                peer_id=peer_id, address=str(value.get("address", "")), outer_step=int(value["outer_step"]),
                params_sha256=str(value.get("params_sha256", "")), bandwidth_bps=float(value.get("bandwidth_bps", 0)),
                tokens_per_second=float(value.get("tokens_per_second", 0)),
                protocol_version=int(value.get("protocol_version", 0)),
                config_fingerprint=str(value.get("config_fingerprint", "")), phase=str(value.get("phase", "")),
                leaving=bool(value.get("leaving", False)), plan_peers=max(0, int(value.get("plan_peers", 0))),
                tls=value.get("tls") is True, dht_address=_short_text(value.get("dht_address")),
            )
        except (KeyError, TypeError, ValueError):
            return None  # a malformed record from a stranger must not break the view

    def to_value(self) -> dict:
        value = asdict(self)
        del value["peer_id"]
        return value


def _short_text(value: object, limit: int = 512) -> str:
    """A string field of a stranger's record: "" unless it is a string of at most ``limit`` characters."""
    return value if isinstance(value, str) and len(value) <= limit else ""


def peers_key(run: str) -> str:
    return f"{run}/peers"


@dataclass
class SwarmView:
    """A snapshot of the peer records, filtered to live peers of our run config."""

    peers: dict[str, PeerRecord]
    foreign: dict[str, PeerRecord]  # live peers whose protocol or config differs
    taken_at: float
    left: frozenset[str] = frozenset()  # peers whose last record says they are leaving
    # Foreign peers whose records carry no run-secret signature at all: peers of an open run,
    # as a node with a run secret sees them (node/joincheck.py).
    open_run: frozenset[str] = frozenset()

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


async def read_swarm(dht: HivemindDHT | SignedDHT, run: str, fingerprint: str, protocol_version: int) -> SwarmView:
    if isinstance(dht, SignedDHT):
        raw, unsigned = await dht.get_checked(peers_key(run))
    else:
        raw, unsigned = await dht.get(peers_key(run)), {}
    peers, foreign, left = {}, {}, set()
    for peer_id, value in raw.items():
        record = PeerRecord.parse(peer_id, value)
        if record is not None and record.leaving:
            left.add(peer_id)
        if record is None or record.leaving:
            continue
        compatible = record.config_fingerprint == fingerprint and record.protocol_version == protocol_version
        (peers if compatible else foreign)[peer_id] = record
    # In a secret run, records this run did not sign are foreign: never averaged with nor
    # downloaded from. A node that sees nobody else contacts one of them once at start (the
    # handshake), so that a peer with a wrong secret is refused (UNAUTHENTICATED, counted there)
    # rather than silently training alone.
    open_run = set()
    for peer_id, value in unsigned.items():
        record = PeerRecord.parse(peer_id, value)
        if record is not None and not record.leaving and peer_id not in peers:
            foreign[peer_id] = record
            if not RunAuth.carries_signature(value):
                open_run.add(peer_id)
    return SwarmView(peers, foreign, time.monotonic(), frozenset(left), frozenset(open_run))
