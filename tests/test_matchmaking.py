"""Group formation through the DHT and one leader, with real gRPC servers in one event loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math

import pytest

from lowcomm.node.config import load_config
from lowcomm.protocol import PROTOCOL_VERSION
from lowcomm.protocol.handshake import Identity, IncompatiblePeer
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.matchmaking import MatchmakingError, round_key, shard_layout, split_into_groups
from lowcomm.protocol import codecs
from lowcomm.protocol.layout import (MAX_PIECE_OWNERS, MAX_PIECE_STREAMS, MAX_PIECES, MAX_SHARE_FACTOR, MIN_PIECE_BYTES,
                                     MIN_PIECE_SECONDS, close_groups, owner_shares, piece_layout, pieces_per_owner)

from .swarm_harness import MemoryDHT, Peer, start_peers, stop_peers

NUMEL = 10_000


def run(coro, limit: float):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


def assert_one_group(groups, peer_ids, owners=None):
    first = groups[0]
    for g in groups:
        assert g.group_id == first.group_id
        assert [m.peer_id for m in g.members] == sorted(peer_ids)
        assert list(g.shard_bounds) == list(first.shard_bounds)
        assert list(g.shard_owners) == list(first.shard_owners)
        assert g == first  # the leader sends everybody the same message
    assert first.shard_bounds[0] == 0 and first.shard_bounds[-1] == NUMEL
    assert list(first.shard_owners) == (list(range(len(peer_ids))) if owners is None else owners)


# -- shard layout -------------------------------------------------------------------------------


def test_pieces_cut_each_owners_share_and_come_piece_by_piece():
    bounds, owner_of = piece_layout(1000, [1.0, 3.0], 3)
    assert owner_of == [0, 1, 0, 1, 0, 1]
    assert bounds[0] == 0 and bounds[-1] == 1000 and bounds == sorted(bounds)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    # Each owner's pieces add up to its share by bandwidth, and differ by at most one value.
    for k, share in enumerate((250, 750)):
        mine = [n for n, o in zip(sizes, owner_of) if o == k]
        assert sum(mine) == share and max(mine) - min(mine) <= 1
    assert piece_layout(90, [0.0] * 3, 1) == (shard_layout(90, [0.0] * 3), [0, 1, 2])
    # An owner whose share is smaller than the pieces asked for caps them: no empty shard.
    bounds, owner_of = piece_layout(10_000, [1.0, 3e-4], 8)  # the second owner's share: 3 values
    assert all(b > a for a, b in zip(bounds, bounds[1:])) and owner_of == [0, 1] * 3


def test_pieces_per_owner_grow_with_the_shard_and_stay_within_the_link_and_stream_budgets():
    piece, slow = MIN_PIECE_BYTES, 2.5e6  # 20 Mbit/s: a 128 KiB piece takes 52 ms
    assert pieces_per_owner(4 * 2 * piece - 1, 4, slow) == 1  # a shard below two pieces stays whole
    assert pieces_per_owner(4 * 3 * piece, 4, slow) == 3
    assert pieces_per_owner(10**9, 2, slow) == MAX_PIECES
    assert pieces_per_owner(10**9, 8, slow) == MAX_PIECE_STREAMS // 7
    assert pieces_per_owner(10**9, MAX_PIECE_OWNERS + 1, slow) == 1  # larger groups keep one shard per owner
    assert pieces_per_owner(10**9, 1, slow) == MAX_PIECES
    # On a fast link a piece must last MIN_PIECE_SECONDS: 1 Gbit/s, 4 MB over 4 owners: whole.
    fast = 125e6
    assert pieces_per_owner(4_000_000, 4, fast) == 1
    assert pieces_per_owner(64_000_000, 4, fast) == int(16_000_000 // (fast * MIN_PIECE_SECONDS))
    # Nobody declared a bandwidth yet (a first round): one piece.
    assert pieces_per_owner(10**9, 4, 0.0) == pieces_per_owner(10**9, 4, math.nan) == 1


@pytest.mark.parametrize("codec,pieces", [("fp32", 2), ("int8", 1)])
def test_a_single_groups_leader_cuts_large_rounds_in_pieces_by_their_encoded_size(codec, pieces):
    numel = 4 * 2 * MIN_PIECE_BYTES // 4  # two pieces per owner in fp32, a quarter of the bytes in int8
    members = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}", weight=1.0) for i in range(4)]
    template = averaging_pb2.Group(step=3, codec=codecs.get_codec(codec).id)
    declared = {m.peer_id: 2.5e6 for m in members}  # 20 Mbit/s
    [group] = close_groups([members], declared | {"p1": 0.0}, numel, template, lambda n: bytes(n))
    assert list(group.shard_owners) == [0, 1, 2, 3] * pieces
    assert group.shard_bounds[-1] == numel
    # Before anybody measured its bandwidth: one shard per owner.
    [first] = close_groups([members], dict.fromkeys(declared, 0.0), numel, template, lambda n: bytes(n))
    assert list(first.shard_owners) == [0, 1, 2, 3]


def test_shard_layout_by_bandwidth():
    assert shard_layout(100, [1.0, 3.0]) == [0, 25, 100]  # two members: by bandwidth (each moves S anyway)
    # Three: the fast owner takes as much as the share cap allows (2/3), the slow ones the rest.
    assert shard_layout(1000, [1e6, 1e6, 3e6]) == [0, 167, 333, 1000]
    assert shard_layout(100, [5.0]) == [0, 100]
    assert shard_layout(100, []) == [0, 100]


def round_time(shares: list[float], bandwidths: list[float], members: int | None = None) -> float:
    """The least time of a butterfly round with these shares over these links (units of S)."""
    n = members or len(shares)
    return max((1 + (n - 2) * s) / b for s, b in zip(shares, bandwidths))


@pytest.mark.parametrize("bandwidths", [[100.0, 100.0, 100.0, 20.0], [100.0, 100.0, 50.0, 50.0], [1.0, 1.0, 3.0],
                                        [1.0, 1.0, 1.0, 5.0], [1.0] * 7 + [0.1], [9.0, 7.0, 5.0, 3.0, 1.0],
                                        [1.0, 1.01, 1.0, 1.0]])
def test_owner_shares_make_the_round_as_short_as_any_shares_within_the_cap(bandwidths):
    shares = owner_shares(bandwidths)
    k = len(bandwidths)
    assert sum(shares) == pytest.approx(1.0) and all(0.0 <= s <= MAX_SHARE_FACTOR / k + 1e-9 for s in shares)
    best = round_time(shares, bandwidths)
    # No share vector on a grid of the simplex (within the cap) gives a shorter round.
    grid = 12
    for cut in itertools.product(range(grid + 1), repeat=k - 1):
        if sum(cut) > grid:
            continue
        other = [c / grid for c in cut] + [(grid - sum(cut)) / grid]
        if max(other) <= MAX_SHARE_FACTOR / k:
            assert best <= round_time(other, bandwidths) + 1e-9
    proportional = [b / sum(bandwidths) for b in bandwidths]
    if max(proportional) <= MAX_SHARE_FACTOR / k:
        assert best <= round_time(proportional, bandwidths) + 1e-9


def test_a_volunteer_too_slow_to_own_anything_owns_nothing():
    """One 20 Mbit/s member among 100 Mbit/s ones: S alone takes it longer than the others need
    for the whole round, so it owns nothing and the others split the parameters evenly (by
    bandwidth it would own 1/16 and make the round 12 % longer)."""
    bandwidths = [100.0, 100.0, 100.0, 20.0]
    assert owner_shares(bandwidths) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    assert round_time(owner_shares(bandwidths), bandwidths) == pytest.approx(1 / 20)
    assert round_time([b / 320 for b in bandwidths], bandwidths) == pytest.approx(1.125 / 20)
    assert owner_shares([100.0, 100.0, 50.0, 50.0]) == pytest.approx([0.5, 0.5, 0.0, 0.0])
    # A client-mode member counts in N (it receives every average) but owns nothing.
    assert owner_shares([100.0, 100.0, 100.0, 20.0], members=5) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    # Equal links: equal shares, exactly; two members: by bandwidth.
    assert owner_shares([3.0] * 4) == [0.25] * 4
    assert owner_shares([1.0, 3.0]) == pytest.approx([0.25, 0.75])


def test_an_owner_with_an_empty_share_gets_no_shard_and_the_others_keep_their_pieces():
    bounds, owner_of = piece_layout(1000, [100e6, 100e6, 100e6, 20e6], 2)
    assert owner_of == [0, 1, 2, 0, 1, 2]
    assert bounds[0] == 0 and bounds[-1] == 1000 and all(b > a for a, b in zip(bounds, bounds[1:]))
    members = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}", weight=1.0) for i in range(4)]
    template = averaging_pb2.Group(step=3, codec=codecs.get_codec("fp32").id)
    declared = {"p0": 12.5e6, "p1": 12.5e6, "p2": 12.5e6, "p3": 2.5e6}  # 100, 100, 100 and 20 Mbit/s
    [group] = close_groups([members], declared, 3000, template, lambda n: bytes(n))
    assert 3 not in group.shard_owners and set(group.shard_owners) == {0, 1, 2}
    assert [m.peer_id for m in group.members] == ["p0", "p1", "p2", "p3"]  # it still takes part


def test_shard_layout_zeros_count_as_the_median():
    assert shard_layout(90, [0.0, 0.0, 0.0]) == [0, 30, 60, 90]  # nobody knows: equal shards
    assert shard_layout(300, [0.0, 1.0, 1.0]) == [0, 100, 200, 300]
    bounds = shard_layout(1000, [1.0, 0.0, 4.0, 4.0])  # the unknown one counts as 4
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sizes == [0, 333, 334, 333]  # the one at a quarter of the others' rate owns nothing


def test_shard_layout_takes_bandwidths_near_the_median_for_the_estimates_noise():
    """Members on equal links declare up to ~1.7× apart (layout.BANDWIDTH_NOISE): equal shares;
    a slow volunteer at a tenth of the others' rate owns nothing."""
    assert shard_layout(1000, [1.0, 1.5, 0.8, 1.9]) == [0, 250, 500, 750, 1000]
    bounds = shard_layout(1000, [5.0, 50.0, 60.0, 70.0])
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert sizes == [0, 333, 334, 333]  # 50, 60 and 70 count as their median, 60


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 10_001])
@pytest.mark.parametrize("bandwidths", [[1.0, 1.0, 1.0], [0.0, 1e9, 1.0], [3.0, 0.0], [1.0] * 5])
def test_shard_layout_covers_everything_in_order(numel, bandwidths):
    bounds = shard_layout(numel, bandwidths)
    assert len(bounds) == len(bandwidths) + 1
    assert bounds[0] == 0 and bounds[-1] == numel
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))


# -- group formation ----------------------------------------------------------------------------


def test_lowest_id_first():
    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            tasks = [asyncio.create_task(peers[0].form(0, expected))]
            await dht.wait_stored(round_key("test", 0), {"peer-00"})
            tasks.append(asyncio.create_task(peers[1].form(0, expected)))
            await peers[0].wait_joined_by("peer-01")
            tasks.append(asyncio.create_task(peers[2].form(0, expected)))
            groups = await asyncio.gather(*tasks)
            assert_one_group(groups, expected)
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_lowest_id_last():
    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            late = [asyncio.create_task(peers[i].form(0, expected)) for i in (2, 1)]
            # peer-01 leads peer-02 before the lowest id shows up.
            await peers[1].wait_joined_by("peer-02")
            first = asyncio.create_task(peers[0].form(0, expected))
            groups = await asyncio.gather(first, *late)
            assert_one_group(groups, expected)
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_late_lowest_id_takes_over_a_leader_that_already_has_followers():
    """peer-01 leads peer-02; then peer-00 shows up and peer-03 joins it. Two leaders with
    followers each must not split the round into two groups that wait until the deadline."""
    timeout = 4.0

    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(4, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            tasks = [asyncio.create_task(peers[i].form(0, expected, timeout=timeout)) for i in (1, 2)]
            await peers[1].wait_joined_by("peer-02")
            tasks.append(asyncio.create_task(peers[0].form(0, expected, timeout=timeout)))
            await dht.wait_stored(round_key("test", 0), {"peer-00"})
            tasks.append(asyncio.create_task(peers[3].form(0, expected, timeout=timeout)))
            await peers[0].wait_joined_by("peer-03")
            # Closed because everybody expected arrived, well before the deadline.
            async with asyncio.timeout(timeout / 2):
                groups = await asyncio.gather(*tasks)
            assert_one_group(groups, expected)
        finally:
            await stop_peers(peers)

    run(scenario(), 15)


def test_stale_registration_of_a_dead_lowest_peer_is_skipped():
    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            dead = peers[0]
            await dht.store(round_key("test", 0), dead.peer_id, {"address": dead.matchmaker.address}, ttl=60)
            await dead.stop()
            alive = peers[1:]
            expected = {p.peer_id for p in alive}
            groups = await asyncio.gather(*(p.form(0, expected, timeout=5) for p in alive))
            assert [m.peer_id for m in groups[0].members] == sorted(expected)
            assert groups[0] == groups[1]
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_all_at_once():
    async def scenario():
        dht = MemoryDHT(barrier=3)  # everybody registers before anybody reads the registrations
        peers = await start_peers(3, NUMEL, dht=dht)
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in reversed(peers)))
            assert_one_group(groups, expected)
            assert peers[0].joins_seen and not peers[1].joins_seen and not peers[2].joins_seen
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_shard_layout_of_a_group_follows_bandwidth():
    async def scenario():
        peers = await start_peers(3, NUMEL)
        try:
            expected = {p.peer_id for p in peers}
            bandwidths = [1e6, 0.0, 3e6]  # the unknown counts as 3e6; the member at a third of it owns nothing
            groups = await asyncio.gather(*(p.form(0, expected, bandwidth_bps=b) for p, b in zip(peers, bandwidths)))
            assert_one_group(groups, expected, owners=[1, 2])
            assert list(groups[0].shard_bounds) == [0, NUMEL // 2, NUMEL]
            # Within the estimates' noise: equal shares.
            groups = await asyncio.gather(*(p.form(1, expected, bandwidth_bps=b)
                                            for p, b in zip(peers, [2e6, 0.0, 3e6])))
            assert_one_group(groups, expected)
            assert list(groups[0].shard_bounds) == shard_layout(NUMEL, [0.0] * 3)
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_client_mode_member_owns_no_shard():
    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(2, NUMEL, dht=dht)
        client = Peer("peer-00-client", NUMEL, "int8", dht, client_mode=True)
        await client.start()
        try:
            expected = {p.peer_id for p in peers} | {client.peer_id}
            groups = await asyncio.gather(*(p.form(0, expected) for p in [client, *peers]))
            members = [m.peer_id for m in groups[0].members]
            assert members == sorted(expected)
            assert all(g == groups[0] for g in groups)
            owners = [members[i] for i in groups[0].shard_owners]
            assert owners == ["peer-00", "peer-01"]
            assert len(groups[0].shard_bounds) == 3
        finally:
            await stop_peers([client, *peers])

    run(scenario(), 10)


def test_more_peers_than_group_size_split_into_balanced_remixed_groups():
    timeout = 5.0

    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(6, NUMEL, dht=dht, group_size=3)
        try:
            expected = {p.peer_id for p in peers}
            tasks = [asyncio.create_task(peers[0].form(0, expected, timeout=timeout))]
            await dht.wait_stored(round_key("test", 0), {"peer-00"})
            tasks += [asyncio.create_task(p.form(0, expected, timeout=timeout)) for p in peers[1:]]
            groups = await asyncio.gather(*tasks)
        finally:
            await stop_peers(peers)
        by_id = {}
        for peer, group in zip(peers, groups):
            assert peer.peer_id in {m.peer_id for m in group.members}
            by_id.setdefault(group.group_id, []).append(group)
        assert len(by_id) == 2  # two groups of three, every member of a group got the same message
        for copies in by_id.values():
            assert len(copies) == 3 and all(c == copies[0] for c in copies)
        assert sorted(m.peer_id for g in by_id.values() for m in g[0].members) == sorted(expected)

    run(scenario(), 20)


def test_split_into_groups_is_balanced_owned_and_remixed_per_step():
    members = [averaging_pb2.Member(peer_id=f"p{i:02d}", address=f"h:{i}" if i < 4 else "") for i in range(9)]
    partitions = []
    for step in range(6):
        groups = split_into_groups(members, 3, step)
        assert sorted(len(g) for g in groups) == [3, 3, 3]
        assert all(any(m.address for m in g) for g in groups)  # every group has a shard owner
        partitions.append(frozenset(frozenset(m.peer_id for m in g) for g in groups))
    assert len(set(partitions)) > 1  # partners change from round to round
    assert [len(g) for g in split_into_groups(members[:3], 2, 0)] == [3]  # never a group of one

def test_lone_peer_expecting_only_itself_gets_a_solo_group_at_once():
    async def scenario():
        peers = await start_peers(1, NUMEL)
        try:
            async with asyncio.timeout(2):  # far below the 30 s matchmaking timeout
                group = await peers[0].form(0, {"peer-00"}, timeout=30)
            assert [m.peer_id for m in group.members] == ["peer-00"]
            assert list(group.shard_bounds) == [0, NUMEL] and list(group.shard_owners) == [0]
        finally:
            await stop_peers(peers)

    run(scenario(), 10)


def test_nobody_expected_and_nobody_comes_ends_at_the_deadline():
    async def scenario():
        peers = await start_peers(1, NUMEL)
        try:
            group = await peers[0].form(0, set(), timeout=0.5)
            assert [m.peer_id for m in group.members] == ["peer-00"]
        finally:
            await stop_peers(peers)

    run(scenario(), 5)


def test_client_mode_peer_alone_raises_matchmaking_error():
    async def scenario():
        client = Peer("peer-00", NUMEL, "int8", MemoryDHT(), client_mode=True)
        await client.start()
        try:
            with pytest.raises(MatchmakingError):
                await client.form(0, {"peer-00", "peer-01"}, timeout=0.5)
        finally:
            await client.stop()

    run(scenario(), 5)


def test_incompatible_run_config_is_refused_on_both_sides(caplog):
    ours = load_config(environ={})
    theirs = load_config(overrides=["sync.codec=int4"], environ={})

    async def scenario():
        dht = MemoryDHT()
        leader = Peer("peer-00", NUMEL, "int8", dht)
        joiner = Peer("peer-01", NUMEL, "int4", dht)
        await leader.start(ours.run_fingerprint(), ours.run_config_json())
        await joiner.start(theirs.run_fingerprint(), theirs.run_config_json())
        try:
            expected = {"peer-00", "peer-01"}
            leading = asyncio.create_task(leader.form(0, expected, timeout=5))
            await dht.wait_stored(round_key("test", 0), {"peer-00"})
            with pytest.raises(IncompatiblePeer) as info:
                await joiner.form(0, expected, timeout=5)
            leading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leading
            return str(info.value)
        finally:
            await stop_peers([leader, joiner])

    with caplog.at_level(logging.WARNING, logger="lowcomm.protocol.matchmaking"):
        joiner_message = run(scenario(), 10)
    # The joiner learns who refused it and which key differs, with each value named by its peer.
    assert "peer peer-00" in joiner_message and "refused" in joiner_message
    assert "[sync] codec: peer-00 'int8', peer-01 'int4'" in joiner_message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("peer-01" in w and "[sync] codec" in w for w in warnings), warnings


def test_handshake_names_protocol_version_and_differing_keys():
    a = load_config(environ={})
    b = load_config(overrides=["sync.codec=int4", "train.inner_steps=3"], environ={})
    ours, theirs = Identity("A", a.run_fingerprint(), a.run_config_json()), Identity("B", b.run_fingerprint(), b.run_config_json())
    ours.check(Identity("C", a.run_fingerprint(), a.run_config_json()).hello())  # same config: fine
    with pytest.raises(IncompatiblePeer) as info:
        ours.check(theirs.hello())
    assert "[sync] codec: A 'int8', B 'int4'" in str(info.value)
    assert "[train] inner_steps: A 50, B 3" in str(info.value)
    old = theirs.hello()
    old.protocol_version = PROTOCOL_VERSION + 1
    with pytest.raises(IncompatiblePeer, match="protocol version"):
        ours.check(old)
    garbled = theirs.hello()
    garbled.run_config_json = "not json"
    with pytest.raises(IncompatiblePeer, match="no readable run config"):
        ours.check(garbled)


def test_a_peer_refused_for_another_run_config_is_told_to_the_node():
    """The node counts these refusals (lowcomm_rejected_contributions_total{reason="config"}
    stayed 0 while the walkthrough's node refused a peer of another config every round)."""
    a = load_config(environ={})
    b = load_config(overrides=["sync.codec=int4"], environ={})
    refused: list[str] = []
    ours = Identity("A", a.run_fingerprint(), a.run_config_json(), on_other_config=refused.append)
    ours.check(Identity("C", a.run_fingerprint(), a.run_config_json()).hello())
    assert refused == []
    with pytest.raises(IncompatiblePeer):
        ours.check(Identity("B", b.run_fingerprint(), b.run_config_json()).hello())
    assert refused == ["B"]


# -- one overall deadline -----------------------------------------------------------------------


class StallingDHT(MemoryDHT):
    """A DHT whose reads (and, with ``stall_store``, writes) never answer: a stuck DHT process."""

    def __init__(self, stall_store: bool = False) -> None:
        super().__init__()
        self.stall_store = stall_store

    async def store(self, key, subkey, value, ttl):
        if self.stall_store:
            await asyncio.Event().wait()
        return await super().store(key, subkey, value, ttl)

    async def get(self, key):
        await asyncio.Event().wait()


@pytest.mark.parametrize("stall_store", [False, True])
def test_a_stuck_dht_ends_in_matchmaking_error_at_the_deadline(stall_store):
    """DHT calls count against the one matchmaking deadline (run() gives up after 5 s)."""
    async def scenario():
        peer = Peer("peer-00", NUMEL, "int8", StallingDHT(stall_store))
        await peer.start()
        try:
            with pytest.raises(MatchmakingError, match="within 0.5s"):
                await peer.form(0, {"peer-00", "peer-01"}, timeout=0.5)
        finally:
            await peer.stop()

    run(scenario(), 5)


def test_a_follower_gives_up_at_its_own_deadline_when_the_leader_never_answers():
    """A leader that takes the JoinGroup call and never closes: the follower's call ends at the
    follower's deadline (no margin on top of it; run() gives up after 4 s, the old margin was 5 s)."""
    async def scenario():
        dht = MemoryDHT()
        leader, follower = await start_peers(2, NUMEL, dht=dht)
        stuck = asyncio.Event()

        async def never_closes(request, context):
            stuck.set()
            await asyncio.Event().wait()

        leader.matchmaker.handle_join = never_closes
        await dht.store(round_key("test", 0), leader.peer_id, {"address": leader.matchmaker.address}, ttl=60)
        try:
            with pytest.raises(MatchmakingError):
                await follower.form(0, {leader.peer_id, follower.peer_id}, timeout=1.0)
            assert stuck.is_set()
        finally:
            await stop_peers([leader, follower])

    run(scenario(), 4)


def test_a_leader_closes_before_its_follower_gives_up():
    """The leader would wait 30 s for a third expected peer that never comes; its follower waits
    only 1.5 s. The leader closes before the follower leaves, and both hold the same group."""
    async def scenario():
        dht = MemoryDHT()
        leader, follower = await start_peers(2, NUMEL, dht=dht)
        expected = {leader.peer_id, follower.peer_id, "peer-99"}
        try:
            leading = asyncio.create_task(leader.form(0, expected, timeout=30))
            await dht.wait_stored(round_key("test", 0), {leader.peer_id})
            groups = await asyncio.gather(follower.form(0, expected, timeout=1.5), leading)
            assert_one_group(groups, {leader.peer_id, follower.peer_id})
        finally:
            await stop_peers([leader, follower])

    run(scenario(), 10)


# -- schedule = "auto": a ring or a butterfly from the declared bandwidths -----------------------


def test_auto_picks_a_ring_on_equal_links_and_a_butterfly_around_a_slow_member():
    from lowcomm.protocol.layout import AUTO_PROBE_EVERY, choose_schedule, predicted_seconds

    ring, butterfly = averaging_pb2.ALL_REDUCE_SCHEDULE_RING, averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY
    payload, fast, slow = 4_000_000, 12.5e6, 2.5e6  # 4 MB; 100 and 20 Mbit/s
    assert choose_schedule(3, payload, [fast] * 4) == ring
    assert choose_schedule(3, payload, [fast, fast * 1.6, fast * 0.7, fast]) == ring  # estimates' noise: equal links
    assert choose_schedule(3, payload, [fast, fast, fast, slow]) == butterfly
    # Until every member measured its link, and at every probe step: a butterfly, which measures.
    assert choose_schedule(3, payload, [fast, fast, 0.0, fast]) == butterfly
    assert choose_schedule(AUTO_PROBE_EVERY * 4, payload, [fast] * 4) == butterfly
    assert choose_schedule(3, payload, [fast]) == butterfly
    # The model against bench/RESULTS.md section 3b (4 × 4 MB, one member at 20 Mbit/s, the others
    # at 100): the ring took 2.58 s, the butterfly with shares by measured bandwidth 2.17 s (the
    # slow member owning 0.02-0.06; owning nothing, its S alone sets the round at the model's 2.05 s).
    assert predicted_seconds(ring, payload, [fast, fast, fast, slow]) == pytest.approx(2.58, rel=0.01)
    assert predicted_seconds(butterfly, payload, [fast, fast, fast, slow]) == pytest.approx(2.17, rel=0.1)


def test_an_auto_leader_sends_a_ring_or_a_butterfly_never_auto():
    members = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}", weight=1.0) for i in range(4)]
    template = averaging_pb2.Group(step=3, codec=codecs.get_codec("int8").id,
                                   schedule=averaging_pb2.ALL_REDUCE_SCHEDULE_AUTO)
    equal = {m.peer_id: 12.5e6 for m in members}
    [group] = close_groups([members], equal, 100_000, template, lambda n: bytes(n))
    assert group.schedule == averaging_pb2.ALL_REDUCE_SCHEDULE_RING
    assert list(group.shard_bounds) == [0, 25_000, 50_000, 75_000, 100_000]  # a ring's equal chunks
    [group] = close_groups([members], equal | {"p3": 1.25e6}, 100_000, template, lambda n: bytes(n))
    assert group.schedule == averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY
    assert set(group.shard_owners) == {0, 1, 2}  # the slow member owns nothing
    # A client-mode member cannot be in a ring: a butterfly whatever the figures.
    client = members[:3] + [averaging_pb2.Member(peer_id="p3", address="", weight=1.0)]
    [group] = close_groups([client], equal, 100_000, template, lambda n: bytes(n))
    assert group.schedule == averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY


def test_a_ring_keeps_a_chunk_for_every_member_even_an_empty_one():
    """A ring needs every member to own a chunk (ring.py ``ring_problem``): with fewer values than
    members some chunks are empty, and nobody is left without one as a butterfly's owner would be."""
    members = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}", weight=1.0) for i in range(3)]
    template = averaging_pb2.Group(step=3, codec=codecs.get_codec("fp32").id,
                                   schedule=averaging_pb2.ALL_REDUCE_SCHEDULE_RING)
    [ring] = close_groups([members], dict.fromkeys(("p0", "p1", "p2"), 12.5e6), 2, template, lambda n: bytes(n))
    assert list(ring.shard_owners) == [0, 1, 2] and list(ring.shard_bounds) == [0, 1, 1, 2]
    template.schedule = averaging_pb2.ALL_REDUCE_SCHEDULE_BUTTERFLY
    [butterfly] = close_groups([members], dict.fromkeys(("p0", "p1", "p2"), 12.5e6), 2, template, lambda n: bytes(n))
    assert list(butterfly.shard_owners) == [0, 2] and list(butterfly.shard_bounds) == [0, 1, 2]
