"""The chunked full-vocabulary reverse KL against the formula computed densely in float64."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.ops.reverse_kl import chunked_reverse_kl


def dense_kl(h_s, w_s, b_s, h_t, w_t, b_t, temperature):
    """``sum_v p_s (log p_s - log p_t)`` from full logits, float64, autograd for the gradient."""
    z_s = h_s.double() @ w_s.double().t() + (0 if b_s is None else b_s.double())
    z_t = h_t.double() @ w_t.double().t() + (0 if b_t is None else b_t.double())
    log_ps = (z_s / temperature).log_softmax(-1)
    log_pt = (z_t / temperature).log_softmax(-1)
    return (log_ps.exp() * (log_ps - log_pt)).sum(-1)


def make(dtype, b=3, t=7, h_s=12, h_t=9, v=41, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(b, t, h_s, generator=g, dtype=dtype).requires_grad_(True)
    ws = (torch.randn(v, h_s, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    bs = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_(True) if bias else None
    ht = torch.randn(b, t, h_t, generator=g, dtype=dtype)  # another width: the teacher is another model
    wt = torch.randn(v, h_t, generator=g, dtype=dtype) * 0.5
    bt = torch.randn(v, generator=g, dtype=dtype) * 0.1 if bias else None
    return hs, ws, bs, ht, wt, bt


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])  # 1, a non-divisor of 21 rows, more than all
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_the_dense_formula(dtype, tol, chunk_rows, temperature, bias):
    hs, ws, bs, ht, wt, bt = make(dtype, bias=bias)
    weights = torch.randn(3, 7, generator=torch.Generator().manual_seed(3), dtype=dtype)
    params = [hs, ws] + ([bs] if bs is not None else [])

    got = chunked_reverse_kl(hs, ws, ht, wt, bs, bt, temperature=temperature, chunk_rows=chunk_rows)
    want = dense_kl(hs, ws, bs, ht, wt, bt, temperature)
    assert got.shape == (3, 7)
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)
    assert (want > 0).all()  # the two distributions differ everywhere: a real KL, not zeros

    g_got = torch.autograd.grad((got * weights).sum(), params)
    g_want = torch.autograd.grad((want * weights.double()).sum(), params)
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == dtype
        assert torch.allclose(a.double(), b.double(), atol=tol * 10, rtol=tol * 10)


def test_the_teacher_gets_no_gradient_and_equal_models_give_zero():
    hs, ws, bs, _, _, _ = make(torch.float64)
    ht = hs.detach().clone().requires_grad_(True)
    wt = ws.detach().clone().requires_grad_(True)
    kl = chunked_reverse_kl(hs, ws, ht, wt, bs, bs.detach(), chunk_rows=4)
    assert torch.allclose(kl, torch.zeros_like(kl), atol=1e-12)
    kl.sum().backward()
    assert ht.grad is None and wt.grad is None
    # at the minimum the gradient vanishes
    assert torch.allclose(hs.grad, torch.zeros_like(hs), atol=1e-12)


def test_one_vocabulary_and_matching_rows_are_required():
    hs, ws, bs, ht, wt, bt = make(torch.float32)
    with pytest.raises(ValueError, match="41 tokens and the teacher's 40"):
        chunked_reverse_kl(hs, ws, ht, wt[:40], bs, bt)
    with pytest.raises(ValueError, match="rows"):
        chunked_reverse_kl(hs, ws, ht[:, :5], wt, bs, bt)
