"""Property-based fuzzing of every lowcomm.v1 handler on one live in-process server, plus a
raw-bytes fuzzer against its port.

One node per module (module-scoped event loop; every example runs on it with
``run_until_complete``): Averaging (a Matchmaker and a ReduceRegistry with real accumulators),
StateTransfer (a StateDonor with two snapshots), NodeInfo, Gossip and the health service.
Every example predicts the status the server must answer and the rejections it must count, and
checks that nothing but valid contributions reached an accumulator and that the node still
answers a health check. Streams are written explicitly (``call.write``), so that a status is
the server's: a request-iterator client reports INTERNAL of its own when the server aborted
early. Examples are derandomized: the same inputs on every run.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import random
import struct
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowcomm.protocol import PROTOCOL_VERSION, allreduce, codecs
from lowcomm.protocol import gossip as gossip_mod
from lowcomm.protocol._pb.lowcomm.v1 import (
    averaging_pb2,
    averaging_pb2_grpc,
    gossip_pb2,
    gossip_pb2_grpc,
    handshake_pb2,
    node_pb2,
    node_pb2_grpc,
    state_pb2,
    state_pb2_grpc,
)
from lowcomm.protocol.allreduce import ReduceRegistry, ShardAccumulator
from lowcomm.protocol.gossip import GossipResponder, Inbox
from lowcomm.protocol.handshake import Identity
from lowcomm.protocol.matchmaking import Matchmaker, _Round
from lowcomm.protocol.rpc import (
    AveragingServicer,
    NodeInfoServicer,
    StateServicer,
    create_server,
    open_channel,
)
from lowcomm.protocol.state import CHUNK_BYTES as STATE_CHUNK, Snapshot, StateDonor

from .swarm_harness import MemoryDHT

S = grpc.StatusCode
NODE = "peer-00"
FINGERPRINT = "f" * 64
FP32 = codecs.get_codec("fp32")
BOUNDS = [0, 64, 64, 200]  # three shards owned by the node, the middle one empty
MEMBERS = ["peer-00", "peer-01", "peer-02", "peer-03"]
GID = b"G" * 16
REDUCE_TIMEOUT = 2.0
GOSSIP_NUMEL = 50
GOSSIP_STEP = 5
GOSSIP_WINDOW = 2
MM_NUMEL = 1000
NEVER = {S.UNKNOWN, S.INTERNAL}
FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


CORE_RACE = "Internal error from Core"  # the client's own status for a write that lost the race with the server's


class Recorded:
    """Wraps a streaming handler to record the status the server itself ended each call with."""

    def __init__(self) -> None:
        self.codes: list[grpc.StatusCode] = []

    async def wrap(self, handler, requests, context):
        code = S.OK
        try:
            async for message in handler(requests, context):
                yield message
        except grpc.aio.AbortError:
            code = context.code()
            raise
        except asyncio.CancelledError:
            code = S.CANCELLED
            raise
        except BaseException:
            code = S.UNKNOWN  # what grpc answers for an exception out of a handler
            raise
        finally:
            self.codes.append(code)


class RecordingAveraging(AveragingServicer):
    recorded = Recorded()

    async def Reduce(self, request_iterator, context):  # grpc.aio wants an async generator here
        async for message in self.recorded.wrap(super().Reduce, request_iterator, context):
            yield message


class RecordingGossip(gossip_mod.GossipServicer):
    recorded = Recorded()

    async def Exchange(self, request_iterator, context):
        async for message in self.recorded.wrap(super().Exchange, request_iterator, context):
            yield message


def status_of(got: grpc.StatusCode, details: str | None, recorded: Recorded) -> grpc.StatusCode:
    """The server's status: a write that raced the server's early end makes the client report
    INTERNAL of its own (CORE_RACE); the server's own status was recorded on its side."""
    if got == S.INTERNAL and details == CORE_RACE:
        return recorded.codes[-1]
    return got


class Node:
    """The node under test and a client channel to it, all on one event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.rejections: list[tuple[str, str]] = []
        self.gossip_rejections: list[tuple[str, str]] = []

    def run(self, coro, limit: float = 30.0):
        async def bounded():
            async with asyncio.timeout(limit):
                return await coro
        return self.loop.run_until_complete(bounded())

    async def start(self) -> None:
        self.identity = Identity(NODE, FINGERPRINT, "{}")
        self.executor = ThreadPoolExecutor(2)
        self.registry = ReduceRegistry(NODE, lambda r, s, d: self.rejections.append((r, s)), self.executor)
        self.dht = MemoryDHT()
        self.matchmaker = Matchmaker(self.dht, "fuzz", self.identity, "", open_channel, 16, int(FP32.id),
                                     MM_NUMEL, REDUCE_TIMEOUT, min_straggler_wait=0.2)
        self.donor = StateDonor(self.identity)
        gen = torch.Generator().manual_seed(0)
        for step in (3, 4):
            self.donor.publish(Snapshot.build(step, torch.randn(100, generator=gen), torch.randn(100, generator=gen)))
        self.inbox = Inbox(capacity=1000)
        reply = FP32.encode(torch.ones(GOSSIP_NUMEL))

        async def reply_payload() -> bytes:
            return reply

        responder = GossipResponder(self.identity, FP32, GOSSIP_NUMEL, self.executor, self.inbox,
                                    lambda: GOSSIP_STEP, reply_payload,
                                    lambda r, s, d: self.gossip_rejections.append((r, s)),
                                    GOSSIP_WINDOW, timeout=1.0)

        async def status() -> node_pb2.NodeStatus:
            return node_pb2.NodeStatus(peer_id=NODE, outer_step=4, phase="training")

        self.server, self.port = create_server(
            "127.0.0.1", 0, RecordingAveraging(self.matchmaker, self.registry), StateServicer(self.donor),
            NodeInfoServicer(status), health.aio.HealthServicer(),
            extra_services=[lambda server: gossip_pb2_grpc.add_GossipServicer_to_server(
                RecordingGossip(responder), server)])
        await self.server.start()
        self.address = f"127.0.0.1:{self.port}"
        self.matchmaker.address = self.address
        self.channel = open_channel(self.address)
        self.averaging = averaging_pb2_grpc.AveragingStub(self.channel)
        self.state = state_pb2_grpc.StateTransferStub(self.channel)
        self.info = node_pb2_grpc.NodeInfoStub(self.channel)
        self.gossip = gossip_pb2_grpc.GossipStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(grace=None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def healthy(self) -> None:
        response = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        status = await self.info.GetStatus(node_pb2.StatusRequest(), timeout=5)
        assert status.peer_id == NODE

    def open_round(self, reduce_timeout: float = REDUCE_TIMEOUT, bounds=BOUNDS,
                   gid: bytes = GID) -> list[ShardAccumulator]:
        """Fresh accumulators of one group, all shards owned by the node (what run_allreduce opens)."""
        group = averaging_pb2.Group(
            group_id=gid, step=0, shard_bounds=bounds, shard_owners=[0] * (len(bounds) - 1), codec=FP32.id,
            members=[averaging_pb2.Member(peer_id=m, address=self.address if m == NODE else "", weight=1.0)
                     for m in MEMBERS],
            reduce_timeout_s=reduce_timeout)
        accs = []
        for index in range(len(bounds) - 1):
            numel = bounds[index + 1] - bounds[index]
            accs.append(ShardAccumulator(
                group=group, shard_index=index, owner_id=NODE, codec=FP32, executor=self.executor,
                owner_residual=torch.zeros(numel), own=torch.full((numel,), 0.5), expected=set(MEMBERS[1:]),
                weights={m: 1.0 for m in MEMBERS}, on_reject=self.registry.on_reject))
        self.registry.open(accs)
        for acc in accs:
            acc.idle.set()
        return accs


@pytest.fixture(scope="module")
def node():
    saved = allreduce.HEADER_TIMEOUT, gossip_mod.HEADER_TIMEOUT
    # NOT_FOUND answers come after this wait; long enough that a loaded 2-core machine still
    # delivers a real first message in time (a shorter wait made the expected status flaky).
    allreduce.HEADER_TIMEOUT = gossip_mod.HEADER_TIMEOUT = 0.5
    n = Node()
    n.run(n.start())
    try:
        yield n
    finally:
        n.run(n.stop())
        n.loop.close()
        allreduce.HEADER_TIMEOUT, gossip_mod.HEADER_TIMEOUT = saved


async def write_all(call, messages) -> None:
    """Write ``messages`` and half-close; a write after the server ended the call fails locally."""
    try:
        for message in messages:
            await call.write(message)
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
        pass  # the server already answered; its status follows


async def read_all(call) -> tuple[grpc.StatusCode, list]:
    out = []
    try:
        while (message := await call.read()) is not grpc.aio.EOF:
            out.append(message)
    except grpc.aio.AioRpcError as err:
        return err.code(), out
    return await call.code(), out


# -- strategies -----------------------------------------------------------------------------------

int32s = st.integers(-2**31, 2**31 - 1)
int64s = st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from([0, -1, 1, 2**31, 2**40, 2**63 - 1, -2**63]))
codec_ids = st.one_of(st.sampled_from([int(c) for c in codecs.CodecId] + [0, 7, 99, -1]), int32s)
peer_ids = st.one_of(st.sampled_from(MEMBERS + ["", "peer-99", "x" * 300, "peer-01\x00"]), st.text(max_size=20))
odd_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.0, -1.0, 1e308, -1e308, 5e-324, float("inf"), float("nan")]))


@st.composite
def hellos(draw, valid_p=True):
    hello = handshake_pb2.Hello(protocol_version=PROTOCOL_VERSION, config_fingerprint=FINGERPRINT,
                                run_config_json="{}", peer_id=draw(peer_ids))
    if draw(st.booleans()) if valid_p else True:
        return hello, True
    which = draw(st.sampled_from(["version", "fingerprint", "empty"]))
    if which == "version":
        hello.protocol_version = draw(int32s.filter(lambda v: v != PROTOCOL_VERSION))
    elif which == "fingerprint":
        hello.config_fingerprint = draw(st.text(max_size=70).filter(lambda f: f != FINGERPRINT))
        hello.run_config_json = draw(st.sampled_from(["{}", "not json", '{"a": {"b": 1}}', "[]"]))
    else:
        hello = handshake_pb2.Hello()
    return hello, False


def float_payload(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@st.composite
def bodies(draw, numel: int):
    """(messages after the header, total chunk bytes, all are chunks, values finite)."""
    kind = draw(st.sampled_from(["exact", "exact", "exact", "nan", "short", "long", "extra", "random"]))
    values = draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=numel, max_size=numel)) if numel else []
    if kind == "nan" and numel:
        values[draw(st.integers(0, numel - 1))] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
    payload = float_payload(values)
    if kind == "short":
        payload = payload[:draw(st.integers(0, max(0, len(payload) - 1)))]
    elif kind == "long":
        payload += draw(st.binary(min_size=1, max_size=64))
    elif kind == "random":
        payload = draw(st.binary(max_size=4 * numel + 8))
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)])]
    messages = [averaging_pb2.ReduceMessage(chunk=p) for p in pieces]
    if kind == "extra":  # a second header, a result or an empty message inside the payload
        bad = draw(st.sampled_from([
            averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(group_id=GID)),
            averaging_pb2.ReduceMessage(result=averaging_pb2.ReduceResult(numel=1)),
            averaging_pb2.ReduceMessage()]))
        messages.insert(draw(st.integers(0, len(messages))), bad)
    finite = all(v == v and abs(v) != float("inf") for v in struct.unpack(f"<{len(payload) // 4}f",
                                                                          payload[:len(payload) // 4 * 4]))
    return messages, len(payload), kind != "extra", finite


@st.composite
def reduce_streams(draw):
    shape = draw(st.sampled_from(["header", "header", "header", "header", "none", "chunk_first", "empty"]))
    if shape == "empty":
        return [], None
    if shape == "none":
        return [averaging_pb2.ReduceMessage(chunk=draw(st.binary(max_size=32)))], None
    shard = draw(st.integers(0, 2))
    numel = BOUNDS[shard + 1] - BOUNDS[shard]
    fields = dict(group_id=GID, shard_index=shard, sender_peer_id=draw(st.sampled_from(MEMBERS[1:])),
                  codec=int(FP32.id), numel=numel, payload_bytes=FP32.encoded_size(numel))
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        fields[name] = draw({
            "group_id": st.one_of(st.just(b""), st.binary(max_size=40)),
            "shard_index": st.one_of(st.sampled_from([-1, 3, 2**31 - 1, -2**31]), int32s),
            "sender_peer_id": peer_ids,
            "codec": codec_ids,
            "numel": st.one_of(st.sampled_from([numel + 1, numel - 1, 2**40, -numel]), int64s),
            "payload_bytes": st.one_of(st.sampled_from([4 * numel + 4, 4 * numel - 1, 2**40, -1]), int64s),
        }[name])
    header = averaging_pb2.ReduceHeader(**fields)
    messages, total, chunks_only, finite = draw(bodies(numel))
    messages = [averaging_pb2.ReduceMessage(header=header), *messages]
    if shape == "chunk_first":
        messages.insert(0, averaging_pb2.ReduceMessage(chunk=b"\0\0\0\0"))
    return messages, (header, total, chunks_only, finite) if shape == "header" else None


def predict_reduce(accs, announced, finalized, stream) -> tuple[grpc.StatusCode, str | None, str | None]:
    """(status, rejection reason or None, sender that enters the accumulator or None)."""
    messages, info = stream
    if info is None:
        return S.INVALID_ARGUMENT, None, None
    header, total, chunks_only, finite = info
    if header.group_id != GID or not 0 <= header.shard_index < len(accs):
        return S.NOT_FOUND, None, None
    acc = accs[header.shard_index]
    sender = header.sender_peer_id
    if sender not in MEMBERS or sender == NODE or sender in announced[header.shard_index]:
        return S.INVALID_ARGUMENT, "unknown_sender", None
    if header.codec != FP32.id:
        return S.INVALID_ARGUMENT, "codec", None
    if header.numel != acc.numel or header.payload_bytes != FP32.encoded_size(acc.numel):
        return S.INVALID_ARGUMENT, "length", None
    announced[header.shard_index].add(sender)
    if not chunks_only or total != header.payload_bytes:
        return S.INVALID_ARGUMENT, "length", None
    if not finite:
        return S.INVALID_ARGUMENT, "non_finite", None
    if finalized[header.shard_index]:
        return S.OK, "late", None
    return S.OK, None, sender


# -- 1. handlers ----------------------------------------------------------------------------------


@settings(FUZZ, max_examples=70)
@given(streams=st.lists(reduce_streams(), min_size=1, max_size=3))
def test_reduce_streams(node, streams):
    async def scenario():
        accs = node.open_round()
        announced = [set() for _ in accs]
        finalized = [False] * len(accs)
        entered = [set() for _ in accs]
        before = len(node.rejections)
        expected_reasons = []
        for stream in streams:
            code, reason, enters = predict_reduce(accs, announced, finalized, stream)
            call = node.averaging.Reduce(timeout=10)
            reader = asyncio.ensure_future(read_all(call))
            await write_all(call, stream[0])
            info = stream[1]
            acc = accs[info[0].shard_index] if code == S.OK else None
            while not reader.done():  # the owner's side: finalize once the contribution is in
                if acc is not None and not acc.finalized.is_set() and enters in acc.contributions:
                    await acc.finalize()
                await asyncio.wait({reader}, timeout=0.01)
            got, messages = reader.result()
            got = status_of(got, await call.details(), RecordingAveraging.recorded)
            assert got not in NEVER, (stream, await call.details())
            assert got == code, (stream, got, code)
            if enters is not None:
                entered[info[0].shard_index].add(enters)
                finalized[info[0].shard_index] = True
            if code == S.OK:  # the average comes back, with the declared size
                result = messages[0].result
                assert result.numel == acc.numel and result.payload_bytes == 4 * acc.numel
                assert sum(len(m.chunk) for m in messages[1:]) == result.payload_bytes
                assert set(result.contributors) <= {NODE, *entered[info[0].shard_index]}
            if reason is not None:
                expected_reasons.append(reason)
        got_reasons = [r for r, _ in node.rejections[before:] if r != "norm"]
        assert got_reasons == expected_reasons
        for index, acc in enumerate(accs):
            assert acc.active_streams == 0
            if acc.finalized.is_set():
                assert set(acc.contributors) <= {NODE} | entered[index]
            else:  # nothing valid arrived: only the owner's own part is held
                assert set(acc.contributions) == {NODE}
        node.registry.close()
        await node.healthy()

    node.run(scenario())


@st.composite
def join_requests(draw):
    hello, valid = draw(hellos())
    return averaging_pb2.JoinRequest(
        hello=hello, step=draw(st.one_of(st.sampled_from([7, 8]), int64s)), address=draw(st.text(max_size=30)),
        weight=draw(odd_floats), bandwidth_bps=draw(odd_floats),
        params_sha256=draw(st.sampled_from(["h" * 64, "", "other"]))), valid


@settings(FUZZ, max_examples=40)
@given(request=join_requests(), state=st.sampled_from(["none", "closed", "follower", "other_step"]))
def test_join_group_outside_a_leading_round(node, request, state):
    request, valid = request
    rounds = {
        "none": None,
        "closed": _Round(7, "h" * 64, role="closed"),
        "follower": _Round(7, "h" * 64, role="follower", leader=averaging_pb2.Redirect(peer_id="peer-01",
                                                                                         address="x:1")),
        "other_step": _Round(9, "h" * 64, role="closed"),
    }
    if not valid:
        want = S.FAILED_PRECONDITION
    elif rounds[state] is None or request.step != rounds[state].step or request.params_sha256 != "h" * 64:
        want = S.ABORTED
    else:
        want = S.OK if state == "follower" else S.ABORTED

    async def scenario():
        node.matchmaker._round = rounds[state]
        try:
            response = await node.averaging.JoinGroup(request, timeout=5)
            code = S.OK
        except grpc.aio.AioRpcError as err:
            code = err.code()
        finally:
            node.matchmaker._round = None
        assert code == want, (request, state, code)
        if code == S.OK:
            assert response.redirect.peer_id == "peer-01"
        await node.healthy()

    node.run(scenario())


@settings(FUZZ, max_examples=25)
@given(peer=peer_ids, address=st.sampled_from(["", "127.0.0.1:1", "garbage", "[::1]:99999"]),
       weight=odd_floats, bandwidth=odd_floats, own_bandwidth=odd_floats)
def test_join_group_while_leading(node, peer, address, weight, bandwidth, own_bandwidth):
    """A follower's declared weight and bandwidth (NaN, inf, 1e308, negative) never break the
    leader: the group closes, shard bounds cover the numel in order, both sides get the same group."""
    step = 11

    async def scenario():
        async def expected():
            return {NODE, peer}

        leading = asyncio.ensure_future(node.matchmaker.form_group(step, 1.0, own_bandwidth, expected, timeout=3.0))
        await asyncio.sleep(0)
        request = averaging_pb2.JoinRequest(
            hello=node.identity.hello(), step=step, address=address, weight=weight, bandwidth_bps=bandwidth)
        request.hello.peer_id = peer
        try:
            response = await node.averaging.JoinGroup(request, timeout=5)
            code = S.OK
        except grpc.aio.AioRpcError as err:
            code = err.code()
        group = await leading  # raises if the leader broke
        node.matchmaker._round = None
        bounds = list(group.shard_bounds)
        assert bounds[0] == 0 and bounds[-1] == MM_NUMEL and bounds == sorted(bounds)
        assert len(bounds) == len(group.shard_owners) + 1
        if peer == NODE:
            assert code in {S.ALREADY_EXISTS, S.ABORTED}
            assert [m.peer_id for m in group.members] == [NODE]
        else:
            assert code == S.OK, code
            assert response.group == group
            assert sorted(m.peer_id for m in group.members) == sorted([NODE, peer])
        await node.healthy()

    node.run(scenario())


@settings(FUZZ, max_examples=60)
@given(hello=hellos(), step=st.one_of(st.sampled_from([3, 4, 5, -1]), int64s),
       offset=st.one_of(st.integers(-10, 900), int64s), length=st.one_of(st.integers(-10, 900), int64s))
def test_state_transfer(node, hello, step, offset, length):
    hello, valid = hello
    blob_len = {s: len(node.donor._snapshots[s].blob) for s in node.donor._snapshots}
    end = None
    if not valid or step not in blob_len:
        want = S.FAILED_PRECONDITION
    else:
        end = blob_len[step] if length == 0 else offset + length
        ok = offset >= 0 and length >= 0 and offset <= end <= blob_len[step]
        want = S.OK if ok else S.FAILED_PRECONDITION

    async def scenario():
        try:
            info = await node.state.GetStateInfo(state_pb2.StateInfoRequest(hello=hello), timeout=5)
            assert valid and info.step == 4
        except grpc.aio.AioRpcError as err:
            assert not valid and err.code() == S.FAILED_PRECONDITION
        call = node.state.DownloadState(state_pb2.StateRequest(hello=hello, step=step, offset=offset,
                                                               length=length), timeout=5)
        code, chunks = await read_all(call)
        assert code == want, (step, offset, length, code)
        if code == S.OK:
            blob = node.donor._snapshots[step].blob
            assert b"".join(c.data for c in chunks) == blob[offset:end]
            for c in chunks:
                assert len(c.data) <= STATE_CHUNK and hashlib.sha256(c.data).hexdigest() == c.sha256
        await node.healthy()

    node.run(scenario())


@st.composite
def gossip_streams(draw):
    hello, valid = draw(hellos())
    fields = dict(step=GOSSIP_STEP, codec=int(FP32.id), numel=GOSSIP_NUMEL, payload_bytes=4 * GOSSIP_NUMEL)
    for name in draw(st.sets(st.sampled_from(sorted(fields)), max_size=2)):
        fields[name] = draw({"step": st.one_of(st.integers(0, 10), int64s), "codec": codec_ids,
                             "numel": st.one_of(st.sampled_from([GOSSIP_NUMEL + 1, 2**40]), int64s),
                             "payload_bytes": st.one_of(st.sampled_from([4 * GOSSIP_NUMEL + 4, 2**40]), int64s)}[name])
    shape = draw(st.sampled_from(["both", "both", "both", "no_hello", "no_header", "empty"]))
    first = gossip_pb2.GossipMessage(hello=hello if shape != "no_hello" else None)
    if shape != "no_header":
        first.header.CopyFrom(gossip_pb2.GossipHeader(**fields))
    messages, total, chunks_only, finite = draw(bodies(GOSSIP_NUMEL))
    body = [gossip_pb2.GossipMessage(chunk=m.chunk) if m.HasField("chunk") else
            gossip_pb2.GossipMessage(header=gossip_pb2.GossipHeader()) for m in messages]
    stream = [] if shape == "empty" else [first, *body]
    return stream, shape, valid, fields, total, chunks_only, finite


@settings(FUZZ, max_examples=50)
@given(case=gossip_streams())
def test_gossip_exchange(node, case):
    stream, shape, valid, fields, total, chunks_only, finite = case
    sender = (stream[0].hello.peer_id or "?") if stream else ""  # the responder names an anonymous one "?"
    reason = None
    if shape != "both":
        want = S.INVALID_ARGUMENT
    elif not valid:
        want = S.FAILED_PRECONDITION
    elif fields["codec"] != FP32.id:
        want, reason = S.INVALID_ARGUMENT, "codec"
    elif fields["numel"] != GOSSIP_NUMEL or fields["payload_bytes"] != 4 * GOSSIP_NUMEL:
        want, reason = S.INVALID_ARGUMENT, "length"
    elif abs(fields["step"] - GOSSIP_STEP) > GOSSIP_WINDOW:
        want = S.ABORTED
    elif sender == NODE:
        want = S.RESOURCE_EXHAUSTED
    elif not chunks_only or total != 4 * GOSSIP_NUMEL:
        want, reason = S.INVALID_ARGUMENT, "length"
    elif not finite:
        want, reason = S.INVALID_ARGUMENT, "non_finite"
    else:
        want = S.OK

    async def scenario():
        before = len(node.gossip_rejections)
        call = node.gossip.Exchange(timeout=10)
        reader = asyncio.ensure_future(read_all(call))
        await write_all(call, stream)
        code, messages = await reader
        code = status_of(code, await call.details(), RecordingGossip.recorded)
        assert code not in NEVER
        assert code == want, (shape, fields, code)
        assert [r for r, _ in node.gossip_rejections[before:]] == ([reason] if reason else [])
        kept = node.inbox.drain()
        assert list(kept) == ([sender] if want == S.OK else [])
        if want == S.OK:
            assert sum(len(m.chunk) for m in messages[1:]) == 4 * GOSSIP_NUMEL
        assert not node.inbox._in_flight
        await node.healthy()

    node.run(scenario())


UNARY_METHODS = [
    ("/lowcomm.v1.Averaging/JoinGroup", "unary"),
    ("/lowcomm.v1.Averaging/ReportShards", "unary"),
    ("/lowcomm.v1.StateTransfer/GetStateInfo", "unary"),
    ("/lowcomm.v1.NodeInfo/GetStatus", "unary"),
    ("/lowcomm.v1.StateTransfer/DownloadState", "stream"),
    ("/lowcomm.v1.Averaging/Reduce", "bidi"),
    ("/lowcomm.v1.Gossip/Exchange", "bidi"),
]
REQUEST_TYPES = {
    "/lowcomm.v1.Averaging/JoinGroup": averaging_pb2.JoinRequest,
    "/lowcomm.v1.Averaging/ReportShards": averaging_pb2.ShardReport,
    "/lowcomm.v1.StateTransfer/GetStateInfo": state_pb2.StateInfoRequest,
    "/lowcomm.v1.NodeInfo/GetStatus": node_pb2.StatusRequest,
    "/lowcomm.v1.StateTransfer/DownloadState": state_pb2.StateRequest,
    "/lowcomm.v1.Averaging/Reduce": averaging_pb2.ReduceMessage,
    "/lowcomm.v1.Gossip/Exchange": gossip_pb2.GossipMessage,
}


def parses(path: str, raw: bytes) -> bool:
    try:
        REQUEST_TYPES[path].FromString(raw)
        return True
    except Exception:  # noqa: BLE001 - DecodeError and friends
        return False


@settings(FUZZ, max_examples=60)
@given(method=st.sampled_from(UNARY_METHODS), raw=st.binary(max_size=200))
def test_undecodable_protobuf_bytes(node, method, raw):
    """Arbitrary bytes as the serialized request of every method: a status the server chose or
    grpc's own refusal of an undecodable message, and the node stays healthy."""
    path, kind = method
    ident = lambda b: b  # noqa: E731

    async def scenario():
        if kind == "unary":
            try:
                await node.channel.unary_unary(path, ident, ident)(raw, timeout=5)
                code = S.OK
            except grpc.aio.AioRpcError as err:
                code = err.code()
        elif kind == "stream":
            code, _ = await read_all(node.channel.unary_stream(path, ident, ident)(raw, timeout=5))
        else:
            call = node.channel.stream_stream(path, ident, ident)(timeout=5)
            reader = asyncio.ensure_future(read_all(call))
            await write_all(call, [raw])
            code, _ = await reader
        # Bytes that are not a protobuf message of the method's type are refused as such
        # (protocol/decode.py); everything that parses gets one of the handlers' statuses.
        if parses(path, raw):
            assert code not in NEVER, (path, raw, code)
        else:
            assert code == S.INVALID_ARGUMENT, (path, raw, code)
        node.registry.close()
        await node.healthy()

    node.run(scenario())


# -- 2. no memory for a declared size that never arrives -----------------------------------------


def test_mismatched_huge_declared_size_is_refused_before_allocation(node):
    async def scenario():
        accs = node.open_round()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for numel, payload_bytes in [(64, 2**40), (2**40, 4 * 2**40), (64, 2**62), (64, -2**40)]:
                before = len(node.rejections)
                call = node.averaging.Reduce(timeout=10)
                reader = asyncio.ensure_future(read_all(call))
                await write_all(call, [averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                    group_id=GID, shard_index=0, sender_peer_id="peer-01", codec=FP32.id, numel=numel,
                    payload_bytes=payload_bytes))])
                code, _ = await reader
                assert code == S.INVALID_ARGUMENT
                assert node.rejections[before:] == [("length", "peer-01")]
            assert tracemalloc.get_traced_memory()[1] - base < 8 * 2**20  # far below any declared size
        finally:
            tracemalloc.stop()
        assert accs[0].announced == set() and set(accs[0].contributions) == {NODE}
        node.registry.close()
        await node.healthy()

    node.run(scenario())


def test_valid_declared_size_then_stall_is_cut_and_released(node):
    """The only allocation: a header whose payload_bytes is the shard's exact encoded size in an
    open group. A sender that declares it and stalls is cut by the round's limit (not the
    client's far deadline) and the buffer goes back."""
    numel = 4 * 2**20  # 16 MiB of fp32
    reduce_timeout = 0.4

    async def scenario():
        (acc,) = node.open_round(reduce_timeout=reduce_timeout, bounds=[0, numel])
        declared = FP32.encoded_size(numel)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            call = node.averaging.Reduce(timeout=60)
            reader = asyncio.ensure_future(read_all(call))
            started = time.monotonic()
            await call.write(averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                group_id=GID, shard_index=0, sender_peer_id="peer-02", codec=FP32.id, numel=numel,
                payload_bytes=declared)))
            await call.write(averaging_pb2.ReduceMessage(chunk=b"\0" * 1024))
            while acc.active_streams == 0 or "peer-02" not in acc.announced:
                await asyncio.sleep(0.01)
            held = tracemalloc.get_traced_memory()[0] - base
            assert held >= declared  # the buffer exists while the stream is live...
            code, _ = await asyncio.wait_for(reader, 10)  # ...and the stream never sends the rest
            elapsed = time.monotonic() - started
            for _ in range(100):  # the server's handler task ends just after the status went out
                gc.collect()
                after = tracemalloc.get_traced_memory()[0] - base
                if after < declared // 4 and acc.active_streams == 0:
                    break
                await asyncio.sleep(0.02)
        finally:
            tracemalloc.stop()
        assert code == S.DEADLINE_EXCEEDED
        assert elapsed < reduce_timeout * 1.5 + 3.0
        assert after < declared // 4, after  # released
        assert acc.active_streams == 0 and "peer-02" not in acc.expected  # the owner stops waiting
        assert set(acc.contributions) == {NODE}
        node.registry.close()
        await node.healthy()

    node.run(scenario())


# -- 3. raw bytes against the port ---------------------------------------------------------------

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">I", n)[1:] + bytes([kind, flags]) + struct.pack(">I", stream & 0x7FFFFFFF) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, no Huffman (names/values < 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_request(path: bytes, length_prefix: int, body: bytes) -> bytes:
    headers = b"".join(literal(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path), (b":authority", b"fuzz"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    return (PREFACE + frame(4, 0, 0, b"") + frame(1, 0x4, 1, headers)
            + frame(0, 0, 1, b"\x00" + struct.pack(">I", length_prefix) + body))


def raw_payloads(count: int) -> list[bytes]:
    rng = random.Random(1234)
    paths = [p.encode() for p, _ in UNARY_METHODS] + [b"/nope", b"/" + b"a" * 100]
    out = []
    for i in range(count):
        kind = i % 3
        if kind == 0:
            out.append(rng.randbytes(rng.randint(0, 2000)))
        elif kind == 1:
            frames = [frame(rng.randint(0, 12), rng.randint(0, 255), rng.randint(0, 2**31 - 1),
                            rng.randbytes(rng.randint(0, 64)),
                            length=rng.choice([None, None, rng.randint(0, 2**24 - 1)]))
                      for _ in range(rng.randint(1, 6))]
            out.append(PREFACE + b"".join(frames))
        else:
            length = rng.choice([2**32 - 1, 2**31, 64 * 2**20, 5 * 2**20])
            out.append(grpc_request(rng.choice(paths), length, rng.randbytes(rng.randint(0, 256))))
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_raw_bytes_against_the_port(node):
    async def poke(payload: bytes) -> None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", node.port), 2)
        except (OSError, TimeoutError):
            return
        try:
            writer.write(payload)
            await asyncio.wait_for(writer.drain(), 0.5)
            await asyncio.wait_for(reader.read(65536), 0.3)
        except (OSError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 0.5)
            except (OSError, TimeoutError, ConnectionError):
                pass

    async def scenario():
        payloads = raw_payloads(210)
        rss_before = rss_bytes()
        for start in range(0, len(payloads), 30):
            await asyncio.gather(*(poke(p) for p in payloads[start:start + 30]))
            await node.healthy()
        # Huge declared gRPC message lengths (up to 4 GiB) never became allocations.
        assert rss_bytes() - rss_before < 256 * 2**20

        # The node still works: a valid Reduce contribution enters its accumulator...
        accs = node.open_round()
        values = torch.linspace(-1, 1, 64)
        call = node.averaging.Reduce(timeout=10)
        reader = asyncio.ensure_future(read_all(call))
        await write_all(call, [
            averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(
                group_id=GID, shard_index=0, sender_peer_id="peer-01", codec=FP32.id, numel=64,
                payload_bytes=256)),
            averaging_pb2.ReduceMessage(chunk=FP32.encode(values))])
        while "peer-01" not in accs[0].contributions:
            await asyncio.sleep(0.01)
        average = await accs[0].finalize()
        code, messages = await reader
        assert code == S.OK and sorted(messages[0].result.contributors) == [NODE, "peer-01"]
        assert torch.allclose(average, (values + 0.5) / 2)
        node.registry.close()

        # ...and a follower can join the group it leads.
        async def expected():
            return {NODE, "peer-05"}

        leading = asyncio.ensure_future(node.matchmaker.form_group(21, 1.0, 0.0, expected, timeout=3.0))
        await asyncio.sleep(0)
        hello = node.identity.hello()
        hello.peer_id = "peer-05"
        response = await node.averaging.JoinGroup(averaging_pb2.JoinRequest(
            hello=hello, step=21, address="127.0.0.1:1", weight=1.0), timeout=5)
        group = await leading
        node.matchmaker._round = None
        assert response.group == group and len(group.members) == 2
        await node.healthy()

    node.run(scenario(), limit=60)
