from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses.preference import preference_loss
from rlhf_lightning.losses.value import clipped_value_loss


def test_clipped_value_loss_formula_and_gradient():
    v = torch.tensor([1.0, 0.0, 2.0, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.5, 0.5, 2.1, 0.0], dtype=torch.float64)
    ret = torch.tensor([2.0, 1.0, 0.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    loss, m = clipped_value_loss(v, old, ret, mask, clip_range=0.2)
    expected, grads = [], []
    for vi, oi, ri in zip(v.tolist(), old.tolist(), ret.tolist()):
        vc = oi + max(-0.2, min(0.2, vi - oi))
        un, cl = (vi - ri) ** 2, (vc - ri) ** 2
        expected.append(0.5 * max(un, cl))
        inside = abs(vi - oi) < 0.2
        grads.append((vi - ri) if un >= cl else ((vc - ri) if inside else 0.0))
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), v)
    torch.testing.assert_close(g, torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-12)
    assert m["vf_clipfrac"].item() == pytest.approx(
        sum(
            (max(-0.2, min(0.2, vi - oi)) + oi - ri) ** 2 > (vi - ri) ** 2
            for vi, oi, ri, k in zip(v.tolist(), old.tolist(), ret.tolist(), mask.tolist())
            if k
        )
        / 3
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_preference_losses_match_formulas(loss_type, label_smoothing):
    g = torch.Generator().manual_seed(2)
    pc, pr, rc, rr = (torch.randn(5, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    pc.requires_grad_(True)
    beta = 0.3
    loss, m = preference_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    expected, grads = [], []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()):
        h = (a - c) - (b - d)
        if loss_type == "sigmoid":
            sig = 1 / (1 + math.exp(-beta * h))
            expected.append(-(1 - label_smoothing) * math.log(sig) - label_smoothing * math.log(1 - sig))
            grads.append(-(1 - label_smoothing) * beta * (1 - sig) + label_smoothing * beta * sig)
        else:
            expected.append((h - 1 / (2 * beta)) ** 2)
            grads.append(2 * (h - 1 / (2 * beta)))
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-10)
    (grad,) = torch.autograd.grad(loss.sum(), pc)
    torch.testing.assert_close(grad, torch.tensor(grads, dtype=torch.float64), rtol=0, atol=1e-10)
    chosen = [beta * (a - c) for a, c in zip(pc.tolist(), rc.tolist())]
    rejected = [beta * (b - d) for b, d in zip(pr.tolist(), rr.tolist())]
    assert m["accuracy"].item() == pytest.approx(sum(x > y for x, y in zip(chosen, rejected)) / 5)
    assert m["margin"].item() == pytest.approx(sum(chosen) / 5 - sum(rejected) / 5)
