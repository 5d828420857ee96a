"""Liger's fused GRPO loss (its chunked losses are plain PyTorch, so they run on the CPU too)
must give the same loss and gradients as our chunked op + objective + aggregation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhf_lightning.learner.liger_path import liger_unsupported
from rlhf_lightning.losses import aggregate, get_policy_loss, kl
from rlhf_lightning.ops import chunked_logprobs
from rlhf_lightning.ops.liger import LigerLoss, liger_available, liger_policy_loss, pack_actions

pytestmark = pytest.mark.skipif(
    not liger_available(), reason="liger-kernel is not installed (make install-dev installs it)"
)


def hp(**kw):
    base = dict(
        loss="ppo_clip",
        loss_agg_mode="token_mean",
        clip_low=0.2,
        clip_high=0.28,
        clip_ratio_c=None,
        beta=0.0,
        kl_mode="loss",
        kl_estimator="k3",
        kl_clamp=None,
        kl_importance_weighted=False,
        is_level="sequence",
        is_pooling="mean",
        module="grpo",
        mask_truncated=False,
        offpolicy_token_bounds=None,
        offpolicy_seq_threshold=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


CASES = [
    hp(),
    hp(loss_agg_mode="seq_mean_token_mean"),
    hp(loss_agg_mode="seq_mean_token_sum_norm"),
    hp(beta=0.05),
    hp(beta=0.05, kl_importance_weighted=True),
    hp(loss="cispo", clip_low=None, clip_high=4.0),
    hp(loss="gspo", loss_agg_mode="seq_mean_token_mean", clip_low=0.05, clip_high=0.05),
]


@pytest.mark.parametrize(
    "h", CASES, ids=lambda h: f"{h.loss}-{h.loss_agg_mode}-beta{h.beta}-iw{h.kl_importance_weighted}"
)
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_liger_matches_our_path(h, with_is_weights):
    assert liger_unsupported(h) is None
    g = torch.Generator().manual_seed(0)
    b, t, hdim, v = 4, 7, 16, 50
    action = torch.rand(b, t, generator=g) > 0.3
    action[:, 0] = True
    n = int(action.sum())
    rows = torch.randn(n, hdim, generator=g, requires_grad=True)
    head = torch.nn.Linear(hdim, v, bias=True)
    targets = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(b, generator=g)
    temperature = 0.9
    with torch.no_grad():
        cur = torch.zeros(b, t).masked_scatter(
            action, chunked_logprobs(rows, head.weight, targets, head.bias, temperature)
        )
    old = (cur + torch.randn(b, t, generator=g) * 0.1) * action
    ref = (cur + torch.randn(b, t, generator=g) * 0.2) * action
    w = (torch.rand(b, t, generator=g) + 0.5).clamp(max=1.3) * action if with_is_weights else None
    norm = {"num_tokens": action.sum().float() + 5.0, "num_seqs": torch.tensor(b + 2.0)}  # a larger window

    # our path
    logp = torch.zeros(b, t).masked_scatter(
        action, chunked_logprobs(rows, head.weight, targets, head.bias, temperature)
    )
    kwargs = {"clip_low": h.clip_low, "clip_high": h.clip_high}
    per_token, m = get_policy_loss(h.loss)(logp, old, adv, action, **kwargs)
    if w is not None:
        per_token = per_token * w
    if h.beta > 0:
        k = kl(logp, ref, "k3")
        if h.kl_importance_weighted:
            k = k * torch.exp(logp - old)
        per_token = per_token + h.beta * k
    ours = aggregate(per_token, action, h.loss_agg_mode, max_len=t, **norm)
    grads_ours = torch.autograd.grad(ours, [rows, head.weight, head.bias])

    theirs, metrics = liger_policy_loss(
        rows,
        head,
        targets,
        action,
        adv,
        old,
        ref if h.beta > 0 else None,
        w,
        LigerLoss(h.loss, h.loss_agg_mode, h.clip_low, h.clip_high, h.beta, h.kl_importance_weighted),
        temperature=temperature,
        max_len=t,
        compiled=False,
        **norm,
    )
    grads_theirs = torch.autograd.grad(theirs, [rows, head.weight, head.bias])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for a, c in zip(grads_theirs, grads_ours):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)
    if h.loss == "ppo_clip":
        torch.testing.assert_close(metrics["clipfrac"], m["clipfrac"], rtol=1e-5, atol=1e-6)


def test_unsupported_combinations_are_named():
    assert "seq_mean_token_sum" in liger_unsupported(hp(loss_agg_mode="seq_mean_token_sum"))
    assert "reinforce" in liger_unsupported(hp(loss="reinforce"))
    assert "kl_clamp" in liger_unsupported(hp(beta=0.1, kl_clamp=10.0))
    assert "dual clip" in liger_unsupported(hp(clip_ratio_c=3.0))


def test_pack_actions_is_left_packed_and_differentiable():
    mask = torch.tensor([[False, True, True], [True, False, False]])
    rows = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    packed, m = pack_actions(rows, mask)
    assert packed.squeeze(-1).tolist() == [[1.0, 2.0], [3.0, 0.0]] and m.tolist() == [
        [True, True],
        [True, False],
    ]
    (g,) = torch.autograd.grad(packed.sum(), rows)
    assert g.tolist() == [[1.0], [1.0], [1.0]]
