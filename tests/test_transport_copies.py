"""The all-reduce's cheaper data path (issue 17 item 2) computes exactly what the plain one did:
the finite-value check, the blockwise float64 mean, fp32's in-place decode, the payload inbox and
error feedback for a lossless codec."""

from __future__ import annotations

import pytest
import torch

from lowcomm.protocol import codecs
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
