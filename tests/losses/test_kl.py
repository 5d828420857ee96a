from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses import kl


@pytest.mark.parametrize(
    ("estimator", "formula"),
    [
        ("k1", lambda lp, rp: lp - rp),
        ("k2", lambda lp, rp: 0.5 * (rp - lp) ** 2),
        ("k3", lambda lp, rp: math.exp(rp - lp) - 1 - (rp - lp)),
    ],
)
def test_kl_estimators_value_and_gradient(estimator, formula):
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
    h = 1e-6
    numeric = torch.tensor(
        [
            [(formula(a + h, b) - formula(a - h, b)) / (2 * h) for a, b in zip(r1, r2)]
            for r1, r2 in zip(lp.tolist(), rp.tolist())
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(grad, numeric, rtol=0, atol=1e-8)


def test_k3_is_nonnegative_and_zero_at_equality_and_clamped():
    lp = torch.tensor([-1.0, -2.0, -0.1])
    assert torch.all(kl(lp, lp, "k3") == 0)
    big = kl(torch.tensor([-20.0]), torch.tensor([-0.01]), "k3", clamp=10.0)
    assert big.item() == 10.0
    assert torch.all(kl(lp, lp - 1.0, "k3") >= 0)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl(torch.zeros(1), torch.zeros(1), "k4")
