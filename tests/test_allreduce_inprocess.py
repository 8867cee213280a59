"""Butterfly all-reduce and matchmaking with several peers in one event loop."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import run_allreduce
from lowcomm.protocol.schedule import result_order, upload_order

from .swarm_harness import apply_outer, digest, start_peers, stop_peers


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("codec", ["int8", "fp32"])
def test_three_peers_end_bit_identical(codec):
    numel = 100_003

    async def scenario():
        peers = await start_peers(3, numel, codec)
        try:
            gen = torch.Generator().manual_seed(0)
            theta = torch.randn(numel, generator=gen)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            expected = {p.peer_id for p in peers}
            results = await asyncio.gather(*(p.average(0, d, expected) for p, d in zip(peers, deltas)))
            groups = [g for g, _ in results]
            assert all(len(g.members) == 3 for g in groups)
            assert len({g.group_id for g in groups}) == 1
            new = [apply_outer(theta, r) for _, r in results]
            assert len({digest(t) for t in new}) == 1
            # The result is the weighted mean of the deltas, up to the codec's error.
            mean = torch.stack(deltas).mean(0)
            got = results[0][1]
            approx = torch.cat([a for a in got.averages])
            tolerance = 0 if codec == "fp32" else 0.01 * mean.abs().max().item()
            assert torch.allclose(approx, mean, atol=tolerance + 1e-7)
        finally:
            await asyncio.gather(*(p.stop() for p in peers))

    run(scenario())


# -- the staggered schedule (protocol/schedule.py) ------------------------------------------------


class RecordingChannels:
    """A peer's ``channel_for`` that records, per Reduce stream, when it was opened and when its
    upload was done (gRPC took the last request message), into one shared list."""

    def __init__(self, channels, caller: str, log: list[tuple[str, str, str]]) -> None:
        self._channels, self._caller, self._log = channels, caller, log

    def __call__(self, address: str):
        return _RecordingChannel(self._channels(address), self._caller, address, self._log)

    async def close(self) -> None:
        await self._channels.close()


class _RecordingChannel:
    def __init__(self, channel, caller: str, address: str, log) -> None:
        self._channel, self._caller, self._address, self._log = channel, caller, address, log

    def __getattr__(self, name: str):
        return getattr(self._channel, name)

    def stream_stream(self, method: str, *args, **kwargs):
        real = self._channel.stream_stream(method, *args, **kwargs)
        if not method.endswith("/Reduce"):
            return real

        def call(requests, **call_kwargs):
            self._log.append(("open", self._caller, self._address))

            async def recorded():
                async for message in requests:
                    yield message
                self._log.append(("uploaded", self._caller, self._address))

            return real(recorded(), **call_kwargs)

        return call


def record_results(owner, log: list[tuple[str, str, str]]) -> None:
    """Record when ``owner`` starts streaming its average to a sender and when that stream is over."""
    serve = owner.registry._serve

    async def recorded(acc, header, requests, context):
        try:
            async for message in serve(acc, header, requests, context):
                if message.HasField("result"):
                    log.append(("result", f"{owner.peer_id}/{header.shard_index}", header.sender_peer_id))
                yield message
        finally:
            log.append(("served", f"{owner.peer_id}/{header.shard_index}", header.sender_peer_id))

    owner.registry._serve = recorded


async def one_round(peers, group, deltas, staggered: bool):
    return await asyncio.gather(*(
        run_allreduce(group, p.peer_id, d, p.residual, p.owner_residual, p.registry, p.channels, p.executor,
                      staggered=staggered)
        for p, d in zip(peers, deltas)))


@pytest.mark.parametrize("codec", ["int8", "fp32"])
def test_staggered_schedule_gives_the_same_bits_as_uploading_to_all_at_once(codec):
    numel = 40_009

    async def scenario():
        gen = torch.Generator().manual_seed(4)
        deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in range(4)]
        outcomes = {}
        for staggered in (True, False):
            peers = await start_peers(4, numel, codec)
            try:
                expected = {p.peer_id for p in peers}
                group = (await asyncio.gather(*(p.form(0, expected) for p in peers)))[0]
                results = await one_round(peers, group, deltas, staggered)
                for r in results:
                    assert all(torch.equal(a, b) for a, b in zip(r.averages, results[0].averages))
                outcomes[staggered] = ([digest(a) for a in results[0].averages],
                                       [digest(p.residual) for p in peers], [digest(p.owner_residual) for p in peers])
            finally:
                await stop_peers(peers)
        assert outcomes[True] == outcomes[False]

    run(scenario())


@pytest.mark.parametrize("numel,pieces", [(400_000, 1), (1_100_000, 2)])
def test_staggered_members_upload_to_one_owner_after_the_other(numel, pieces):
    """Each member opens its stream to the owner k places after its own only once its upload to
    the owner k-1 places after is done, in schedule order, piece by piece when the leader cut
    each owner's share in pieces (layout.py), and each owner sends each average to one member
    after the other, so that every downlink sees one sender per stage."""
    # A few chunks of int8 per shard (uploads take a while); the larger model is cut in 2 pieces.

    async def scenario():
        peers = await start_peers(4, numel, "int8")
        events: list[tuple[str, str, str]] = []
        served: list[tuple[str, str, str]] = []
        try:
            for p in peers:
                p.channels = RecordingChannels(p.channels, p.peer_id, events)
                record_results(p, served)
            expected = {p.peer_id for p in peers}
            # Members that measured a 20 Mbit/s link (pieces need a known bandwidth, layout.py).
            group = (await asyncio.gather(*(p.form(0, expected, bandwidth_bps=2.5e6) for p in peers)))[0]
            address_of = {m.peer_id: m.address for m in group.members}
            owners = [group.members[i].peer_id for i in group.shard_owners]
            assert len(owners) == pieces * len(peers)
            gen = torch.Generator().manual_seed(6)
            deltas = [torch.randn(numel, generator=gen) for _ in peers]
            await one_round(peers, group, deltas, staggered=True)
            for p in peers:
                mine = [(kind, address) for kind, caller, address in events if caller == p.peer_id]
                order = upload_order(group, p.peer_id)
                assert mine == [e for s in order for e in (("open", address_of[owners[s]]),
                                                           ("uploaded", address_of[owners[s]]))], p.peer_id
                # Piece by piece: every owner's piece 0 before anybody's piece 1.
                assert [s // len(peers) for s in order] == sorted(s // len(peers) for s in order)
            # Stage 1 of member i goes to the owner i+1 places after it: no two members upload to
            # one owner in the same stage.
            firsts = [owners[upload_order(group, p.peer_id)[0]] for p in peers]
            assert sorted(firsts) == sorted(p.peer_id for p in peers)
            # Owners send each average back one member after the other too, in schedule order.
            for shard, owner in enumerate(owners):
                sent = [(kind, sender) for kind, key, sender in served if key == f"{owner}/{shard}"]
                assert sent == [e for m in result_order(group, owner) for e in (("result", m), ("served", m))]
            assert sorted(result_order(group, p.peer_id)[0] for p in peers) == sorted(p.peer_id for p in peers)

        finally:
            await stop_peers(peers)

    run(scenario())


# -- the ring (protocol/ring.py) ------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["int8", "fp32"])
def test_a_ring_led_group_ends_bit_identical_with_the_weighted_mean_over_grpc(codec):
    """Leaders that ask for a ring (the node's ``[sync] schedule = "ring"``) close a ring group,
    and its members average over real gRPC streams, one per member, to the same bits."""
    from lowcomm.protocol.ring import RING

    numel = 300_007

    async def scenario():
        peers = await start_peers(4, numel, codec)
        try:
            for p in peers:
                p.matchmaker.schedule = RING
            gen = torch.Generator().manual_seed(6)
            theta = torch.randn(numel, generator=gen)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            expected = {p.peer_id for p in peers}
            results = await asyncio.gather(*(p.average(0, d, expected) for p, d in zip(peers, deltas)))
            groups = [g for g, _ in results]
            assert all(g.schedule == RING and len(g.members) == 4 for g in groups)
            assert len({digest(apply_outer(theta, r)) for _, r in results}) == 1
            assert all(all(a is not None for a in r.averages) for _, r in results)
            mean = torch.stack(deltas).mean(0)
            got = torch.cat(results[0][1].averages)
            tolerance = 1e-8 if codec == "fp32" else 0.02 * mean.abs().max().item()
            assert torch.allclose(got, mean, atol=tolerance, rtol=1e-5)
            # One stream per member: every member sent 2·(N−1)/N of the payload.
            for _, r in results:
                assert r.bytes_sent == pytest.approx(1.5 * r.payload_bytes, rel=0.01)
        finally:
            await stop_peers(peers)

    run(scenario())


def grpc_ring_group(peers, numel: int, reduce_timeout: float, group_id: bytes) -> averaging_pb2.Group:
    """A RING group of ``peers`` (in-process, over gRPC): four fp32 pieces per member, equal weights."""
    from lowcomm.protocol import ring
    from lowcomm.protocol.layout import piece_layout

    bounds, owners = piece_layout(numel, [0.0] * len(peers), 4)
    return averaging_pb2.Group(
        group_id=group_id, step=0, shard_bounds=bounds, shard_owners=owners, codec=1,
        reduce_timeout_s=reduce_timeout, schedule=ring.RING,
        members=[averaging_pb2.Member(peer_id=p.peer_id, address=p.matchmaker.address, weight=1.0) for p in peers])


def test_a_ring_member_stopped_mid_round_breaks_the_ring_for_all_at_once_over_grpc(monkeypatch):
    """The third member's process goes away (task cancelled, server stopped) once the first sum
    from the member before it has arrived: both survivors' streams break, they skip every shard
    they do not all hold, keep all of x there, end long before the ring's deadline, and leave
    no task or stream behind (the loop's exception handler hears nothing)."""
    from lowcomm.protocol import ring

    numel, reduce_timeout = 1_000_003, 20.0
    first_read = asyncio.Event()
    read = ring.RingInbox.read

    async def observed_read(self, size):
        box = await read(self, size)
        if self.sender == "peer-01":  # the inbox of peer-02, the member after peer-01
            first_read.set()
            await asyncio.Event().wait()  # peer-02 goes no further
        return box

    monkeypatch.setattr(ring.RingInbox, "read", observed_read)

    async def scenario():
        problems = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: problems.append(f"{context['message']} {context.get('task') or context.get('future')!r}"))
        peers = await start_peers(3, numel, "fp32", reduce_timeout=reduce_timeout)
        try:
            group = grpc_ring_group(peers, numel, reduce_timeout, b"k" * 16)
            gen = torch.Generator().manual_seed(8)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            started = asyncio.get_running_loop().time()
            tasks = [asyncio.create_task(p.reduce(group, d)) for p, d in zip(peers, deltas)]
            await first_read.wait()
            tasks[2].cancel()
            await peers[2].stop()
            results = await asyncio.gather(*tasks[:2])
            elapsed = asyncio.get_running_loop().time() - started
            for p, r, d in zip(peers, results, deltas):
                assert [a is None for a in r.averages] == [a is None for a in results[0].averages]
                for j, sl in enumerate(r.slices):
                    if r.averages[j] is None:
                        assert torch.equal(p.residual[sl], d[sl])  # all of x carried
            assert all(a is None for a in results[0].averages)  # no sum got round a ring with a hole
            assert elapsed < reduce_timeout / 2
        finally:
            await stop_peers(peers)
        await asyncio.sleep(0.1)  # let anything left behind be collected and reported
        import gc
        gc.collect()
        await asyncio.sleep(0)
        assert problems == []

    run(scenario())


def test_a_ring_member_dead_before_the_round_breaks_it_for_all_at_once_though_its_stream_never_opens(monkeypatch):
    """peer-02 is gone before the round starts, so its stream to peer-00 never opens and peer-00
    never hears of a break from its input. peer-01 tries to reach peer-02 only once all of
    peer-00's first sums have come, so peer-00 has nothing left to send that could be refused:
    peer-01's answer on peer-00's stream must end peer-00's round, or both survivors wait for the
    deadline (peer-01 for peer-00's report in the shard agreement)."""
    from lowcomm.protocol import ring

    numel, reduce_timeout = 100_003, 20.0
    first_sums_read = asyncio.Event()
    read, send = ring.RingInbox.read, ring._Exchange.send
    reads = 0

    async def counted_read(self, size):
        nonlocal reads
        box = await read(self, size)
        if self.sender == "peer-00":  # peer-01's inbox
            reads += 1
            if reads == first_sums:
                first_sums_read.set()
        return box

    async def send_once_the_first_sums_came(self, timeout):
        if self.peer_id == "peer-01":
            await first_sums_read.wait()
        await send(self, timeout)

    monkeypatch.setattr(ring.RingInbox, "read", counted_read)
    monkeypatch.setattr(ring._Exchange, "send", send_once_the_first_sums_came)

    async def scenario():
        nonlocal first_sums
        peers = await start_peers(3, numel, "fp32", reduce_timeout=reduce_timeout)
        try:
            group = grpc_ring_group(peers, numel, reduce_timeout, b"z" * 16)
            first_sums = sum(1 for item in ring._Plan(group, 1).incoming if item.kind == "sum" and item.step == 0)
            await peers[2].stop()
            gen = torch.Generator().manual_seed(10)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            started = asyncio.get_running_loop().time()
            results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers[:2], deltas)))
            elapsed = asyncio.get_running_loop().time() - started
            assert first_sums_read.is_set()
            for p, r, d in zip(peers, results, deltas):
                assert all(a is None for a in r.averages)  # no sum got round a ring with a hole
                assert torch.equal(p.residual, d)  # all of x carried
            assert elapsed < reduce_timeout / 2  # not the deadline: (1 + margin) · 20 s
        finally:
            await stop_peers(peers)

    first_sums = 0
    run(scenario())


def test_a_ring_hop_still_encoding_when_the_ring_breaks_cannot_overwrite_the_x_it_carries(monkeypatch):
    """A codec job that a thread has begun cannot be cancelled. peer-01 is adding its part to the
    first sum it received when its successor goes away; that job writes peer-01's residual. The
    round must not put x back into the residual (for the shards it skips) before the job has
    ended, or the job's write replaces the x that the next round should carry. The job here stays
    in its thread until the round has carried x back (so that, were the round not to wait for it,
    its write would come last), or for 2 s at most."""
    import threading

    from lowcomm.protocol import ring

    numel, reduce_timeout = 200_003, 20.0
    hop_started, carried_back = asyncio.Event(), threading.Event()
    running_sum = ring._Exchange.running_sum

    async def scenario():
        loop = asyncio.get_running_loop()
        peers = await start_peers(3, numel, "fp32", reduce_timeout=reduce_timeout)
        once = threading.Lock()

        def held_hop(self, shard, received):
            if self.peer_id == peers[1].peer_id and received is not None and once.acquire(blocking=False):
                loop.call_soon_threadsafe(hop_started.set)
                carried_back.wait(timeout=2.0)
            return running_sum(self, shard, received)

        monkeypatch.setattr(ring._Exchange, "running_sum", held_hop)
        submit = peers[1].executor.submit

        def observed_submit(fn, *args, **kwargs):
            if getattr(fn, "__name__", "") != "carry_skipped":
                return submit(fn, *args, **kwargs)

            def carry_then_release():
                fn(*args, **kwargs)
                carried_back.set()

            return submit(carry_then_release)

        peers[1].executor.submit = observed_submit
        try:
            group = grpc_ring_group(peers, numel, reduce_timeout, b"h" * 16)
            gen = torch.Generator().manual_seed(9)
            deltas = [torch.randn(numel, generator=gen) * 0.01 for _ in peers]
            tasks = [asyncio.create_task(p.reduce(group, d)) for p, d in zip(peers, deltas)]
            await hop_started.wait()
            tasks[2].cancel()
            await peers[2].stop()
            results = await asyncio.gather(*tasks[:2])
            await asyncio.to_thread(peers[1].executor.shutdown, wait=True)  # every job of the round has ended
            for p, r, d in zip(peers, results, deltas):
                assert all(a is None for a in r.averages)  # no sum got round a ring with a hole
                assert torch.equal(p.residual, d)  # all of x carried, by both survivors
                assert torch.count_nonzero(p.owner_residual) == 0
        finally:
            carried_back.set()
            await stop_peers(peers)

    run(scenario())
