"""Each objective against an independent float64 implementation of its paper's formula."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses import POLICY_LOSSES, get_policy_loss


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
    return logp, old, adv, mask


def ref_ppo_clip(
    lp: float, old: float, a: float, lo: float | None, hi: float | None, c: float | None
) -> float:
    r = math.exp(lp - old)
    rc = r if lo is None else max(r, 1 - lo)
    rc = rc if hi is None else min(rc, 1 + hi)
    obj = min(r * a, rc * a)
    if c is not None and a < 0:
        obj = max(obj, c * a)
    return -obj


def ref_cispo(lp: float, old: float, a: float, lo: float | None, hi: float | None) -> float:
    r = math.exp(lp - old)
    w = r if lo is None else max(r, 1 - lo)
    w = w if hi is None else min(w, 1 + hi)
    return -w * a * lp  # w is a constant (stop-gradient)


def elementwise(fn, logp, old, adv):
    b, t = logp.shape
    a2 = adv if adv.dim() == 2 else adv[:, None].expand(b, t)
    return [[fn(logp[i, j].item(), old[i, j].item(), a2[i, j].item()) for j in range(t)] for i in range(b)]


def numeric_grad(fn, logp, old, adv, h=1e-6):
    """Central differences of each token's reference loss w.r.t. its own logp."""
    b, t = logp.shape
    a2 = adv if adv.dim() == 2 else adv[:, None].expand(b, t)
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            lp, o, a = logp[i, j].item(), old[i, j].item(), a2[i, j].item()
            out[i, j] = (fn(lp + h, o, a) - fn(lp - h, o, a)) / (2 * h)
    return out


CASES = [
    (
        "ppo_clip",
        {"clip_low": 0.2, "clip_high": 0.2},
        lambda lp, o, a: ref_ppo_clip(lp, o, a, 0.2, 0.2, None),
    ),
    (
        "ppo_clip",
        {"clip_low": 0.2, "clip_high": 0.28},
        lambda lp, o, a: ref_ppo_clip(lp, o, a, 0.2, 0.28, None),
    ),
    (
        "ppo_clip",
        {"clip_low": None, "clip_high": 0.3},
        lambda lp, o, a: ref_ppo_clip(lp, o, a, None, 0.3, None),
    ),
    (
        "ppo_clip",
        {"clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": 1.5},
        lambda lp, o, a: ref_ppo_clip(lp, o, a, 0.2, 0.2, 1.5),
    ),
    ("cispo", {"clip_low": None, "clip_high": 0.5}, lambda lp, o, a: ref_cispo(lp, o, a, None, 0.5)),
    ("cispo", {"clip_low": 0.1, "clip_high": 0.2}, lambda lp, o, a: ref_cispo(lp, o, a, 0.1, 0.2)),
    ("reinforce", {}, lambda lp, o, a: -a * lp),
]


@pytest.mark.parametrize(("name", "kwargs", "ref"), CASES)
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_objective_value_and_gradient_match_paper_formula(name, kwargs, ref, per_token_adv):
    logp, old, adv, mask = random_inputs(
        seed=sum(map(ord, name)) + 7 * per_token_adv, per_token_adv=per_token_adv
    )
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, **kwargs)
    expected = torch.tensor(elementwise(ref, logp, old, adv), dtype=torch.float64)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-10)
    (grad,) = torch.autograd.grad((loss * mask).sum(), logp)
    if name == "cispo":  # the weight is detached: d/dlogp = -w * A exactly
        r = torch.exp(logp.detach() - old)
        w = r.clamp(None if kwargs["clip_low"] is None else 1 - kwargs["clip_low"], 1 + kwargs["clip_high"])
        a2 = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
        expected_grad = -w * a2 * mask
    else:
        expected_grad = numeric_grad(ref, logp.detach(), old, adv) * mask
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-8 if name != "cispo" else 1e-10)
    for key in ("clipfrac", "ratio_mean", "ratio_max"):
        assert key in metrics and not metrics[key].requires_grad


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


def test_registry_lists_names_and_rejects_duplicates():
    assert {"ppo_clip", "cispo", "reinforce"} <= set(POLICY_LOSSES)
    with pytest.raises(KeyError, match=r"valid names: .*cispo.*ppo_clip"):
        get_policy_loss("ppo_clipp")
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("cispo")(lambda *a: None)
