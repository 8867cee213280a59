"""Chunked, hashed state download from several donors over real gRPC servers (protocol/state.py)."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import grpc
import pytest
import torch
from grpc_health.v1 import health

from lowcomm.node.config import load_config
from lowcomm.protocol import state
from lowcomm.protocol.auth import RunAuth, ServerAuthInterceptor
from lowcomm.protocol.handshake import Identity, IncompatiblePeer
from lowcomm.protocol.rpc import ChannelPool, NodeInfoServicer, StateServicer, create_server
from lowcomm.protocol.state import (
    Donor,
    Snapshot,
    StateDonor,
    StateError,
    download_state,
    params_sha256,
    parse_blob,
)

NUMEL = 3_000_000  # a 24 MB blob
STEP = 7
CONFIG = load_config(environ={})
OTHER_CONFIG = load_config(overrides=["sync.codec=int4"], environ={})


def identity(peer_id: str, config=CONFIG) -> Identity:
    return Identity(peer_id, config.run_fingerprint(), config.run_config_json())


def make_state(numel: int = NUMEL, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch):
    # Many ranges and several chunks per range, so that parallelism and retries are exercised.
    monkeypatch.setattr(state, "RANGE_BYTES", 1 << 20)
    monkeypatch.setattr(state, "CHUNK_BYTES", 256 << 10)


def run(coro, limit: float = 20.0):
    async def bounded():
        async with asyncio.timeout(limit):
            return await coro
    return asyncio.run(bounded())


class FlippingDonor(StateDonor):
    """Corrupts one byte of every chunk; ``rehash`` also recomputes the chunk's hash (a liar)."""

    def __init__(self, *args, rehash: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rehash = rehash
        self.served = 0

    def chunks(self, step, offset, length):
        for chunk in super().chunks(step, offset, length):
            data = bytearray(chunk.data)
            data[len(data) // 2] ^= 0x01
            chunk.data = bytes(data)
            if self.rehash:
                chunk.sha256 = hashlib.sha256(chunk.data).hexdigest()
            self.served += 1
            yield chunk


class CountingDonor(StateDonor):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ranges = 0

    def chunks(self, step, offset, length):
        self.ranges += 1
        yield from super().chunks(step, offset, length)


class HangingServicer(StateServicer):
    """Serves one range, then hangs on the next one until the server is stopped."""

    def __init__(self, donor: StateDonor) -> None:
        super().__init__(donor)
        self.requests = 0
        self.hanging = asyncio.Event()

    async def DownloadState(self, request, context):
        self.requests += 1
        if self.requests >= 2:
            self.hanging.set()
            await asyncio.Event().wait()  # cancelled when the server stops
        async for chunk in super().DownloadState(request, context):
            yield chunk


class Swarm:
    """Donor servers on 127.0.0.1:0 and the joiner's channels."""

    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []
        self.donors: list[Donor] = []
        self.channels = ChannelPool()
        self.numel: int | None = None  # the run's model size: the first donor's snapshot

    async def add(self, donor: StateDonor, servicer: StateServicer | None = None,
                  interceptors: list[grpc.aio.ServerInterceptor] | None = None) -> Donor:
        async def no_status():
            raise NotImplementedError

        server, port = create_server("127.0.0.1", 0, None, servicer or StateServicer(donor),
                                     NodeInfoServicer(no_status), health.aio.HealthServicer(),
                                     interceptors=interceptors)
        await server.start()
        self.servers.append(server)
        if self.numel is None and donor.latest() is not None:
            self.numel = donor.latest().numel
        entry = Donor(donor.identity.peer_id, f"127.0.0.1:{port}")
        self.donors.append(entry)
        return entry

    async def download(self, expected_sha: str | None, step: int = STEP, joiner: Identity | None = None,
                       donors: list[Donor] | None = None):
        return await download_state(self.donors if donors is None else donors, step, expected_sha,
                                    joiner or identity("joiner"), self.channels, timeout=10.0,
                                    expected_numel=self.numel)

    async def close(self) -> None:
        await asyncio.gather(*(s.stop(grace=None) for s in self.servers))
        await self.channels.close()


def donor_with(snapshot: Snapshot, peer_id: str, cls=StateDonor, **kwargs) -> StateDonor:
    donor = cls(identity(peer_id), **kwargs)
    donor.publish(snapshot)
    return donor


def assert_same_state(got, params, momentum, step=STEP):
    assert got.step == step
    assert torch.equal(got.params, params)
    assert torch.equal(got.momentum, momentum)
    assert params_sha256(got.params) == params_sha256(params)


# -- snapshot and blob --------------------------------------------------------------------------


def test_snapshot_round_trip_and_malformed_blobs():
    params, momentum = make_state(1000)
    snap = Snapshot.build(3, params, momentum)
    step, p, m = parse_blob(snap.blob)
    assert step == 3 and torch.equal(p, params) and torch.equal(m, momentum)
    assert snap.params_sha256 == params_sha256(params)
    assert snap.state_sha256 == hashlib.sha256(snap.blob).hexdigest()
    for bad in (snap.blob[:10], snap.blob[:-4], b"XXXX" + snap.blob[4:], snap.blob + b"\0" * 8):
        with pytest.raises(StateError):
            parse_blob(bad)


def test_donor_keeps_the_last_two_snapshots_and_checks_ranges():
    params, momentum = make_state(1000)
    donor = StateDonor(identity("d"))
    assert donor.info().step == -1
    for step in (1, 2, 3):
        donor.publish(Snapshot.build(step, params + step, momentum))
    assert donor.info().step == 3
    with pytest.raises(StateError, match="step 1 is not held"):
        list(donor.chunks(1, 0, 0))
    blob = b"".join(c.data for c in donor.chunks(2, 0, 0))
    assert parse_blob(blob)[0] == 2
    with pytest.raises(StateError, match="outside"):
        list(donor.chunks(3, 0, len(blob) + 1))
    with pytest.raises(StateError, match="outside"):
        list(donor.chunks(3, -1, 10))


# -- downloads ----------------------------------------------------------------------------------


def test_parallel_download_from_three_donors_is_bit_identical():
    params, momentum = make_state()
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        donors = [donor_with(snapshot, f"donor-{i}", CountingDonor) for i in range(3)]
        try:
            for d in donors:
                await swarm.add(d)
            got = await swarm.download(snapshot.params_sha256)
            assert_same_state(got, params, momentum)
            assert got.donors_used == 3
            assert got.bytes_downloaded == len(snapshot.blob)
            ranges = [d.ranges for d in donors]
            assert sum(ranges) == -(-len(snapshot.blob) // state.RANGE_BYTES)
            assert all(r > 0 for r in ranges), ranges  # every donor served a share
        finally:
            await swarm.close()

    run(scenario())


def test_download_without_expected_hash():
    params, momentum = make_state(10_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            await swarm.add(donor_with(snapshot, "donor-0"))
            assert_same_state(await swarm.download(None), params, momentum)
        finally:
            await swarm.close()

    run(scenario())


@pytest.mark.parametrize("rehash", [False, True], ids=["bad-chunk-hash", "lying-donor"])
def test_corrupting_donor_is_routed_around(rehash, caplog):
    params, momentum = make_state(1_000_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        bad = donor_with(snapshot, "donor-bad", FlippingDonor, rehash=rehash)
        try:
            await swarm.add(bad)
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}"))
            with caplog.at_level(logging.WARNING, logger=state.log.name):
                got = await swarm.download(snapshot.params_sha256)
            assert_same_state(got, params, momentum)
            assert bad.served > 0  # it was asked, and its bytes were thrown away
            if rehash:  # its chunks looked fine: only the whole blob's hash caught it
                assert "does not match its announced hash" in caplog.text
            else:
                assert "donor-bad" in caplog.text and "hash does not match" in caplog.text
        finally:
            await swarm.close()

    run(scenario())


def test_majority_state_wins_over_an_odd_donor():
    """Three donors agree on the params hash; one serves another momentum. The joiner takes the
    blob the majority serves, even when the odd donor answers first."""
    params, momentum = make_state(200_000)
    snapshot = Snapshot.build(STEP, params, momentum)
    odd = Snapshot.build(STEP, params, torch.zeros_like(momentum))
    assert odd.params_sha256 == snapshot.params_sha256 and odd.state_sha256 != snapshot.state_sha256

    async def scenario():
        swarm = Swarm()
        odd_answered = asyncio.Event()
        odd_entry = await swarm.add(donor_with(odd, "donor-odd"))
        for i in range(2):
            await swarm.add(donor_with(snapshot, f"donor-{i}"))

        class Gate(grpc.aio.UnaryUnaryClientInterceptor):
            """The honest donors' GetStateInfo starts only after the odd donor's answer arrived."""

            def __init__(self, address: str) -> None:
                self.address = address

            async def intercept_unary_unary(self, continuation, details, request):
                if details.method.endswith(b"/GetStateInfo"):
                    if self.address == odd_entry.address:
                        call = await continuation(details, request)
                        await call
                        odd_answered.set()
                        return call
                    await odd_answered.wait()
                return await continuation(details, request)

        channels: list[grpc.aio.Channel] = []

        def channel_for(address: str) -> grpc.aio.Channel:
            channel = grpc.aio.insecure_channel(address, interceptors=[Gate(address)])
            channels.append(channel)
            return channel

        try:
            got = await download_state(swarm.donors, STEP, snapshot.params_sha256, identity("joiner"), channel_for, 10.0,
                                       expected_numel=snapshot.numel)
            assert_same_state(got, params, momentum)
            assert got.donors_used == 2
        finally:
            for channel in channels:
                await channel.close()
            await swarm.close()

    run(scenario())


def test_donor_stopping_mid_download_is_resumed_from_the_others():
    params, momentum = make_state(1_000_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        leaving = HangingServicer(donor_with(snapshot, "donor-leaving"))
        try:
            await swarm.add(leaving.donor, leaving)
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}"))
            download = asyncio.create_task(swarm.download(snapshot.params_sha256))
            await leaving.hanging.wait()  # it served a range and is stuck inside the next one
            await swarm.servers[0].stop(grace=None)
            got = await download
            assert_same_state(got, params, momentum)
            assert leaving.requests >= 2
        finally:
            await swarm.close()

    run(scenario())


def test_all_donors_failing_raises_state_error():
    params, momentum = make_state(100_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            for i in range(3):
                await swarm.add(donor_with(snapshot, f"donor-{i}", FlippingDonor))
            with pytest.raises(StateError, match="every donor failed"):
                await swarm.download(snapshot.params_sha256)
        finally:
            await swarm.close()

    run(scenario())


def test_all_donors_lying_raises_state_error():
    params, momentum = make_state(100_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}", FlippingDonor, rehash=True))
            with pytest.raises(StateError, match="does not match"):
                await swarm.download(snapshot.params_sha256)
        finally:
            await swarm.close()

    run(scenario())


def test_unreachable_donors_raise_state_error():
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}"))
            await asyncio.gather(*(s.stop(grace=None) for s in swarm.servers))
            with pytest.raises(StateError, match="no donor holds step"):
                await swarm.download(snapshot.params_sha256)
        finally:
            await swarm.close()

    run(scenario())


def test_wrong_expected_hash_or_step_raises_state_error():
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            await swarm.add(donor_with(snapshot, "donor-0"))
            with pytest.raises(StateError, match="params hash"):
                await swarm.download("0" * 64)
            with pytest.raises(StateError, match=f"step {STEP + 1}"):
                await swarm.download(snapshot.params_sha256, step=STEP + 1)
        finally:
            await swarm.close()

    run(scenario())


def test_donors_of_another_run_config_raise_incompatible_peer(caplog):
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}"))
            joiner = identity("joiner", OTHER_CONFIG)
            with pytest.raises(IncompatiblePeer) as info:
                await swarm.download(snapshot.params_sha256, joiner=joiner)
            return str(info.value)
        finally:
            await swarm.close()

    with caplog.at_level(logging.WARNING):
        message = run(scenario())
    assert "donor-0" in message and "[sync] codec" in message
    assert "'int4'" in message and "'int8'" in message
    # The donors log the refusal too, naming the joiner.
    assert any("refused a state request from joiner" in r.getMessage() for r in caplog.records)


def test_donors_of_a_secret_run_refusing_a_node_without_the_secret_raise_incompatible_peer():
    """A node without the run secret reads a secret swarm's records, and every donor refuses it
    (UNAUTHENTICATED): that is final, not a download failure to retry after every inner phase
    (the node then never finished a round, --max-rounds or not)."""
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            for i in range(2):
                await swarm.add(donor_with(snapshot, f"donor-{i}"),
                                interceptors=[ServerAuthInterceptor(RunAuth(b"the run's secret, 16+ bytes"))])
            with pytest.raises(IncompatiblePeer) as info:
                await swarm.download(snapshot.params_sha256)
            return str(info.value)
        finally:
            await swarm.close()

    message = run(scenario())
    assert "donor-0" in message and "donor-1" in message and "--run-secret-file" in message


def test_one_compatible_donor_is_enough():
    """A refusing donor among compatible ones is skipped, not fatal."""
    params, momentum = make_state(10_000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            foreign = StateDonor(identity("donor-foreign", OTHER_CONFIG))
            foreign.publish(snapshot)
            await swarm.add(foreign)
            await swarm.add(donor_with(snapshot, "donor-0"))
            assert_same_state(await swarm.download(snapshot.params_sha256), params, momentum)
        finally:
            await swarm.close()

    run(scenario())


def test_refusal_plus_unreachable_donor_is_still_incompatible():
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            await swarm.add(donor_with(snapshot, "donor-0"))
            gone = await swarm.add(donor_with(snapshot, "donor-gone"))
            await swarm.servers[1].stop(grace=None)
            with pytest.raises(IncompatiblePeer):
                await swarm.download(snapshot.params_sha256, joiner=identity("joiner", OTHER_CONFIG),
                                     donors=[swarm.donors[0], gone])
        finally:
            await swarm.close()

    run(scenario())


def test_a_downloader_that_stops_reading_does_not_keep_others_out():
    """One slot, a short lease: a stream whose reader stalls stops counting after its lease, so
    the next joiner is served in full while the stalled stream is still open."""
    params, momentum = make_state()
    snap = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            donor = await swarm.add(donor_with(snap, "d0", max_concurrent=1, lease_seconds=0.5, wait_seconds=10))
            stub = state.state_pb2_grpc.StateTransferStub(swarm.channels(donor.address))
            hello = identity("slow").hello()
            stalled = stub.DownloadState(state.state_pb2.StateRequest(hello=hello, step=STEP, offset=0, length=0))
            await stalled.read()  # one chunk, then nothing: it keeps the stream (and once, the slot)
            got = await swarm.download(snap.params_sha256)
            assert_same_state(got, params, momentum)
            stalled.cancel()
        finally:
            await swarm.close()

    run(scenario())


class OversizeDonor(CountingDonor):
    """Announces the published step and params hash, but a state far larger than the run's model."""

    def __init__(self, *args, declared_numel: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.declared_numel = declared_numel

    def info(self):
        info = super().info()
        info.numel = self.declared_numel
        info.total_bytes = state.state_bytes(self.declared_numel)
        return info


def test_a_donor_declaring_an_oversize_state_is_refused_before_anything_is_allocated(caplog):
    params, momentum = make_state(1000)
    snapshot = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            honest = await swarm.add(donor_with(snapshot, "honest"))
            liar = donor_with(snapshot, "liar", OversizeDonor, declared_numel=50_000_000)  # a 400 MB claim
            liar_entry = await swarm.add(liar)
            with caplog.at_level(logging.WARNING, logger="lowcomm.protocol.state"):
                assert_same_state(await swarm.download(snapshot.params_sha256), params, momentum)
            assert liar.ranges == 0, "the oversize donor was asked for its state"
            assert "declares 50000000 params" in caplog.text
            # Alone, the liar makes the download fail without a single range asked (or allocated).
            with pytest.raises(StateError, match="model size"):
                await swarm.download(snapshot.params_sha256, donors=[liar_entry])
            assert liar.ranges == 0 and honest in swarm.donors
        finally:
            await swarm.close()

    run(scenario())


def test_parse_blob_checks_the_expected_size():
    params, momentum = make_state(1000)
    blob = Snapshot.build(STEP, params, momentum).blob
    assert parse_blob(bytearray(blob), expected_numel=1000)[0] == STEP
    with pytest.raises(StateError, match="the run's model has 999"):
        parse_blob(blob, expected_numel=999)


# -- slow links ---------------------------------------------------------------------------------


class SlowServicer(StateServicer):
    """Sends each chunk ``pause`` seconds after the last; with ``stall_after`` chunks of a range,
    stops sending (holds the stream) until the server stops. Records the ranges asked for."""

    def __init__(self, donor: StateDonor, pause: float, stall_after: int | None = None) -> None:
        super().__init__(donor)
        self.pause, self.stall_after = pause, stall_after
        self.asked: list[tuple[int, int]] = []

    async def DownloadState(self, request, context):
        self.asked.append((request.offset, request.length))
        sent = 0
        async for chunk in super().DownloadState(request, context):
            if self.stall_after is not None and sent == self.stall_after:
                await asyncio.Event().wait()
            await asyncio.sleep(self.pause)
            sent += 1
            yield chunk


def test_a_range_that_keeps_coming_is_not_cut_by_a_deadline_and_progress_is_told():
    # A 16 MiB range at 2 Mbit/s takes 67 s: a 60 s deadline on the whole range cut every one,
    # and a joiner on such a link could never get in. Here a range takes 4 x 0.15 s, the wait
    # for each chunk is bounded by 0.4 s.
    params, momentum = make_state(300_000)  # 2.4 MB: 3 ranges of 4 chunks
    snap = Snapshot.build(STEP, params, momentum)
    told: list[tuple[int, int]] = []

    async def scenario():
        swarm = Swarm()
        try:
            slow = SlowServicer(donor_with(snap, "slow"), pause=0.15)
            await swarm.add(slow.donor, slow)
            got = await download_state(swarm.donors, STEP, snap.params_sha256, identity("joiner"), swarm.channels,
                                       0.4, expected_numel=snap.numel, progress=lambda r, t: told.append((r, t)))
            assert_same_state(got, params, momentum)
        finally:
            await swarm.close()

    run(scenario())
    total = len(snap.blob)
    assert told[-1] == (total, total) and [r for r, _ in told] == sorted(r for r, _ in told)


def test_a_range_whose_donor_stalls_is_taken_up_by_another_from_its_first_missing_byte():
    params, momentum = make_state(300_000)
    snap = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            stalling = SlowServicer(donor_with(snap, "stalling"), pause=0.0, stall_after=2)
            steady = SlowServicer(donor_with(snap, "steady"), pause=0.0)
            await swarm.add(stalling.donor, stalling)
            await swarm.add(steady.donor, steady)
            got = await download_state(swarm.donors, STEP, snap.params_sha256, identity("joiner"), swarm.channels,
                                       0.5, expected_numel=snap.numel)
            assert_same_state(got, params, momentum)
            return stalling.asked, steady.asked
        finally:
            await swarm.close()

    stalled, resumed = run(scenario())
    chunk = state.CHUNK_BYTES
    # Every range the stalling donor was asked for is asked again from the steady one from the
    # byte after its two chunks, not from its start.
    cut = [(offset, length) for offset, length in stalled if length > 2 * chunk]
    assert cut
    for offset, length in cut:
        assert (offset + 2 * chunk, length - 2 * chunk) in resumed


def test_a_donor_keeps_the_snapshot_a_download_reads_one_at_most():
    now = [0.0]
    params, momentum = make_state(1000)
    donor = StateDonor(identity("d"), clock=lambda: now[0])
    for step in (1, 2):
        donor.publish(Snapshot.build(step, params + step, momentum))
    next(donor.chunks(1, 0, 0))  # a joiner reads step 1
    for step in (3, 4):
        now[0] += 10.0
        donor.publish(Snapshot.build(step, params + step, momentum))
    assert next(donor.chunks(1, 0, 0)).data  # still served: a download reads it
    with pytest.raises(StateError, match="step 2 is not held"):  # one pinned snapshot, no more
        next(donor.chunks(2, 0, 0))
    now[0] += StateDonor.PIN_SECONDS
    donor.publish(Snapshot.build(5, params + 5, momentum))
    with pytest.raises(StateError, match=r"step 1 is not held here \(have \[4, 5\]\)"):
        next(donor.chunks(1, 0, 0))


def test_a_slow_reader_past_its_lease_goes_on_while_nobody_else_needs_the_slot():
    # Ended at its lease, a joiner on a 1.5 Mbit/s link was told that "the slot went to another
    # downloader" when there was none, and lost its download.
    params, momentum = make_state(300_000)
    snap = Snapshot.build(STEP, params, momentum)

    async def scenario():
        swarm = Swarm()
        try:
            # Two slots: the joiner's own two ranges in flight. A range takes 4 x 0.1 s, its lease 0.2 s.
            slow = SlowServicer(donor_with(snap, "d0", max_concurrent=2, lease_seconds=0.2), pause=0.1)
            await swarm.add(slow.donor, slow)
            got = await download_state(swarm.donors, STEP, snap.params_sha256, identity("joiner"),
                                       swarm.channels, 5.0, expected_numel=snap.numel)
            assert_same_state(got, params, momentum)
        finally:
            await swarm.close()

    run(scenario())
