"""Tests of lowcomm.protocol.codecs: wire format, error bounds, malformed payloads, error feedback."""

from __future__ import annotations

import math
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lowcomm.protocol import codecs
from lowcomm.protocol.codecs import CodecError, CodecId

# Deterministic runs (no example database, fixed generation), no deadline (first calls
# warm up torch kernels).
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

REL = 2.0**-12  # relative slack of the quantizers' documented bounds
TINY = codecs.TINY

# (name, options): the defaults plus small blocks so that examples span many blocks.
CONFIGS = [
    ("fp32", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {}),
    ("int8", {"block_size": 16}),
    ("int8", {"block_size": 7}),
    ("int4", {}),
    ("int4", {"block_size": 16}),
    ("int4", {"block_size": 6}),
    ("topk", {}),
    ("topk", {"block_size": 64, "fraction": 0.125}),
    ("topk", {"block_size": 7, "fraction": 0.3}),
    ("topk", {"block_size": 16, "fraction": 1.0}),
]
CONFIG_IDS = [name + "".join(f"-{k}={v}" for k, v in o.items()) for name, o in CONFIGS]


def t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).copy())


def block_size_of(codec) -> int:
    return getattr(codec, "block_size", 1024)


# ------------------------------------------------------------------------------------------
# strategies


def sizes(bs: int):
    special = sorted({0, 1, 2, 3, bs - 1, bs, bs + 1, 2 * bs - 1, 2 * bs + 3, 3 * bs + bs // 2})
    special = [s for s in special if s >= 0]
    return st.one_of(st.sampled_from(special), st.integers(0, min(4 * bs + 5, 5000)))


@st.composite
def tensors(draw, bs: int):
    """float32 arrays with values in [-1e4, 1e4]: sparse ones drawn element by element
    (subnormals, exact zeros, ties...) or dense seeded ones at various scales with whole
    blocks zeroed."""
    n = draw(sizes(bs))
    if draw(st.booleans()):
        fill = draw(st.sampled_from([0.0, 1.0, -3.5, 1e-3]))
        arr = draw(
            hnp.arrays(
                np.float32,
                n,
                elements=st.floats(-1e4, 1e4, width=32),
                fill=st.just(np.float32(fill)),
            )
        )
    else:
        seed = draw(st.integers(0, 2**32 - 1))
        scale = draw(st.sampled_from([1e-35, 1e-6, 1.0, 100.0, 1e4]))
        kind = draw(st.sampled_from(["normal", "uniform", "heavy"]))
        rng = np.random.default_rng(seed)
        if kind == "normal":
            arr = rng.standard_normal(n)
        elif kind == "uniform":
            arr = rng.uniform(-1, 1, n)
        else:
            arr = rng.standard_cauchy(n)
        arr = np.clip(arr * scale, -1e4, 1e4).astype(np.float32)
        nb = -(-n // bs)
        if nb:
            zero_blocks = draw(st.lists(st.integers(0, nb - 1), max_size=3))
            for b in zero_blocks:
                arr[b * bs : (b + 1) * bs] = 0
    return arr


# ------------------------------------------------------------------------------------------
# reference checks (independent of the module's own bound code)


def block_absmax(x: np.ndarray, bs: int) -> np.ndarray:
    """float64 absmax per element's block, repeated per element."""
    n = x.size
    nb = -(-n // bs)
    pad = np.zeros(nb * bs, dtype=np.float64)
    pad[:n] = np.abs(x.astype(np.float64))
    am = pad.reshape(nb, bs).max(axis=1)
    return np.repeat(am, bs)[:n]


def quant_bound(absmax: np.ndarray, qmax: int) -> np.ndarray:
    return np.where(absmax >= TINY, absmax / (2 * qmax) * (1 + REL), absmax)


def parse_topk(payload: bytes, codec, n: int):
    """Blocks of (indices, int8 values) and scales from the documented topk layout."""
    bs = codec.block_size
    nb = -(-n // bs)
    lens = [min(bs, n - b * bs) for b in range(nb)]
    ks = [min(L, max(1, math.ceil(round(codec.fraction * L, 9)))) for L in lens]
    total = sum(ks)
    assert len(payload) == 4 * nb + 3 * total
    scales = np.frombuffer(payload, "<f4", nb, 0)
    idx = np.frombuffer(payload, "<u2", total, 4 * nb)
    q = np.frombuffer(payload, "i1", total, 4 * nb + 2 * total)
    out, off = [], 0
    for b in range(nb):
        out.append((idx[off : off + ks[b]].astype(np.int64), q[off : off + ks[b]], lens[b]))
        off += ks[b]
    return scales, out


def check_round_trip(codec, x_np: np.ndarray) -> None:
    n = x_np.size
    x = t(x_np)
    x_before = x.clone()
    payload = codec.encode(x)
    assert isinstance(payload, bytes)
    assert len(payload) == codec.encoded_size(n)
    assert torch.equal(x, x_before), "encode must not modify its input"
    d = codec.decode(payload, n)
    assert d.dtype == torch.float32 and d.shape == (n,) and d.is_contiguous()
    if n:
        assert d.data_ptr() != x.data_ptr()
    d_np = d.numpy().astype(np.float64)
    xd = x_np.astype(np.float64)
    err = np.abs(d_np - xd)
    assert np.isfinite(d_np).all()
    bound = codec.error_bound(x)
    if n:
        assert err.max() <= bound, (err.max(), bound)

    if codec.name == "fp32":
        assert np.array_equal(d.numpy().view(np.int32), x_np.view(np.int32))  # bit exact
    elif codec.name == "fp16":
        assert (err <= np.abs(xd) * 2.0**-11 + 2.0**-25).all()
    elif codec.name == "bf16":
        assert (err <= np.abs(xd) * 2.0**-8 + 2.0**-134).all()
    elif codec.name in ("int8", "int4"):
        qmax = 127 if codec.name == "int8" else 7
        am = block_absmax(x_np, codec.block_size)
        assert (err <= quant_bound(am, qmax)).all(), np.max(err - quant_bound(am, qmax))
        # blocks that are exactly zero stay exactly zero
        assert (d_np[am == 0] == 0).all()
    elif codec.name == "topk":
        scales, blocks = parse_topk(payload, codec, n)
        bs = codec.block_size
        for b, (idx, q, length) in enumerate(blocks):
            xs = xd[b * bs : b * bs + length]
            ds = d_np[b * bs : b * bs + length]
            assert (np.diff(idx) > 0).all(), "indices ascending and unique"
            assert (idx < length).all()
            assert (np.abs(q) <= 127).all()
            kept = np.zeros(length, dtype=bool)
            kept[idx] = True
            # the dropped values are the smallest in magnitude and decode to 0
            if (~kept).any():
                assert np.abs(xs[kept]).min() >= np.abs(xs[~kept]).max()
            assert (ds[~kept] == 0).all()
            am = np.abs(xs[kept]).max()
            assert scales[b] == pytest.approx(am / 127 if am >= TINY else 0.0, rel=1e-6)
            assert (np.abs(ds[kept] - xs[kept]) <= quant_bound(np.array(am), 127)).all()


# ------------------------------------------------------------------------------------------
# identity and registry


def test_codec_ids_match_proto_enum():
    assert [(c.name, int(c)) for c in CodecId] == [
        ("FP32", 1), ("FP16", 2), ("BF16", 3), ("INT8", 4), ("INT4", 5), ("TOPK", 6),
        ("SPARSELOCO", 7),
    ]
    proto = Path(__file__).resolve().parents[1] / "proto" / "lowcomm" / "v1" / "tensor.proto"
    if not proto.exists():
        pytest.skip("tensor.proto not found")
    text = proto.read_text()
    body = re.search(r"enum\s+Codec\s*\{(.*?)\}", text, re.S)
    assert body, "enum Codec not found in tensor.proto"
    values = {m[0]: int(m[1]) for m in re.findall(r"CODEC_(\w+)\s*=\s*(\d+)\s*;", body.group(1))}
    for cid in CodecId:
        assert values.get(cid.name) == int(cid), cid


def test_registry():
    assert codecs.CODEC_NAMES == ("fp32", "fp16", "bf16", "int8", "int4", "topk", "sparseloco")
    for name in codecs.CODEC_NAMES:
        c = codecs.get_codec(name)
        assert c.name == name
        assert codecs.get_codec(c.id).name == name
        assert codecs.get_codec(int(c.id)).name == name
        assert codecs.get_codec(name.upper()).name == name
        assert c.lossy == (name != "fp32")
        assert isinstance(c, codecs.Codec)
    assert codecs.get_codec("int8", block_size=256).block_size == 256
    assert codecs.get_codec("topk", fraction=0.5).fraction == 0.5
    for bad in ("int2", "", 0, 8, 99):
        with pytest.raises(ValueError, match="fp32.*fp16.*bf16.*int8.*int4.*topk"):
            codecs.get_codec(bad)
    with pytest.raises(ValueError):
        codecs.get_codec("fp32", block_size=4)
    with pytest.raises(ValueError):
        codecs.get_codec("int8", bogus=1)
    with pytest.raises(ValueError):
        codecs.get_codec("int8", block_size=0)
    with pytest.raises(ValueError):
        codecs.get_codec("int4", block_size=5)  # int4 blocks must be even
    with pytest.raises(ValueError):
        codecs.get_codec("topk", block_size=65537)
    for frac in (0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError):
            codecs.get_codec("topk", fraction=frac)


def test_encoded_size_formulas():
    i8, i4, tk = codecs.get_codec("int8"), codecs.get_codec("int4"), codecs.get_codec("topk")
    for n in (0, 1, 1023, 1024, 1025, 10**6):
        nb = -(-n // 1024)
        assert codecs.get_codec("fp32").encoded_size(n) == 4 * n
        assert codecs.get_codec("fp16").encoded_size(n) == 2 * n
        assert codecs.get_codec("bf16").encoded_size(n) == 2 * n
        assert i8.encoded_size(n) == 4 * nb + n
        assert i4.encoded_size(n) == 4 * nb + (n + 1) // 2
        tail = n % 1024
        k = (n // 1024) * 16 + (max(1, math.ceil(tail / 64)) if tail else 0)
        assert tk.encoded_size(n) == 4 * nb + 3 * k
    with pytest.raises(CodecError):
        i8.encoded_size(-1)


def test_topk_k_rounding():
    assert codecs.get_codec("topk", fraction=0.07).k_for(100) == 7
    c = codecs.get_codec("topk")
    assert c.k_for(1024) == 16
    assert c.k_for(1) == 1 and c.k_for(64) == 1 and c.k_for(65) == 2 and c.k_for(0) == 0


# ------------------------------------------------------------------------------------------
# pinned wire format


def test_golden_payloads():
    x = torch.tensor([1.0, -2.0, 0.5, 4.0, 3.0])
    f = np.float32
    s8 = struct.pack("<2f", f(4) / f(127), f(3) / f(127))
    # round half to even: -63.5 -> -64
    assert codecs.get_codec("int8", block_size=4).encode(x) == s8 + bytes([32, 256 - 64, 16, 127, 127])
    s4 = struct.pack("<2f", f(4) / f(7), f(3) / f(7))
    # nibbles 2, -4, 1, 7 | 7, pad 0 -> 0xC2, 0x71, 0x07
    assert codecs.get_codec("int4", block_size=4).encode(x) == s4 + bytes([0xC2, 0x71, 0x07])
    # topk block 4, fraction 1/2: block 0 keeps idx 1 (-2) and 3 (4); tail keeps idx 0 (3)
    tk = codecs.get_codec("topk", block_size=4, fraction=0.5)
    assert tk.encode(x) == s8 + struct.pack("<3H", 1, 3, 0) + bytes([256 - 64, 127, 127])
    assert codecs.get_codec("fp32").encode(x) == struct.pack("<5f", 1, -2, 0.5, 4, 3)
    assert codecs.get_codec("fp16").encode(x) == struct.pack("<5e", 1, -2, 0.5, 4, 3)
    assert codecs.get_codec("bf16").encode(torch.tensor([1.0, -2.0])) == bytes([0x80, 0x3F, 0x00, 0xC0])
    # decoding the golden payloads
    d = codecs.get_codec("int4", block_size=4).decode(s4 + bytes([0xC2, 0x71, 0x07]), 5)
    expect = [2 * f(4) / f(7), -4 * f(4) / f(7), 1 * f(4) / f(7), 7 * (f(4) / f(7)), 7 * (f(3) / f(7))]
    assert d.tolist() == pytest.approx(expect, rel=1e-6)
    d = tk.decode(tk.encode(x), 5)
    assert d.tolist() == pytest.approx([0, -64 * 4 / 127, 0, 4, 3], rel=1e-6)


def test_empty_and_zero():
    for name in codecs.CODEC_NAMES:
        c = codecs.get_codec(name)
        p = c.encode(torch.zeros(0))
        assert len(p) == c.encoded_size(0) == 0
        assert c.decode(p, 0).shape == (0,)
        z = torch.zeros(3000)
        assert torch.equal(c.decode(c.encode(z), 3000), z)
        assert c.error_bound(torch.zeros(0)) == 0.0


# ------------------------------------------------------------------------------------------
# property-based round trips


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=CONFIG_IDS)
def test_round_trip_property(name, options):
    codec = codecs.get_codec(name, **options)

    @PROPERTY
    @given(tensors(block_size_of(codec)))
    def check(x_np):
        check_round_trip(codec, x_np)

    check()


@pytest.mark.parametrize("name", codecs.CODEC_NAMES)
def test_round_trip_default_blocks_edge_sizes(name):
    codec = codecs.get_codec(name)
    rng = np.random.default_rng(1)
    for n in (1, 2, 1023, 1024, 1025, 2047, 2049, 5000, 65537):
        x = (rng.standard_normal(n) * rng.choice([1e-3, 1, 1e3])).astype(np.float32)
        check_round_trip(codec, x)


def test_bounds_are_tight_enough_to_fail():
    """The reference bounds are not vacuous: a coarser quantizer violates them."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(4096).astype(np.float32)
    am = block_absmax(x, 1024)
    d4 = codecs.get_codec("int4").decode(codecs.get_codec("int4").encode(t(x)), 4096).numpy()
    assert (np.abs(d4 - x) > quant_bound(am, 127)).any()
    d8 = codecs.get_codec("int8").decode(codecs.get_codec("int8").encode(t(x)), 4096).numpy()
    assert np.abs(d8 - x).max() > 0.5 * quant_bound(am, 127).max()


def test_large_tensor_chunk_boundaries():
    """Sizes spanning several internal chunks, with odd tails."""
    rng = np.random.default_rng(3)
    n = 3 * 2**18 + 1024 * 5 + 333
    x = rng.standard_normal(n).astype(np.float32)
    x[2**18 - 1024 : 2**18 + 1024] = 0  # zero blocks around a chunk boundary
    for name in ("int8", "int4", "topk"):
        check_round_trip(codecs.get_codec(name), x)


def test_deterministic_and_thread_safe():
    rng = np.random.default_rng(4)
    xs = [t(rng.standard_normal(300_000 + i)) for i in range(8)]
    for name in codecs.CODEC_NAMES:
        c = codecs.get_codec(name)
        sequential = [c.encode(x) for x in xs]
        assert sequential == [c.encode(x) for x in xs]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(c.encode, xs)) == sequential
            decoded = list(pool.map(lambda p: c.decode(p[0], p[1]), [(p, x.numel()) for p, x in zip(sequential, xs)]))
        for p, x, d in zip(sequential, xs, decoded):
            assert torch.equal(d, c.decode(p, x.numel()))


def test_non_finite_input():
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan")] + [0.5] * 100)
    for name in ("int8", "int4", "topk"):
        with pytest.raises(CodecError):
            codecs.get_codec(name).encode(x)
    for name in ("fp32", "fp16", "bf16"):  # casts: no finiteness policy in the codec
        c = codecs.get_codec(name)
        d = c.decode(c.encode(x), x.numel())
        assert d[1] == float("inf") and d[2] == -float("inf") and math.isnan(d[3])
    big = torch.tensor([1e5])  # beyond fp16 range
    assert codecs.get_codec("fp16").error_bound(big) == math.inf


def test_input_conversion_and_errors():
    c = codecs.get_codec("int8")
    x64 = torch.randn(100, dtype=torch.float64)
    assert c.encode(x64) == c.encode(x64.float())
    strided = torch.randn(200)[::2]
    assert c.encode(strided) == c.encode(strided.contiguous())
    with pytest.raises(ValueError):
        c.encode(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        c.encode(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError):
        c.encode([1.0, 2.0])


# ------------------------------------------------------------------------------------------
# malformed payloads


def _valid(name, n, **options):
    c = codecs.get_codec(name, **options)
    x = t(np.random.default_rng(n).standard_normal(n))
    return c, c.encode(x)


@pytest.mark.parametrize("name", codecs.CODEC_NAMES)
@pytest.mark.parametrize("n", [1, 1000, 2500])
def test_wrong_length(name, n):
    c, p = _valid(name, n)
    for bad in (p[:-1], p + b"\0", b"", p + p):
        with pytest.raises(CodecError):
            c.decode(bad, n)
    for other in (n - 1, n + 1, n + 2):
        if c.encoded_size(other) != len(p):  # int4: n odd and n + 1 share a size
            with pytest.raises(CodecError):
                c.decode(p, other)
    with pytest.raises(CodecError):
        c.decode(p, -1)
    with pytest.raises(CodecError):
        c.decode(p, 10**15)  # refused by length before allocating anything
    with pytest.raises(CodecError):
        c.decode("not bytes", n)  # type: ignore[arg-type]
    # bytearray and memoryview are accepted and give the same result
    d = c.decode(p, n)
    assert torch.equal(c.decode(bytearray(p), n), d)
    assert torch.equal(c.decode(memoryview(p), n), d)
    assert torch.equal(c.decode(memoryview(b"xx" + p + b"yy")[2:-2], n), d)
    assert torch.equal(c.decode(np.frombuffer(p, np.uint8).data, n), d)


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
def test_wrong_block_count(name):
    """A payload made with another block size has another block count: refused."""
    n = 4096
    sender, p = _valid(name, n, block_size=512)
    receiver = codecs.get_codec(name, block_size=1024)
    assert receiver.encoded_size(n) != len(p)
    with pytest.raises(CodecError):
        receiver.decode(p, n)


@pytest.mark.parametrize("name", ["int8", "int4", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1.0, -0.0 - 1e-30])
@pytest.mark.parametrize("block", [0, 2])
def test_bad_scale(name, bad, block):
    c, p = _valid(name, 2500)  # 3 blocks, the last partial
    forged = bytearray(p)
    forged[4 * block : 4 * block + 4] = struct.pack("<f", bad)
    with pytest.raises(CodecError, match="scale"):
        c.decode(bytes(forged), 2500)


def test_topk_index_out_of_range():
    n = 2500  # blocks of 1024, 1024, 452
    c, p = _valid("topk", n)
    scales, blocks = parse_topk(p, c, n)
    nb = len(blocks)
    k0 = len(blocks[0][0])
    idx_off = 4 * nb
    for pos, value in ((0, 1024), (k0 - 1, 65535), (2 * k0, 452), (2 * k0, 1023)):
        forged = bytearray(p)
        forged[idx_off + 2 * pos : idx_off + 2 * pos + 2] = struct.pack("<H", value)
        with pytest.raises(CodecError, match="index"):
            c.decode(bytes(forged), n)
    # the largest valid index of the last block (its last index) is accepted
    last = 2 * k0 + len(blocks[-1][0]) - 1
    forged = bytearray(p)
    forged[idx_off + 2 * last : idx_off + 2 * last + 2] = struct.pack("<H", 451)
    c.decode(bytes(forged), n)


@pytest.mark.parametrize("block", [0, 1, 2])
@pytest.mark.parametrize("kind", ["duplicate", "descending"])
def test_topk_indices_must_be_strictly_ascending(block, kind):
    """A position written twice would let the thread schedule pick the winner (members could then
    decode different bits from the same bytes); the encoder never writes one, so it is refused."""
    n = 2500  # blocks of 1024, 1024, 452
    c, p = _valid("topk", n)
    scales, blocks = parse_topk(p, c, n)
    first = sum(len(b[0]) for b in blocks[:block])  # position of the block's first index
    a, b = int(blocks[block][0][0]), int(blocks[block][0][1])
    forged = bytearray(p)
    pair = (a, a) if kind == "duplicate" else (b, a)
    forged[4 * len(blocks) + 2 * first : 4 * len(blocks) + 2 * first + 4] = struct.pack("<2H", *pair)
    with pytest.raises(CodecError, match=f"block {block} are not strictly ascending"):
        c.decode(bytes(forged), n)


def test_quantized_value_out_of_range():
    c, p = _valid("int8", 2000)
    forged = bytearray(p)
    forged[-1] = 0x80  # -128
    with pytest.raises(CodecError):
        c.decode(bytes(forged), 2000)
    c, p = _valid("topk", 2000)
    forged = bytearray(p)
    forged[-1] = 0x80
    with pytest.raises(CodecError):
        c.decode(bytes(forged), 2000)
    c, p = _valid("int4", 2000)
    for byte in (0x08, 0x80, 0x88):  # nibble -8, low or high
        forged = bytearray(p)
        forged[4 * 2 + 17] = byte
        with pytest.raises(CodecError):
            c.decode(bytes(forged), 2000)
    c, p = _valid("int4", 2001)  # odd: the last high nibble is padding and must be 0
    forged = bytearray(p)
    forged[-1] = (forged[-1] & 0x0F) | 0x10
    with pytest.raises(CodecError, match="pad"):
        c.decode(bytes(forged), 2001)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=CONFIG_IDS)
def test_random_payloads_never_crash(name, options):
    """Any bytes of the right length decode to a tensor of the right shape or raise CodecError."""
    codec = codecs.get_codec(name, **options)

    @settings(PROPERTY, max_examples=40)
    @given(st.integers(0, 300), st.data())
    def check(n, data):
        size = codec.encoded_size(n)
        payload = data.draw(st.binary(min_size=size, max_size=size))
        try:
            d = codec.decode(payload, n)
        except CodecError:
            return
        assert d.shape == (n,) and d.dtype == torch.float32

    check()


# ------------------------------------------------------------------------------------------
# error feedback


def _feedback_run(codec, n, rounds, seed):
    """Yields (round, x, decoded, residual, s) with s = x + previous residual."""
    rng = np.random.default_rng(seed)
    residual = torch.zeros(n)
    ptr = residual.data_ptr()
    for r in range(rounds):
        x = t(rng.standard_normal(n) * rng.uniform(0.5, 2.0))
        s = x + residual
        payload, decoded = codecs.encode_with_feedback(codec, x, residual)
        assert residual.data_ptr() == ptr  # updated in place
        assert torch.equal(decoded, codec.decode(payload, n))  # what receivers see
        yield r, x, decoded, residual, s


@pytest.mark.parametrize(
    ("name", "options", "growth"),
    [
        # residual <= (X + residual) * e  =>  residual <= X * e / (1 - e); e per codec
        ("fp32", {}, 0.0),
        ("fp16", {}, 2.0**-11 * 1.01),
        ("bf16", {}, 2.0**-8 * 1.01),
        ("int8", {}, 1 / 254 * (1 + REL)),
        ("int8", {"block_size": 64}, 1 / 254 * (1 + REL)),
        ("int4", {}, 1 / 14 * (1 + REL)),
    ],
)
def test_error_feedback_quantizers(name, options, growth):
    codec = codecs.get_codec(name, **options)
    n = 5000
    sum_in = np.zeros(n)
    sum_dec = np.zeros(n)
    x_max = 0.0
    no_feedback_err = np.zeros(n)
    for r, x, decoded, residual, s in _feedback_run(codec, n, 100, seed=5):
        sum_in += x.numpy()
        sum_dec += decoded.numpy()
        x_max = max(x_max, float(x.abs().max()))
        drift = np.abs(sum_in - sum_dec)
        # the drift of the running sums is the residual (up to float32 rounding of x + r)
        np.testing.assert_allclose(sum_in - sum_dec, residual.numpy(), rtol=0, atol=1e-4 * x_max)
        # one round's bound of what was encoded, and a constant bound over all rounds
        assert float(residual.abs().max()) <= codec.error_bound(s) + 1e-12
        assert drift.max() <= x_max * growth / (1 - growth) + 1e-4 * x_max + 2.0**-24, (r, drift.max())
        if name == "fp32":
            assert torch.equal(residual, torch.zeros(n))
        no_feedback_err += (codec.decode(codec.encode(x), n) - x).numpy()
    if name != "fp32":
        # without feedback the drift grows (random walk); with it, it does not
        assert np.abs(no_feedback_err).max() > 2 * drift.max()


@pytest.mark.parametrize(
    "options", [{"block_size": 64, "fraction": 0.25}, {"block_size": 256, "fraction": 0.125}, {}]
)
def test_error_feedback_topk(options):
    """Top-k keeps at least the fraction of each block's energy, so per block
    ||r||^2 <= (1 - delta (1 - k'))||x + r_prev||^2 with delta = fraction and k' the
    quantization share; the residual then stays below c / (1 - c) * max ||x||, a constant."""
    codec = codecs.get_codec("topk", **options)
    bs, frac = codec.block_size, codec.fraction
    k = codec.k_for(bs)
    n = 6 * bs + bs // 3
    kq = k * (1 + REL) ** 2 / 254**2
    c = math.sqrt(1 - frac * (1 - kq))
    limit = c / (1 - c)
    nb = -(-n // bs)

    def block_norms(v):
        pad = np.zeros(nb * bs)
        pad[:n] = v
        return np.sqrt((pad.reshape(nb, bs) ** 2).sum(axis=1))

    sum_in = np.zeros(n)
    sum_dec = np.zeros(n)
    x_norm_max = np.zeros(nb)
    x_max = 0.0
    norms = []
    for r, x, decoded, residual, s in _feedback_run(codec, n, 100, seed=6):
        sum_in += x.numpy()
        sum_dec += decoded.numpy()
        x_max = max(x_max, float(x.abs().max()))
        np.testing.assert_allclose(sum_in - sum_dec, residual.numpy(), rtol=0, atol=1e-3 * x_max)
        x_norm_max = np.maximum(x_norm_max, block_norms(x.numpy()))
        rn = block_norms(residual.numpy())
        # one round: what is left is at most c of what was encoded
        assert (rn <= c * block_norms(s.numpy()) * (1 + 1e-5) + 1e-6).all()
        assert (rn <= limit * x_norm_max * (1 + 1e-5)).all(), r
        norms.append(rn.max())
    # a feedback loop that loses the dropped values would leave a small residual and a large
    # drift; one that never sends them would grow linearly. Neither holds here:
    assert max(norms) > 0
    assert np.abs(sum_in - sum_dec).max() <= limit * x_norm_max.max()


def test_error_feedback_checks_and_non_finite():
    c = codecs.get_codec("int8")
    x = torch.randn(100)
    with pytest.raises(ValueError):
        codecs.encode_with_feedback(c, x, torch.zeros(99))
    with pytest.raises(ValueError):
        codecs.encode_with_feedback(c, x, torch.zeros(100, dtype=torch.float64))
    residual = torch.full((100,), 0.25)
    bad = x.clone()
    bad[3] = float("nan")
    with pytest.raises(CodecError):
        codecs.encode_with_feedback(c, bad, residual)
    assert torch.equal(residual, torch.full((100,), 0.25))  # untouched on failure


# ------------------------------------------------------------------------------------------
# compression ratios


def test_ratios():
    n = 2**20
    x = t(np.random.default_rng(7).standard_normal(n))
    ratio = {name: 4 * n / len(codecs.get_codec(name).encode(x)) for name in codecs.CODEC_NAMES}
    assert ratio["fp32"] == 1.0
    assert ratio["fp16"] == ratio["bf16"] == 2.0
    assert 3.9 < ratio["int8"] < 4.0
    assert 7.8 < ratio["int4"] < 8.0
    assert ratio["topk"] > 20
    # topk error is large but the kept coordinates carry the most energy
    tk = codecs.get_codec("topk")
    d = tk.decode(tk.encode(x), n)
    assert float((d * x).sum()) / float((x * x).sum()) > 1 / 64
