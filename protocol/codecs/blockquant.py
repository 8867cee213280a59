"""Blockwise absmax quantizers: int8 and int4."""

from __future__ import annotations

import math

import numpy as np
import torch

from ._base import (
    _CHUNK_ELEMS,
    _REL_SLACK,
    TINY,
    Codec,
    CodecError,
    CodecId,
    Payload,
    _block_absmax,
    _cdiv,
    _check_block_size,
    _check_input,
    _check_int8_range,
    _check_numel,
    _dequantize_blocks,
    _payload_bytes,
    _quantize_blocks,
    _read,
    _read_scales,
    _scales_and_inverses,
    _write_le,
)


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


