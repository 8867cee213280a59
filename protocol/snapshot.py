"""The state blob a donor serves and a joiner downloads (protocol/state.py moves its bytes).

A snapshot is what a joiner needs to take part in the next round: the outer step, θ_global and
the outer optimizer's momentum, and, in runs that average the inner optimizer's state
(``[sync] state_sync``: DES-LOC, MT-DAO), that optimizer's state as well.

Blob formats (little-endian). Format 1, every run without state sync (unchanged, no extra bytes):
``header(magic, 1, step, numel) || θ_global || momentum``. Format 2, runs with state sync:
``header(magic, 2, step, numel) || optimizer header(inner steps, count, names length) || names ||
θ_global || momentum || state_1 .. state_k``, every tensor float32 in the order of the flat
parameters, the names comma-separated and zero-padded to 8 bytes. A joiner knows from its own run
config which layout and size to expect, and refuses any other with the reason (a donor of an
older lowcomm serves format 1 in a state-sync run).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch


MAGIC = b"LCST"
FORMAT_VERSION = 1  # θ_global and the outer momentum
OPTIMIZER_FORMAT_VERSION = 2  # and the inner optimizer's state
_HEADER = struct.Struct("<4sIqq")  # magic, format version, step, numel
_OPTIMIZER_HEADER = struct.Struct("<qII")  # the optimizer's step count, number of states, names length


class StateError(Exception):
    """A state blob or download that cannot be trusted or used."""


def params_sha256(params: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(params)).hexdigest()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    # float32 little-endian on every platform we run on; numpy() shares memory, no copy.
    return memoryview(t.detach().contiguous().numpy()).cast("B")


@dataclass(frozen=True)
class OptimizerStates:
    """A peer's inner optimizer state as served with a snapshot: every state the optimizer keeps
    per parameter (``names``, a fixed order), each a flat float32 CPU vector in the order of the
    flat parameters, and the optimizer's step count (its bias corrections depend on it)."""

    step: int
    tensors: dict[str, torch.Tensor]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.tensors)

    def hashes(self) -> dict[str, str]:
        """sha256 of each state, as ``state_synced`` events report the averaged ones."""
        return {name: params_sha256(value) for name, value in self.tensors.items()}


def _names_field(names: tuple[str, ...]) -> bytes:
    raw = ",".join(names).encode()
    return raw + bytes(-len(raw) % 8)  # the tensors after it stay 8-byte aligned


@dataclass(frozen=True)
class Snapshot:
    """An immutable committed state as served to joiners."""

    step: int
    numel: int
    blob: bytes
    params_sha256: str
    state_sha256: str

    @classmethod
    def build(cls, step: int, params: torch.Tensor, momentum: torch.Tensor,
              params_hash: str | None = None, optimizer: OptimizerStates | None = None) -> "Snapshot":
        """``params_hash``: sha256 of ``params`` when the caller already computed it. ``optimizer``:
        the inner optimizer's state, in runs that sync it (format 2); None: format 1."""
        numel = params.numel()
        assert momentum.numel() == numel
        if optimizer is None:
            parts = [_HEADER.pack(MAGIC, FORMAT_VERSION, step, numel), tensor_bytes(params), tensor_bytes(momentum)]
        else:
            assert optimizer.names and all(t.numel() == numel for t in optimizer.tensors.values())
            names = _names_field(optimizer.names)
            parts = [_HEADER.pack(MAGIC, OPTIMIZER_FORMAT_VERSION, step, numel),
                     _OPTIMIZER_HEADER.pack(optimizer.step, len(optimizer.names), len(names)), names,
                     tensor_bytes(params), tensor_bytes(momentum),
                     *(tensor_bytes(t.to(torch.float32)) for t in optimizer.tensors.values())]
        blob = b"".join(parts)
        return cls(step, numel, blob, params_hash or params_sha256(params), hashlib.sha256(blob).hexdigest())


def state_bytes(numel: int, optimizer_states: tuple[str, ...] = ()) -> int:
    """Size of the state blob of a model with ``numel`` parameters (header, θ_global, momentum,
    and with ``optimizer_states`` named, the optimizer header, the names and those states)."""
    if not optimizer_states:
        return _HEADER.size + 8 * numel
    return (_HEADER.size + _OPTIMIZER_HEADER.size + len(_names_field(optimizer_states))
            + 4 * (2 + len(optimizer_states)) * numel)


def describe_layout(optimizer_states: tuple[str, ...]) -> str:
    if not optimizer_states:
        return f"format {FORMAT_VERSION} (θ_global and the outer momentum)"
    return f"format {OPTIMIZER_FORMAT_VERSION} (θ_global, the outer momentum and the inner optimizer's " \
           f"{', '.join(optimizer_states)})"


@dataclass(frozen=True)
class BlobContents:
    step: int
    params: torch.Tensor
    momentum: torch.Tensor
    optimizer: OptimizerStates | None  # format 2 only


def read_blob(blob: bytes | bytearray, expected_numel: int | None = None,
              expected_states: tuple[str, ...] | None = None) -> BlobContents:
    """The contents of a state blob; raises StateError if it is malformed, or (with
    ``expected_numel``, ``expected_states``) holds another number of parameters or other
    optimizer states than this run's (``()``: none, format 1)."""
    if len(blob) < _HEADER.size:
        raise StateError("state blob shorter than its header")
    magic, version, step, numel = _HEADER.unpack_from(blob)
    if magic != MAGIC or version not in (FORMAT_VERSION, OPTIMIZER_FORMAT_VERSION):
        raise StateError(f"unknown state format {magic!r} v{version}")
    if numel < 0:
        raise StateError(f"state blob declares {numel} params")
    if expected_numel is not None and numel != expected_numel:
        raise StateError(f"state blob holds {numel} params, the run's model has {expected_numel}")
    names: tuple[str, ...] = ()
    optimizer_step = 0
    offset = _HEADER.size
    if version == OPTIMIZER_FORMAT_VERSION:
        if len(blob) < offset + _OPTIMIZER_HEADER.size:
            raise StateError("state blob shorter than its optimizer header")
        optimizer_step, count, names_length = _OPTIMIZER_HEADER.unpack_from(blob, offset)
        offset += _OPTIMIZER_HEADER.size
        raw = bytes(blob[offset:offset + names_length]).rstrip(b"\0")
        try:
            names = tuple(raw.decode().split(",")) if raw else ()
        except UnicodeDecodeError:
            raise StateError("state blob's optimizer state names are not text") from None
        if count == 0 or len(names) != count or names_length != len(_names_field(names)):
            raise StateError(f"state blob's optimizer header is malformed ({count} states named {raw!r})")
        offset += names_length
    if expected_states is not None and names != expected_states:
        raise StateError(f"state blob is {describe_layout(names)}; this run expects {describe_layout(expected_states)}")
    if len(blob) != state_bytes(numel, names):
        raise StateError(f"state blob has {len(blob)} bytes, expected {state_bytes(numel, names)} for {numel} params")
    if numel == 0:
        empty = {name: torch.empty(0) for name in names}
        return BlobContents(step, torch.empty(0), torch.empty(0), OptimizerStates(optimizer_step, empty) if names else None)
    # A view of a writable buffer, then one copy per tensor: never two extra copies of the blob.
    buffer = blob if isinstance(blob, bytearray) else bytearray(blob)
    data = torch.frombuffer(buffer, dtype=torch.float32, offset=offset, count=(2 + len(names)) * numel)
    tensors = [data[i * numel:(i + 1) * numel].clone() for i in range(2 + len(names))]
    optimizer = OptimizerStates(optimizer_step, dict(zip(names, tensors[2:]))) if names else None
    return BlobContents(step, tensors[0], tensors[1], optimizer)


def parse_blob(blob: bytes | bytearray, expected_numel: int | None = None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(step, params, momentum) of a state blob of either format (``read_blob``)."""
    contents = read_blob(blob, expected_numel)
    return contents.step, contents.params, contents.momentum
