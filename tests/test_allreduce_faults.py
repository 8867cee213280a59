"""Butterfly all-reduce under failures: dead owners, silent and late senders, malicious streams,
and unequal weights. Several peers with real gRPC servers in one event loop (DESIGN §4, §7)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
import torch

from lowcomm.protocol import allreduce, codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2, averaging_pb2_grpc
from lowcomm.protocol.allreduce import ReduceRegistry, ShardAccumulator
from lowcomm.protocol.rpc import ChannelPool

from .swarm_harness import MemoryDHT, Peer, apply_outer, digest, start_peers, stop_peers

NUMEL = 30_001
REDUCE_TIMEOUT = 1.5


def run(coro, limit: float):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


def random_deltas(count: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * 0.01 for _ in range(count)]


def seed_residuals(peers: list[Peer], seed: int = 1) -> list[torch.Tensor]:
    """Non-zero residuals from an earlier round, so that "kept in the residual" is observable."""
    gen = torch.Generator().manual_seed(seed)
    old = []
    for p in peers:
        p.residual.copy_(torch.randn(p.numel, generator=gen) * 0.001)
        old.append(p.residual.clone())
    return old


def new_params(theta: torch.Tensor, results) -> list[torch.Tensor]:
    return [apply_outer(theta, r) for r in results]


# -- (a) a shard owner dies after the group formed ---------------------------------------------


def test_dead_owner_shard_is_skipped_by_everybody_and_kept_in_residuals():
    async def scenario():
        peers = await start_peers(3, NUMEL, "int8", reduce_timeout=REDUCE_TIMEOUT)
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            group = groups[0]
            assert len(group.members) == 3 and all(g == group for g in groups)
            dead, survivors = peers[2], peers[:2]
            dead_shard = [group.members[i].peer_id for i in group.shard_owners].index(dead.peer_id)
            await dead.stop()

            deltas = random_deltas(2)
            old = seed_residuals(survivors)
            async with asyncio.timeout(REDUCE_TIMEOUT * 1.5 + 2):
                results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(survivors, deltas)))

            sl = results[0].slices[dead_shard]
            for p, d, o, r in zip(survivors, deltas, old, results):
                assert r.averages[dead_shard] is None
                assert all(a is not None for i, a in enumerate(r.averages) if i != dead_shard)
                assert torch.equal(p.residual[sl], d[sl] + o[sl])  # all of this part is carried over
            for i in range(len(results[0].averages)):
                if i != dead_shard:
                    assert torch.equal(results[0].averages[i], results[1].averages[i])

            theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
            updated = new_params(theta, results)
            assert digest(updated[0]) == digest(updated[1])
            assert torch.equal(updated[0][sl], theta[sl])  # nobody touched the dead owner's shard
            assert not torch.equal(updated[0], theta)
        finally:
            await stop_peers(peers)

    run(scenario(), 20)


def test_a_dead_owner_does_not_hold_the_survivors_shards_until_their_deadline():
    """The survivors learn that the dead member is gone when their call to it fails: their own
    shards stop waiting for its part at once instead of at the deadline (the walkthrough's
    survivor of a peer killed mid-round waited its whole reduce timeout, ~70 s)."""
    async def scenario():
        reduce_timeout = 600.0  # the bound below is far shorter: only a round that does not wait passes
        peers = await start_peers(3, NUMEL, "fp32", reduce_timeout=reduce_timeout)
        try:
            groups = await asyncio.gather(*(p.form(0, {p.peer_id for p in peers}) for p in peers))
            group = groups[0]
            dead, survivors = peers[2], peers[:2]
            owners = [group.members[i].peer_id for i in group.shard_owners]
            await dead.stop()

            deltas = random_deltas(2)
            old = seed_residuals(survivors)
            contributions = [d + o for d, o in zip(deltas, old)]
            async with asyncio.timeout(30):
                results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(survivors, deltas)))

            mean = (contributions[0] + contributions[1]) / 2  # the survivors' parts, renormalised
            for i, sl in enumerate(results[0].slices):
                if owners[i] == dead.peer_id:
                    assert all(r.averages[i] is None for r in results)
                    continue
                assert torch.equal(results[0].averages[i], results[1].averages[i])
                assert torch.allclose(results[0].averages[i], mean[sl], atol=1e-7, rtol=1e-6)
        finally:
            await stop_peers(peers)

    run(scenario(), 60)


# -- (b) a member forms the group but never sends ----------------------------------------------


def test_silent_member_is_left_out_at_the_deadline_with_renormalised_weights():
    async def scenario():
        peers = await start_peers(3, NUMEL, "fp32", reduce_timeout=REDUCE_TIMEOUT)
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            group = groups[0]
            silent, senders = peers[2], peers[:2]
            silent_shard = [group.members[i].peer_id for i in group.shard_owners].index(silent.peer_id)

            deltas = random_deltas(2)
            old = seed_residuals(senders)
            contributions = [d + o for d, o in zip(deltas, old)]
            # Owners finalize at the deadline; senders give up on the silent owner's shard a
            # little after it: the whole call is bounded by the group's reduce timeout.
            async with asyncio.timeout(group.reduce_timeout_s * 1.5 + 1.0):
                results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(senders, deltas)))

            mean = (contributions[0] + contributions[1]) / 2  # renormalised over who sent
            for i, sl in enumerate(results[0].slices):
                if i == silent_shard:
                    assert all(r.averages[i] is None for r in results)
                    for p, c in zip(senders, contributions):
                        assert torch.equal(p.residual[sl], c[sl])
                    continue
                assert torch.equal(results[0].averages[i], results[1].averages[i])
                assert torch.allclose(results[0].averages[i], mean[sl], atol=1e-7, rtol=1e-6)
            updated = new_params(torch.zeros(NUMEL), results)
            assert digest(updated[0]) == digest(updated[1])
        finally:
            await stop_peers(peers)

    run(scenario(), 20)


def test_late_sender_still_receives_the_average_and_keeps_its_part():
    """A client-mode member that sends only after the owners' deadline is left out of the
    averages, gets them anyway, ends bit-identical, and keeps its whole Δ in its residual."""

    async def scenario():
        dht = MemoryDHT()
        peers = await start_peers(2, NUMEL, "int8", dht=dht, reduce_timeout=REDUCE_TIMEOUT)
        late = Peer("peer-02", NUMEL, "int8", dht, reduce_timeout=REDUCE_TIMEOUT, client_mode=True)
        await late.start()
        everyone = [*peers, late]
        try:
            expected = {p.peer_id for p in everyone}
            groups = await asyncio.gather(*(p.form(0, expected) for p in everyone))
            group = groups[0]
            assert len(group.members) == 3 and len(group.shard_owners) == 2
            deltas = random_deltas(3)
            old = seed_residuals(everyone)
            async with asyncio.timeout(group.reduce_timeout_s * 1.5 + 1.0):
                on_time = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers, deltas)))
            async with asyncio.timeout(group.reduce_timeout_s * 1.5 + 1.0):
                tardy = await late.reduce(group, deltas[2])

            for i in range(len(group.shard_owners)):
                assert torch.equal(tardy.averages[i], on_time[0].averages[i])
                assert torch.equal(on_time[1].averages[i], on_time[0].averages[i])
            assert torch.equal(late.residual, deltas[2] + old[2])  # nothing of it was delivered
            for p in peers:
                assert ("late", late.peer_id) in p.rejections
            updated = new_params(torch.zeros(NUMEL), [*on_time, tardy])
            assert len({digest(t) for t in updated}) == 1
        finally:
            await stop_peers(everyone)

    run(scenario(), 20)


# -- (c) malicious streams ----------------------------------------------------------------------


def test_malicious_streams_are_rejected_before_the_accumulator(monkeypatch):
    """One owner (peer-00), one honest sender (peer-01), and streams written by hand for the
    other members: every bad one gets INVALID_ARGUMENT, is counted with its reason, and leaves
    the average equal to the weighted mean of the honest contributions."""
    numel = 5_000
    fp32, int8 = codecs.get_codec("fp32"), codecs.get_codec("int8")
    reduce_timeout = 2.0
    added: list[str] = []
    headers: list[str] = []
    hooks: dict[str, asyncio.Event] = {}

    original_add = ShardAccumulator.add
    original_check = ReduceRegistry._check_header

    async def spy_add(self, sender, decoded):
        added.append(sender)
        hooks["added"].set()
        return await original_add(self, sender, decoded)

    def spy_check(acc, header):
        headers.append(header.sender_peer_id)
        hooks["header"].set()
        return original_check(acc, header)

    monkeypatch.setattr(ShardAccumulator, "add", spy_add)
    monkeypatch.setattr(ReduceRegistry, "_check_header", staticmethod(spy_check))

    async def scenario():
        hooks["added"], hooks["header"] = asyncio.Event(), asyncio.Event()
        owner, honest = await start_peers(2, numel, "fp32")
        channels = ChannelPool()
        names = ["peer-00", "peer-01", "peer-02", "peer-03", "peer-04"]
        group = averaging_pb2.Group(
            group_id=os.urandom(16), step=0,
            members=[averaging_pb2.Member(peer_id=n, address=a, weight=1.0)
                     for n, a in zip(names, [f"127.0.0.1:{owner.port}", f"127.0.0.1:{honest.port}", "", "", ""])],
            shard_bounds=[0, numel], shard_owners=[0], codec=fp32.id, reduce_timeout_s=reduce_timeout,
        )
        stub = averaging_pb2_grpc.AveragingStub(channels(f"127.0.0.1:{owner.port}"))
        gen = torch.Generator().manual_seed(3)
        x_owner, x_honest, x_third = (torch.randn(numel, generator=gen) for _ in range(3))

        def header(sender="peer-02", codec=fp32, n=numel, payload_bytes=None):
            return averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                group_id=group.group_id, shard_index=0, sender_peer_id=sender, codec=codec.id, numel=n,
                payload_bytes=codec.encoded_size(n) if payload_bytes is None else payload_bytes))

        async def stream(first, payload=b"", gate: asyncio.Event | None = None, header_only=False):
            # Explicit writes instead of a request iterator: once the server has aborted, a further
            # write fails locally and the call's own status (the server's) is what we report. A
            # stream refused at its header sends nothing after it: a write racing the server's
            # abort can make the client core report INTERNAL instead of the server's status.
            call = stub.Reduce(timeout=10)
            try:
                await call.write(first)
                if not header_only:
                    half = len(payload) // 2
                    await call.write(averaging_pb2.ReduceMessage(chunk=payload[:half]))
                    if gate is not None:
                        await gate.wait()
                    await call.write(averaging_pb2.ReduceMessage(chunk=payload[half:]))
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass  # the server already answered; its status follows
            got = bytearray()
            result = None
            try:
                async for message in call:
                    if message.HasField("result"):
                        result = message.result
                    else:
                        got += message.chunk
            except grpc.aio.AioRpcError as err:
                return err.code(), None, None
            code = await call.code()
            if code != grpc.StatusCode.OK:
                return code, None, None
            return grpc.StatusCode.OK, result, fp32.decode(got, numel)

        async def rejected(first, payload, reason, sender, header_only=True):
            before = len(owner.rejections)
            code, _, _ = await stream(first, payload, header_only=header_only)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (reason, code)
            assert owner.rejections[before:] == [(reason, sender)]

        try:
            x_owner_copy = x_owner.clone()
            owning = asyncio.create_task(allreduce.run_allreduce(
                group, "peer-00", x_owner, owner.residual, owner.owner_residual, owner.registry, owner.channels,
                owner.executor))
            good = fp32.encode(x_third)
            nan = x_third.clone()
            nan[17] = float("nan")
            inf = x_third.clone()
            inf[0] = float("inf")
            # Header problems: refused before a byte of payload is read.
            await rejected(header(n=numel - 1), fp32.encode(x_third[:-1]), "length", "peer-02")
            await rejected(header(payload_bytes=4 * numel + 4), good + b"\0\0\0\0", "length", "peer-02")
            await rejected(header(codec=int8), int8.encode(x_third), "codec", "peer-02")
            await rejected(header(sender="peer-99"), good, "unknown_sender", "peer-99")
            await rejected(header(sender="peer-00"), good, "unknown_sender", "peer-00")  # the owner itself
            # Payload problems: a valid header (which uses up that member's one try), bad bytes.
            await rejected(header(sender="peer-03"), fp32.encode(nan), "non_finite", "peer-03", header_only=False)
            await rejected(header(sender="peer-04"), good[:-4], "length", "peer-04", header_only=False)
            await rejected(header(sender="peer-04"), good, "unknown_sender", "peer-04")  # no second try

            # Duplicate while the first stream is still sending.
            gate = asyncio.Event()
            mark = len(headers)
            first = asyncio.create_task(stream(header(), good, gate))  # an honest stream
            while "peer-02" not in headers[mark:]:  # the hook fires when its header is checked
                hooks["header"].clear()
                await hooks["header"].wait()
            await rejected(header(), good, "unknown_sender", "peer-02")
            hooks["added"].clear()
            gate.set()
            await hooks["added"].wait()
            assert added == ["peer-02"]
            # Duplicate after the first one was accumulated.
            await rejected(header(), good, "unknown_sender", "peer-02")

            honest_result = await allreduce.run_allreduce(
                group, "peer-01", x_honest, honest.residual, honest.owner_residual, honest.registry,
                honest.channels, honest.executor)
            owner_result = await owning
            code, result_header, third_average = await first
            assert code == grpc.StatusCode.OK

            # Only the honest contributions reached the accumulator, each once; peer-03 and
            # peer-04 were left out at the deadline and the weights renormalised over three.
            assert sorted(added) == ["peer-01", "peer-02"]
            assert sorted(result_header.contributors) == ["peer-00", "peer-01", "peer-02"]
            mean = (x_owner_copy + x_honest + x_third) / 3
            average = owner_result.averages[0]
            assert torch.allclose(average, mean, atol=1e-6, rtol=1e-6)
            assert torch.isfinite(average).all()
            assert torch.equal(honest_result.averages[0], average)
            assert torch.equal(third_average, average)
            reasons = [r for r, _ in owner.rejections]
            assert reasons.count("unknown_sender") == 5 and reasons.count("length") == 3
            assert reasons.count("codec") == 1 and reasons.count("non_finite") == 1
        finally:
            await channels.close()
            await stop_peers([owner, honest])

    run(scenario(), reduce_timeout * 1.5 + 10)


def test_stream_without_header_or_for_unknown_group(monkeypatch):
    monkeypatch.setattr(allreduce, "HEADER_TIMEOUT", 0.2)

    async def scenario():
        (peer,) = await start_peers(1, 100, "fp32")
        channels = ChannelPool()
        stub = averaging_pb2_grpc.AveragingStub(channels(f"127.0.0.1:{peer.port}"))

        async def call(*messages):
            async def requests():
                for m in messages:
                    yield m
            try:
                async for _ in stub.Reduce(requests(), timeout=5):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
            return grpc.StatusCode.OK

        try:
            assert await call(averaging_pb2.ReduceMessage(chunk=b"abc")) == grpc.StatusCode.INVALID_ARGUMENT
            assert await call() == grpc.StatusCode.INVALID_ARGUMENT
            unknown = averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                group_id=b"no such group", shard_index=0, sender_peer_id="peer-01", codec=1, numel=100,
                payload_bytes=400))
            assert await call(unknown, averaging_pb2.ReduceMessage(chunk=b"\0" * 400)) == grpc.StatusCode.NOT_FOUND
            assert peer.rejections == []  # malformed, not a contribution
        finally:
            await channels.close()
            await stop_peers([peer])

    run(scenario(), 15)


# -- (d) unequal weights ------------------------------------------------------------------------


@pytest.mark.parametrize("bandwidths", [[0.0, 0.0, 0.0], [1e6, 5e6, 2e6]])
def test_weighted_average_with_unequal_weights(bandwidths):
    weights = [1.0, 2.0, 5.0]

    async def scenario():
        peers = await start_peers(3, NUMEL, "fp32")
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected, weight=w, bandwidth_bps=b)
                                            for p, w, b in zip(peers, weights, bandwidths)))
            group = groups[0]
            assert [m.weight for m in group.members] == weights
            deltas = random_deltas(3)
            results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers, deltas)))
            want = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
            got = torch.cat(results[0].averages)
            assert torch.allclose(got, want, atol=1e-7, rtol=1e-5)
            plain_mean = torch.stack(deltas).mean(0)
            assert not torch.allclose(got, plain_mean, atol=1e-4)  # the weights mattered
            for r in results[1:]:
                assert all(torch.equal(a, b) for a, b in zip(r.averages, results[0].averages))
            for p in peers:
                assert torch.count_nonzero(p.residual) == 0  # fp32 delivers everything
            updated = new_params(torch.zeros(NUMEL), results)
            assert len({digest(t) for t in updated}) == 1
        finally:
            await stop_peers(peers)

    run(scenario(), 20)


def test_more_owners_than_values_leaves_an_owner_without_a_shard():
    async def scenario():
        peers = await start_peers(3, 2, "int8")
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            # The middle owner's share rounds to no value: it gets no shard (layout.piece_layout)
            # and averages as a member that owns nothing.
            assert list(groups[0].shard_bounds) == [0, 1, 2] and list(groups[0].shard_owners) == [0, 2]
            deltas = [torch.full((2,), float(i + 1)) for i in range(3)]
            results = await asyncio.gather(*(p.reduce(groups[0], d) for p, d in zip(peers, deltas)))
            for r in results:
                assert [a.tolist() for a in r.averages] == [[2.0], [2.0]]
        finally:
            await stop_peers(peers)

    run(scenario(), 15)


def test_owners_stop_waiting_for_a_straggler_soon_after_a_quorum():
    """With a quorum, the reduce deadline adapts: owners wait about twice what the quorum took,
    not the group's whole reduce timeout, for a member that never sends.

    The adaptive waits (the reduce's straggler grace, then the shard agreement's grace) scale
    with how long the quorum took, which on a loaded 2-core machine is seconds: the bound is a
    third of a long reduce timeout, not a fixed number of seconds."""
    long_timeout = 300.0

    async def scenario():
        dht = MemoryDHT()
        owners = await start_peers(3, NUMEL, "fp32", reduce_timeout=long_timeout, dht=dht)
        silent = Peer("peer-99", NUMEL, "fp32", dht, reduce_timeout=long_timeout, client_mode=True)
        await silent.start()
        peers = [*owners, silent]
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            group = groups[0]
            assert len(group.members) == 4 and len(group.shard_owners) == 3  # the silent one owns nothing
            deltas = random_deltas(3)
            async with asyncio.timeout(long_timeout / 3):  # far below the 300 s reduce timeout
                results = await asyncio.gather(*(p.reduce(group, d, quorum=0.6) for p, d in zip(owners, deltas)))
            mean = torch.stack(deltas).mean(0)
            for i, sl in enumerate(results[0].slices):
                assert all(torch.equal(r.averages[i], results[0].averages[i]) for r in results)
                assert torch.allclose(results[0].averages[i], mean[sl], atol=1e-6, rtol=1e-6)
        finally:
            await stop_peers(peers)

    run(scenario(), long_timeout / 2)


class OutOfTimeHere:
    """A member's transport whose reduce calls run out of time (a real gRPC deadline) before a
    byte of theirs leaves, as on a volunteer's line far slower than the round's deadline allows.
    (A deadline alone, of 1 ms, sometimes let the whole part through first.)"""

    def __init__(self, inner) -> None:
        self.inner = inner

    def reduce(self, address, requests, timeout):
        async def nothing_in_time():
            await asyncio.Event().wait()  # never set: the call's deadline ends it
            yield  # pragma: no cover - makes this an async generator

        return self.inner.reduce(address, nothing_in_time(), 0.2)

    def report_shards(self, address, report, timeout):
        return self.inner.report_shards(address, report, timeout)


def test_a_member_whose_every_upload_runs_out_of_time_costs_only_itself():
    """Found with a 100 kbit/s volunteer among fast peers: its calls to every other owner ran
    out of time, it asked the group to skip those shards, and the fast peers barely moved the
    model round after round. Now it takes the fault as its own: the others apply what they hold."""
    from lowcomm.protocol.grpc_transport import GrpcReduceTransport
    from lowcomm.protocol.member import run_allreduce

    async def scenario():
        peers = await start_peers(3, NUMEL, "fp32", reduce_timeout=REDUCE_TIMEOUT)
        try:
            expected = {p.peer_id for p in peers}
            groups = await asyncio.gather(*(p.form(0, expected) for p in peers))
            group = groups[0]
            assert len(group.shard_owners) == 3
            slow = peers[2]
            owners = [group.members[i].peer_id for i in group.shard_owners]
            slows_shard = owners.index(slow.peer_id)
            others_shards = [i for i in range(3) if i != slows_shard]
            deltas = random_deltas(3)
            old = seed_residuals(peers)
            slow_call = run_allreduce(group, slow.peer_id, deltas[2], slow.residual, slow.owner_residual,
                                      slow.registry, None, slow.executor,
                                      transport=OutOfTimeHere(GrpcReduceTransport(slow.channels)))
            async with asyncio.timeout(group.reduce_timeout_s * 3 + 5.0):
                fast, slow_result = await asyncio.gather(
                    asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers[:2], deltas[:2]))), slow_call)

            mean_of_fast = (deltas[0] + old[0] + deltas[1] + old[1]) / 2  # the slow one's parts came too late
            for i in others_shards:
                sl = fast[0].slices[i]
                assert slow_result.averages[i] is None and not slow_result.held[i]
                assert torch.equal(slow.residual[sl], (deltas[2] + old[2])[sl])  # its part stays with it
                for result in fast:  # applied by those who hold it
                    assert torch.allclose(result.averages[i], mean_of_fast[sl], atol=1e-7, rtol=1e-6)
            # Its own shard: all three parts reached it, and all three apply it.
            for result in (*fast, slow_result):
                assert torch.equal(result.averages[slows_shard], fast[0].averages[slows_shard])
            updated = new_params(torch.zeros(NUMEL), fast)
            assert digest(updated[0]) == digest(updated[1])
        finally:
            await stop_peers(peers)

    run(scenario(), 30)


# -- self-reported weights ------------------------------------------------------------------------

def _members(*weights: float) -> list[averaging_pb2.Member]:
    return [averaging_pb2.Member(peer_id=f"p{i}", address="", weight=w) for i, w in enumerate(weights)]


def test_a_peer_claiming_huge_weight_is_capped_relative_to_the_group():
    from lowcomm.protocol.allreduce import MAX_WEIGHT_RATIO, bounded_weights

    honest = 4096.0
    weights = bounded_weights(_members(honest, honest, 1e12))
    assert weights == {"p0": honest, "p1": honest, "p2": MAX_WEIGHT_RATIO * honest}
    # In a group of two the honest member's weight bounds the liar.
    assert bounded_weights(_members(1e12, honest))["p0"] == MAX_WEIGHT_RATIO * honest
    # Honest differences (two inner phases after a failed round) and bad values.
    assert bounded_weights(_members(honest, 2 * honest, honest)) == {"p0": honest, "p1": 2 * honest, "p2": honest}
    assert bounded_weights(_members(float("nan"), -3.0, float("inf"))) == {"p0": 1.0, "p1": 1.0, "p2": 1.0}


# -- (e) the members agree on which shards to skip ------------------------------------------------


def _gate_results(owner: Peer, blocked: set[str], reached: dict[str, asyncio.Event]) -> None:
    """``owner`` streams its average back except to ``blocked`` senders, whose result stream stops
    before its first message (until the owner dies); ``reached[sender]`` is set when the average
    for that sender exists (the owner is about to stream it)."""
    serve = owner.registry._serve

    async def gated(acc, header, requests, context):
        async for message in serve(acc, header, requests, context):
            if message.HasField("result"):
                reached[header.sender_peer_id].set()
                if header.sender_peer_id in blocked:
                    await asyncio.Event().wait()  # ends when the owner's server stops
            yield message

    owner.registry._serve = gated


def _watch_reports(peer: Peer, arrived: dict[str, asyncio.Event]) -> None:
    """``arrived[sender]`` is set when ``sender``'s shard report reaches ``peer``."""
    handle = peer.registry.agreements.handle

    async def watched(request, context):
        arrived[request.sender_peer_id].set()
        return await handle(request, context)

    peer.registry.agreements.handle = watched


@pytest.mark.parametrize("when", ["before", "during", "after", "lost"])
def test_failed_owner_costs_its_shard_on_every_member_alike(when):
    """A shard owner dies before its result stream (it has the average, nobody got it), during
    it (one member got the average, the other did not), or after it (both got it); or it stays
    alive but one member never gets its average ("lost"). The surviving members skip the shard
    all alike, or apply it all alike, and end bit-identical: no member would download state.
    A skipped shard leaves each member's exact x = Δ + residual in its residual, and the owner's
    error feedback as it was."""

    async def scenario():
        peers = await start_peers(3, NUMEL, "int8", reduce_timeout=REDUCE_TIMEOUT)
        try:
            expected = {p.peer_id for p in peers}
            group = (await asyncio.gather(*(p.form(0, expected) for p in peers)))[0]
            owner_ids = [group.members[i].peer_id for i in group.shard_owners]
            owner, first, second = peers[2], peers[0], peers[1]
            j = owner_ids.index(owner.peer_id)
            blocked = {"before": {first.peer_id, second.peer_id}, "during": {second.peer_id},
                       "after": set(), "lost": {second.peer_id}}[when]
            reached = {p.peer_id: asyncio.Event() for p in peers}
            reports_at_second = {p.peer_id: asyncio.Event() for p in peers}
            reports_at_first = {p.peer_id: asyncio.Event() for p in peers}
            _gate_results(owner, blocked, reached)
            _watch_reports(second, reports_at_second)
            _watch_reports(first, reports_at_first)

            deltas = random_deltas(3)
            old = seed_residuals(peers)
            gen = torch.Generator().manual_seed(9)
            old_owner = []
            for p in peers:
                p.owner_residual.copy_(torch.randn(NUMEL, generator=gen) * 0.001)
                old_owner.append(p.owner_residual.clone())
            tasks = [asyncio.create_task(p.reduce(group, d)) for p, d in zip(peers, deltas)]

            survivors = [first, second] if when != "lost" else peers
            if when != "lost":
                if when == "before":
                    await asyncio.gather(*(reached[p.peer_id].wait() for p in (first, second)))
                elif when == "during":
                    await reports_at_second[first.peer_id].wait()  # first holds every average
                else:
                    await asyncio.gather(reports_at_second[first.peer_id].wait(),
                                         reports_at_first[second.peer_id].wait())
                tasks[2].cancel()
                await owner.stop()
                await asyncio.gather(tasks[2], return_exceptions=True)
            async with asyncio.timeout(REDUCE_TIMEOUT * 3 + 5):
                results = await asyncio.gather(*(tasks[peers.index(p)] for p in survivors))

            held_by_first = {"before": False, "during": True, "after": True, "lost": True}[when]
            assert results[0].held[j] is held_by_first  # the failure happened where the test says
            skipped = when != "after"
            for p, r in zip(survivors, results):
                k = peers.index(p)
                sl = r.slices[j]
                assert (r.averages[j] is None) is skipped
                assert all(a is not None for i, a in enumerate(r.averages) if i != j)
                if skipped:
                    assert torch.equal(p.residual[sl], deltas[k][sl] + old[k][sl])  # all of x carried over
                    assert torch.equal(p.owner_residual[sl], old_owner[k][sl])  # nobody's feedback moved
            for i in range(len(results[0].averages)):
                if results[0].averages[i] is not None:
                    assert all(torch.equal(r.averages[i], results[0].averages[i]) for r in results)
            theta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
            updated = new_params(theta, results)
            assert len({digest(t) for t in updated}) == 1
            assert torch.equal(updated[0][results[0].slices[j]], theta[results[0].slices[j]]) is skipped
        finally:
            for task in tasks if "tasks" in locals() else []:
                task.cancel()
            await stop_peers(peers)

    run(scenario(), 30)


def test_shard_reports_that_break_the_protocol_are_refused_over_grpc(monkeypatch):
    """ReportShards through a real server: garbage bytes, a report for an unknown group, from a
    non-member or with the wrong number of shards get a clear status; with a run secret a report
    that names another sender than its token is refused. The server keeps serving."""
    from lowcomm.protocol import agreement
    from lowcomm.protocol.agreement import ShardAgreement
    from lowcomm.protocol.auth import RunAuth, client_interceptors

    from .test_auth import SECRET, authed_peer

    monkeypatch.setattr(agreement, "FIND_TIMEOUT", 0.2)

    async def scenario():
        (plain,) = await start_peers(1, 100, "fp32")
        secret = await authed_peer("peer-a", SECRET, MemoryDHT(), 100)
        channels = ChannelPool()
        try:
            for peer in (plain, secret):
                peer.registry.agreements.open(ShardAgreement(b"g" * 16, peer.peer_id, [peer.peer_id, "peer-b"], 2,
                                                             time.monotonic() + 60))
            stub = averaging_pb2_grpc.AveragingStub(channels(f"127.0.0.1:{plain.port}"))

            async def code_of(report):
                try:
                    await stub.ReportShards(report, timeout=5)
                except grpc.aio.AioRpcError as err:
                    return err.code()
                return grpc.StatusCode.OK

            garbage = channels(f"127.0.0.1:{plain.port}").unary_unary(
                "/lowcomm.v1.Averaging/ReportShards", lambda b: b, lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await garbage(b"\xff\xff\xff", timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            report = averaging_pb2.ShardReport
            assert await code_of(report(group_id=b"x" * 16, sender_peer_id="peer-b", skip=[False] * 2)) \
                == grpc.StatusCode.NOT_FOUND
            assert await code_of(report(group_id=b"g" * 16, sender_peer_id="peer-z", skip=[False] * 2)) \
                == grpc.StatusCode.INVALID_ARGUMENT
            assert await code_of(report(group_id=b"g" * 16, sender_peer_id="peer-b", skip=[False] * 3)) \
                == grpc.StatusCode.INVALID_ARGUMENT

            # peer-b's token, a report in peer-c's name: refused before the handler sees it.
            authed = ChannelPool(client_interceptors(RunAuth(SECRET), "peer-b", lambda: 0))
            try:
                stub_b = averaging_pb2_grpc.AveragingStub(authed(secret.matchmaker.address))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub_b.ReportShards(report(group_id=b"g" * 16, sender_peer_id="peer-c", skip=[False] * 2),
                                              timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "peer-c" in err.value.details()
            finally:
                await authed.close()
            assert secret.registry.agreements.get(b"g" * 16).heard == set()  # nothing of it was kept
            # A valid report is kept and answered (here after the deadline, with this peer's view).
            plain.registry.agreements.get(b"g" * 16).own([True, True], [False, True], 0.0)
            plain.registry.agreements.get(b"g" * 16).decide()
            answer = await stub.ReportShards(report(group_id=b"g" * 16, sender_peer_id="peer-b", skip=[False] * 2),
                                             timeout=5)
            assert list(answer.skip) == [False, True] and answer.sender_peer_id == plain.peer_id
        finally:
            await channels.close()
            await stop_peers([plain, secret])

    run(scenario(), 20)
