"""Lossless and float-cast codecs: fp32, fp16, bf16."""

from __future__ import annotations

import math

import numpy as np
import torch

from ._base import (
    _LITTLE_ENDIAN,
    Codec,
    CodecId,
    Payload,
    _check_input,
    _check_numel,
    _payload_bytes,
    _read,
)


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

    def decode_owned(self, payload: bytearray | memoryview, numel: int) -> torch.Tensor:
        numel = _check_numel(numel)
        mv = _payload_bytes(payload, self.encoded_size(numel), self.name)
        if not _LITTLE_ENDIAN or mv.readonly or numel == 0:  # pragma: no cover - big-endian hosts
            return self.decode(mv, numel)
        return torch.frombuffer(mv, dtype=torch.float32, count=numel)  # the payload's memory is the tensor

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


