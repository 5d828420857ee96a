"""The chunked op against naive full-logits log-probs, values and gradients."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.ops import chunked_logprobs, resolve_chunk_rows


def naive(hidden, weight, targets, bias, temperature):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logp_all = (logits / temperature).log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def make(dtype, b=3, t=7, h=12, v=41, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g, dtype=dtype) * 0.5).requires_grad_(True)
    b_ = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_(True) if bias else None
    targets = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, b_, targets


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1000])  # 1, a non-divisor of B*T=21, larger than B*T
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [True, False])
def test_values_entropy_and_gradients_match_naive(dtype, tol, chunk_rows, temperature, bias):
    hidden, weight, b, targets = make(dtype, bias=bias)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(3, 7, generator=g, dtype=dtype), torch.randn(3, 7, generator=g, dtype=dtype)
    mask = torch.rand(3, 7, generator=g) > 0.3  # padded positions get no weight
    params = [hidden, weight] + ([b] if b is not None else [])

    lp, ent = chunked_logprobs(
        hidden, weight, targets, bias=b, temperature=temperature, chunk_rows=chunk_rows, return_entropy=True
    )
    grads = torch.autograd.grad(((lp * w_lp + ent * w_ent) * mask).sum(), params)
    lp_ref, ent_ref = naive(hidden, weight, targets, b, temperature)
    grads_ref = torch.autograd.grad(((lp_ref * w_lp + ent_ref * w_ent) * mask).sum(), params)

    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=tol)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=tol)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_tied_weights_accumulate_both_gradient_paths():
    """With tied embeddings the lm-head weight is also the input embedding."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(30, 8).double()
    ids = torch.randint(0, 30, (2, 6))

    def loss(use_chunked):
        h = torch.tanh(emb(ids[:, :-1]))
        if use_chunked:
            lp = chunked_logprobs(h, emb.weight, ids[:, 1:], chunk_rows=4)
        else:
            lp, _ = naive(h, emb.weight, ids[:, 1:], None, 1.0)
        return -lp.sum()

    (g1,) = torch.autograd.grad(loss(True), emb.weight)
    (g2,) = torch.autograd.grad(loss(False), emb.weight)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-10)


def test_frozen_weight_gets_no_gradient_and_no_grad_mode_works():
    hidden, weight, _, targets = make(torch.float64, bias=False)
    weight.requires_grad_(False)
    lp = chunked_logprobs(hidden, weight, targets, chunk_rows=4)
    (gh,) = torch.autograd.grad(lp.sum(), [hidden])
    assert gh.shape == hidden.shape
    with torch.no_grad():
        lp2 = chunked_logprobs(hidden, weight, targets)
    torch.testing.assert_close(lp.detach(), lp2)


def test_bf16_inputs_compute_in_fp32():
    hidden, weight, _, targets = make(torch.float32, bias=False)
    lp = chunked_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_rows=4)
    assert lp.dtype == torch.float32
    ref, _ = naive(hidden.bfloat16().float(), weight.bfloat16().float(), targets, None, 1.0)
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-2)


def test_chunk_rows_knob():
    assert resolve_chunk_rows(None, 151_936) == 441  # ~256 MB of fp32 logits
    assert resolve_chunk_rows(None, 400) == 4096  # clamped
    assert resolve_chunk_rows(None, 10**7) == 128
    assert resolve_chunk_rows(7, 100) == 7
    for bad in (0, -3):
        with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
            resolve_chunk_rows(bad, 100)
