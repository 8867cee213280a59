"""Round notices (protocol/direct.py, issue 17 item 3): the first member of a stable group to
start the direct round tells the others (RoundStarted), so their overlapped phases end without a
DHT read; a stranger's notice is ignored, a dead or older member delays nobody, and an
incompatible caller is refused. Unit tests on the fakes of tests/protocol_fakes.py (virtual time),
then the gRPC surface: the servicer, an older peer's UNIMPLEMENTED and the run secret."""

from __future__ import annotations

import asyncio
import random
import threading
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health

from lowcomm.node.overlap import COMMIT_LOOK, OverlappedLoop
from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2, averaging_pb2_grpc
from lowcomm.protocol.auth import RunAuth, ServerAuthInterceptor, client_interceptors
from lowcomm.protocol.direct import NOTICE_TIMEOUT
from lowcomm.protocol.grpc_transport import GrpcMatchmakingTransport
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import POLL_SECONDS, Matchmaker, round_key
from lowcomm.protocol.rpc import AveragingServicer, ChannelPool, NodeInfoServicer, create_server
from lowcomm.protocol.transport import CallFailed, Code

from .protocol_fakes import FakeDHT, FakeNet, VirtualTimeLoop, run_virtual
from .swarm_harness import MemoryDHT, Peer, start_peers, stop_peers

NUMEL = 1000
FP32 = int(codecs.get_codec("fp32").id)
H0, H1 = "a0" * 32, "b1" * 32  # the params hashes of steps 0 and 1


def make_peer(net: FakeNet, dht: FakeDHT, loop: VirtualTimeLoop, peer_id: str,
              fingerprint: str = "f" * 64) -> Matchmaker:
    address = f"fake://{peer_id}"
    matchmaker = Matchmaker(dht, "unit", Identity(peer_id, fingerprint, "{}"), address, None, 16, FP32,
                            NUMEL, reduce_timeout=5.0, transport=net, clock=loop.clock,
                            random_bytes=random.Random(peer_id).randbytes, wall_clock=loop.time)
    net.matchmakers[address] = matchmaker
    return matchmaker


def expecting(ids: set[str]):
    async def expected_peers() -> set[str]:
        return set(ids)
    return expected_peers


async def form(m: Matchmaker, step: int, expected: set[str], params_hash: str, timeout: float = 10.0):
    return await m.form_group(step, 1.0, 0.0, expecting(expected), timeout, params_hash=params_hash)


async def stable_group(loop: VirtualTimeLoop, count: int, net: FakeNet | None = None):
    """``count`` peers that averaged step 0 together (through the DHT): each has a last group."""
    net, dht = net or FakeNet(), FakeDHT(loop)
    group = [make_peer(net, dht, loop, f"peer-{i:02d}") for i in range(count)]
    ids = {m.peer_id for m in group}
    groups = await asyncio.gather(*(form(m, 0, ids, H0) for m in group))
    assert all(g == groups[0] and len(g.members) == count for g in groups)
    return net, dht, group, ids


def notices(net: FakeNet) -> list[str]:
    return [address for method, address in net.calls if method == "RoundStarted"]


def test_the_first_member_to_start_the_direct_round_tells_the_others_without_any_dht_read():
    async def scenario(loop: VirtualTimeLoop):
        net, dht, (p0, p1, p2), ids = await stable_group(loop, 3)
        before = len(notices(net))
        reads = list(dht.keys_read)
        started = loop.time()
        first = asyncio.create_task(form(p2, 1, ids, H1))  # the fastest peer reaches its boundary
        seen = await asyncio.gather(p0.wait_round_started(1, H1, 10.0), p1.wait_round_started(1, H1, 10.0))
        noticed_after = loop.time() - started
        dht_reads_meanwhile = dht.keys_read[len(reads):]
        # The others start the round once told: they were noticed, so they tell nobody again.
        groups = await asyncio.gather(first, form(p0, 1, ids, H1), form(p1, 1, ids, H1))
        return (seen, noticed_after, dht_reads_meanwhile, notices(net)[before:], groups,
                p0.round_noticed(1, H0), p2.round_noticed(1, H1))

    seen, noticed_after, reads, sent, groups, other_hash, sender_told = run_virtual(scenario)
    assert seen == [True, True]
    assert noticed_after < POLL_SECONDS  # a round trip of the fake network, not a DHT poll
    assert round_key("unit", 1, H1) not in reads  # nobody read the step's registrations
    assert sorted(sent) == ["fake://peer-00", "fake://peer-01"]  # g-1 notices for the round, not g(g-1)
    assert all(g == groups[0] and [m.peer_id for m in g.members] == ["peer-00", "peer-01", "peer-02"]
               for g in groups)
    assert not sender_told  # nobody told the first one: it started the round itself
    assert not other_hash  # a notice is for one (step, params hash): other parameters are not cut


def test_a_round_is_announced_once_and_only_to_the_group_that_averaged_the_step_before():
    async def scenario(loop: VirtualTimeLoop):
        net, _, (p0, p1, p2), _ = await stable_group(loop, 3)
        before = len(notices(net))
        p2.announce_round(1, H1)
        p2.announce_round(1, H1)  # the node announces as the round starts, form_group again: sent once
        p2.announce_round(3, H1)  # our last group averaged step 0, not 2: it has no round of step 3 with us
        await asyncio.sleep(NOTICE_TIMEOUT)
        return sorted(notices(net)[before:]), p0.round_noticed(1, H1), p1.round_noticed(1, None)

    sent, p0_told, p1_told = run_virtual(scenario)
    assert sent == ["fake://peer-00", "fake://peer-01"]
    assert p0_told and p1_told


def test_a_notice_counts_only_from_a_member_of_the_last_group_and_for_the_next_step():
    async def scenario(loop: VirtualTimeLoop):
        net, dht, (p0, p1), _ = await stable_group(loop, 2)
        stranger = make_peer(net, dht, loop, "peer-09")  # compatible, but never in p0's group
        replies = {}
        for name, sender, step in [("stranger", stranger, 1), ("stale step", p1, 0), ("far step", p1, 5)]:
            notice = averaging_pb2.RoundNotice(hello=sender.identity.hello(), step=step, params_sha256=H1)
            replies[name] = (await net.notice(p0.address, notice, 1.0)).accepted
        waited = await p0.wait_round_started(1, H1, 2.0)  # no member said so: times out
        cut_by_strangers = any(p0.round_noticed(s, H1) for s in (0, 1, 5))
        member = averaging_pb2.RoundNotice(hello=p1.identity.hello(), step=1, params_sha256=H1)
        replies["member"] = (await net.notice(p0.address, member, 1.0)).accepted
        return replies, waited, cut_by_strangers, await p0.wait_round_started(1, H1, 0.0)

    replies, waited, cut_by_strangers, after_member = run_virtual(scenario)
    assert replies == {"stranger": False, "stale step": False, "far step": False, "member": True}
    assert waited is False and cut_by_strangers is False
    assert after_member is True


@pytest.mark.parametrize("dead", ["down", "silent", "old"])
def test_a_dead_or_older_member_does_not_delay_the_senders_round(dead):
    """peer-02 of the last group is gone (refuses at once, or hangs) or an older peer without
    RoundStarted: the notice to it fails in the background and the others' round goes on."""

    class OldPeerNet(FakeNet):
        async def notice(self, address, request, timeout):
            if address == "fake://peer-02":
                raise CallFailed(Code.UNIMPLEMENTED, "Method not found!")
            return await super().notice(address, request, timeout)

    async def scenario(loop: VirtualTimeLoop):
        net, _, (p0, p1, _p2), _ = await stable_group(loop, 3, OldPeerNet() if dead == "old" else None)
        if dead != "old":
            getattr(net, dead).add("fake://peer-02")
        started = loop.time()
        # The view no longer expects peer-02: the direct leader closes once peer-01 joined.
        groups = await asyncio.gather(form(p0, 1, {"peer-00", "peer-01"}, H1), form(p1, 1, {"peer-00", "peer-01"}, H1))
        took = loop.time() - started
        await asyncio.sleep(NOTICE_TIMEOUT + 0.1)  # the hung call ends at its own deadline
        return took, groups, notices(net), bool(p0._noticing or p1._noticing)

    took, groups, sent, still_sending = run_virtual(scenario)
    assert [m.peer_id for m in groups[0].members] == ["peer-00", "peer-01"] and groups[0] == groups[1]
    assert took < NOTICE_TIMEOUT / 10  # the round did not wait for the notice to the dead member
    if dead != "old":  # (the old peer's fake refuses before FakeNet records the call)
        assert "fake://peer-02" in sent
    assert not still_sending  # every notice task ended, the hung one at its deadline


def test_an_incompatible_caller_is_refused_and_never_noticed():
    async def scenario(loop: VirtualTimeLoop):
        net, dht, (p0, p1), _ = await stable_group(loop, 2)
        # peer-01's id, another run config: the hello check comes before anything else.
        other = Identity("peer-01", "e" * 64, "{}")
        notice = averaging_pb2.RoundNotice(hello=other.hello(), step=1, params_sha256=H1)
        with pytest.raises(CallFailed) as refused:
            await net.notice(p0.address, notice, 1.0)
        return refused.value, p0.round_noticed(1, H1)

    refused, noticed = run_virtual(scenario)
    assert refused.code == Code.FAILED_PRECONDITION and "different run config" in refused.detail
    assert noticed is False


def test_the_overlapped_phase_watcher_cuts_on_a_notice_before_any_dht_read():
    """node/overlap.py: the watcher of the phase that leads to step 1's round ends it as soon as
    the notice comes, or, when the notice came before our own round of step 0 committed, as soon
    as that commit lands; without a notice it still cuts on the DHT registrations (the fallback)."""

    async def scenario(loop: VirtualTimeLoop, notice_at: float | None, commit_at: float):
        _, _, (p0, p1), _ = await stable_group(loop, 2)
        dht_looks: list[float] = []

        async def others_registered(step: int, params_hash: str) -> bool:
            dht_looks.append(loop.time())
            return True  # somebody did register: the fallback cuts at its first look

        async def round_started(step: int, params_hash: str | None, timeout: float) -> bool:
            return await p0.wait_round_started(step, params_hash, timeout)

        averager = SimpleNamespace(tried=set(), others_registered=others_registered, round_started=round_started)
        state = SimpleNamespace(step=0, params_hash=H0)  # our background round of step 0 is running
        driver = SimpleNamespace(state=state, averager=averager)
        watch = OverlappedLoop(driver)._watch_round_start(SimpleNamespace(step=0))  # type: ignore[arg-type]
        assert watch is not None
        cut = threading.Event()
        started = loop.time()
        watching = asyncio.create_task(watch(cut))

        async def at(when: float, action) -> None:
            await asyncio.sleep(when)
            action()

        def commit() -> None:
            state.step, state.params_hash = 1, H1

        def notify() -> None:
            p1.announce_round(1, H1)

        events = [at(commit_at, commit)] + ([at(notice_at, notify)] if notice_at is not None else [])
        await asyncio.gather(watching, *events)
        return cut.is_set(), loop.time() - started, dht_looks

    # Notice after the commit: the phase ends a round trip after the notice.
    cut, took, looks = run_virtual(lambda loop: scenario(loop, 0.10, 0.05))
    assert cut and took < 0.10 + 0.01 and looks == []
    # Notice before the commit: it ends at the commit (a look at our own state), not a DHT poll later.
    cut, took, looks = run_virtual(lambda loop: scenario(loop, 0.05, 0.10))
    assert cut and took <= 0.10 + 2 * COMMIT_LOOK and looks == []
    # No notice: the DHT registrations, read every POLL_SECONDS once committed.
    cut, took, looks = run_virtual(lambda loop: scenario(loop, None, 0.05))
    assert cut and took >= POLL_SECONDS and len(looks) == 1


# -- the gRPC surface ---------------------------------------------------------------------------


def run(coro, limit: float = 30.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


def test_notices_travel_over_grpc_and_an_older_peer_answers_unimplemented():
    async def scenario():
        peers = await start_peers(3, NUMEL, dht=MemoryDHT())
        old_server, old_port = create_server("127.0.0.1", 0, None, None, NodeInfoServicer(lambda: None),
                                             health.aio.HealthServicer())  # no Averaging service at all
        await old_server.start()
        pool = ChannelPool()
        try:
            expected = {p.peer_id for p in peers}
            await asyncio.gather(*(p.form(0, expected) for p in peers))
            first = asyncio.create_task(peers[2].form(1, expected))
            seen = await asyncio.gather(*(p.matchmaker.wait_round_started(1, "", 10.0) for p in peers[:2]))
            await asyncio.gather(first, *(p.form(1, expected) for p in peers[:2]))
            transport = GrpcMatchmakingTransport(lambda: pool)
            notice = averaging_pb2.RoundNotice(hello=peers[2].identity.hello(), step=2)
            with pytest.raises(CallFailed) as old:
                await transport.notice(f"127.0.0.1:{old_port}", notice, 5.0)
            return seen, old.value.code
        finally:
            await pool.close()
            await old_server.stop(grace=None)
            await stop_peers(peers)

    seen, old_code = run(scenario())
    assert seen == [True, True]
    assert old_code == Code.UNIMPLEMENTED  # what the sender logs at debug and ignores


def test_round_started_needs_the_run_secret():
    secret = b"correct horse battery staple 42"

    async def scenario():
        peer = Peer("server", NUMEL, "fp32", MemoryDHT())
        await peer.start()
        server, port = create_server("127.0.0.1", 0, AveragingServicer(peer.matchmaker, peer.registry), None,
                                     NodeInfoServicer(lambda: None), health.aio.HealthServicer(),
                                     interceptors=[ServerAuthInterceptor(RunAuth(secret), lambda *r: None)])
        await server.start()
        plain = ChannelPool()
        ours = ChannelPool(client_interceptors(RunAuth(secret), "peer-a", lambda: 1))
        notice = averaging_pb2.RoundNotice(hello=Identity("peer-a", "f" * 64, "{}").hello(), step=1)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await averaging_pb2_grpc.AveragingStub(plain(f"127.0.0.1:{port}")).RoundStarted(notice)
            reply = await averaging_pb2_grpc.AveragingStub(ours(f"127.0.0.1:{port}")).RoundStarted(notice)
            return refused.value.code(), reply.accepted
        finally:
            for pool in (plain, ours):
                await pool.close()
            await server.stop(grace=None)
            await peer.stop()

    code, accepted = run(scenario())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert accepted is False  # with the token it is served: peer-a is in no last group of the server
