"""The all-reduce's cheaper data path (issue 17 item 2) computes exactly what the plain one did:
the finite-value check, the blockwise float64 mean, fp32's in-place decode, the payload inbox,
error feedback for a lossless codec, and chunks framed and parsed without protobuf (wire.py)."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError

from lowcomm.protocol import codecs, wire
from lowcomm.protocol._pb.lowcomm.v1 import averaging_pb2
from lowcomm.protocol.aggregation import MEAN_BLOCK, _scaled_mean
from lowcomm.protocol.sender import Inbox
from lowcomm.protocol.validate import ContributionRejected, check_contribution

FP32 = codecs.get_codec("fp32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 1, 4097, -1])
def test_finite_check_finds_one_bad_value_anywhere(bad: float, where: int) -> None:
    values = torch.linspace(-1.0, 1.0, 5000)
    values[::2] *= 3e38  # finite extremes pass...
    check_contribution(values)
    values[where] = bad  # ...one NaN or infinity anywhere does not
    with pytest.raises(ContributionRejected, match="1 of 5000 values") as err:
        check_contribution(values)
    assert err.value.reason == "non_finite"


def test_finite_check_accepts_empty_and_multidimensional() -> None:
    check_contribution(torch.empty(0))
    check_contribution(torch.zeros(3, 4))
    with pytest.raises(ContributionRejected):
        check_contribution(torch.tensor([[0.0, float("nan")]]))


def whole_tensor_mean(terms: list[tuple[float, float, torch.Tensor]]) -> torch.Tensor:
    """The formula before blocks: one float64 pass over the whole tensor per term."""
    total = torch.zeros(terms[0][2].numel(), dtype=torch.float64)
    for weight, scale, x in terms:
        total.add_(x.to(torch.float64, copy=True).mul_(weight * scale))
    return total.div_(sum(w for w, _, _ in terms)).to(torch.float32)


@pytest.mark.parametrize("numel", [1, MEAN_BLOCK, 2 * MEAN_BLOCK + 17])
def test_blockwise_mean_is_bit_identical_to_the_whole_tensor_formula(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    xs = [torch.randn(numel, generator=gen) * 10 ** torch.randint(-30, 30, (numel,), generator=gen)
          for _ in range(4)]
    xs[0][: min(numel, 5)] = -0.0  # -0.0 + ... must come out as the same zero
    xs[1][: min(numel, 3)] = -0.0
    terms = [(1.0, 1.0, xs[0]), (3.0, 1.0, xs[1]), (1.0, 0.37, xs[2]), (0.5, 2.0, xs[3])]
    for chosen in (terms, terms[:1], [terms[0], terms[1]]):
        got, want = _scaled_mean(chosen), whole_tensor_mean(chosen)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fp32_decode_owned_reads_the_payload_in_place() -> None:
    x = torch.randn(1000)
    payload = bytearray(FP32.encode(x))
    decoded = FP32.decode_owned(payload, 1000)
    assert torch.equal(decoded, x)
    payload[:4] = FP32.encode(torch.tensor([7.0]))
    assert decoded[0] == 7.0  # the same memory: no copy was made
    assert torch.equal(FP32.decode_owned(bytes(FP32.encode(x)), 1000), x)  # read-only bytes: a copy
    with pytest.raises(codecs.CodecError, match="expected 4000"):
        FP32.decode_owned(bytearray(3999), 1000)


@pytest.mark.parametrize("name", ["int8", "fp16", "topk"])
def test_decode_owned_of_other_codecs_is_decode(name: str) -> None:
    codec = codecs.get_codec(name)
    payload = codec.encode(torch.randn(300))
    assert torch.equal(codec.decode_owned(bytearray(payload), 300), codec.decode(payload, 300))


def test_inbox_gathers_chunks_refuses_overflow_and_checks_values() -> None:
    x = torch.randn(5000)
    payload = FP32.encode(x)
    inbox = Inbox(len(payload))
    for start in range(0, len(payload), 6000):
        assert not inbox.complete
        assert inbox.add(payload[start:start + 6000])
    assert inbox.complete and inbox.filled == len(payload)
    assert not inbox.add(b"\0")  # beyond the declared size: refused, nothing appended
    assert inbox.filled == len(payload)
    assert torch.equal(inbox.decode(FP32, 5000), x)

    bad = x.clone()
    bad[17] = float("inf")
    inbox = Inbox(len(payload))
    assert inbox.add(FP32.encode(bad))
    with pytest.raises(ContributionRejected):
        inbox.decode(FP32, 5000)
    inbox.release()
    assert inbox.size == inbox.filled == 0


def test_lossless_error_feedback_returns_what_a_receiver_decodes() -> None:
    x, residual = torch.randn(1000), torch.randn(1000)
    s = x + residual
    payload, decoded = codecs.encode_with_feedback(FP32, x, residual)
    assert torch.equal(decoded, FP32.decode(payload, 1000))
    assert torch.equal(decoded, s)
    assert torch.equal(residual, torch.zeros(1000))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 2 * 2**20 + 3])
def test_a_chunk_has_protobufs_wire_bytes_and_parses_back_as_a_view(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    framed = wire.Chunk(memoryview(data), framed=True)
    raw = wire.serialize(framed)
    assert raw == averaging_pb2.ReduceMessage(chunk=data).SerializeToString()
    assert wire.serialize(framed) is raw  # framed once: every member is sent the same object
    assert wire.serialize(wire.Chunk(memoryview(data))) == raw
    parsed = wire.parse(raw)
    assert isinstance(parsed, wire.Chunk) and parsed.HasField("chunk") and not parsed.HasField("header")
    assert bytes(parsed.chunk) == data and len(parsed.chunk) == size
    assert averaging_pb2.ReduceMessage.FromString(raw).chunk == data


def test_wire_parse_leaves_every_other_message_to_protobuf() -> None:
    header = averaging_pb2.ReduceMessage(header=averaging_pb2.ReduceHeader(numel=5, sender_peer_id="p"))
    got = wire.parse(header.SerializeToString())
    assert isinstance(got, averaging_pb2.ReduceMessage) and got.header.numel == 5
    assert not wire.parse(b"").HasField("chunk")  # an empty message: no field set, as protobuf says
    # A chunk followed by a header: protobuf's oneof keeps the last one; so does parse.
    two = averaging_pb2.ReduceMessage(chunk=b"ab").SerializeToString() + header.SerializeToString()
    assert wire.parse(two).HasField("header")
    with pytest.raises(DecodeError):  # a chunk shorter than its length says: protobuf's error
        wire.parse(b"\x1a\x05ab")
    assert [bytes(c.chunk) for c in wire.chunks(b"abcde", 2)] == [b"ab", b"cd", b"e"]
    assert [bytes(c.chunk) for c in wire.chunks(b"", 2)] == [b""]
