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
sparseloco  per chunk of <= 4096 values two float32 levels (or one int8 scale), then 12-bit
         packed chunk-local indices, then 2-bit codes (or int8); see ``sparseloco``. Its error
         feedback decays: ``encode_with_feedback`` encodes x + feedback_decay * residual
=======  ==================================================================================

``n_blocks = ceil(numel / block_size)``; the last block may be partial. A block whose absmax
is below ``TINY`` (2**-118, about 3e-36: all-zero blocks, denormal dust) gets scale 0 and
decodes to zeros; this keeps every scale and reciprocal finite and normal.

Decoding is bit-identical on every CPU kernel and thread count: each value is an exact
conversion (int8/int4 to float32, fp16/bf16 to float32) followed by at most one IEEE multiply
by its block's scale, elementwise, with no reduction; topk writes each position once (its
indices must be strictly ascending per block), and so does sparseloco (its 2-bit values are copies
of stored levels, its 8-bit values one multiply). Every member of a round applies these decoded
values to θ_global, so this is what keeps them identical (see protocol/outer.py). Encoders need
no such care: a payload is encoded by one peer only, and everybody, that peer too, uses its
decoded bytes.

Encoders of the quantizing codecs (int8, int4, topk, sparseloco) raise ``CodecError`` for non-finite
input: such a payload could never be decoded (decoders refuse non-finite scales). The
float casts encode whatever they get; checking decoded values for finiteness is the job of
the validation layer, not of the codec.

Speed: the int8 path is the hot one (every round encodes and decodes the whole
pseudo-gradient). It works on cache-sized chunks of blocks with vectorized torch ops and a
small scratch buffer, so that no 4-bytes-per-value temporary the size of the input is ever
allocated (on a VM, first-touch page faults of such a buffer cost more than the arithmetic).
See bench/codecs.py and bench/README.md.

Layout: ``_base`` (ids, errors, shared checks and block helpers, the ``Codec`` interface),
``floats`` (fp32/fp16/bf16), ``blockquant`` (int8/int4), ``topk``, ``sparseloco``; this module holds the
registry (``get_codec``) and sender-side error feedback (``encode_with_feedback``).
"""

from __future__ import annotations

import types

import numpy as np
import torch

from ._base import TINY, Codec, CodecError, CodecId, _check_input
from .blockquant import Int4Codec, Int8Codec
from .floats import Bf16Codec, Fp16Codec, Fp32Codec
from .sparseloco import SparseLoCoCodec
from .topk import TopKCodec

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
    "SparseLoCoCodec",
    "TopKCodec",
    "encode_with_feedback",
    "get_codec",
]


# --------------------------------------------------------------------------------------------
# registry and error feedback

_CODECS: types.MappingProxyType = types.MappingProxyType(
    {
        cls.name: cls
        for cls in (Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, Int4Codec, TopKCodec, SparseLoCoCodec)
    }
)
_BY_ID = types.MappingProxyType({cls.id: cls for cls in _CODECS.values()})

CODEC_NAMES: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4", "topk", "sparseloco")
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
    """Error feedback: encodes s = x + residual, sets residual[:] = s - decoded (in place),
    returns (payload, decoded). For lossless fp32, residual becomes zero. A codec with a
    ``feedback_decay`` β < 1 (sparseloco) encodes s = x + β·residual instead: what it did not
    send fades by β per round (SparseLoCo's accumulator).

    ``decoded`` is exactly what any receiver's ``codec.decode(payload, numel)`` returns.
    If encoding fails (CodecError for non-finite values), ``residual`` is left unchanged.
    """
    x = _check_input(x)
    if not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or residual.device.type != "cpu":
        raise ValueError("residual must be a float32 CPU tensor")
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous with shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    decay = getattr(codec, "feedback_decay", 1.0)
    if decay == 1.0:
        s = x + residual
    else:
        s = residual.mul(decay)
        s.add_(x)
    payload = codec.encode(s)
    if not codec.lossy:  # decode(encode(s)) is s, bit for bit: skip a decode and a subtraction
        residual.zero_()
        return payload, s
    decoded = codec.decode(payload, s.numel())
    torch.sub(s, decoded, out=residual)
    return payload, decoded
