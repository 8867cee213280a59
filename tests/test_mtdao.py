"""MT-DAO (node/optimizers.py): its update rule against the formula written out by hand, and its
states as the trainer exposes them to the state sync (flat, in the parameters' order)."""

from __future__ import annotations

import math

import pytest
import torch

from lowcomm.node.optimizers import MTDAO
from lowcomm.node.trainer import load_optimizer_state_flat, optimizer_state_flat


def test_update_matches_the_hand_formula_over_several_steps():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(4)]
    lr, b_f, b_s, b2, omega, eps, wd = 0.01, 0.9, 0.99, 0.95, 0.3, 1e-8, 0.1
    param = torch.nn.Parameter(start.clone())
    opt = MTDAO([param], lr=lr, beta_fast=b_f, beta_slow=b_s, beta2=b2, slow_weight=omega, eps=eps, weight_decay=wd)
    theta, m_f, m_s, v = start.tolist(), [0.0] * 5, [0.0] * 5, [0.0] * 5
    for t, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        opt.step()
        for i, g in enumerate(grad.tolist()):
            m_f[i] = b_f * m_f[i] + (1 - b_f) * g
            m_s[i] = b_s * m_s[i] + (1 - b_s) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (1 - omega) * m_f[i] / (1 - b_f ** t) + omega * m_s[i] / (1 - b_s ** t)
            theta[i] = theta[i] * (1 - lr * wd) - lr * u / (math.sqrt(v[i] / (1 - b2 ** t)) + eps)
    assert torch.allclose(param.detach(), torch.tensor(theta, dtype=torch.float64), rtol=0, atol=1e-12)
    state = opt.state[param]
    assert state["step"] == 4
    assert torch.allclose(state["exp_avg_slow"], torch.tensor(m_s, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(state["exp_avg_fast"], torch.tensor(m_f, dtype=torch.float64), atol=1e-15)


def test_slow_weight_zero_is_adam_with_decoupled_decay():
    """ω = 0 leaves only the fast moment: AdamW's step with the same betas (a second, independent check)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.nn.Parameter(torch.randn(7, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ours = MTDAO([a], lr=0.05, beta_fast=0.9, beta2=0.95, slow_weight=0.0, weight_decay=0.1)
    adamw = torch.optim.AdamW([b], lr=0.05, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for _ in range(5):
        grad = torch.randn(7, generator=gen)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step()
        adamw.step()
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"beta_slow": 1.0}, {"slow_weight": 1.5}, {"lr": 0.0}])
def test_bad_hyperparameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="MTDAO"):
        MTDAO([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_a_state_goes_out_flat_and_comes_back_in_place():
    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    opt = MTDAO(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    flat = optimizer_state_flat(opt, params, "exp_avg_slow")
    assert flat.shape == (10,) and torch.allclose(flat, torch.full((10,), 0.01))
    load_optimizer_state_flat(opt, params, "exp_avg_slow", torch.arange(10, dtype=torch.float32))
    assert torch.equal(opt.state[params[0]]["exp_avg_slow"], torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(opt.state[params[1]]["exp_avg_slow"], torch.arange(6, 10, dtype=torch.float32))
