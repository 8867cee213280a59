"""The direct path of a stable group (protocol/matchmaking.py, issue 17): the peers of the last
group meet again over gRPC without reading the DHT, newcomers still get in, and a dead member
of the last group costs at most the direct path's deadline and the straggler wait, and members
slower than the direct path still get into the step's plan. Real gRPC servers in one event loop."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from lowcomm.protocol.matchmaking import round_key

from .swarm_harness import MemoryDHT, Peer, start_peers, stop_peers

NUMEL = 1_000


def run(coro, limit: float):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


class CountingDHT(MemoryDHT):
    """A MemoryDHT that counts reads and stores per key (the registration polling shows here)."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: Counter[str] = Counter()
        self.stores: Counter[str] = Counter()

    async def get(self, key: str) -> dict[str, dict]:
        self.gets[key] += 1
        return await super().get(key)

    async def store(self, key: str, subkey: str, value: dict, ttl: float) -> bool:
        self.stores[key] += 1
        return await super().store(key, subkey, value, ttl)


def assert_same_group(groups, peer_ids, step):
    first = groups[0]
    assert [m.peer_id for m in first.members] == sorted(peer_ids)
    assert first.step == step
    assert first.shard_bounds[0] == 0 and first.shard_bounds[-1] == NUMEL
    for group in groups:
        assert group == first  # one leader decided: the same members and shard layout for all


async def first_round(peers, expected) -> None:
    """Step 0 through the DHT, as a swarm starts; afterwards every peer has a last group."""
    groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
    assert_same_group(groups, expected, 0)


def test_a_stable_group_meets_directly_without_reading_registrations():
    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            await first_round(peers, expected)
            assert dht.gets[round_key("test", 0)] > 0  # the first round did read (and poll) the DHT
            # The followers reach the boundary first: the leader holds their calls until its round starts.
            followers = [asyncio.create_task(p.form(1, expected)) for p in peers[1:]]
            for p in peers[1:]:
                await peers[0].wait_joined_by(p.peer_id)
            assert not any(f.done() for f in followers)
            groups = await asyncio.gather(peers[0].form(1, expected), *followers)
            assert_same_group(groups, expected, 1)
            assert peers[0].matchmaker.led_last_group
            assert dht.gets[round_key("test", 1)] == 0  # nobody read the registrations of step 1
            await asyncio.sleep(0)  # let the background registrations land
            assert dht.stores[round_key("test", 1)] == 3  # each member registered once, for newcomers
            # And again at the next step: the direct path holds while the group is stable.
            groups = await asyncio.gather(*(p.form(2, expected) for p in peers))
            assert_same_group(groups, expected, 2)
            assert dht.gets[round_key("test", 2)] == 0
        finally:
            await stop_peers(peers)

    run(scenario(), 20)


@pytest.mark.parametrize("newcomer_id", ["peer-03", "peer-0"])  # above and below the direct leader
def test_a_newcomer_registered_in_the_dht_gets_into_the_next_steps_group(newcomer_id):
    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        newcomer = Peer(newcomer_id, NUMEL, "int8", dht)
        await newcomer.start()
        for p in [*peers, newcomer]:
            # A short direct path: seeing the newcomer expected, the leader sends its direct
            # followers back to join the ordinary round with their whole deadline.
            p.matchmaker.direct_timeout = 1.0
        try:
            old = {p.peer_id for p in peers}
            await first_round(peers, old)
            everybody = old | {newcomer_id}
            # The newcomer is at step 1 with the same parameters and registered for its round.
            joining = asyncio.create_task(newcomer.form(1, everybody, timeout=20))
            await dht.wait_stored(round_key("test", 1), {newcomer_id})
            groups = await asyncio.gather(joining, *(p.form(1, everybody, timeout=20) for p in peers))
            assert_same_group(groups, everybody, 1)
            # Now the four are the last group: the next step meets directly, the newcomer included.
            reads = dht.gets[round_key("test", 2)]
            groups = await asyncio.gather(*(p.form(2, everybody) for p in [newcomer, *peers]))
            assert_same_group(groups, everybody, 2)
            assert dht.gets[round_key("test", 2)] == reads == 0
        finally:
            await stop_peers([*peers, newcomer])

    run(scenario(), 30)


def test_a_dead_member_of_the_last_group_does_not_stall_the_direct_path():
    timeout, direct = 20.0, 1.5

    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            await first_round(peers, expected)
            await peers[2].stop()  # dies between the rounds; the swarm view still lists it
            for p in peers:
                p.matchmaker.direct_timeout = direct
            # The direct path ends at its deadline without the dead member; the leader then leads
            # on the DHT way, where the two live members are a quorum: it closes after the
            # straggler wait, far from the overall deadline.
            async with asyncio.timeout(timeout / 2):
                groups = await asyncio.gather(*(p.form(1, expected, timeout=timeout) for p in peers[:2]))
            assert_same_group(groups, {"peer-00", "peer-01"}, 1)
        finally:
            await stop_peers(peers)

    run(scenario(), 30)


def test_members_slower_than_the_direct_path_still_get_into_the_steps_one_plan():
    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(4, NUMEL, dht=dht)
        for p in peers:
            p.matchmaker.direct_timeout = 1.0
        try:
            expected = {p.peer_id for p in peers}
            await first_round(peers, expected)
            key = round_key("test", 1)
            early = [asyncio.create_task(p.form(1, expected, timeout=20)) for p in peers[:2]]
            # Two of four are no quorum: when the direct path ends, the leader leads on the DHT
            # way (its first read of the step's registrations) instead of closing a group of two.
            while dht.gets[key] == 0 and not any(t.done() for t in early):
                await asyncio.sleep(0.05)
            assert not any(t.done() for t in early)
            groups = await asyncio.gather(*early, *(p.form(1, expected, timeout=20) for p in peers[2:]))
            assert_same_group(groups, expected, 1)
        finally:
            await stop_peers(peers)

    run(scenario(), 30)


def test_a_dead_leader_of_the_last_group_hands_over_to_the_dht_path():
    timeout = 20.0

    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            await first_round(peers, expected)
            await peers[0].stop()  # the direct leader is gone: its followers fall back to the DHT
            rest = {"peer-01", "peer-02"}
            async with asyncio.timeout(timeout / 2):
                groups = await asyncio.gather(*(p.form(1, rest, timeout=timeout) for p in peers[1:]))
            assert_same_group(groups, rest, 1)
            assert dht.gets[round_key("test", 1)] > 0  # found each other through the registrations
        finally:
            await stop_peers(peers)

    run(scenario(), 30)


def test_a_direct_call_for_a_step_the_leader_never_reaches_is_refused_in_bounded_time():
    """A direct JoinGroup held for a round that does not start ends when the caller's wait does,
    and the caller then finds its partner through the DHT within the same overall deadline."""
    timeout = 20.0

    async def scenario():
        dht = CountingDHT()
        peers = await start_peers(2, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            await first_round(peers, expected)
            peers[1].matchmaker.direct_timeout = 1.0
            # peer-00 stays at step 0 (say its round failed); peer-01 goes on to step 1 and, after
            # its direct call times out, registers and leads a solo group once nobody else is expected.
            async with asyncio.timeout(timeout / 2):
                group = await peers[1].form(1, {"peer-01"}, timeout=timeout)
            assert [m.peer_id for m in group.members] == ["peer-01"]
            assert dht.stores[round_key("test", 1)] == 1
        finally:
            await stop_peers(peers)

    run(scenario(), 30)
