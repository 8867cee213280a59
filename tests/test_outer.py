"""The outer Nesterov step (protocol/outer.py): PyTorch's SGD(nesterov=True) with every op rounded on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lowcomm.protocol.outer import NesterovOuter

NUMEL = 10_007
STEPS = 6


def data(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = torch.randn(NUMEL, generator=gen)
    grads = [torch.randn(NUMEL, generator=gen) * (0.1 * (i + 1)) for i in range(STEPS)]
    return params, grads


def reference_step(params: np.ndarray, buf: np.ndarray, grad: np.ndarray, lr: float, momentum: float) -> None:
    """The outer step in numpy float32, every multiply and add a ufunc of its own (one rounding each)."""
    m, lr32 = np.float32(momentum), np.float32(lr)
    buf[...] = np.add(np.multiply(buf, m), grad)
    params[...] = np.subtract(params, np.multiply(lr32, np.add(grad, np.multiply(m, buf))))


@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_equals_the_separately_rounded_formula_bit_for_bit(lr, momentum):
    params, grads = data()
    ref_params, ref_buf = params.numpy().copy(), np.zeros(NUMEL, dtype=np.float32)
    ours = params.clone()
    outer = NesterovOuter.zeros(lr, momentum, NUMEL)
    for grad in grads:
        reference_step(ref_params, ref_buf, grad.numpy(), lr, momentum)
        outer.step_slice(ours, 0, grad)
        assert np.array_equal(ours.numpy(), ref_params)
        assert np.array_equal(outer.buffer.numpy(), ref_buf)
    assert not torch.equal(ours, params)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (1.0, 0.0), (0.3, 0.5)])
def test_matches_torch_sgd_nesterov_up_to_fused_rounding(foreach, lr, momentum):
    """SGD uses fused multiply-adds (``add(..., alpha=)``); we round every op on its own (see
    protocol/outer.py), so the two agree to a few float32 ulps, not bit for bit."""
    params, grads = data()
    reference = torch.nn.Parameter(params.clone())
    sgd = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=foreach)
    ours = params.clone()
    outer = NesterovOuter.zeros(lr, momentum, NUMEL)
    for grad in grads:
        reference.grad = grad.clone()
        sgd.step()
        outer.step_slice(ours, 0, grad)
        torch.testing.assert_close(ours, reference.detach(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(ours, params)


def test_preview_takes_the_step_without_touching_the_momentum():
    params, grads = data(5)
    outer = NesterovOuter.zeros(0.7, 0.9, NUMEL)
    outer.step_slice(params, 0, grads[0])
    buffer = outer.buffer.clone()
    preview = params[100:5000].clone()
    outer.preview_slice(preview, 100, grads[1][100:5000])
    assert torch.equal(outer.buffer, buffer)
    outer.step_slice(params, 100, grads[1][100:5000])
    assert torch.equal(preview, params[100:5000])


def test_refuses_state_off_the_cpu_or_not_float32():
    with pytest.raises(ValueError, match="float32 CPU"):
        NesterovOuter(0.7, 0.9, torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="float32 CPU"):
        NesterovOuter.zeros(0.7, 0.9, 4).step_slice(torch.zeros(4, dtype=torch.float64), 0, torch.zeros(4))


def test_lr_one_no_momentum_moves_onto_local_weights():
    theta_global, _ = data(1)
    theta_local = theta_global + torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
    delta = theta_global - theta_local
    params = theta_global.clone()
    NesterovOuter.zeros(1.0, 0.0, NUMEL).step_slice(params, 0, delta)
    assert torch.allclose(params, theta_local, atol=1e-6)


@pytest.mark.parametrize("bounds", [[0, NUMEL], [0, 1, NUMEL], [0, 3000, 3001, 7000, NUMEL], [0, 0, 5000, 5000, NUMEL]])
def test_disjoint_slices_equal_one_full_step(bounds):
    params, grads = data(3)
    full, sliced = params.clone(), params.clone()
    full_outer, sliced_outer = NesterovOuter.zeros(0.7, 0.9, NUMEL), NesterovOuter.zeros(0.7, 0.9, NUMEL)
    for grad in grads:
        full_outer.step_slice(full, 0, grad)
        for start, end in reversed(list(zip(bounds, bounds[1:]))):  # order must not matter
            sliced_outer.step_slice(sliced, start, grad[start:end])
    assert torch.equal(full, sliced)
    assert torch.equal(full_outer.buffer, sliced_outer.buffer)


def test_skipped_slice_keeps_params_and_momentum():
    params, grads = data(4)
    outer = NesterovOuter.zeros(0.7, 0.9, NUMEL)
    outer.step_slice(params, 0, grads[0])
    before_params, before_buffer = params.clone(), outer.buffer.clone()
    outer.step_slice(params, 5000, grads[1][5000:])  # shard [0, 5000) was skipped this round
    assert torch.equal(params[:5000], before_params[:5000])
    assert torch.equal(outer.buffer[:5000], before_buffer[:5000])
    assert not torch.equal(params[5000:], before_params[5000:])
