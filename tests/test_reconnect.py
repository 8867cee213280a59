"""Tests of lowcomm.node.reconnect: re-bootstrapping the DHT when peers vanish from the swarm view.

The last test runs two real hivemind DHTs: each forgets the other (as both sides of a network
partition do), and one re-bootstrap puts them back into each other's routing table.
"""

from __future__ import annotations

import asyncio
import functools

import hivemind
import pytest
from hivemind.p2p import PeerID

from lowcomm.node.reconnect import FORGET_AFTER, Reconnector, initial_peer_ids

A, B, C = "QmA", "QmB", "QmC"
BOOT = "QmPVxc3bzoXNYibzUByRZHFyLuMi3Ay8P3CTgXYs2zcK8t"


def test_initial_peer_ids_come_from_the_multiaddrs():
    maddr = "/ip4/10.0.0.1/tcp/4000/p2p/QmPVxc3bzoXNYibzUByRZHFyLuMi3Ay8P3CTgXYs2zcK8t"
    assert initial_peer_ids([maddr]) == ["QmPVxc3bzoXNYibzUByRZHFyLuMi3Ay8P3CTgXYs2zcK8t"]
    assert initial_peer_ids(["/ip4/10.0.0.1/tcp/4000"]) == []


def test_missing_peers_are_those_seen_recently_that_did_not_say_goodbye():
    r = Reconnector(dht=None, my_peer_id=A, initial_peers=[], interval=10)
    assert r.missing([A, B, C], now=0) == []
    assert r.missing([A, C], now=1) == [B]  # B vanished without a leaving record
    assert r.missing([A], left=[C], now=2) == [B]  # C said goodbye: not missing
    assert r.missing([A], now=FORGET_AFTER + 5) == []  # B gone for good after FORGET_AFTER
    assert r.missing([A, B], now=FORGET_AFTER + 6) == []


def test_no_attempt_without_missing_peers_and_at_most_one_per_interval():
    calls = []

    class FakeDHT:
        def run_coroutine(self, fn, return_future):
            calls.append(fn.keywords["peer_ids"])
            future = asyncio.get_running_loop().create_future()
            future.set_result([])
            return future

    async def scenario():
        r = Reconnector(FakeDHT(), A, [f"/ip4/1.2.3.4/tcp/1/p2p/{BOOT}"], interval=3600)
        assert await r.maybe_reconnect([A, B]) is None
        assert await r.maybe_reconnect([A]) == []  # B missing: the initial peer and B are pinged
        assert await r.maybe_reconnect([A]) is None  # within the interval
        return r

    r = asyncio.run(scenario())
    assert calls == [[BOOT, B]] and r.attempts == 1


async def _forget(_dht, node, peer_id: str) -> bool:
    """In the DHT process: drop ``peer_id`` from the routing table, as a failed RPC does."""
    table = node.protocol.routing_table
    uid = table.get(peer_id=PeerID.from_base58(peer_id))
    if uid is not None:
        del table[uid]
    return PeerID.from_base58(peer_id) in table


async def _knows(_dht, node, peer_id: str) -> bool:
    return PeerID.from_base58(peer_id) in node.protocol.routing_table


@pytest.mark.multiprocess
def test_a_reconnect_puts_both_sides_back_into_each_others_routing_table():
    first = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        maddrs = [str(m) for m in first.get_visible_maddrs()]
        second = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        try:
            one, two = str(first.peer_id), str(second.peer_id)

            def run(dht, fn, **kwargs):
                return dht.run_coroutine(functools.partial(fn, **kwargs))

            assert run(second, _knows, peer_id=one) and run(first, _knows, peer_id=two)
            assert not run(second, _forget, peer_id=one)
            assert not run(first, _forget, peer_id=two)

            reconnector = Reconnector(second, two, maddrs, interval=0)
            reconnector.missing([one, two])  # both were in the view ...

            answered = asyncio.run(reconnector.maybe_reconnect([two]))  # ... then only we are
            assert answered == [one]
            assert run(second, _knows, peer_id=one), "the re-bootstrap did not restore the routing table"
            assert run(first, _knows, peer_id=two), "the pinged peer did not learn about us again"
        finally:
            second.shutdown()
    finally:
        first.shutdown()


def test_remembered_peers_stay_bounded_under_churn():
    from lowcomm.node import reconnect

    r = Reconnector.__new__(Reconnector)  # only the bookkeeping: no DHT
    r.my_peer_id, r.last_seen = "me", {}
    for i in range(3 * reconnect.MAX_REMEMBERED):  # ten new peers a second, each seen once
        r.missing([f"peer-{i}"], now=i / 10)
    assert len(r.last_seen) == reconnect.MAX_REMEMBERED
    assert f"peer-{3 * reconnect.MAX_REMEMBERED - 1}" in r.last_seen and "peer-0" not in r.last_seen
