"""Tensor codecs of the sync protocol (DESIGN §4 "Codecs").

Every codec turns a flat float32 CPU tensor into a payload of a size that depends only on
the number of values (``encoded_size``), so a receiver can refuse or bound a payload before
buffering it, and turns a payload back into a new float32 tensor, refusing (``CodecError``)
any payload that does not match what it expects.

Wire formats (all multi-byte fields little-endian, no header: the codec and the length travel
in the surrounding message):

=======  ==================================================================================
fp32     ``numel`` float32
fp16     ``numel`` IEEE binary16 (values beyond ±65504 become ±inf)
bf16     ``numel`` bfloat16 (top 16 bits of the float32, round to nearest even)
int8     ``n_blocks`` float32 scales, then ``numel`` int8 in [-127, 127];
         value = q * scale, scale = absmax(block) / 127
int4     ``n_blocks`` float32 scales, then ``ceil(numel / 2)`` bytes of signed 4-bit values in
         [-7, 7], two per byte, low nibble first, as one stream over the whole tensor (a pad
         nibble of 0 when numel is odd); value = q * scale, scale = absmax(block) / 7
topk     ``n_blocks`` float32 scales, then ``K`` uint16 indices, then ``K`` int8 values in
         [-127, 127], where block b keeps k_b of its values (the largest magnitudes), its
         indices ascending, relative to the block start; K = sum(k_b);
         value = q * scale, scale = absmax(kept values of the block) / 127
=======  ==================================================================================

``n_blocks = ceil(numel / block_size)``; the last block may be partial. A block whose absmax
is below ``TINY`` (2**-118, about 3e-36: all-zero blocks, denormal dust) gets scale 0 and
decodes to zeros; this keeps every scale and reciprocal finite and normal.

Encoders of the quantizing codecs (int8, int4, topk) raise ``CodecError`` for non-finite
input: such a payload could never be decoded (decoders refuse non-finite scales). The
float casts encode whatever they get; checking decoded values for finiteness is the job of
the validation layer, not of the codec.

Speed: the int8 path is the hot one (every round encodes and decodes the whole
pseudo-gradient). It works on cache-sized chunks of blocks with vectorized torch ops and a
small scratch buffer, so that no 4-bytes-per-value temporary the size of the input is ever
allocated (on a VM, first-touch page faults of such a buffer cost more than the arithmetic).
See bench/codecs.py and bench/README.md.
"""

from __future__ import annotations

import abc
import enum
import math
import sys
import types
from typing import Union

import numpy as np
import torch

__all__ = [
    "CODEC_NAMES",
    "TINY",
    "Bf16Codec",
    "Codec",
    "CodecError",
    "CodecId",
    "Fp16Codec",
    "Fp32Codec",
    "Int4Codec",
    "Int8Codec",
    "TopKCodec",
    "encode_with_feedback",
    "get_codec",
]

Payload = Union[bytes, bytearray, memoryview]


class CodecId(enum.IntEnum):
    """Codec identifiers; the values equal the proto enum ``lowcomm.v1.Codec``."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    INT8 = 4
    INT4 = 5
    TOPK = 6


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


class Fp32Codec(Codec):
    """Lossless: the float32 values, little-endian. error_bound = 0."""

    id = CodecId.FP32
    name = "fp32"
    lossy = False

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        arr = x.numpy()
        if not _LITTLE_ENDIAN:  # pragma: no cover
            arr = arr.astype("<f4")
        return arr.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        out = torch.empty(numel, dtype=torch.float32)
        out.numpy()[...] = _read(mv, "<f4", numel, 0)
        return out

    def encoded_size(self, numel: int) -> int:
        return 4 * _check_numel(numel)

    def error_bound(self, x: torch.Tensor) -> float:
        return 0.0


class Fp16Codec(Codec):
    """IEEE half precision, round to nearest even.

    error_bound = max|x| * 2**-11 + 2**-25 (half an ulp, relative, plus half the smallest
    subnormal), or inf when max|x| >= 65520 (those values overflow to inf).
    """

    id = CodecId.FP16
    name = "fp16"
    lossy = True

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        arr = x.to(torch.float16).numpy()
        if not _LITTLE_ENDIAN:  # pragma: no cover
            arr = arr.astype("<f2")
        return arr.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        h = _read(mv, "<f2", numel, 0)
        out = torch.empty(numel, dtype=torch.float32)
        if numel:
            # torch's half->float conversion is vectorized; numpy's is not. The small copy
            # keeps torch from wrapping a read-only buffer.
            out.copy_(torch.from_numpy(np.array(h, copy=True)))
        return out

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def error_bound(self, x: torch.Tensor) -> float:
        x = _check_input(x)
        if x.numel() == 0:
            return 0.0
        m = float(x.abs().max())
        if not m < 65520.0:
            return math.inf
        return m * 2.0**-11 + 2.0**-25


class Bf16Codec(Codec):
    """bfloat16 (the top half of the float32, round to nearest even).

    error_bound = max|x| * 2**-8 + 2**-134 (half an ulp, relative, plus half the smallest
    subnormal), inf for non-finite input or values that round up past the bf16 range.
    """

    id = CodecId.BF16
    name = "bf16"
    lossy = True

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        arr = x.to(torch.bfloat16).view(torch.int16).numpy()
        if not _LITTLE_ENDIAN:  # pragma: no cover
            arr = arr.astype("<i2")
        return arr.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        h = _read(mv, "<u2", numel, 0)
        out = torch.empty(numel, dtype=torch.float32)
        if numel:
            np.left_shift(h, 16, out=out.numpy().view(np.uint32), dtype=np.uint32)
        return out

    def encoded_size(self, numel: int) -> int:
        return 2 * _check_numel(numel)

    def error_bound(self, x: torch.Tensor) -> float:
        x = _check_input(x)
        if x.numel() == 0:
            return 0.0
        m = float(x.abs().max())
        if not math.isfinite(m) or m > float(torch.finfo(torch.bfloat16).max):
            return math.inf
        return m * 2.0**-8 + 2.0**-134


class _BlockQuantCodec(Codec):
    """Shared code of int8 and int4: blockwise absmax scales, round to nearest."""

    qmax: int

    def __init__(self, block_size: int = 1024) -> None:
        self.block_size = _check_block_size(block_size, self.name, even=self._even_blocks)

    _even_blocks = False

    def options(self) -> dict:
        return {"block_size": self.block_size}

    def n_blocks(self, numel: int) -> int:
        return _cdiv(_check_numel(numel), self.block_size)

    def error_bound(self, x: torch.Tensor) -> float:
        """max over blocks of absmax/(2*qmax) * (1 + 2**-12); absmax itself for blocks below TINY."""
        x = _check_input(x)
        n = x.numel()
        if n == 0:
            return 0.0
        absmax = _block_absmax(x, n, self.block_size)
        if not bool(torch.isfinite(absmax).all()):
            return math.inf
        per_block = torch.where(absmax >= TINY, absmax / (2 * self.qmax) * (1 + _REL_SLACK), absmax)
        return float(per_block.max())


class Int8Codec(_BlockQuantCodec):
    """Blockwise absmax int8: per block one float32 scale = absmax/127, values round(x/scale).

    Per element |error| <= absmax(block)/254 * (1 + 2**-12) (absmax itself when absmax < TINY).
    """

    id = CodecId.INT8
    name = "int8"
    lossy = True
    qmax = 127

    def encoded_size(self, numel: int) -> int:
        numel = _check_numel(numel)
        return 4 * _cdiv(numel, self.block_size) + numel

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        n, bs = x.numel(), self.block_size
        nb = _cdiv(n, bs)
        scale, inv = _scales_and_inverses(_block_absmax(x, n, bs), self.qmax, self.name)
        buf = np.empty(4 * nb + n, dtype=np.uint8)
        _write_le(buf[: 4 * nb].view("<f4"), scale)
        if n:
            q = torch.from_numpy(buf[4 * nb :].view(np.int8))
            _quantize_blocks(x, inv, n, bs, q, self.qmax)
        return buf.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        bs = self.block_size
        nb = _cdiv(numel, bs)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        scales = _read_scales(mv, nb, self.name)
        q = _read(mv, "i1", numel, 4 * nb)
        _check_int8_range(q, -self.qmax, self.name)
        out = torch.empty(numel, dtype=torch.float32)
        _dequantize_blocks(q, scales, numel, bs, out)
        return out


class Int4Codec(_BlockQuantCodec):
    """Blockwise absmax int4: scale = absmax/7, values round(x/scale) in [-7, 7], two per byte.

    Per element |error| <= absmax(block)/14 * (1 + 2**-12) (absmax itself when absmax < TINY).
    block_size must be even (every block but the last starts on a byte boundary).
    """

    id = CodecId.INT4
    name = "int4"
    lossy = True
    qmax = 7
    _even_blocks = True

    def encoded_size(self, numel: int) -> int:
        numel = _check_numel(numel)
        return 4 * _cdiv(numel, self.block_size) + _cdiv(numel, 2)

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        n, bs = x.numel(), self.block_size
        nb = _cdiv(n, bs)
        scale, inv = _scales_and_inverses(_block_absmax(x, n, bs), self.qmax, self.name)
        buf = np.empty(4 * nb + _cdiv(n, 2), dtype=np.uint8)
        _write_le(buf[: 4 * nb].view("<f4"), scale)
        if n == 0:
            return buf.tobytes()
        packed = torch.from_numpy(buf[4 * nb :].view(np.int8))
        # Quantize to int8 chunk by chunk (chunks of whole blocks; even length since bs is
        # even, the odd tail gets a zero pad nibble), then pack pairs: low nibble first.
        chunk = max(bs, (_CHUNK_ELEMS // bs) * bs)
        q8 = torch.zeros(min(chunk, n) + 1, dtype=torch.int8)
        for e0 in range(0, n, chunk):
            e1 = min(e0 + chunk, n)
            m = e1 - e0
            b0 = e0 // bs
            _quantize_blocks(x[e0:e1], inv[b0:], m, bs, q8, self.qmax)
            if m % 2:
                q8[m] = 0
                m += 1
            pairs = q8[:m].view(-1, 2)
            lo = pairs[:, 0].bitwise_and(0x0F)
            hi = pairs[:, 1].bitwise_left_shift(4)
            torch.bitwise_or(lo, hi, out=packed[e0 // 2 : e0 // 2 + m // 2])
        return buf.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        bs = self.block_size
        nb = _cdiv(numel, bs)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        scales = _read_scales(mv, nb, self.name)
        nbytes = _cdiv(numel, 2)
        packed_np = _read(mv, "i1", nbytes, 4 * nb)
        out = torch.empty(numel, dtype=torch.float32)
        if numel == 0:
            return out
        if numel % 2 and (int(packed_np[-1]) >> 4) != 0:
            raise CodecError(f"{self.name}: pad nibble is not zero")
        chunk_bytes = max(bs, (_CHUNK_ELEMS // bs) * bs) // 2
        s8 = torch.empty(2 * min(chunk_bytes, nbytes), dtype=torch.int8)
        for p0 in range(0, nbytes, chunk_bytes):
            p1 = min(p0 + chunk_bytes, nbytes)
            m = p1 - p0
            p = torch.from_numpy(np.array(packed_np[p0:p1]))  # small copy: writable tensor
            pairs = s8[: 2 * m].view(m, 2)
            torch.bitwise_right_shift(p, 4, out=pairs[:, 1])  # arithmetic shift: sign-extends
            torch.bitwise_right_shift(p.bitwise_left_shift_(4), 4, out=pairs[:, 0])
            if int(pairs.min()) < -self.qmax:
                raise CodecError(f"{self.name}: quantized value -8 out of range [-7, 7]")
            e0 = 2 * p0
            e1 = min(2 * p1, numel)
            out[e0:e1].copy_(s8[: e1 - e0])
        # scale per block: views over whole blocks, then the partial tail
        nfull = numel // bs
        if nfull:
            out[: nfull * bs].view(nfull, bs).mul_(scales[:nfull, None])
        if nfull * bs < numel:
            out[nfull * bs :].mul_(scales[nfull])
        return out


class TopKCodec(Codec):
    """Per block keep the k largest-magnitude values, int8-quantized with one absmax scale.

    k = ceil(fraction * block_size) for full blocks; the last partial block of length r keeps
    max(1, ceil(fraction * r)). Kept values: |error| <= absmax(kept)/254 * (1 + 2**-12)
    (absmax when below TINY); dropped values decode to 0, so their error is |x| and they are
    never larger in magnitude than any kept value of their block. error_bound returns the
    max of both. Error feedback carries the dropped values to later rounds.
    """

    id = CodecId.TOPK
    name = "topk"
    lossy = True
    qmax = 127

    def __init__(self, block_size: int = 1024, fraction: float = 1 / 64) -> None:
        self.block_size = _check_block_size(block_size, self.name, max_size=65536)
        try:
            fraction = float(fraction)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: fraction must be a number, got {fraction!r}") from None
        if not (0.0 < fraction <= 1.0):
            raise ValueError(f"{self.name}: fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def options(self) -> dict:
        return {"block_size": self.block_size, "fraction": self.fraction}

    def k_for(self, length: int) -> int:
        """Values kept in a block of ``length`` values (rounded to 9 digits before ceil so that
        e.g. 0.07 * 100 keeps 7, not 8)."""
        if length <= 0:
            return 0
        return min(length, max(1, math.ceil(round(self.fraction * length, 9))))

    def _layout(self, numel: int) -> tuple[int, int, int, int, int]:
        """(n_blocks, n_full_blocks, tail_len, k_full, k_tail)."""
        bs = self.block_size
        nfull, tail = divmod(numel, bs)
        return _cdiv(numel, bs), nfull, tail, self.k_for(bs), self.k_for(tail)

    def encoded_size(self, numel: int) -> int:
        numel = _check_numel(numel)
        nb, nfull, _, kf, kt = self._layout(numel)
        return 4 * nb + 3 * (nfull * kf + kt)

    def _select(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per block (rows) the ascending indices and signed values of the kept elements, as
        [full-block part, tail part] lists of 2-D tensors."""
        n, bs = x.numel(), self.block_size
        _, nfull, tail, kf, kt = self._layout(n)
        idx_parts, val_parts = [], []
        if nfull:
            xb = x[: nfull * bs].view(nfull, bs)
            cb = max(1, _CHUNK_ELEMS // bs)
            idx = torch.empty(nfull, kf, dtype=torch.int64)
            scratch = torch.empty(min(cb, nfull), bs, dtype=torch.float32)
            for b0 in range(0, nfull, cb):
                b1 = min(b0 + cb, nfull)
                a = torch.abs(xb[b0:b1], out=scratch[: b1 - b0])
                idx[b0:b1] = torch.topk(a, kf, dim=1, sorted=False).indices
            idx = idx.sort(dim=1).values
            idx_parts.append(idx)
            val_parts.append(torch.gather(xb, 1, idx))
        if tail:
            xt = x[nfull * bs :].view(1, tail)
            idx = torch.topk(xt.abs(), kt, dim=1, sorted=False).indices.sort(dim=1).values
            idx_parts.append(idx)
            val_parts.append(torch.gather(xt, 1, idx))
        return idx_parts, val_parts

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        n = x.numel()
        nb, nfull, tail, kf, kt = self._layout(n)
        total_k = nfull * kf + kt
        idx_parts, val_parts = self._select(x)
        buf = np.empty(self.encoded_size(n), dtype=np.uint8)
        if n == 0:
            return buf.tobytes()
        absmax = torch.cat([v.abs().amax(dim=1) for v in val_parts])
        scale, inv = _scales_and_inverses(absmax, self.qmax, self.name)
        _write_le(buf[: 4 * nb].view("<f4"), scale)
        idx_all = torch.cat([i.reshape(-1) for i in idx_parts]).to(torch.int32).numpy()
        _write_le(buf[4 * nb : 4 * nb + 2 * total_k].view("<u2"), idx_all.astype(np.uint16))
        q = torch.from_numpy(buf[4 * nb + 2 * total_k :].view(np.int8))
        if nfull:
            v = val_parts[0].mul(inv[:nfull, None]).round_()
            q[: nfull * kf].copy_(v.reshape(-1))
        if tail:
            v = val_parts[-1].mul(inv[nfull]).round_()
            q[nfull * kf :].copy_(v.reshape(-1))
        return buf.tobytes()

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        nb, nfull, tail, kf, kt = self._layout(numel)
        total_k = nfull * kf + kt
        bs = self.block_size
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        scales = _read_scales(mv, nb, self.name)
        idx = _read(mv, "<u2", total_k, 4 * nb)
        q = _read(mv, "i1", total_k, 4 * nb + 2 * total_k)
        _check_int8_range(q, -self.qmax, self.name)
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        if nfull and int(idx[: nfull * kf].max()) >= bs:
            bad = int(np.flatnonzero(idx[: nfull * kf] >= bs)[0])
            raise CodecError(
                f"{self.name}: index {int(idx[bad])} >= block length {bs} in block {bad // kf}"
            )
        if tail and int(idx[nfull * kf :].max()) >= tail:
            raise CodecError(
                f"{self.name}: index {int(idx[nfull * kf:].max())} >= block length {tail} in last block"
            )
        pos = torch.from_numpy(idx.astype(np.int64))
        vals = torch.from_numpy(q.astype(np.float32))
        if nfull:
            pos[: nfull * kf].view(nfull, kf).add_(torch.arange(nfull, dtype=torch.int64)[:, None] * bs)
            vals[: nfull * kf].view(nfull, kf).mul_(scales[:nfull, None])
        if tail:
            pos[nfull * kf :].add_(nfull * bs)
            vals[nfull * kf :].mul_(scales[nfull])
        out[pos] = vals  # duplicate indices (only in forged payloads): one of them wins
        return out

    def error_bound(self, x: torch.Tensor) -> float:
        x = _check_input(x)
        n = x.numel()
        if n == 0:
            return 0.0
        if not bool(torch.isfinite(x).all()):
            return math.inf
        idx_parts, val_parts = self._select(x)
        bound = 0.0
        for v in val_parts:
            am = v.abs().amax(dim=1)
            b = torch.where(am >= TINY, am / (2 * self.qmax) * (1 + _REL_SLACK), am)
            bound = max(bound, float(b.max()))
        dropped = x.abs()
        for part, i in enumerate(idx_parts):
            if part == 0 and n // self.block_size:
                nfull = i.shape[0]
                view = dropped[: nfull * self.block_size].view(nfull, self.block_size)
                view.scatter_(1, i, 0.0)
            else:
                dropped[(n // self.block_size) * self.block_size :].view(1, -1).scatter_(1, i, 0.0)
        return max(bound, float(dropped.max()))


# --------------------------------------------------------------------------------------------
# registry and error feedback

_CODECS: types.MappingProxyType = types.MappingProxyType(
    {
        cls.name: cls
        for cls in (Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, Int4Codec, TopKCodec)
    }
)
_BY_ID = types.MappingProxyType({cls.id: cls for cls in _CODECS.values()})

CODEC_NAMES: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "topk")
assert CODEC_NAMES == tuple(_CODECS)


def get_codec(name_or_id: str | int | CodecId, **options) -> Codec:
    """A codec by name ("int8"), proto enum value (4) or CodecId, with its options.

    Raises ValueError naming the valid codecs for an unknown name or id, and for options the
    codec does not take or values it refuses.
    """
    valid = ", ".join(f"{n} ({int(_CODECS[n].id)})" for n in CODEC_NAMES)
    cls = None
    if isinstance(name_or_id, str):
        cls = _CODECS.get(name_or_id.strip().lower())
    elif isinstance(name_or_id, (int, np.integer)) and not isinstance(name_or_id, bool):
        try:
            cls = _BY_ID.get(CodecId(int(name_or_id)))
        except ValueError:
            cls = None
    if cls is None:
        raise ValueError(f"unknown codec {name_or_id!r}; valid codecs: {valid}")
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"bad options for codec {cls.name!r}: {options!r} ({e})") from None


def encode_with_feedback(codec: Codec, x: torch.Tensor, residual: torch.Tensor) -> tuple[bytes, torch.Tensor]:
    """Error feedback: encodes x + residual, sets residual[:] = (x + residual) - decoded (in place),
    returns (payload, decoded). For lossless fp32, residual becomes zero.

    ``decoded`` is exactly what any receiver's ``codec.decode(payload, numel)`` returns.
    If encoding fails (CodecError for non-finite values), ``residual`` is left unchanged.
    """
    x = _check_input(x)
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.device.type != "cpu":
        raise ValueError("residual must be a float32 CPU tensor")
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous with shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    s = x + residual
    payload = codec.encode(s)
    decoded = codec.decode(payload, s.numel())
    torch.sub(s, decoded, out=residual)
    return payload, decoded
