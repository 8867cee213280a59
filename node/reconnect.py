"""Keep the DHT connected to the whole swarm after peers vanish from it (partitions, outages).

hivemind's DHT only learns about peers from the RPCs it makes and receives, and drops a peer
from its routing table when that peer stops answering. During a network partition each side
therefore forgets the other, and when the network heals nothing makes them meet again: both
halves keep storing and reading the swarm records among themselves. The ``Reconnector`` notices
peers that were in the swarm view recently and are gone without having said goodbye, and then
pings the initial peers and those missing peers from inside the DHT process (which puts every
peer that answers back into the routing table, on both sides) and looks up its own neighbours
again, as hivemind does at start-up.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from typing import Iterable

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger(__name__)

FORGET_AFTER = 600.0  # a peer missing for this long is considered gone for good
MAX_TARGETS = 8  # missing peers pinged per attempt (the initial peers are always pinged)
MAX_REMEMBERED = 1024  # peers remembered at most (the most recently seen): memory stays bounded under churn
PING_TIMEOUT = 10.0


def initial_peer_ids(multiaddrs: Iterable[str]) -> list[str]:
    """The peer ids at the end of the ``--peers`` multiaddrs (config validation ensures /p2p/)."""
    ids = []
    for text in multiaddrs:
        try:
            ids.append(Multiaddr(text)["p2p"])
        except Exception:  # not ours to validate here: the DHT refused bad ones at start-up
            continue
    return ids


async def _ping_and_refresh(_dht: hivemind.DHT, node, peer_ids: list[str]) -> list[str]:
    """Runs in the DHT process: ping ``peer_ids``; when any answered, look up our neighbours."""
    ids = [PeerID.from_base58(p) for p in peer_ids]
    pings = [asyncio.create_task(node.protocol.call_ping(pid)) for pid in ids]
    done, pending = await asyncio.wait(pings, timeout=PING_TIMEOUT)
    for task in pending:
        task.cancel()
    answered = [peer_ids[i] for i, task in enumerate(pings)
                if task in done and not task.cancelled() and task.exception() is None and task.result() is not None]
    if answered:
        async with asyncio.timeout(PING_TIMEOUT):  # not wait_for: it can lose a cancel (node/cancel.py)
            await node.find_nearest_nodes([node.node_id])
    return answered


class Reconnector:
    """Decides when to re-bootstrap the DHT and does it (see the module docstring)."""

    def __init__(self, dht: hivemind.DHT, my_peer_id: str, initial_peers: Iterable[str], interval: float) -> None:
        self.dht = dht
        self.my_peer_id = my_peer_id
        self.initial = [p for p in initial_peer_ids(initial_peers) if p != my_peer_id]
        self.interval = interval
        self.last_seen: dict[str, float] = {}  # peer id -> when a view last contained it
        self._last_attempt = -float("inf")
        self.attempts = 0

    def missing(self, live: Iterable[str], left: Iterable[str] = (), now: float | None = None) -> list[str]:
        """Record a swarm view; the peers seen within FORGET_AFTER that are not in it.

        ``left`` are peers that announced that they are leaving: they are forgotten at once.
        """
        now = time.monotonic() if now is None else now
        for peer in live:
            self.last_seen[peer] = now
        for peer in left:
            self.last_seen.pop(peer, None)
        live = set(live)
        for peer, seen in list(self.last_seen.items()):
            if now - seen > FORGET_AFTER:
                del self.last_seen[peer]
        if len(self.last_seen) > MAX_REMEMBERED:  # churn (or a flood of records) within FORGET_AFTER
            keep = sorted(self.last_seen.items(), key=lambda item: item[1])[-MAX_REMEMBERED:]
            self.last_seen = dict(keep)
        return [p for p in self.last_seen if p not in live and p != self.my_peer_id]

    async def maybe_reconnect(self, live: Iterable[str], left: Iterable[str] = ()) -> list[str] | None:
        """Re-bootstrap when peers went missing, at most once per ``interval``; who answered."""
        return await self.reconnect(self.missing(live, left))

    def due(self, missing: list[str]) -> bool:
        """Whether ``reconnect(missing)`` would ping now (peers missing, interval passed)."""
        return bool(missing) and time.monotonic() - self._last_attempt >= self.interval

    async def reconnect(self, missing: list[str]) -> list[str] | None:
        """Ping the initial peers and some of ``missing`` when ``due``; who answered, or None.

        It can take up to 3 × PING_TIMEOUT: callers that must not wait (the heartbeat) run it
        as a task of its own.
        """
        if not self.due(missing):
            return None
        self._last_attempt = time.monotonic()
        self.attempts += 1
        targets = list(dict.fromkeys(self.initial + random.sample(missing, min(MAX_TARGETS, len(missing)))))
        # A partial of a module-level function: run_coroutine pickles it into the DHT process.
        future = self.dht.run_coroutine(functools.partial(_ping_and_refresh, peer_ids=targets), return_future=True)
        try:
            async with asyncio.timeout(3 * PING_TIMEOUT):  # not wait_for: it can lose a cancel (node/cancel.py)
                answered = await future
        except Exception as err:  # the DHT process is busy or gone: the heartbeat must go on
            log.debug("DHT re-bootstrap failed: %r", err)
            return []
        if answered:
            log.info("%d peer(s) missing from the swarm view; re-bootstrapped the DHT through %d of %d peer(s)",
                     len(missing), len(answered), len(targets))
        return answered

