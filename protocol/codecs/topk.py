"""Top-k per block with int8 values and uint16 indices."""

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
    _cdiv,
    _check_block_size,
    _check_input,
    _check_int8_range,
    _check_numel,
    _payload_bytes,
    _read,
    _read_scales,
    _scales_and_inverses,
    _write_le,
)


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
        self._check_ascending(idx, nfull, kf, kt)
        pos = torch.from_numpy(idx.astype(np.int64))
        vals = torch.from_numpy(q.astype(np.float32))
        if nfull:
            pos[: nfull * kf].view(nfull, kf).add_(torch.arange(nfull, dtype=torch.int64)[:, None] * bs)
            vals[: nfull * kf].view(nfull, kf).mul_(scales[:nfull, None])
        if tail:
            pos[nfull * kf :].add_(nfull * bs)
            vals[nfull * kf :].mul_(scales[nfull])
        # Unique positions (checked above) and one rounding per value (q * scale): the same bits
        # on every kernel and thread count. With duplicates, which write wins could depend on threads.
        out[pos] = vals
        return out

    def _check_ascending(self, idx: np.ndarray, nfull: int, kf: int, kt: int) -> None:
        """CodecError unless every block's indices are strictly ascending (so unique), as encoded."""
        rows = [idx[: nfull * kf].reshape(nfull, kf)] if nfull else []
        if kt:
            rows.append(idx[nfull * kf :].reshape(1, kt))
        for base, block in zip((0, nfull), rows):
            bad = np.flatnonzero((block[:, 1:] <= block[:, :-1]).any(axis=1))
            if bad.size:
                raise CodecError(f"{self.name}: indices of block {base + int(bad[0])} are not strictly ascending")

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


