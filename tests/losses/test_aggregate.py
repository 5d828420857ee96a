from __future__ import annotations

import pytest
import torch

from rlhf_lightning.losses import AGGREGATION_MODES, aggregate


def reference(loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int) -> float:
    """Loops over sequences and tokens, written from the definitions."""
    seq_sums, seq_lens = [], []
    for i in range(loss.shape[0]):
        tokens = [loss[i, j].item() for j in range(loss.shape[1]) if mask[i, j]]
        seq_sums.append(sum(tokens))
        seq_lens.append(len(tokens))
    b = loss.shape[0]
    if mode == "token_mean":
        return sum(seq_sums) / max(sum(seq_lens), 1)
    if mode == "seq_mean_token_mean":
        return sum(s / max(n, 1) for s, n in zip(seq_sums, seq_lens)) / b
    if mode == "seq_mean_token_sum":
        return sum(seq_sums) / b
    return sum(seq_sums) / max_len / b


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_matches_definition(mode):
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) > 0.4
    mask[2] = False  # an empty sequence
    got = aggregate(loss, mask, mode, max_len=11)
    assert got.item() == pytest.approx(reference(loss, mask, mode, 11), abs=1e-12)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_window_normalisers_equal_full_batch_gradient(mode):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 6, generator=g, requires_grad=True)
    mask = torch.rand(8, 6, generator=g) > 0.3

    def per_token():
        return x.square() * torch.linspace(0.5, 2.0, 6)

    (full,) = torch.autograd.grad(aggregate(per_token(), mask, mode, max_len=6), x)
    norm = {"num_tokens": mask.sum().float(), "num_seqs": 8}
    total = 0
    for idx in torch.arange(8).split(3):  # uneven micro-batches: 3, 3, 2
        total = total + aggregate(per_token()[idx], mask[idx], mode, max_len=6, **norm)
    (acc,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(acc, full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_gradient_is_mask_over_denominator(mode):
    g = torch.Generator().manual_seed(8)
    loss = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[:, 0] = True
    (grad,) = torch.autograd.grad(aggregate(loss, mask, mode, max_len=9), loss)
    expected = torch.zeros(4, 6, dtype=torch.float64)
    total, b = int(mask.sum()), 4
    for i in range(4):
        n_i = int(mask[i].sum())
        for j in range(6):
            if mask[i, j]:
                expected[i, j] = {
                    "token_mean": 1 / total,
                    "seq_mean_token_mean": 1 / n_i / b,
                    "seq_mean_token_sum": 1 / b,
                    "seq_mean_token_sum_norm": 1 / 9 / b,
                }[mode]
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)


def test_unknown_mode_and_missing_max_len_are_clear_errors():
    with pytest.raises(ValueError, match="valid modes: token_mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "token_sum")
    with pytest.raises(ValueError, match="needs max_len"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "seq_mean_token_sum_norm")
