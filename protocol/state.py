"""Global state snapshots, and their chunked, hashed download by joiners.

A snapshot is what a joiner needs to take part in the next round: the outer step, θ_global and
the outer optimizer's momentum. Donors keep the last two committed snapshots as immutable
bytes; a joiner fetches byte ranges from several donors in parallel, checks every chunk's hash,
the whole blob's hash, and finally that θ_global hashes to what the swarm published in the DHT.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from dataclasses import dataclass
from typing import Iterator

import grpc
import torch

from ._pb.lowcomm.v1 import state_pb2, state_pb2_grpc
from .handshake import Identity

log = logging.getLogger(__name__)

MAGIC = b"LCST"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sIqq")  # magic, format version, step, numel
CHUNK_BYTES = 2 * 2**20
RANGE_BYTES = 16 * 2**20  # one download request; several run in parallel across donors


class StateError(Exception):
    """A state blob or download that cannot be trusted or used."""


def params_sha256(params: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(params)).hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    # float32 little-endian on every platform we run on; numpy() shares memory, no copy.
    return memoryview(t.detach().contiguous().numpy()).cast("B")


@dataclass(frozen=True)
class Snapshot:
    """An immutable committed state as served to joiners."""

    step: int
    numel: int
    blob: bytes
    params_sha256: str
    state_sha256: str

    @classmethod
    def build(cls, step: int, params: torch.Tensor, momentum: torch.Tensor) -> "Snapshot":
        assert params.numel() == momentum.numel()
        blob = b"".join(
            [_HEADER.pack(MAGIC, FORMAT_VERSION, step, params.numel()), tensor_bytes(params), tensor_bytes(momentum)]
        )
        return cls(step, params.numel(), blob, params_sha256(params), hashlib.sha256(blob).hexdigest())


def parse_blob(blob: bytes | bytearray) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(step, params, momentum) from a state blob; raises StateError if it is malformed."""
    if len(blob) < _HEADER.size:
        raise StateError("state blob shorter than its header")
    magic, version, step, numel = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise StateError(f"unknown state format {magic!r} v{version}")
    if numel < 0 or len(blob) != _HEADER.size + 8 * numel:
        raise StateError(f"state blob has {len(blob)} bytes, expected {_HEADER.size + 8 * numel} for {numel} params")
    data = torch.frombuffer(bytearray(blob[_HEADER.size:]), dtype=torch.float32)
    return step, data[:numel].clone(), data[numel:].clone()


class StateDonor:
    """Serves the last two committed snapshots; limits how many downloads run at once."""

    def __init__(self, identity: Identity, max_concurrent: int = 4) -> None:
        self.identity = identity
        self._snapshots: dict[int, Snapshot] = {}
        self._slots = asyncio.Semaphore(max_concurrent)

    def publish(self, snapshot: Snapshot) -> None:
        self._snapshots[snapshot.step] = snapshot
        for step in sorted(self._snapshots)[:-2]:
            del self._snapshots[step]

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
        end = len(snap.blob) if length == 0 else offset + length
        if offset < 0 or length < 0 or end > len(snap.blob):
            raise StateError(f"range [{offset}, {end}) outside the {len(snap.blob)}-byte state")
        view = memoryview(snap.blob)
        for start in range(offset, end, CHUNK_BYTES):
            data = bytes(view[start:min(start + CHUNK_BYTES, end)])
            yield state_pb2.StateChunk(offset=start, data=data, sha256=hashlib.sha256(data).hexdigest())

    @property
    def slots(self) -> asyncio.Semaphore:
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


async def download_state(
    donors: list[Donor],
    expected_step: int,
    expected_params_sha256: str | None,
    identity: Identity,
    channel_for,
    timeout: float,
) -> DownloadedState:
    """Fetch the snapshot of ``expected_step`` from ``donors`` in parallel ranges.

    ``channel_for(address)`` returns a grpc.aio channel. A range that fails on one donor is
    retried on the next; the result is checked against ``expected_params_sha256``.
    """
    hello = identity.hello()
    infos: list[tuple[Donor, state_pb2.StateInfo]] = []

    async def ask(donor: Donor) -> None:
        stub = state_pb2_grpc.StateTransferStub(channel_for(donor.address))
        try:
            info = await stub.GetStateInfo(state_pb2.StateInfoRequest(hello=hello), timeout=min(10.0, timeout))
        except grpc.aio.AioRpcError as err:
            log.warning("state donor %s at %s did not answer: %s", donor.peer_id, donor.address, err.details())
            return
        if info.step == expected_step and (expected_params_sha256 in (None, info.params_sha256)):
            infos.append((donor, info))

    await asyncio.gather(*(ask(d) for d in donors))
    if not infos:
        raise StateError(f"no donor holds step {expected_step} with the published params hash")
    # Donors may agree on the params hash but still serve blobs that differ (another momentum);
    # only use donors that serve the same blob as the first.
    reference = infos[0][1]
    usable = [d for d, info in infos if info.state_sha256 == reference.state_sha256]
    total = reference.total_bytes
    blob = bytearray(total)
    remaining = [(start, min(RANGE_BYTES, total - start)) for start in range(0, total, RANGE_BYTES)]

    async def fetch(donor: Donor, start: int, length: int) -> bool:
        stub = state_pb2_grpc.StateTransferStub(channel_for(donor.address))
        request = state_pb2.StateRequest(hello=hello, step=expected_step, offset=start, length=length)
        received = 0
        try:
            async for chunk in stub.DownloadState(request, timeout=timeout):
                if not (start <= chunk.offset and chunk.offset + len(chunk.data) <= start + length):
                    raise StateError(f"donor {donor.peer_id} sent a chunk outside the asked range")
                if hashlib.sha256(chunk.data).hexdigest() != chunk.sha256:
                    raise StateError(f"donor {donor.peer_id} sent a chunk whose hash does not match")
                blob[chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
                received += len(chunk.data)
            if received != length:
                raise StateError(f"donor {donor.peer_id} sent {received} of {length} bytes")
            return True
        except grpc.aio.AioRpcError as err:
            log.warning("state range %d+%d from %s failed: %s", start, length, donor.peer_id, err.details())
        except StateError as err:
            log.warning("state range %d+%d from %s failed: %s", start, length, donor.peer_id, err)
        return False

    # Ranges go round-robin to the donors still trusted; a donor that fails once is dropped and
    # its ranges go to the others in the next pass, so one leaving donor costs only a retry.
    alive = list(usable)
    while remaining and alive:
        assignment = [(alive[i % len(alive)], start, length) for i, (start, length) in enumerate(remaining)]
        limit = asyncio.Semaphore(2 * len(alive))  # a few ranges in flight per donor

        async def limited(donor: Donor, start: int, length: int) -> bool:
            async with limit:
                return await fetch(donor, start, length)

        results = await asyncio.gather(*(limited(d, s, n) for d, s, n in assignment))
        failed_donors = {d for (d, _, _), ok in zip(assignment, results) if not ok}
        remaining = [(s, n) for (_, s, n), ok in zip(assignment, results) if not ok]
        alive = [d for d in alive if d not in failed_donors]
    if remaining:
        raise StateError(f"could not download step {expected_step}: every donor failed on some range")
    if hashlib.sha256(blob).hexdigest() != reference.state_sha256:
        raise StateError("downloaded state does not match the donor's state hash")
    step, params, momentum = parse_blob(blob)
    if step != expected_step:
        raise StateError(f"downloaded state is for step {step}, expected {expected_step}")
    if expected_params_sha256 is not None and params_sha256(params) != expected_params_sha256:
        raise StateError("downloaded params do not match the hash the swarm published")
    return DownloadedState(step, params, momentum, total, len(usable))
