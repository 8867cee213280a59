"""Global state snapshots (protocol/snapshot.py), served by donors and downloaded by joiners.

Donors keep the last two committed snapshots as immutable bytes; a joiner fetches byte ranges
from several donors in parallel, checks every chunk's hash, the whole blob's hash, and finally
that θ_global hashes to what the swarm published in the DHT. In runs that sync the inner
optimizer's state the blob holds it too, and a joiner refuses a donor that serves another layout.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import grpc
import torch

from ._pb.lowcomm.v1 import state_pb2, state_pb2_grpc
from .channels import STREAM_CHUNK_BYTES
from .handshake import Identity, IncompatiblePeer
from .missed_rounds import RoundLog
from .slots import DownloadSlots
# The blob format; importers of these names from here (most of the code base) keep working.
from .snapshot import (  # noqa: F401
    FORMAT_VERSION,
    MAGIC,
    OPTIMIZER_FORMAT_VERSION,
    BlobContents,
    OptimizerStates,
    Snapshot,
    StateError,
    describe_layout,
    params_sha256,
    parse_blob,
    read_blob,
    state_bytes,
    tensor_bytes,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = STREAM_CHUNK_BYTES
RANGE_BYTES = 16 * 2**20  # one download request; several run in parallel across donors


class StateDonor:
    """Serves the last two committed snapshots, and the averages of the last rounds for peers
    that missed them (missed_rounds.py); limits how many downloads run at once.

    A snapshot older than those two stays while a download reads it (a range asked for within
    ``PIN_SECONDS``), one such at most: a joiner on a slow link asks for its ranges over minutes,
    and once the swarm had moved two steps on, every range it still lacked was refused ("not held
    here") and the whole download was lost."""

    KEEP = 2
    PIN_SECONDS = 120.0

    def __init__(self, identity: Identity, max_concurrent: int = 4, lease_seconds: float = 120.0,
                 wait_seconds: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = identity
        self._snapshots: dict[int, Snapshot] = {}
        self._read_at: dict[int, float] = {}  # step -> when a range of it was last asked for
        self._clock = clock
        self.rounds = RoundLog()
        self._slots = DownloadSlots(max_concurrent, lease_seconds, wait_seconds)

    def publish(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.step] = snapshot
        now = self._clock()
        older = sorted(self._snapshots)[:-self.KEEP]
        being_read = [step for step in older if now - self._read_at.get(step, -float("inf")) < self.PIN_SECONDS]
        pinned = set(being_read[-1:])  # the newest one a download reads: bounded memory
        for step in older:
            if step not in pinned:
                del self._snapshots[step]
                self._read_at.pop(step, None)

    def latest(self) -> Snapshot | None:
        return self._snapshots[max(self._snapshots)] if self._snapshots else None

    def info(self) -> state_pb2.StateInfo:
        snap = self.latest()
        if snap is None:
            return state_pb2.StateInfo(step=-1)
        return state_pb2.StateInfo(step=snap.step, params_sha256=snap.params_sha256,
                                   state_sha256=snap.state_sha256, total_bytes=len(snap.blob), numel=snap.numel)

    def chunks(self, step: int, offset: int, length: int) -> Iterator[state_pb2.StateChunk]:
        snap = self._snapshots.get(step)
        if snap is None:
            raise StateError(f"step {step} is not held here (have {sorted(self._snapshots)})")
        self._read_at[step] = self._clock()
        end = len(snap.blob) if length == 0 else offset + length
        if offset < 0 or length < 0 or offset > end or end > len(snap.blob):  # offset past the end with length 0
            raise StateError(f"range [{offset}, {end}) outside the {len(snap.blob)}-byte state")
        view = memoryview(snap.blob)
        for start in range(offset, end, CHUNK_BYTES):
            data = bytes(view[start:min(start + CHUNK_BYTES, end)])
            yield state_pb2.StateChunk(offset=start, data=data, sha256=hashlib.sha256(data).hexdigest())

    @property
    def slots(self) -> DownloadSlots:
        return self._slots


@dataclass(frozen=True)
class Donor:
    peer_id: str
    address: str


@dataclass
class DownloadedState:
    step: int
    params: torch.Tensor
    momentum: torch.Tensor
    bytes_downloaded: int
    donors_used: int
    optimizer: OptimizerStates | None = None  # runs that sync the inner optimizer's state


async def download_state(
    donors: list[Donor],
    expected_step: int,
    expected_params_sha256: str | None,
    identity: Identity,
    channel_for,
    timeout: float,
    *,
    expected_numel: int,
    expected_states: tuple[str, ...] = (),
    progress: Callable[[int, int], None] | None = None,
) -> DownloadedState:
    """Fetch the snapshot of ``expected_step`` from ``donors`` in parallel ranges.

    ``channel_for(address)`` returns a grpc.aio channel. A range that fails on one donor is
    retried on the next from the first byte it lacks; the result is checked against
    ``expected_params_sha256``. ``timeout`` bounds each call for the state's description and
    the wait for each chunk of a range, never a whole range: a slow link takes as long as it
    needs while bytes keep coming (a 16 MiB range at 2 Mbit/s takes 67 s, and every range ran
    out of a 60 s deadline, so such a joiner could never get in). ``progress(received, total)``
    is called as bytes arrive.

    ``expected_numel`` is the parameter count the run's config implies (the joiner's own model):
    a donor that declares another size is not used, so nothing a donor says makes this node
    allocate more than ``state_bytes(expected_numel, expected_states)`` for the blob.
    ``expected_states``: the inner optimizer's states this run serves with its snapshots (state
    sync), in their order; ``()`` for a run without state sync (format 1).

    Raises ``IncompatiblePeer`` when every donor that answered refused this node's Hello
    (another protocol version or run config), its credentials (a secret run, and this node has
    no or another run secret) or serves the state in another layout (another lowcomm version),
    and ``StateError`` for everything else.
    """
    hello = identity.hello()
    infos: list[tuple[Donor, state_pb2.StateInfo]] = []
    refusals: list[str] = []  # donors that refused our Hello or our token (FAILED_PRECONDITION, UNAUTHENTICATED)
    answered = 0  # donors that answered GetStateInfo at all
    expected_bytes = state_bytes(expected_numel, expected_states)

    async def ask(donor: Donor) -> None:
        nonlocal answered
        stub = state_pb2_grpc.StateTransferStub(channel_for(donor.address))
        try:
            info = await stub.GetStateInfo(state_pb2.StateInfoRequest(hello=hello), timeout=min(10.0, timeout))
        except grpc.aio.AioRpcError as err:
            # FAILED_PRECONDITION is used only for incompatibility. UNAUTHENTICATED: a node without
            # the secret of a secret run sees its (signed) records but is refused by every donor;
            # retried, it would download again after every phase and never finish a round.
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                answered += 1
                refusals.append(f"peer {donor.peer_id} at {donor.address} refused this node: {err.details()}")
            log.warning("state donor %s at %s did not answer: %s", donor.peer_id, donor.address, err.details())
            return
        answered += 1
        if info.step != expected_step or expected_params_sha256 not in (None, info.params_sha256):
            return
        if info.numel == expected_numel and info.total_bytes != expected_bytes:
            # Our model, another layout: a peer of another lowcomm version (one that serves no
            # optimizer state in a state-sync run, or serves it when we expect none). Refused with
            # the reason: mixing them would leave this node with another optimizer state than its
            # group's, silently.
            if info.total_bytes == state_bytes(expected_numel):
                served = describe_layout(())
            elif info.total_bytes > state_bytes(expected_numel):
                served = f"format {OPTIMIZER_FORMAT_VERSION} or later, with optimizer state"
            else:
                served = "an unknown layout"
            refusals.append(f"peer {donor.peer_id} at {donor.address} serves a {info.total_bytes}-byte state "
                            f"({served}); "
                            f"this node expects {describe_layout(expected_states)}, {expected_bytes} bytes: "
                            f"the peers run lowcomm versions whose state formats differ")
            log.warning("state donor %s: %s", donor.peer_id, refusals[-1])
            return
        if info.numel != expected_numel or info.total_bytes != expected_bytes:
            # Checked before anything is allocated: a donor's declaration alone must never size
            # our buffers (a liar or a buggy peer could ask for any amount of memory).
            log.warning("state donor %s at %s declares %d params in %d bytes; the run's model has %d params "
                        "(%d bytes): not used", donor.peer_id, donor.address, info.numel, info.total_bytes,
                        expected_numel, expected_bytes)
            return
        infos.append((donor, info))

    await asyncio.gather(*(ask(d) for d in donors))
    if not infos:
        if refusals and len(refusals) == answered:
            raise IncompatiblePeer("; ".join(refusals))
        raise StateError(f"no donor holds step {expected_step} with the published params hash "
                         f"and the run's model size ({expected_numel} params)"
                         + "".join(f"; {refusal}" for refusal in refusals))
    # Donors may agree on the params hash but still serve blobs that differ (another momentum);
    # use the blob most donors serve (ties: the first to answer), and only the donors serving it.
    by_state: dict[str, int] = {}
    for _, info in infos:
        by_state[info.state_sha256] = by_state.get(info.state_sha256, 0) + 1
    reference = next(info for _, info in infos if by_state[info.state_sha256] == max(by_state.values()))
    usable = [d for d, info in infos if info.state_sha256 == reference.state_sha256]
    total = reference.total_bytes
    downloaded = 0

    async def fetch(donor: Donor, blob: bytearray, start: int, length: int) -> int:
        """Bytes of the range received, from its start on (``length`` when all of it came)."""
        nonlocal downloaded
        stub = state_pb2_grpc.StateTransferStub(channel_for(donor.address))
        request = state_pb2.StateRequest(hello=hello, step=expected_step, offset=start, length=length)
        received = 0
        call = stub.DownloadState(request)  # no deadline: the wait for each chunk is bounded instead
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        chunk = await call.read()
                except TimeoutError:
                    raise StateError(f"no data for {timeout:.3g} s after {received} of {length} bytes") from None
                if chunk is grpc.aio.EOF:
                    break
                if chunk.offset != start + received or received + len(chunk.data) > length:
                    raise StateError(f"donor {donor.peer_id} sent a chunk outside the asked range")
                if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256:
                    raise StateError(f"donor {donor.peer_id} sent a chunk whose hash does not match")
                blob[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
                received += len(chunk.data)
                downloaded += len(chunk.data)
                if progress is not None:
                    progress(downloaded, total)
            if received != length:
                raise StateError(f"donor {donor.peer_id} sent {received} of {length} bytes")
        except grpc.aio.AioRpcError as err:
            log.warning("state range %d+%d from %s failed: %s", start, length, donor.peer_id, err.details())
        except StateError as err:
            log.warning("state range %d+%d from %s failed: %s", start, length, donor.peer_id, err)
        finally:
            call.cancel()  # a range given up on (or done) holds nothing on the donor
        return received

    async def fetch_from(sources: list[Donor]) -> bytearray | None:
        """The whole blob from ``sources``; None when every one of them failed on some range."""
        blob = bytearray(total)
        remaining = [(start, min(RANGE_BYTES, total - start)) for start in range(0, total, RANGE_BYTES)]
        # Ranges go round-robin to the donors still trusted; a donor that fails once is dropped and
        # its ranges go to the others in the next pass, so one leaving donor costs only a retry.
        alive = list(sources)
        while remaining and alive:
            assignment = [(alive[i % len(alive)], start, length) for i, (start, length) in enumerate(remaining)]
            limit = asyncio.Semaphore(2 * len(alive))  # a few ranges in flight per donor

            async def limited(donor: Donor, start: int, length: int) -> int:
                async with limit:
                    return await fetch(donor, blob, start, length)

            results = await asyncio.gather(*(limited(d, s, n) for d, s, n in assignment))
            failed_donors = {d for (d, _, n), got in zip(assignment, results) if got < n}
            # What a failed range lacks goes to the next donor; what it brought stays.
            remaining = [(s + got, n - got) for (_, s, n), got in zip(assignment, results) if got < n]
            alive = [d for d in alive if d not in failed_donors]
        return None if remaining else blob

    def blob_hash(data: bytearray) -> str:
        return hashlib.sha256(data).hexdigest()

    # Whole-state hashing and parsing run in a thread: ~0.5 GB for the gpt2 preset would stall
    # the event loop (RPCs, heartbeats) for a second or more.
    blob = await fetch_from(usable)
    if blob is None:
        raise StateError(f"could not download step {expected_step}: every donor failed on some range")
    if await asyncio.to_thread(blob_hash, blob) != reference.state_sha256:
        # Every chunk matched the hash its donor sent, yet the whole does not: some donor hashed
        # bytes it altered. Ranges do not say which, so fetch the whole state from one donor at a
        # time until one serves exactly the blob the donors announced.
        log.warning("state of step %d from %d donor(s) does not match its announced hash; "
                    "retrying one donor at a time", expected_step, len(usable))
        blob = None
        for donor in usable:
            candidate = await fetch_from([donor])
            if candidate is not None and await asyncio.to_thread(blob_hash, candidate) == reference.state_sha256:
                blob = candidate
                break
            log.warning("state donor %s did not serve the announced state of step %d", donor.peer_id, expected_step)
        if blob is None:
            raise StateError("downloaded state does not match the donors' state hash")
    got = await asyncio.to_thread(read_blob, blob, expected_numel, expected_states)
    if got.step != expected_step:
        raise StateError(f"downloaded state is for step {got.step}, expected {expected_step}")
    if expected_params_sha256 is not None and await asyncio.to_thread(params_sha256, got.params) != expected_params_sha256:
        raise StateError("downloaded params do not match the hash the swarm published")
    return DownloadedState(got.step, got.params, got.momentum, downloaded, len(usable), got.optimizer)
