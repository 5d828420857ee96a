from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses.corrections import offpolicy_mask, overlong_penalty, truncated_importance_weights


def test_truncated_importance_weights_and_metrics():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    beh = torch.tensor([[-1.1, -1.0, -2.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    w, m = truncated_importance_weights(old, beh, mask, cap=2.0)
    expected = [min(math.exp(o - b), 2.0) for o, b in zip(old[0].tolist(), beh[0].tolist())]
    torch.testing.assert_close(w[0], torch.tensor(expected, dtype=torch.float64))
    assert m["gap_mean"].item() == pytest.approx((0.1 + 1.0 + 1.5) / 3)
    assert m["clip_frac"].item() == pytest.approx(1 / 3)  # exp(1.5) > 2


def test_offpolicy_token_and_sequence_masks():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    beh = torch.tensor([[-1.0, -3.0, -1.05], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    keep, m = offpolicy_mask(old, beh, mask, token_bounds=(0.5, 2.0))
    # ratios exp(old - beh): row 0: 1, e^2 (out), e^0.05; row 1: e^-1 (out) everywhere
    assert keep.tolist() == [[True, False, True], [False, False, False]]
    assert m["masked_token_frac"].item() == pytest.approx(4 / 6)
    keep, m = offpolicy_mask(old, beh, mask, seq_threshold=0.5)
    # mean(beh - old): row 0: (0 - 2 - 0.05) / 3 < 0.5 kept; row 1: 1.0 > 0.5 dropped
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    assert m["masked_seq_frac"].item() == 0.5


def test_overlong_penalty_follows_dapo_eq_13():
    lengths = torch.tensor([10, 16, 17, 19, 20, 25])
    got = overlong_penalty(lengths, max_len=20, buffer=4, factor=1.0)
    expected = [0.0, 0.0, (16 - 17) / 4, (16 - 19) / 4, (16 - 20) / 4, -1.0]
    torch.testing.assert_close(got, torch.tensor(expected))
