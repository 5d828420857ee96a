"""Each objective against an independent float64 implementation of its paper's formula:
element-wise Python arithmetic for the value and the analytic derivative for the gradient."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses import POLICY_LOSSES, aggregate, get_policy_loss


def random_inputs(seed: int, b: int = 6, t: int = 9, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    adv = (
        torch.randn(b, t, generator=g, dtype=torch.float64)
        if per_token_adv
        else torch.randn(b, generator=g, dtype=torch.float64)
    )
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    return logp, old, adv, mask


def clip(x: float, lo: float | None, hi: float | None) -> float:
    x = x if lo is None else max(x, 1 - lo)
    return x if hi is None else min(x, 1 + hi)


def ppo_token(lp, old, a, lo, hi, c):
    """-min(rA, clip(r)A) (+ dual clip) and its derivative w.r.t. lp."""
    r = math.exp(lp - old)
    unclipped, clipped = r * a, clip(r, lo, hi) * a
    obj, grad = (unclipped, -r * a) if unclipped <= clipped else (clipped, 0.0)
    if c is not None and a < 0 and obj < c * a:
        obj, grad = c * a, 0.0
    return -obj, grad


def cispo_token(lp, old, a, lo, hi):
    w = clip(math.exp(lp - old), lo, hi)  # stop-gradient weight
    return -w * a * lp, -w * a


def reinforce_token(lp, old, a):
    return -a * lp, -a


TOKEN_CASES = [
    ("ppo_clip", {"clip_low": 0.2, "clip_high": 0.2}, lambda *x: ppo_token(*x, 0.2, 0.2, None)),
    ("ppo_clip", {"clip_low": 0.2, "clip_high": 0.28}, lambda *x: ppo_token(*x, 0.2, 0.28, None)),
    ("ppo_clip", {"clip_low": None, "clip_high": 0.3}, lambda *x: ppo_token(*x, None, 0.3, None)),
    (
        "ppo_clip",
        {"clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": 1.5},
        lambda *x: ppo_token(*x, 0.2, 0.2, 1.5),
    ),
    ("cispo", {"clip_low": None, "clip_high": 0.5}, lambda *x: cispo_token(*x, None, 0.5)),
    ("cispo", {"clip_low": 0.1, "clip_high": 0.2}, lambda *x: cispo_token(*x, 0.1, 0.2)),
    ("reinforce", {}, reinforce_token),
]


@pytest.mark.parametrize(("name", "kwargs", "ref"), TOKEN_CASES)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_token_objective_value_and_gradient(name, kwargs, ref, per_token_adv):
    logp, old, adv, mask = random_inputs(
        seed=sum(map(ord, name)) + 7 * per_token_adv, per_token_adv=per_token_adv
    )
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, **kwargs)
    a2 = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    value = torch.zeros_like(old)
    grad_ref = torch.zeros_like(old)
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            v, g = ref(logp[i, j].item(), old[i, j].item(), a2[i, j].item())
            value[i, j], grad_ref[i, j] = v, g * float(mask[i, j])
    torch.testing.assert_close(loss.detach(), value, rtol=0, atol=1e-10)
    (grad,) = torch.autograd.grad((loss * mask).sum(), logp)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-10)
    for key in ("clipfrac", "ratio_mean", "ratio_max", "ratio_min", "ratio_std"):
        assert key in metrics and not metrics[key].requires_grad


def gspo_reference(logp, old, adv, mask, turn_ids, lo, hi, pooling):
    """J = 1/B sum_i 1/|y_i| sum_{k} |turn k| * -min(s_ik A, clip(s_ik) A) and dJ/dlogp, element-wise.

    Without turn_ids the whole sequence is one turn (GSPO eq. 5, s_i = geometric-mean ratio)."""
    b, t = logp.shape
    total, grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        tokens = [j for j in range(t) if mask[i, j]]
        turns: dict[int, list[int]] = {}
        for j in tokens:
            turns.setdefault(0 if turn_ids is None else int(turn_ids[i, j]), []).append(j)
        a = float(adv[i])
        for members in turns.values():
            logr = sum(logp[i, j].item() - old[i, j].item() for j in members)
            s = math.exp(logr / len(members) if pooling == "mean" else logr)
            obj, active = (s * a, True) if s * a <= clip(s, lo, hi) * a else (clip(s, lo, hi) * a, False)
            total += -obj * len(members) / len(tokens) / b
            if active:
                d_pool = 1 / len(members) if pooling == "mean" else 1.0
                for j in members:
                    grad[i, j] = -a * s * d_pool * len(members) / len(tokens) / b
    return total, grad


@pytest.mark.parametrize("pooling", ["mean", "sum"])
@pytest.mark.parametrize("per_turn", [False, True])
@pytest.mark.parametrize(("lo", "hi"), [(3e-4, 4e-4), (0.2, 0.3)])
def test_gspo_value_and_gradient(pooling, per_turn, lo, hi):
    logp, old, adv, mask = random_inputs(seed=11 + per_turn, b=5, t=10)
    with torch.no_grad():  # ratios near 1 so that some sequences fall inside the clip range
        old.copy_(logp.detach() + (old - logp.detach()) * 0.02)
    turn_ids = None
    if per_turn:
        turn_ids = torch.where(mask, torch.arange(10)[None, :].expand(5, 10) // 4, torch.full((5, 10), -1))
    kwargs = {"clip_low": lo, "clip_high": hi, "is_pooling": pooling, "turn_ids": turn_ids}
    loss, metrics = get_policy_loss("gspo")(logp, old, adv, mask, **kwargs)
    j = aggregate(loss, mask, "seq_mean_token_mean")
    expected, expected_grad = gspo_reference(logp, old, adv, mask, turn_ids, lo, hi, pooling)
    assert j.item() == pytest.approx(expected, abs=1e-10)
    (grad,) = torch.autograd.grad(j, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-10)
    assert 0 <= metrics["clipfrac"].item() <= 1


def test_gspo_on_policy_equals_sequence_mean_reinforce_gradient():
    logp, _, adv, mask = random_inputs(seed=5)
    old = logp.detach().clone()
    g1 = torch.autograd.grad(
        aggregate(get_policy_loss("gspo")(logp, old, adv, mask)[0], mask, "seq_mean_token_mean"), logp
    )
    g2 = torch.autograd.grad(
        aggregate(get_policy_loss("reinforce")(logp, old, adv, mask)[0], mask, "seq_mean_token_mean"), logp
    )
    torch.testing.assert_close(g1[0], g2[0], rtol=0, atol=1e-12)


def test_ppo_clipfrac_counts_tokens_whose_gradient_is_clipped():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]], dtype=torch.float64))
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    _, m = get_policy_loss("ppo_clip")(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # token 0: r=1.5 > 1.2 with A>0 -> clipped; token 1: r=0.5 < 0.8 with A<0 -> clipped; token 2 inside.
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert m["ratio_min"].item() == pytest.approx(0.5)  # the masked token's 0.7 does not count
    mean = (1.5 + 0.5 + 1.1) / 3
    spread = (((1.5 - mean) ** 2 + (0.5 - mean) ** 2 + (1.1 - mean) ** 2) / 3) ** 0.5
    assert m["ratio_std"].item() == pytest.approx(spread, abs=1e-12)


def test_registry_lists_names_and_rejects_duplicates():
    assert {"ppo_clip", "cispo", "gspo", "reinforce", "dppo_tv", "dppo_kl", "sapo", "gmpo", "kl_cov"} == set(
        POLICY_LOSSES
    )
    with pytest.raises(
        KeyError, match=r"valid names: cispo, dppo_kl, dppo_tv, gmpo, gspo, kl_cov, ppo_clip, reinforce, sapo"
    ):
        get_policy_loss("ppo_clipp")
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("cispo")(lambda *a: None)
