"""Shared pieces of the codecs: ids, errors, constants, checks and block helpers, the interface."""

from __future__ import annotations

import abc
import enum
import sys
from typing import Union

import numpy as np
import torch

Payload = Union[bytes, bytearray, memoryview]


class CodecId(enum.IntEnum):
    """Codec identifiers; the values equal the proto enum ``lowcomm.v1.Codec``."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    TOPK = 6
    SPARSELOCO = 7


class CodecError(ValueError):
    """A payload that does not match what the receiver expects (length, codec, block count, index range...)."""


#: Blocks whose absmax is below this are encoded with scale 0 (decode to zeros).
#: 2**-118 keeps absmax/127 and absmax/7 normal floats and 127/absmax finite.
TINY = 2.0**-118

# Relative slack on the quantizers' error bounds: float32 rounding of the reciprocal, of the
# product x * (1/scale), of the scale and of q * scale adds a few 1e-5 of a step at most.
_REL_SLACK = 2.0**-12

# Elements per chunk of the blockwise paths: big enough that the Python and dispatch overhead
# per chunk (a few torch calls) is negligible, small enough that the chunk and its float32
# scratch stay in L2/L3 (1 MiB each). Measured on 16M values, one thread: 1<<16 gave 4.7 GB/s
# int8 encode, 1<<18 gave 5.9 GB/s, 1<<20 no better.
_CHUNK_ELEMS = 1 << 18

_LITTLE_ENDIAN = sys.byteorder == "little"
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# --------------------------------------------------------------------------------------------
# helpers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_numel(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)):
        raise CodecError(f"numel must be an int, got {type(numel).__name__}")
    numel = int(numel)
    if numel < 0:
        raise CodecError(f"numel must be >= 0, got {numel}")
    return numel


def _check_input(x: torch.Tensor) -> torch.Tensor:
    """The encoders' input: a 1-D contiguous float32 CPU tensor (converted if it is not)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    if not (x.dtype.is_floating_point):
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _payload_bytes(payload: Payload, expected: int, what: str) -> memoryview:
    """A flat byte view of ``payload``; CodecError unless it is exactly ``expected`` bytes."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"{what}: payload must be bytes-like, got {type(payload).__name__}")
    mv = memoryview(payload)
    if mv.nbytes != expected:
        raise CodecError(f"{what}: payload is {mv.nbytes} bytes, expected {expected}")
    if not mv.c_contiguous:
        raise CodecError(f"{what}: payload buffer is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _read(mv: memoryview, dtype: str, count: int, offset: int) -> np.ndarray:
    """A read-only numpy view of ``count`` little-endian ``dtype`` items at ``offset``, in native order."""
    arr = np.frombuffer(mv, dtype=np.dtype(dtype), count=count, offset=offset)
    if not _LITTLE_ENDIAN and arr.dtype.itemsize > 1:  # pragma: no cover - big-endian hosts
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def _read_scales(mv: memoryview, n_blocks: int, what: str) -> torch.Tensor:
    scales = _read(mv, "<f4", n_blocks, 0)
    if n_blocks and not (np.isfinite(scales).all() and (scales >= 0).all()):
        bad = int(np.flatnonzero(~(np.isfinite(scales) & (scales >= 0)))[0])
        raise CodecError(f"{what}: scale of block {bad} is {scales[bad]!r} (must be finite and >= 0)")
    return torch.from_numpy(np.array(scales, dtype=np.float32))  # small copy: writable, native


def _block_absmax(x: torch.Tensor, n: int, bs: int) -> torch.Tensor:
    """Per-block max |x| (NaN if a block holds a NaN) as a float32 tensor of n_blocks."""
    nfull = n // bs
    out = torch.empty(_cdiv(n, bs), dtype=torch.float32)
    if nfull:
        xb = x[: nfull * bs].view(nfull, bs)
        torch.amax(xb, dim=1, out=out[:nfull])
        torch.maximum(out[:nfull], torch.amin(xb, dim=1).neg_(), out=out[:nfull])
    if nfull * bs < n:
        tail = x[nfull * bs :]
        out[nfull] = torch.maximum(tail.amax(), tail.amin().neg())
    return out


def _scales_and_inverses(absmax: torch.Tensor, qmax: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scale = absmax / qmax and its inverse, both 0 for blocks with absmax < TINY."""
    if absmax.numel() and not bool(torch.isfinite(absmax).all()):
        raise CodecError(f"{what}: cannot encode non-finite values")
    keep = absmax >= TINY
    zero = torch.zeros((), dtype=torch.float32)
    scale = torch.where(keep, absmax / qmax, zero)
    inv = torch.where(keep, qmax / torch.where(keep, absmax, torch.ones((), dtype=torch.float32)), zero)
    return scale, inv


def _write_le(dst: np.ndarray, src: torch.Tensor | np.ndarray) -> None:
    """Copy ``src`` into the little-endian numpy view ``dst`` (numpy swaps bytes if needed)."""
    dst[...] = src.numpy() if isinstance(src, torch.Tensor) else src


def _quantize_blocks(
    x: torch.Tensor, inv: torch.Tensor, n: int, bs: int, q_out: torch.Tensor, qmax: int
) -> None:
    """q_out[:n] (int8) = round(x * inv[block]), chunk by chunk through a small float scratch.

    ``q_out`` may be longer than ``n``; only ``q_out[:n]`` is written.
    """
    nfull = n // bs
    if nfull:
        cb = max(1, _CHUNK_ELEMS // bs)  # blocks per chunk
        scratch = torch.empty(min(cb, nfull), bs, dtype=torch.float32)
        xb = x[: nfull * bs].view(nfull, bs)
        qb = q_out[: nfull * bs].view(nfull, bs)
        for b0 in range(0, nfull, cb):
            b1 = min(b0 + cb, nfull)
            tmp = scratch[: b1 - b0]
            torch.mul(xb[b0:b1], inv[b0:b1, None], out=tmp)
            tmp.round_()
            qb[b0:b1].copy_(tmp)
    if nfull * bs < n:
        tmp = x[nfull * bs : n] * inv[nfull]
        tmp.round_()
        q_out[nfull * bs : n].copy_(tmp)
    # x * (qmax / absmax) can exceed qmax by float rounding only by far less than 0.5, so
    # the rounded values are already in [-qmax, qmax]; nothing to clamp.


def _dequantize_blocks(q: np.ndarray, scales: torch.Tensor, n: int, bs: int, out: torch.Tensor) -> None:
    """out[:n] = q[:n] * scales[block] (q: int8 numpy view), chunk by chunk."""
    out_np = out.numpy()
    nfull = n // bs
    if nfull:
        cb = max(1, _CHUNK_ELEMS // bs)
        for b0 in range(0, nfull, cb):
            b1 = min(b0 + cb, nfull)
            e0, e1 = b0 * bs, b1 * bs
            np.copyto(out_np[e0:e1], q[e0:e1], casting="unsafe")
            out[e0:e1].view(b1 - b0, bs).mul_(scales[b0:b1, None])
    if nfull * bs < n:
        e0 = nfull * bs
        np.copyto(out_np[e0:n], q[e0:n], casting="unsafe")
        out[e0:n].mul_(scales[nfull])


def _check_int8_range(q: np.ndarray, lo: int, what: str) -> None:
    if q.size and int(q.min()) < lo:
        raise CodecError(f"{what}: quantized value {int(q.min())} out of range [{lo}, {-lo}]")


def _check_block_size(block_size: int, what: str, *, even: bool = False, max_size: int | None = None) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{what}: block_size must be an int, got {block_size!r}")
    block_size = int(block_size)
    if block_size < 1 or (max_size is not None and block_size > max_size):
        hi = f", <= {max_size}" if max_size is not None else ""
        raise ValueError(f"{what}: block_size must be >= 1{hi}, got {block_size}")
    if even and block_size % 2:
        raise ValueError(f"{what}: block_size must be even, got {block_size}")
    return block_size


# --------------------------------------------------------------------------------------------
# the interface


class Codec(abc.ABC):
    """A fixed-size tensor codec. Instances hold only their (immutable) options."""

    id: CodecId
    name: str
    lossy: bool

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Payload bytes of a 1-D float32 CPU tensor of any length (0 allowed)."""

    @abc.abstractmethod
    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        """A new 1-D float32 tensor of ``numel`` values; CodecError for a payload that does not fit."""

    def decode_owned(self, payload: bytearray | memoryview, numel: int) -> torch.Tensor:
        """``decode`` for a writable payload the caller hands over: the result may share its
        memory (fp32 then decodes without a copy), so the caller must not reuse the buffer."""
        return self.decode(payload, numel)

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int:
        """The exact byte length ``encode`` produces for ``numel`` values."""

    @abc.abstractmethod
    def error_bound(self, x: torch.Tensor) -> float:
        """The largest absolute error of any element after one round trip of ``x``."""

    def options(self) -> dict:
        """Constructor options (for config fingerprints and repr)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.options() == other.options()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.options().items()))))


