from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses import kl


@pytest.mark.parametrize(
    ("estimator", "formula", "derivative"),
    [
        ("k1", lambda lp, rp: lp - rp, lambda lp, rp: 1.0),
        ("k2", lambda lp, rp: 0.5 * (rp - lp) ** 2, lambda lp, rp: lp - rp),
        ("k3", lambda lp, rp: math.exp(rp - lp) - 1 - (rp - lp), lambda lp, rp: 1.0 - math.exp(rp - lp)),
    ],
)
def test_kl_estimators_value_and_gradient(estimator, formula, derivative):
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 5, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    rp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 2
    out = kl(lp, rp, estimator)
    expected = torch.tensor(
        [[formula(a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), rp.tolist())],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out.detach(), expected, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    analytic = torch.tensor(
        [[derivative(a, b) for a, b in zip(r1, r2)] for r1, r2 in zip(lp.tolist(), rp.tolist())],
        dtype=torch.float64,
    )
    torch.testing.assert_close(grad, analytic, rtol=0, atol=1e-10)


def test_k3_is_nonnegative_and_zero_at_equality_and_clamped():
    lp = torch.tensor([-1.0, -2.0, -0.1])
    assert torch.all(kl(lp, lp, "k3") == 0)
    big = kl(torch.tensor([-20.0]), torch.tensor([-0.01]), "k3", clamp=10.0)
    assert big.item() == 10.0
    assert torch.all(kl(lp, lp - 1.0, "k3") >= 0)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_in_reward_and_advantage_shaping():
    from rlhf_lightning.losses.kl import kl_penalized_returns, kl_shaped_advantages

    kl_t = torch.tensor([[0.5, 0.2, 9.0], [0.1, 0.0, 0.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    got = kl_penalized_returns(torch.tensor([1.0, 0.0], dtype=torch.float64), kl_t, mask, beta=0.1)
    torch.testing.assert_close(got, torch.tensor([1.0 - 0.1 * 0.7, 0.0 - 0.1 * 0.4], dtype=torch.float64))
    shaped = kl_shaped_advantages(torch.tensor([2.0, -1.0], dtype=torch.float64), kl_t, mask, beta=0.5)
    expected = torch.tensor([[2 - 0.25, 2 - 0.1, 0.0], [-1 - 0.05, -1.0, -1 - 0.15]], dtype=torch.float64)
    torch.testing.assert_close(shaped, expected)
