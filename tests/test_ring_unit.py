"""The ring all-reduce (protocol/ring.py) without sockets: the real run_allreduce with a RING group
over the fake transport and a virtual clock (tests/protocol_fakes.py). Bit-identical averages
equal to the weighted mean, the error feedback of lossy hops, a member that dies mid-round or
never comes, and the serving side's refusals."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lowcomm.protocol import codecs
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.allreduce import AllReduceResult, ReduceRegistry, run_allreduce
from lowcomm.protocol.layout import piece_layout
from lowcomm.protocol.member import EXCHANGE_END, RESULT_MARGIN
from lowcomm.protocol.ring import RING, RingBook, RingInbox, _Plan, ring_problem
from lowcomm.protocol.transport import Code, Refused

from .protocol_fakes import FakeNet, InlineExecutor, VirtualTimeLoop, run_virtual

NUMEL = 4000
EXECUTOR = InlineExecutor()


class Peer:
    def __init__(self, net: FakeNet, loop: VirtualTimeLoop, peer_id: str, weight: float = 1.0) -> None:
        self.peer_id, self.weight = peer_id, weight
        self.address = f"fake://{peer_id}"
        self.registry = ReduceRegistry(peer_id, lambda *_: None, EXECUTOR, clock=loop.clock)
        net.registries[self.address] = self.registry
        self.residual = torch.zeros(NUMEL)
        self.owner_residual = torch.zeros(NUMEL)
        self.net = net

    def member(self) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=self.peer_id, address=self.address, weight=self.weight)

    async def reduce(self, group: averaging_pb2.Group, delta: torch.Tensor) -> AllReduceResult:
        return await run_allreduce(group, self.peer_id, delta, self.residual, self.owner_residual, self.registry,
                                   None, EXECUTOR, transport=self.net)


class LinkNet(FakeNet):
    """FakeNet whose Reduce streams take ``per_message`` seconds per message: a round that lasts."""

    def __init__(self, per_message: float) -> None:
        super().__init__()
        self.per_message = per_message

    async def reduce(self, address, requests, timeout):
        async def paced():
            async for message in requests:
                await asyncio.sleep(self.per_message)
                yield message

        async for answer in super().reduce(address, paced(), timeout):
            yield answer


def ring_group(peers: list[Peer], codec: str = "fp32", pieces: int = 1, reduce_timeout: float = 5.0) -> averaging_pb2.Group:
    bounds, owners = piece_layout(NUMEL, [0.0] * len(peers), pieces)
    return averaging_pb2.Group(
        group_id=b"r" * 16, step=3, members=[p.member() for p in peers], shard_bounds=bounds, shard_owners=owners,
        codec=int(codecs.get_codec(codec).id), reduce_timeout_s=reduce_timeout, schedule=RING)


def deltas(count: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) * 0.01 for _ in range(count)]


def test_every_item_a_member_sends_is_one_its_successor_expects_in_the_same_order():
    group = averaging_pb2.Group(members=[averaging_pb2.Member(peer_id=f"p{i}", address="a") for i in range(4)],
                                shard_bounds=list(range(9)), shard_owners=[0, 1, 2, 3, 0, 1, 2, 3])
    for position in range(4):
        plan, after = _Plan(group, position), _Plan(group, (position + 1) % 4)
        assert plan.outgoing == after.incoming
        # Every shard's sum passes every member but its owner once, and its average every member but the owner's successor.
        sums = [item.shard for item in plan.outgoing if item.kind == "sum"]
        averages = [item.shard for item in plan.outgoing if item.kind == "average"]
        assert sorted(sums) == sorted(j for j in range(8) if group.shard_owners[j] != position)
        assert sorted(averages) == sorted(j for j in range(8) if group.shard_owners[j] != (position + 1) % 4)


@pytest.mark.parametrize("size,pieces", [(2, 1), (3, 2), (5, 3)])
def test_every_member_ends_with_the_same_bits_the_weighted_mean(size, pieces):
    weights = [1.0, 3.0, 2.0, 1.5, 1.0][:size]

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        peers = [Peer(net, loop, f"peer-{i:02d}", w) for i, w in enumerate(weights)]
        group = ring_group(peers, pieces=pieces)
        results = await asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers, deltas(size))))
        return loop.time(), results, peers

    elapsed, results, peers = run_virtual(scenario)
    mean = sum(w * d for w, d in zip(weights, deltas(size))) / sum(weights)
    assert len(results[0].slices) == size * pieces
    for j, sl in enumerate(results[0].slices):
        assert all(torch.equal(r.averages[j], results[0].averages[j]) for r in results)  # bit-identical
        assert torch.allclose(results[0].averages[j], mean[sl], atol=1e-8, rtol=1e-5)
        assert all(r.payloads[j] == results[0].payloads[j] for r in results)
    assert all(torch.count_nonzero(p.residual) == 0 for p in peers)  # fp32 is lossless: nothing left to carry
    # Every link carried the butterfly's bytes: 2·(N−1)/N of the payload.
    payload = results[0].payload_bytes
    for r in results:
        assert r.bytes_sent == pytest.approx(2 * (size - 1) / size * payload, rel=0.01)
        assert r.bytes_received == pytest.approx(2 * (size - 1) / size * payload, rel=0.01)
    assert elapsed < 0.1  # nothing waited for a deadline


def test_a_lossy_codec_keeps_every_hops_error_in_the_residuals():
    """int8 re-encodes the running sum at every hop. Per shard, what the members put in
    (Σ w·x) equals what the group applies (W times the decoded average, net of the owner's
    error feedback) plus what the members carry (Σ w·residual): nothing is lost."""
    weights = [1.0, 2.0, 1.0, 3.0]

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        peers = [Peer(net, loop, f"peer-{i:02d}", w) for i, w in enumerate(weights)]
        gen = torch.Generator().manual_seed(5)
        for p in peers:
            p.residual.copy_(torch.randn(NUMEL, generator=gen) * 1e-3)
            p.owner_residual.copy_(torch.randn(NUMEL, generator=gen) * 1e-4)
        before = [(p.residual.clone(), p.owner_residual.clone()) for p in peers]
        results = await asyncio.gather(*(p.reduce(ring_group(peers, codec="int8", pieces=2), d)
                                         for p, d in zip(peers, deltas(4, seed=2))))
        return results, peers, before

    results, peers, before = run_virtual(scenario)
    total = sum(weights)
    sent = sum(w * (d + b[0]) for w, d, b in zip(weights, deltas(4, seed=2), before))
    carried = sum(w * p.residual for w, p in zip(weights, peers))
    group = ring_group(peers, codec="int8", pieces=2)
    for j, sl in enumerate(results[0].slices):
        owner = group.shard_owners[j]
        average = results[0].averages[j]
        assert all(torch.equal(r.averages[j], average) for r in results)
        # The owner encoded mean + r_before and kept r_after = that − decoded: mean = decoded + r_after − r_before.
        applied = total * (average + peers[owner].owner_residual[sl] - before[owner][1][sl])
        assert torch.allclose(sent[sl], applied + carried[sl], atol=1e-5)
        assert torch.allclose(average, (sent[sl] / total), atol=2e-3)  # int8 of the mean
    assert any(torch.count_nonzero(p.residual) > 0 for p in peers)  # the hops' errors are carried


def test_a_member_that_dies_mid_round_makes_every_survivor_skip_fast_and_keep_all_of_x():
    """A member stops (its task and server are gone) while sums travel: its neighbours' streams
    break, the failure goes round the ring both ways, and every survivor skips what any of
    them lacks, carries its exact x there, and ends long before the ring's deadline."""
    reduce_timeout = 30.0

    async def scenario(loop: VirtualTimeLoop):
        net = LinkNet(per_message=0.005)
        peers = [Peer(net, loop, f"peer-{i:02d}") for i in range(4)]
        group = ring_group(peers, pieces=4, reduce_timeout=reduce_timeout)
        gen = torch.Generator().manual_seed(9)
        for p in peers:
            p.residual.copy_(torch.randn(NUMEL, generator=gen) * 1e-3)
        old = [p.residual.clone() for p in peers]
        tasks = [asyncio.create_task(p.reduce(group, d)) for p, d in zip(peers, deltas(4))]
        await asyncio.sleep(0.035)  # a few hops in: sums are on the way
        assert not any(t.done() for t in tasks)
        tasks[2].cancel()
        net.down.add(peers[2].address)
        net.registries.pop(peers[2].address)
        results = await asyncio.gather(*(tasks[i] for i in (0, 1, 3)))
        return loop.time(), results, [peers[i] for i in (0, 1, 3)], [old[i] for i in (0, 1, 3)]

    elapsed, results, survivors, old = run_virtual(scenario)
    x = [d + o for d, o in zip([deltas(4)[i] for i in (0, 1, 3)], old)]
    applied = [[a is not None for a in r.averages] for r in results]
    assert applied[0] == applied[1] == applied[2]
    assert not all(applied[0])  # the dead member's sums never completed
    for r, p, xi in zip(results, survivors, x):
        for j, sl in enumerate(r.slices):
            if r.averages[j] is None:
                assert torch.equal(p.residual[sl], xi[sl])
    assert elapsed < reduce_timeout / 2  # no survivor waited for the deadline


def test_a_member_that_never_comes_costs_the_rings_deadline_no_more():
    reduce_timeout = 4.0

    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        peers = [Peer(net, loop, f"peer-{i:02d}") for i in range(3)]
        group = ring_group(peers, reduce_timeout=reduce_timeout)
        net.silent.add(peers[1].address)  # takes calls, never answers, never runs the round
        old = [p.residual.clone() for p in peers]
        results = await asyncio.gather(*(peers[i].reduce(group, deltas(3)[i]) for i in (0, 2)))
        return loop.time(), results, [peers[0], peers[2]], [old[0], old[2]]

    elapsed, results, survivors, old = run_virtual(scenario)
    assert all(a is None for r in results for a in r.averages)
    for p, d, o in zip(survivors, (deltas(3)[0], deltas(3)[2]), old):
        assert torch.equal(p.residual, d + o)
    assert reduce_timeout * (1 + RESULT_MARGIN) <= elapsed <= EXCHANGE_END * reduce_timeout + 1.5


def test_a_group_that_cannot_ring_is_skipped_by_every_member_with_nothing_lost():
    async def scenario(loop: VirtualTimeLoop):
        net = FakeNet()
        peers = [Peer(net, loop, f"peer-{i:02d}") for i in range(3)]
        group = ring_group(peers)
        del group.shard_owners[:]
        group.shard_owners.extend([0, 0, 1])  # peer-02 owns nothing: it has no chunk to finish
        return await asyncio.gather(*(p.reduce(group, d) for p, d in zip(peers, deltas(3)))), peers, group

    results, peers, group = run_virtual(scenario)
    assert "must own a shard" in ring_problem(group)
    assert all(a is None for r in results for a in r.averages)
    assert all(torch.equal(p.residual, d) for p, d in zip(peers, deltas(3)))


def test_ring_problem_names_what_a_ring_needs():
    peers = [averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}") for i in range(3)]
    good = averaging_pb2.Group(members=peers, shard_bounds=[0, 1, 2, 3], shard_owners=[0, 1, 2],
                               codec=int(codecs.get_codec("int8").id))
    assert ring_problem(good) == ""
    client = averaging_pb2.Group(); client.CopyFrom(good); client.members[1].address = ""
    assert "reachable" in ring_problem(client)
    sparse = averaging_pb2.Group(); sparse.CopyFrom(good); sparse.codec = int(codecs.get_codec("topk").id)
    assert "dense" in ring_problem(sparse)
    alone = averaging_pb2.Group(members=peers[:1], shard_bounds=[0, 3], shard_owners=[0], codec=good.codec)
    assert "two members" in ring_problem(alone)
    assert "malformed" in ring_problem(good, numel=4)  # the bounds end at 3
    backwards = averaging_pb2.Group(); backwards.CopyFrom(good); backwards.shard_bounds[1] = 3
    backwards.shard_bounds[2] = 2
    assert "malformed" in ring_problem(backwards)


def test_the_serving_side_refuses_a_stranger_a_second_stream_and_too_many_bytes():
    async def chunks(*payloads: bytes):
        for payload in payloads:
            yield averaging_pb2.ReduceMessage(chunk=payload)

    async def scenario():
        book = RingBook()
        inbox = RingInbox(b"g", "peer-00", expected_bytes=6)
        book.open(inbox)
        refusals = []
        for header, payloads in [(averaging_pb2.RingHeader(group_id=b"g", sender_peer_id="peer-07"), [b"x"]),
                                 (averaging_pb2.RingHeader(group_id=b"g", sender_peer_id="peer-00"), [b"1234", b"567"]),
                                 (averaging_pb2.RingHeader(group_id=b"g", sender_peer_id="peer-00"), [b"1"]),
                                 (averaging_pb2.RingHeader(group_id=b"other", sender_peer_id="peer-00"), [b"1"])]:
            try:
                async for _ in book.handle(header, chunks(*payloads), timeout=0.05):
                    pass
            except Refused as err:
                refusals.append(err.code)
        return refusals, inbox

    refusals, inbox = asyncio.run(scenario())
    assert refusals == [Code.INVALID_ARGUMENT, Code.INVALID_ARGUMENT, Code.ALREADY_EXISTS, Code.NOT_FOUND]
    assert inbox.messages.get_nowait() == b"1234"
    assert inbox.messages.get_nowait() == "broken"



def test_a_stream_the_round_here_no_longer_needs_is_answered_which_stops_its_sender():
    """Any answer ends the sender's ring round (_Exchange.send). A stream still open when the
    round here ends without all of it, and one that comes after, get one at once; refusing them
    instead would end the call under a sender still writing, which often hears only "Internal
    error from Core" from its gRPC."""
    async def chunks(*payloads: bytes):
        for payload in payloads:
            yield averaging_pb2.ReduceMessage(chunk=payload)
        await asyncio.Event().wait()  # a sender with nothing more to send for now

    header = averaging_pb2.RingHeader(group_id=b"g", sender_peer_id="peer-00")

    async def scenario():
        book = RingBook()
        inbox = RingInbox(b"g", "peer-00", expected_bytes=6)
        book.open(inbox)
        open_stream = book.handle(header, chunks(b"1234"), timeout=60.0)
        answered = asyncio.ensure_future(anext(open_stream))
        assert await inbox.messages.get() == b"1234"
        assert not answered.done()
        book.close(inbox)  # the round here ends without the last 2 bytes
        answers = [await answered]
        late_stream = book.handle(header, chunks(), timeout=60.0)  # not the 60 s wait for a round to open
        answers.append(await anext(late_stream))
        for stream in (open_stream, late_stream):
            await stream.aclose()  # the sender hangs up
        return answers, inbox

    answers, inbox = asyncio.run(scenario())
    assert answers == [averaging_pb2.ReduceMessage()] * 2
    assert inbox.messages.get_nowait() == "broken"  # what the round would read after the first chunk

def test_a_leader_asked_for_a_ring_closes_one_where_it_can_and_a_butterfly_elsewhere():
    from lowcomm.protocol.layout import close_groups

    def member(i: int, reachable: bool = True) -> averaging_pb2.Member:
        return averaging_pb2.Member(peer_id=f"p{i}", address=f"a{i}" if reachable else "", weight=1.0)

    template = averaging_pb2.Group(step=1, codec=int(codecs.get_codec("int8").id), reduce_timeout_s=5.0, schedule=RING)
    ids = iter(bytes([i]) * 16 for i in range(100)).__next__
    numel = 10_000_000
    fast = {f"p{i}": (1e9 if i == 0 else 12.5e6) for i in range(8)}  # one datacenter peer, three home links

    [ring] = close_groups([[member(i) for i in range(4)]], fast, numel, template, lambda n: ids())
    assert ring.schedule == RING and ring_problem(ring) == ""
    sizes = [ring.shard_bounds[k + 1] - ring.shard_bounds[k] for k in range(len(ring.shard_owners))]
    assert max(sizes) - min(sizes) <= 1  # every chunk crosses every link: equal, whatever the bandwidths
    assert len(ring.shard_owners) > 4  # cut into pieces, so that a hop forwards one while the next arrives

    [with_client] = close_groups([[member(0), member(1), member(2, reachable=False)]], fast, numel, template,
                                 lambda n: ids())
    assert with_client.schedule != RING  # a client-mode member cannot receive a ring stream

    sparse = averaging_pb2.Group(); sparse.CopyFrom(template); sparse.codec = int(codecs.get_codec("topk").id)
    [topk] = close_groups([[member(i) for i in range(3)]], fast, numel, sparse, lambda n: ids())
    assert topk.schedule != RING

    split = close_groups([[member(i) for i in range(4)], [member(i) for i in range(4, 8)]], fast, numel, template,
                         lambda n: ids())
    assert all(g.schedule != RING for g in split)  # teams across groups are the butterfly's
