"""Gossip mode in one event loop: push-pull exchanges over real grpc.aio servers on 127.0.0.1:0.

Protocol level (protocol/gossip.py): what arrives equals what was sent within the codec's bound,
bad input is refused and counted, deadlines hold. Node level (node/gossip_mode.py, with a small
stand-in for the Node): mixing shrinks the distance between peers, a partner's parameters wait
in the inbox until the next boundary, and a partner that never answers does not hang a round.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from lowcomm.node.config import Config
from lowcomm.node.globalstate import GlobalState
from lowcomm.node.gossip_mode import STEP_WINDOW, GossipHost, GossipMode, gossip_codec
from lowcomm.node.metrics import NodeMetrics
from lowcomm.node.swarm import PeerRecord, SwarmView
from lowcomm.protocol import PROTOCOL_VERSION, codecs
from lowcomm.protocol._pb.lowcomm.v1 import gossip_pb2, gossip_pb2_grpc
from lowcomm.protocol.gossip import GossipError, GossipResponder, Inbox, Traffic, exchange, service
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.rpc import ChannelPool

NUMEL = 20_011  # not a multiple of any block size
FINGERPRINT = "f" * 64


def run(coro, limit: float = 30.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


def random_theta(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * scale


async def serve(add_service) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


# -- protocol level -------------------------------------------------------------------------------


class ProtoPeer:
    """A responder with its own θ and residual, as a node would wire it."""

    def __init__(self, peer_id: str, theta: torch.Tensor, codec: str = "int8", step: int = 0,
                 capacity: int = 4, timeout: float = 5.0, fingerprint: str = FINGERPRINT) -> None:
        self.identity = Identity(peer_id, fingerprint, "{}")
        self.codec = codecs.get_codec(codec)
        self.theta = theta
        self.residual = torch.zeros(NUMEL)
        self.step = step
        self.inbox = Inbox(capacity)
        self.rejections: list[tuple[str, str]] = []
        self.served: list[tuple[int, int]] = []
        self.executor = ThreadPoolExecutor(2)
        self.responder = GossipResponder(
            self.identity, self.codec, NUMEL, self.executor, self.inbox, step=lambda: self.step, reply=self.reply,
            on_reject=lambda reason, sender, detail: self.rejections.append((reason, sender)),
            step_window=STEP_WINDOW, timeout=timeout, on_traffic=lambda r, s: self.served.append((r, s)))

    async def reply(self) -> bytes:
        return codecs.encode_with_feedback(self.codec, self.theta, self.residual)[0]

    async def start(self) -> "ProtoPeer":
        self.server, self.address = await serve(service(self.responder))
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def call(self, other: "ProtoPeer", theta: torch.Tensor, timeout: float = 5.0, traffic=None):
        """Exchange ``theta`` (encoded without feedback) with ``other``."""
        payload = self.codec.encode(theta)
        async with grpc.aio.insecure_channel(other.address) as channel:
            return await exchange(channel, self.identity, self.codec, self.step, payload, NUMEL, self.executor,
                                  timeout, STEP_WINDOW, traffic)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4"])
def test_push_pull_delivers_both_parameters_within_the_codec_bound(codec):
    async def scenario():
        a, b = ProtoPeer("peer-a", random_theta(1), codec), ProtoPeer("peer-b", random_theta(2), codec)
        await b.start()
        try:
            traffic = Traffic()
            got = await a.call(b, a.theta, traffic=traffic)
            c = a.codec
            size = c.encoded_size(NUMEL)
            assert traffic.sent == size and traffic.received == size
            assert b.served == [(size, size)]
            assert got.step == b.step
            # Pull: A holds B's θ; push: B keeps A's θ in its inbox, θ_B itself is untouched.
            assert (got.theta - b.theta).abs().max().item() <= c.error_bound(b.theta)
            kept = b.inbox.drain()
            assert list(kept) == ["peer-a"]
            assert (kept["peer-a"] - a.theta).abs().max().item() <= c.error_bound(a.theta)
            if codec == "fp32":
                assert torch.equal(got.theta, b.theta) and torch.equal(kept["peer-a"], a.theta)
            assert torch.equal(b.theta, random_theta(2))
            assert not b.rejections
        finally:
            await b.stop()

    run(scenario())


def test_error_feedback_makes_repeated_replies_unbiased():
    """The same θ sent again and again: the mean of what arrives converges to θ (int4, coarse)."""
    async def scenario():
        a, b = ProtoPeer("peer-a", random_theta(1), "int4"), ProtoPeer("peer-b", random_theta(2), "int4")
        await b.start()
        try:
            received = [(await a.call(b, a.theta)).theta for _ in range(20)]
            one = (received[0] - b.theta).abs().mean().item()
            mean = (torch.stack(received).mean(0) - b.theta).abs().mean().item()
            assert mean < one / 5
        finally:
            await b.stop()

    run(scenario())


async def raw_exchange(address: str, hello: Identity | None, header: gossip_pb2.GossipHeader | None,
                       chunks: list[bytes]) -> grpc.StatusCode:
    """Speak the protocol with arbitrary content; returns the status the callee ended the call with."""
    first = gossip_pb2.GossipMessage()
    if hello is not None:
        first.hello.CopyFrom(hello.hello())
    if header is not None:
        first.header.CopyFrom(header)
    async with grpc.aio.insecure_channel(address) as channel:
        call = gossip_pb2_grpc.GossipStub(channel).Exchange(timeout=5)
        await call.write(first)
        if await call.read() is not grpc.aio.EOF:  # the go-ahead
            for chunk in chunks:
                await call.write(gossip_pb2.GossipMessage(chunk=chunk))
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        return await call.code()


def header_for(codec: codecs.Codec, step: int = 0, numel: int = NUMEL, payload_bytes: int | None = None):
    size = codec.encoded_size(numel) if payload_bytes is None else payload_bytes
    return gossip_pb2.GossipHeader(step=step, codec=codec.id, numel=numel, payload_bytes=size)


def nan_int8_payload(codec: codecs.Codec) -> bytes:
    payload = bytearray(codec.encode(random_theta(3)))
    payload[0:4] = torch.tensor([math.nan]).numpy().tobytes()  # the first block's scale
    return bytes(payload)


def bad_requests():
    int8, fp32 = codecs.get_codec("int8"), codecs.get_codec("fp32")
    good = int8.encode(random_theta(3))
    nan_fp32 = fp32.encode(torch.full((NUMEL,), math.nan))
    caller = Identity("peer-bad", FINGERPRINT, "{}")
    other_run = Identity("peer-other", "e" * 64, '{"sync": {"codec": "int4"}}')
    return {
        # name: (hello, header, chunks, expected status, expected rejection reason or None)
        "no_hello": (None, header_for(int8), [good], grpc.StatusCode.INVALID_ARGUMENT, None),
        "other_run_config": (other_run, header_for(int8), [good], grpc.StatusCode.FAILED_PRECONDITION, None),
        "wrong_codec": (caller, header_for(fp32), [nan_fp32], grpc.StatusCode.INVALID_ARGUMENT, "codec"),
        "wrong_numel": (caller, header_for(int8, numel=NUMEL - 1), [good], grpc.StatusCode.INVALID_ARGUMENT,
                        "length"),
        "wrong_payload_bytes": (caller, header_for(int8, payload_bytes=len(good) + 1), [good],
                                grpc.StatusCode.INVALID_ARGUMENT, "length"),
        "more_bytes_than_declared": (caller, header_for(int8), [good + b"x"], grpc.StatusCode.INVALID_ARGUMENT,
                                     "length"),
        "fewer_bytes_than_declared": (caller, header_for(int8), [good[:-1]], grpc.StatusCode.INVALID_ARGUMENT,
                                      "length"),
        "nan_scale": (caller, header_for(int8), [nan_int8_payload(int8)], grpc.StatusCode.INVALID_ARGUMENT, "codec"),
        "step_out_of_window": (caller, header_for(int8, step=STEP_WINDOW + 1), [good], grpc.StatusCode.ABORTED, None),
    }


@pytest.mark.parametrize("case", list(bad_requests()))
def test_bad_requests_are_refused_counted_and_never_kept(case):
    hello, header, chunks, status, reason = bad_requests()[case]

    async def scenario():
        b = await ProtoPeer("peer-b", random_theta(2)).start()
        try:
            try:
                code = await raw_exchange(b.address, hello, header, chunks)
            except grpc.aio.AioRpcError as err:
                code = err.code()
            assert code == status
            assert b.rejections == ([(reason, "peer-bad")] if reason else [])
            assert len(b.inbox) == 0 and b.inbox.reserve("peer-bad")  # nothing kept, nothing left reserved
        finally:
            await b.stop()

    run(scenario())


def test_non_finite_parameters_are_refused():
    async def scenario():
        a = ProtoPeer("peer-a", random_theta(1), "fp32")
        b = await ProtoPeer("peer-b", random_theta(2), "fp32").start()
        try:
            with pytest.raises(GossipError) as err:
                await a.call(b, torch.full((NUMEL,), math.inf))
            assert "INVALID_ARGUMENT" in str(err.value)
            assert b.rejections == [("non_finite", "peer-a")] and len(b.inbox) == 0
        finally:
            await b.stop()

    run(scenario())


def test_a_bad_answer_is_a_typed_error_for_the_caller():
    """A partner answering NaN parameters is rejected by the caller, with a reason to count."""
    async def scenario():
        a = ProtoPeer("peer-a", random_theta(1), "fp32")
        b = await ProtoPeer("peer-b", torch.full((NUMEL,), math.nan), "fp32").start()
        try:
            with pytest.raises(GossipError) as err:
                await a.call(b, a.theta)
            assert err.value.reason == "non_finite"
        finally:
            await b.stop()

    run(scenario())


def test_a_full_inbox_refuses_new_senders():
    async def scenario():
        b = await ProtoPeer("peer-b", random_theta(2), capacity=1).start()
        a, c = ProtoPeer("peer-a", random_theta(1)), ProtoPeer("peer-c", random_theta(3))
        try:
            await a.call(b, a.theta)
            await a.call(b, a.theta * 2)  # the same sender again: replaces its entry
            with pytest.raises(GossipError, match="RESOURCE_EXHAUSTED"):
                await c.call(b, c.theta)
            kept = b.inbox.drain()
            assert list(kept) == ["peer-a"] and torch.allclose(kept["peer-a"], a.theta * 2, atol=0.05)
            await c.call(b, c.theta)  # drained at the boundary: room again
        finally:
            await b.stop()

    run(scenario())


class Silent(gossip_pb2_grpc.GossipServicer):
    """A partner that accepts the call and never answers."""

    async def Exchange(self, request_iterator, context):
        await asyncio.Event().wait()
        yield gossip_pb2.GossipMessage()  # pragma: no cover


def test_a_partner_that_never_answers_costs_only_the_deadline():
    async def scenario():
        server, address = await serve(lambda s: gossip_pb2_grpc.add_GossipServicer_to_server(Silent(), s))
        a = ProtoPeer("peer-a", random_theta(1))
        try:
            async with asyncio.timeout(5):  # the exchange's own deadline is 0.5 s
                with pytest.raises(GossipError, match="DEADLINE_EXCEEDED|no answer"):
                    await a.call(type("P", (), {"address": address})(), a.theta, timeout=0.5)
        finally:
            await server.stop(grace=None)

    run(scenario())


def test_a_caller_that_stalls_mid_payload_is_cut_off_and_released():
    async def scenario():
        b = await ProtoPeer("peer-b", random_theta(2), timeout=0.5).start()
        caller = Identity("peer-slow", FINGERPRINT, "{}")
        int8 = codecs.get_codec("int8")

        async def stalling():
            yield gossip_pb2.GossipMessage(hello=caller.hello(), header=header_for(int8))
            await asyncio.Event().wait()

        try:
            async with grpc.aio.insecure_channel(b.address) as channel:
                call = gossip_pb2_grpc.GossipStub(channel).Exchange(stalling(), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert len(b.inbox) == 0 and b.inbox.reserve("peer-slow")
        finally:
            await b.stop()

    run(scenario())


def test_with_a_run_secret_the_hello_must_name_the_tokens_peer():
    """The token interceptors carry the reader/writer call, and the caller's Hello is bound to its token."""
    from lowcomm.protocol.auth import RunAuth, ServerAuthInterceptor, client_interceptors

    auth = RunAuth(b"s" * 32)

    async def scenario():
        b = ProtoPeer("peer-b", random_theta(2))
        refused: list[str] = []
        server = grpc.aio.server(interceptors=[ServerAuthInterceptor(auth, lambda reason, *_: refused.append(reason))])
        service(b.responder)(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        b.address = f"127.0.0.1:{port}"
        a = ProtoPeer("peer-a", random_theta(1))
        try:
            for token_peer, expect_ok in (("peer-a", True), ("peer-mallory", False)):
                channels = ChannelPool(client_interceptors(auth, token_peer, lambda: 0))
                payload = a.codec.encode(a.theta)
                try:
                    call = exchange(channels(b.address), a.identity, a.codec, 0, payload, NUMEL, a.executor, 5.0,
                                    STEP_WINDOW)
                    if expect_ok:
                        got = await call
                        assert (got.theta - b.theta).abs().max().item() <= a.codec.error_bound(b.theta)
                    else:
                        with pytest.raises(GossipError, match="UNAUTHENTICATED"):
                            await call
                finally:
                    await channels.close()
            assert refused == ["unauthenticated"] and list(b.inbox.drain()) == ["peer-a"]
        finally:
            await server.stop(grace=None)
            b.executor.shutdown(wait=False)

    run(scenario())


# -- node level -----------------------------------------------------------------------------------


class FakeNode:
    """A node around a GossipMode: its GossipHost (state, identity, channels, executor, view,
    metrics) and the daemon's part of a round (the commit, the consensus distance it keeps)."""

    def __init__(self, peer_id: str, theta: torch.Tensor, swarm: list["FakeNode"], partners: int = 1,
                 codec: str = "int8", reduce_timeout: float = 3.0) -> None:
        self.config = Config.model_validate({"sync": {"mode": "gossip", "gossip_partners": partners, "codec": codec,
                                                      "reduce_timeout": reduce_timeout}})
        self.peer_id = peer_id
        self.identity = Identity(peer_id, FINGERPRINT, "{}")
        self.codec = codecs.get_codec(codec)
        self.numel = theta.numel()
        self.state = GlobalState.fresh(theta, 0.7, 0.9)
        self.channels = ChannelPool()
        self.codec_executor = ThreadPoolExecutor(2)
        self.metrics = NodeMetrics()
        self.rejections: list[tuple[str, str]] = []
        self.consensus_distance = math.nan
        self.address = ""
        self.swarm = swarm
        self.view = SwarmView({}, {}, 0.0)
        self.gossip = GossipMode(GossipHost(
            peer_id, self.identity, self.config.sync, self.codec, self.numel, self.state, self.channels,
            self.codec_executor, self.metrics, view=lambda: self.view, refresh_view=self.refresh_view,
            on_reject=self._on_reject))

    def _on_reject(self, reason: str, sender: str, detail: str) -> None:
        self.rejections.append((reason, sender))

    async def refresh_view(self) -> SwarmView:
        self.view = SwarmView({n.peer_id: n.record() for n in self.swarm}, {}, 0.0)
        return self.view

    def record(self) -> PeerRecord:
        return PeerRecord(self.peer_id, self.address, self.state.step, self.state.params_hash, 0.0, 0.0,
                          PROTOCOL_VERSION, FINGERPRINT, "training")

    async def start(self) -> "FakeNode":
        self.server, self.address = await serve(self.gossip.services()[0])
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)
        await self.channels.close()
        self.codec_executor.shutdown(wait=False, cancel_futures=True)

    async def round(self, delta: torch.Tensor | None = None):
        """One boundary: the gossip round, then the daemon's commit (step + 1)."""
        delta = torch.zeros(self.numel) if delta is None else delta
        report = await self.gossip.round(self.state.step, delta, 1.0)
        if report is not None:
            self.consensus_distance = report.consensus_distance
            self.state.commit()
        return report


async def start_nodes(thetas: list[torch.Tensor], **kwargs) -> list[FakeNode]:
    swarm: list[FakeNode] = []
    for i, theta in enumerate(thetas):
        swarm.append(FakeNode(f"peer-{i}", theta, swarm, **kwargs))
    await asyncio.gather(*(n.start() for n in swarm))
    return swarm


def spread(nodes: list[FakeNode]) -> float:
    """Largest relative distance of any node's θ_global to the mean of all."""
    mean = torch.stack([n.state.params for n in nodes]).mean(0)
    return max(float((n.state.params - mean).norm() / mean.norm()) for n in nodes)


def test_gossip_rounds_shrink_the_distance_between_peers():
    async def scenario():
        base = random_theta(0)
        nodes = await start_nodes([base + random_theta(10 + i, 0.5) for i in range(4)])
        for i, n in enumerate(nodes):
            n.gossip._rng.seed(i)  # reproducible partner choice; rounds run one after the other
        try:
            spreads = [spread(nodes)]
            distances = []
            for _ in range(6):
                for n in nodes:
                    report = await n.round()
                    assert report.group_size == 2  # k = 1 partner
                distances.append(sum(n.consensus_distance for n in nodes) / len(nodes))
                spreads.append(spread(nodes))
            assert all(later < earlier for earlier, later in zip(spreads, spreads[1:])), spreads
            assert spreads[-1] < spreads[0] / 10, spreads
            assert distances[-1] < distances[0] / 5, distances
            for n in nodes:
                assert n.metrics.consensus_distance._value.get() == n.consensus_distance
                assert not n.rejections
        finally:
            await asyncio.gather(*(n.stop() for n in nodes))

    run(scenario())


def test_an_exchange_leaves_the_partners_global_parameters_alone_until_its_boundary():
    async def scenario():
        a_theta, b_theta = random_theta(1), random_theta(2)
        a, b = await start_nodes([a_theta, b_theta], codec="fp32")
        try:
            delta = random_theta(3, 0.01)
            report = await a.round(delta)
            assert report.group_size == 2 and report.bytes_sent == report.bytes_received == 4 * NUMEL
            # A: its own exact outer step (lr 0.7, fresh momentum 0.9: update = 1.9 Δ), then the mean with B.
            stepped = a_theta - 0.7 * 1.9 * delta
            assert torch.allclose(a.state.params, (stepped + b_theta) / 2, atol=1e-6)
            assert math.isclose(a.consensus_distance, float((stepped - b_theta).norm() / stepped.norm()), rel_tol=1e-5)
            # B: untouched while it trains; A's θ waits in its inbox ...
            assert torch.equal(b.state.params, b_theta) and b.state.step == 0
            # ... and is mixed at B's boundary (B alone now: A moved to step 1, B's partner is A again).
            report = await b.round()
            assert report.group_size == 2
            assert torch.allclose(b.state.params, (b_theta + stepped + a.state.params) / 3, atol=1e-6)
        finally:
            await asyncio.gather(*(n.stop() for n in (a, b)))

    run(scenario())


def test_a_silent_partner_does_not_hang_the_round():
    async def scenario():
        server, address = await serve(lambda s: gossip_pb2_grpc.add_GossipServicer_to_server(Silent(), s))
        nodes = await start_nodes([random_theta(1)], reduce_timeout=1.0)
        silent = FakeNode("peer-silent", random_theta(3), nodes)
        silent.address = address
        nodes.append(silent)
        a = nodes[0]
        try:
            before = a.state.params.clone()
            async with asyncio.timeout(1.0 + 3):  # the exchange phase has a 1 s deadline
                report = await a.round(random_theta(2, 0.01))
            # A gossip peer commits its own step whatever its partners do; the round counts as no_group.
            assert report is not None and report.group_size == 1
            assert not torch.equal(a.state.params, before)
            assert math.isnan(a.consensus_distance)
            assert a.metrics.round_failures.labels(reason="no_group")._value.get() == 1
        finally:
            nodes.remove(silent)
            await server.stop(grace=None)
            await asyncio.gather(*(n.stop() for n in nodes))

    run(scenario())


def test_a_partner_that_fails_fast_is_replaced_by_the_next_candidate():
    async def scenario():
        nodes = await start_nodes([random_theta(i) for i in range(3)])  # k = 1
        a, gone = nodes[0], nodes[2]
        await gone.stop()  # still in the view, nobody listening: UNAVAILABLE at once
        try:
            for _ in range(3):  # whichever candidate comes first, A ends the round with peer-1
                report = await a.round()
                assert report.group_size == 2
            assert len(nodes[1].gossip.inbox) == 1
        finally:
            await asyncio.gather(*(n.stop() for n in nodes[:2]))

    run(scenario())


def test_a_lone_peer_commits_its_own_outer_step():
    async def scenario():
        theta = random_theta(1)
        (a,) = await start_nodes([theta])
        try:
            delta = random_theta(2, 0.01)
            report = await a.round(delta)
            assert report.group_size == 1 and report.bytes_sent == 0
            assert torch.allclose(a.state.params, theta - 0.7 * 1.9 * delta, atol=1e-6)
            assert math.isnan(a.consensus_distance)
            assert a.metrics.round_failures.labels(reason="no_group")._value.get() == 0  # nobody to reach
        finally:
            await a.stop()

    run(scenario())


def test_a_round_cancelled_again_while_its_mix_runs_waits_for_it_and_is_reported_done():
    """The driver abandons a round with ``cancel_and_wait``, which cancels again every 0.1 s. The
    mix (the swap of θ_global, its momentum and the spent residual) runs in a thread that cannot
    be stopped: the round must wait for it through every cancellation, keep the lock meanwhile
    (a partner's reply encodes θ_global with the same residual), and then end as done, so that
    the daemon commits the swap. It used to end cancelled at the second cancellation with the
    mix still running: θ_global swapped under its old hash, a checkpoint that fails its hash."""
    import threading

    async def scenario():
        theta = random_theta(1)
        (a,) = await start_nodes([theta])
        mixing, release = threading.Event(), threading.Event()
        submit = a.codec_executor.submit

        def held_mix(fn, *args, **kwargs):
            if getattr(fn, "__name__", "") != "mix":
                return submit(fn, *args, **kwargs)

            def mix_when_released():
                mixing.set()
                release.wait(timeout=30)
                return fn(*args, **kwargs)

            return submit(mix_when_released)

        a.codec_executor.submit = held_mix
        try:
            delta = random_theta(2, 0.01)
            a.state.residual.copy_(random_theta(3, 0.001))
            round_task = asyncio.create_task(a.gossip.round(a.state.step, delta, 1.0))
            await asyncio.to_thread(mixing.wait, 30)
            for _ in range(3):  # as cancel_and_wait does, each time once the round has run on
                round_task.cancel()
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not round_task.done()
                assert a.gossip._lock.locked()
            release.set()
            report = await round_task
            assert report is not None and report.group_size == 1
            assert torch.allclose(a.state.params, theta - 0.7 * 1.9 * (delta + random_theta(3, 0.001)), atol=1e-6)
            assert torch.count_nonzero(a.state.residual) == 0  # spent by the swap, which the daemon now commits
            assert not a.gossip._lock.locked()
        finally:
            release.set()
            await a.stop()

    run(scenario())


def test_partners_are_chosen_within_the_step_window():
    async def scenario():
        nodes = await start_nodes([random_theta(i) for i in range(3)], partners=2)
        try:
            nodes[2].state.step = STEP_WINDOW + 1
            assert nodes[0].gossip.needs_download(STEP_WINDOW + 1) and not nodes[0].gossip.needs_download(STEP_WINDOW)
            report = await nodes[0].round()
            assert report.group_size == 2  # k = 2, but only peer-1 qualifies
            assert len(nodes[1].gossip.inbox) == 1 and len(nodes[2].gossip.inbox) == 0
        finally:
            await asyncio.gather(*(n.stop() for n in nodes))

    run(scenario())


def test_topk_runs_gossip_parameters_densely():
    assert gossip_codec(codecs.get_codec("topk")).name == "int8"
    assert gossip_codec(codecs.get_codec("int4")).name == "int4"
