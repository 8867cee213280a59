"""SparseLoCo's codec: top-k per chunk of the error-feedback accumulator, 12-bit indices, 2-bit values.

SparseLoCo (the Covenant-72B paper) replaces DiLoCo's outer Nesterov momentum by a *decayed*
error-feedback buffer: each member forms ``acc = β·e + Δ`` (β = ``feedback_decay``, 0.95), sends
a compressed top-k of ``acc``, keeps ``e ← acc − decoded`` and the swarm steps
``θ ← θ − α·mean(decoded)`` with α ≈ 1 and no momentum. Coordinates that are not sent pile up
in ``e`` until they are large enough to be, as a momentum buffer would let them, but stale ones
fade by β per round instead of being released in bulk much later. ``encode_with_feedback``
applies the decay (it reads ``feedback_decay``); ``[sync] method = "sparseloco"`` pairs this codec
with the outer rule (node/config.py).

Wire format (little-endian, no header; ``C`` = chunk_size <= 4096, so a local index fits 12 bits):

* per chunk two float32 magnitudes ``lo <= hi`` (bits = 2) or one float32 scale (bits = 8);
* the ``K`` kept positions of all chunks, chunk after chunk, each chunk's ascending, as 12-bit
  indices relative to the chunk start, packed two per three bytes (first index in the low 12 bits
  of the 24-bit little-endian group); an odd ``K`` ends with one index in a byte and a half, its
  pad nibble zero: ``ceil(3K / 2)`` bytes;
* the ``K`` values: bits = 2: one 2-bit code per value, four per byte, low bits first (pad bits
  zero); bit 0 picks ``hi`` (1) or ``lo`` (0), bit 1 makes it negative; value = ±level, an exact
  copy (no arithmetic at all). bits = 8: int8 q in [-127, 127], value = q · scale (one rounding).

A full chunk keeps ``k = ceil(fraction·C)`` values (128 of 4096 by default, 3.1 %, the top of the
paper's 1–3 %: measured better than 1/16 at H = 50 and as good as 1/64 at H = 10 for the same
bytes, bench/analysis.md), the last partial chunk of r values ``max(1, ceil(fraction·r))``. Per
kept value that is 12 + 2 bits plus 8 bytes per chunk (14.5 bits per value at the defaults, 0.45
bits per coordinate, 70× below fp32).

The 2-bit quantizer: the ``ceil(k/2)`` largest magnitudes of a chunk share ``hi`` = their mean,
the others ``lo`` = theirs. Means keep each half's sum of magnitudes, so the error the feedback
carries is only the spread inside each half. Decoding writes each position once (indices are
checked strictly ascending per chunk): bit-identical on every CPU and thread count.

**The shard owner's re-encoding** (protocol/accumulator.py encodes the average with the round's
codec and its own error feedback). The average of N sparse contributions is up to N times denser
than one. We encode it like a contribution, top-k of ``β·e_owner + average`` with this codec, and
the owner's residual keeps the rest, instead of sending the union of the kept positions with
8-bit values. Why:

1. every payload of a codec has one size per numel (``encoded_size``): members check the owner's
   answer against it before buffering, and the upload/download budget stays 2·(N−1)/N·S with S
   the sparse size, whatever N is. The union would be variable-sized and, at N = 16 and 3.1 %,
   about 40 % dense: the download would cost ~13× the upload and the ≥1,000× byte goal would fall;
2. top-k of the average keeps the coordinates the members agree on (their values add) ahead of
   those only one member sent (diluted by 1/N): a consensus selection, not a random loss;
3. nothing is lost, only delayed: the owner's error feedback carries the dropped part of the
   average to its next round, decayed by the same β so that coordinates whose shard moves to
   another owner when the group changes fade instead of coming back rounds later.

The owner's own part enters its average exactly (allreduce.py, as for every codec) and is
subject to the same norm clipping as the others (``[sync] aggregation``).
"""

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
    _check_input,
    _check_int8_range,
    _check_numel,
    _payload_bytes,
    _read,
    _scales_and_inverses,
    _write_le,
)

MAX_CHUNK = 4096  # 12-bit local indices


def pack12(idx: np.ndarray) -> np.ndarray:
    """Indices < 4096 packed two per three bytes (see the module docstring): ceil(3K/2) bytes."""
    k = idx.size
    padded = np.zeros(k + (k % 2), dtype=np.uint16)
    padded[:k] = idx
    a, b = padded[0::2], padded[1::2]
    out = np.empty(3 * (padded.size // 2), dtype=np.uint8)
    out[0::3] = a & 0xFF
    out[1::3] = (a >> 8) | ((b & 0x0F) << 4)
    out[2::3] = b >> 4
    return out[: _cdiv(3 * k, 2)]


def unpack12(data: np.ndarray, k: int, what: str) -> np.ndarray:
    """The K indices of ``pack12``'s bytes (uint16); CodecError for a non-zero pad nibble."""
    groups = _cdiv(k, 2)
    raw = np.zeros(3 * groups, dtype=np.uint16)
    raw[: data.size] = data
    b0, b1, b2 = raw[0::3], raw[1::3], raw[2::3]
    out = np.empty(2 * groups, dtype=np.uint16)
    out[0::2] = b0 | ((b1 & 0x0F) << 8)
    out[1::2] = (b1 >> 4) | (b2 << 4)
    if k % 2 and out[k] != 0:
        raise CodecError(f"{what}: pad nibble of the last index is not zero")
    return out[:k]


def pack2(codes: np.ndarray) -> np.ndarray:
    """2-bit codes (uint8 < 4), four per byte, low bits first: ceil(K/4) bytes."""
    k = codes.size
    padded = np.zeros(4 * _cdiv(k, 4), dtype=np.uint8)
    padded[:k] = codes
    q = padded.reshape(-1, 4)
    return q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)


def unpack2(data: np.ndarray, k: int, what: str) -> np.ndarray:
    """The K codes of ``pack2``'s bytes; CodecError for non-zero pad bits."""
    out = np.empty((data.size, 4), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (data >> (2 * j)) & 3
    flat = out.reshape(-1)
    if flat[k:].any():
        raise CodecError(f"{what}: pad bits after the last value are not zero")
    return flat[:k]


class SparseLoCoCodec(Codec):
    """Top-k per chunk of ``chunk_size`` values, 12-bit local indices, 2-bit (or int8) values."""

    id = CodecId.SPARSELOCO
    name = "sparseloco"
    lossy = True
    qmax = 127  # bits = 8

    def __init__(self, chunk_size: int = MAX_CHUNK, fraction: float = 1 / 32, bits: int = 2,
                 feedback_decay: float = 0.95) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
                or not 1 <= int(chunk_size) <= MAX_CHUNK:
            raise ValueError(f"{self.name}: chunk_size must be an int in [1, {MAX_CHUNK}], got {chunk_size!r}")
        self.chunk_size = int(chunk_size)
        try:
            fraction, feedback_decay = float(fraction), float(feedback_decay)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: fraction and feedback_decay must be numbers") from None
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"{self.name}: fraction must be in (0, 1], got {fraction}")
        if not 0.0 <= feedback_decay <= 1.0:
            raise ValueError(f"{self.name}: feedback_decay must be in [0, 1], got {feedback_decay}")
        if bits not in (2, 8):
            raise ValueError(f"{self.name}: bits must be 2 or 8, got {bits!r}")
        self.fraction, self.bits, self.feedback_decay = fraction, int(bits), feedback_decay

    def options(self) -> dict:
        return {"chunk_size": self.chunk_size, "fraction": self.fraction, "bits": self.bits,
                "feedback_decay": self.feedback_decay}

    # ---------------------------------------------------------------------------------- layout

    def k_for(self, length: int) -> int:
        if length <= 0:
            return 0
        return min(length, max(1, math.ceil(round(self.fraction * length, 9))))

    def _layout(self, numel: int) -> tuple[int, int, int, int, int, int]:
        """(n_chunks, n_full, tail_len, k_full, k_tail, K)."""
        nfull, tail = divmod(numel, self.chunk_size)
        kf, kt = self.k_for(self.chunk_size), self.k_for(tail)
        return _cdiv(numel, self.chunk_size), nfull, tail, kf, kt, nfull * kf + kt

    def _sizes(self, numel: int) -> tuple[int, int, int]:
        """Bytes of (chunk header, indices, values)."""
        nc, _, _, _, _, k = self._layout(numel)
        head = (8 if self.bits == 2 else 4) * nc
        return head, _cdiv(3 * k, 2), (_cdiv(k, 4) if self.bits == 2 else k)

    def encoded_size(self, numel: int) -> int:
        return sum(self._sizes(_check_numel(numel)))

    # ---------------------------------------------------------------------------------- encode

    def _select(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per row group (full chunks, then the tail): (ascending local indices, kept values,
        magnitude rank of each kept value: 0 = largest), each of shape (rows, k)."""
        n, cs = x.numel(), self.chunk_size
        _, nfull, tail, kf, kt, _ = self._layout(n)
        parts = []
        rows_per_pass = max(1, _CHUNK_ELEMS // cs)
        for rows, length, k, base in ((nfull, cs, kf, 0), (1 if tail else 0, tail, kt, nfull * cs)):
            if not rows:
                continue
            xv = x[base: base + rows * length].view(rows, length)
            idx = torch.empty(rows, k, dtype=torch.int64)
            # one small reused scratch: a fresh |x| per pass would page-fault its memory in each time
            scratch = torch.empty(min(rows, rows_per_pass), length, dtype=torch.float32)
            for r0 in range(0, rows, rows_per_pass):
                r1 = min(r0 + rows_per_pass, rows)
                a = torch.abs(xv[r0:r1], out=scratch[: r1 - r0])
                idx[r0:r1] = torch.topk(a, k, dim=1, sorted=True).indices  # by magnitude: rank = column
            ordered, perm = idx.sort(dim=1)
            parts.append((ordered, torch.gather(xv, 1, ordered), perm))
        return parts

    @staticmethod
    def _levels(vals: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lo, hi) per row and the 'hi' mask: the ceil(k/2) largest magnitudes average into hi."""
        k = vals.shape[1]
        top = rank < _cdiv(k, 2)
        mag = vals.abs().double()
        n_hi, n_lo = top.sum(dim=1), (~top).sum(dim=1)
        hi = torch.where(top, mag, 0.0).sum(dim=1) / n_hi
        lo = torch.where(n_lo > 0, torch.where(top, 0.0, mag).sum(dim=1) / n_lo.clamp(min=1), hi)
        hi, lo = hi.float(), lo.float()
        zero = torch.zeros((), dtype=torch.float32)
        return torch.where(lo >= TINY, lo, zero), torch.where(hi >= TINY, hi, zero), top

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x)
        n = x.numel()
        head, nidx, _ = self._sizes(n)
        buf = np.zeros(self.encoded_size(n), dtype=np.uint8)
        if n == 0:
            return buf.tobytes()
        parts = self._select(x)
        # torch.topk ranks NaN and ±inf above every finite magnitude, so a non-finite input is
        # always among the kept values: checking those spares a pass over the whole input.
        if not all(bool(torch.isfinite(vals).all()) for _, vals, _ in parts):
            raise CodecError(f"{self.name}: cannot encode non-finite values")
        buf[head: head + nidx] = pack12(torch.cat([p[0].reshape(-1) for p in parts]).numpy().astype(np.uint16))
        if self.bits == 2:
            levels, codes = [], []
            for _, vals, rank in parts:
                lo, hi, top = self._levels(vals, rank)
                levels.append(torch.stack([lo, hi], dim=1))
                codes.append((top.to(torch.uint8) | ((vals < 0).to(torch.uint8) << 1)).reshape(-1))
            _write_le(buf[:head].view("<f4"), torch.cat(levels).reshape(-1))
            buf[head + nidx:] = pack2(torch.cat(codes).numpy())
        else:
            absmax = torch.cat([vals.abs().amax(dim=1) for _, vals, _ in parts])
            scale, inv = _scales_and_inverses(absmax, self.qmax, self.name)
            _write_le(buf[:head].view("<f4"), scale)
            q = torch.from_numpy(buf[head + nidx:].view(np.int8))
            at, row = 0, 0
            for _, vals, _ in parts:
                rows, k = vals.shape
                q[at: at + rows * k].copy_(vals.mul(inv[row: row + rows, None]).round_().reshape(-1))
                at, row = at + rows * k, row + rows
        return buf.tobytes()

    # ---------------------------------------------------------------------------------- decode

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        nc, nfull, tail, kf, kt, k = self._layout(numel)
        head, nidx, _ = self._sizes(numel)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        header = _read(mv, "<f4", head // 4, 0)
        if not (np.isfinite(header).all() and (header >= 0).all()):
            raise CodecError(f"{self.name}: a chunk level or scale is negative or not finite")
        idx = unpack12(_read(mv, "u1", nidx, head), k, self.name)
        self._check_indices(idx, nfull, tail, kf, kt)
        vals_raw = _read(mv, "u1" if self.bits == 2 else "i1", k if self.bits == 8 else _cdiv(k, 4), head + nidx)
        header_t = torch.from_numpy(np.array(header, dtype=np.float32))
        chunk_of = np.repeat(np.arange(nc), [kf] * nfull + ([kt] if tail else []))
        row = torch.from_numpy(chunk_of)
        if self.bits == 2:
            levels = header_t.view(nc, 2)
            if bool((levels[:, 0] > levels[:, 1]).any()):
                raise CodecError(f"{self.name}: a chunk's lo level exceeds its hi level")
            codes = torch.from_numpy(unpack2(vals_raw, k, self.name).astype(np.int64))
            mag = levels[row, codes & 1]  # a copy of one stored float: no rounding
            vals = torch.where((codes & 2).bool(), mag.neg(), mag)
        else:
            _check_int8_range(vals_raw, -self.qmax, self.name)
            vals = torch.from_numpy(vals_raw.astype(np.float32)).mul_(header_t[row])  # one rounding each
        pos = torch.from_numpy(idx.astype(np.int64) + chunk_of.astype(np.int64) * self.chunk_size)
        out[pos] = vals  # unique positions: one write each
        return out

    def _check_indices(self, idx: np.ndarray, nfull: int, tail: int, kf: int, kt: int) -> None:
        rows = [(idx[: nfull * kf].reshape(nfull, kf), self.chunk_size, 0)] if nfull else []
        if tail:
            rows.append((idx[nfull * kf:].reshape(1, kt), tail, nfull))
        for block, length, base in rows:
            if block.size and int(block.max()) >= length:
                bad = int(np.flatnonzero((block >= length).any(axis=1))[0])
                raise CodecError(f"{self.name}: index {int(block.max())} >= chunk length {length} in chunk {base + bad}")
            bad_rows = np.flatnonzero((block[:, 1:] <= block[:, :-1]).any(axis=1))
            if bad_rows.size:
                raise CodecError(f"{self.name}: indices of chunk {base + int(bad_rows[0])} are not strictly ascending")

    # ---------------------------------------------------------------------------------- bound

    def error_bound(self, x: torch.Tensor) -> float:
        """Max of: dropped values (|x|), and per kept value ||v| − its level| (bits = 2, plus the
        float32 rounding of the level) or absmax/254 (bits = 8), with 2**-12 relative slack."""
        x = _check_input(x)
        n = x.numel()
        if n == 0:
            return 0.0
        if not bool(torch.isfinite(x).all()):
            return math.inf
        bound = 0.0
        dropped = x.abs()
        base = 0
        for ordered, vals, rank in self._select(x):
            rows, k = vals.shape
            length = self.chunk_size if base < (n // self.chunk_size) * self.chunk_size else n - base
            dropped[base: base + rows * length].view(rows, length).scatter_(1, ordered, 0.0)
            base += rows * length
            if self.bits == 2:
                lo, hi, top = self._levels(vals, rank)
                level = torch.where(top, hi[:, None], lo[:, None]).double()
                err = (vals.abs().double() - level).abs() + level * _REL_SLACK
            else:
                am = vals.abs().amax(dim=1, keepdim=True).expand(rows, k)
                err = torch.where(am >= TINY, am / (2 * self.qmax) * (1 + _REL_SLACK), am)
            bound = max(bound, float(err.max()) * (1 + _REL_SLACK))
        return max(bound, float(dropped.max()))
