"""Matchmaking without sockets: the real Matchmaker over a fake transport, a fake DHT and a
virtual clock (tests/protocol_fakes.py). Leader election, group formation under a deadline,
splitting, a late joiner, the overall deadline and the direct path, each in milliseconds of
wall time however many protocol seconds they span, and the same on every run."""

from __future__ import annotations

import asyncio
import random

import pytest

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.handshake import Identity, IncompatiblePeer
from lowcomm.protocol.matchmaking import POLL_SECONDS, REPLY_MARGIN, Matchmaker, MatchmakingError, round_key
from lowcomm.protocol.transport import CallFailed, Code

from .protocol_fakes import FakeDHT, FakeNet, VirtualTimeLoop, run_virtual

NUMEL = 1000
FP32 = int(codecs.get_codec("fp32").id)


def make_peer(net: FakeNet, dht: FakeDHT, loop: VirtualTimeLoop, peer_id: str, *, group_size: int = 16,
              fingerprint: str = "f" * 64, client: bool = False) -> Matchmaker:
    address = "" if client else f"fake://{peer_id}"
    matchmaker = Matchmaker(dht, "unit", Identity(peer_id, fingerprint, "{}"), address, None, group_size, FP32,
                            NUMEL, reduce_timeout=5.0, transport=net, clock=loop.clock,
                            random_bytes=random.Random(peer_id).randbytes, wall_clock=loop.time)
    if address:
        net.matchmakers[address] = matchmaker
    return matchmaker


def peers(net: FakeNet, dht: FakeDHT, loop: VirtualTimeLoop, count: int, **kwargs) -> list[Matchmaker]:
    return [make_peer(net, dht, loop, f"peer-{i:02d}", **kwargs) for i in range(count)]


def expecting(ids: set[str]):
    async def expected_peers() -> set[str]:
        return set(ids)
    return expected_peers


async def form_all(matchmakers: list[Matchmaker], step: int, expected: set[str], timeout: float):
    return await asyncio.gather(*(m.form_group(step, 1.0, 0.0, expecting(expected), timeout) for m in matchmakers))


def test_the_lowest_id_leads_and_everybody_gets_the_same_group_at_once():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = peers(net, dht, loop, 4)
        groups = await form_all(group[::-1], 0, {m.peer_id for m in group}, timeout=10.0)  # the leader starts last
        return loop.time(), groups, [m.led_last_group for m in group], net.calls

    elapsed, groups, led, calls = run_virtual(scenario)
    assert all(g == groups[0] for g in groups)  # one message from one leader
    assert [m.peer_id for m in groups[0].members] == ["peer-00", "peer-01", "peer-02", "peer-03"]
    assert list(groups[0].shard_owners) == [0, 1, 2, 3] and groups[0].shard_bounds[-1] == NUMEL
    assert led == [True, False, False, False]
    assert groups[0].group_id == random.Random("peer-00").randbytes(16)  # the injected RNG made the id
    assert elapsed < POLL_SECONDS * 2  # closed when the last expected peer joined, not at a deadline
    assert {address for method, address in calls if method == "JoinGroup"} == {"fake://peer-00"}


def test_runs_are_deterministic():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = peers(net, dht, loop, 6, group_size=3)
        groups = await form_all(group, 3, {m.peer_id for m in group} | {"peer-77"}, timeout=20.0)
        return loop.time(), [g.SerializeToString() for g in groups], net.calls, dht.reads

    assert run_virtual(scenario) == run_virtual(scenario)


def test_a_quorum_closes_after_the_straggler_wait_and_without_it_at_the_deadline():
    async def scenario(loop: VirtualTimeLoop, absent: int):
        net, dht = FakeNet(), FakeDHT(loop)
        present = peers(net, dht, loop, 3)
        expected = {m.peer_id for m in present} | {f"peer-9{i}" for i in range(absent)}
        groups = await form_all(present, 0, expected, timeout=20.0)
        return loop.time(), groups, present[0].straggler_wait()

    # 3 of 4 expected is a quorum (2/3): the leader waits its straggler wait, then closes.
    elapsed, groups, wait = run_virtual(lambda loop: scenario(loop, 1))
    assert [m.peer_id for m in groups[0].members] == ["peer-00", "peer-01", "peer-02"]
    assert wait <= elapsed <= wait + POLL_SECONDS + 0.01
    # 3 of 6 is not: the leader closes just before its followers' own deadline, never after it.
    elapsed, groups, _ = run_virtual(lambda loop: scenario(loop, 3))
    assert all(g == groups[0] for g in groups) and len(groups[0].members) == 3
    assert 20.0 - REPLY_MARGIN - POLL_SECONDS - 0.01 <= elapsed <= 20.0 - REPLY_MARGIN + 0.01


def test_more_peers_than_the_group_size_are_split_by_the_leader():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = peers(net, dht, loop, 7, group_size=3)
        return await form_all(group, 5, {m.peer_id for m in group}, timeout=10.0)

    groups = run_virtual(scenario)
    by_id: dict[bytes, averaging_pb2.Group] = {}
    for peer, g in zip(range(7), groups):
        assert f"peer-{peer:02d}" in [m.peer_id for m in g.members]
        assert by_id.setdefault(g.group_id, g) == g  # every member of a group got the same message
    sizes = sorted(len(g.members) for g in by_id.values())
    assert sizes == [2, 2, 3] and sum(sizes) == 7  # balanced, nobody twice, nobody left out


def test_a_late_joiner_is_refused_and_forms_its_own_round():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        early = peers(net, dht, loop, 3)
        expected = {m.peer_id for m in early}
        closed = await form_all(early, 0, expected, timeout=10.0)
        late = make_peer(net, dht, loop, "peer-05")
        request = averaging_pb2.JoinRequest(hello=late.identity.hello(), step=0, address=late.address, weight=1.0)
        with pytest.raises(CallFailed) as refused:
            await net.join(early[0].address, request, timeout=1.0)
        started = loop.time()
        alone = await late.form_group(0, 1.0, 0.0, expecting(expected | {"peer-05"}), timeout=3.0)
        return closed, refused.value, alone, loop.time() - started

    closed, refused, alone, took = run_virtual(scenario)
    assert refused.code == Code.ABORTED and "already closed" in refused.detail
    assert [m.peer_id for m in alone.members] == ["peer-05"] and alone.group_id != closed[0].group_id
    assert took <= 3.0  # within its own deadline


def test_incompatible_peers_are_told_why_and_never_meet():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        leader = make_peer(net, dht, loop, "peer-00")
        other = make_peer(net, dht, loop, "peer-01", fingerprint="e" * 64)
        expected = {"peer-00", "peer-01"}
        return await asyncio.gather(*(m.form_group(0, 1.0, 0.0, expecting(expected), 2.0) for m in (leader, other)),
                                    return_exceptions=True)

    # The follower is refused (FAILED_PRECONDITION); the lonely leader then tries the other one.
    for outcome, other in zip(run_virtual(scenario), ["peer-01", "peer-00"]):
        assert isinstance(outcome, IncompatiblePeer)
        assert f"peer {other} at fake://{other} refused to average" in str(outcome)


@pytest.mark.parametrize("stuck", ["leader", "dht"])
def test_the_overall_deadline_holds_when_the_leader_or_the_dht_never_answers(stuck):
    class StuckDHT(FakeDHT):
        async def get(self, key: str) -> dict[str, dict]:
            await asyncio.Event().wait()
            return {}

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        dht = StuckDHT(loop) if stuck == "dht" else FakeDHT(loop)
        follower = make_peer(net, dht, loop, "peer-05")
        await dht.store(round_key("unit", 0), "peer-00", {"address": "fake://hung"}, ttl=60)
        net.silent.add("fake://hung")
        net.matchmakers["fake://hung"] = follower  # takes the call, never answers
        with pytest.raises(MatchmakingError, match="within 2.0s"):
            await follower.form_group(0, 1.0, 0.0, expecting({"peer-00", "peer-05"}), timeout=2.0)
        return loop.time()

    assert run_virtual(scenario) == pytest.approx(2.0, abs=1e-6)


def test_a_stable_group_meets_directly_without_reading_the_dht():
    async def scenario(loop: VirtualTimeLoop):
        net, dht = FakeNet(), FakeDHT(loop)
        group = peers(net, dht, loop, 3)
        expected = {m.peer_id for m in group}
        first = await form_all(group, 0, expected, timeout=10.0)
        reads, started = dht.reads, loop.time()
        second = await form_all(group[::-1], 1, expected, timeout=10.0)
        await asyncio.sleep(0)  # the background registrations of the direct path
        return first, second, dht.reads - reads, loop.time() - started, dht.data

    first, second, reads, took, data = run_virtual(scenario)
    assert all(g == second[0] for g in second) and second[0].step == 1
    assert [m.peer_id for m in second[0].members] == [m.peer_id for m in first[0].members]
    assert reads == 0  # the direct path: no DHT read at all
    assert took < POLL_SECONDS
    assert set(data[round_key("unit", 1)]) == {"peer-00", "peer-01", "peer-02"}  # newcomers still find it
