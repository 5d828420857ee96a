"""DPPO (TV and KL masks), SAPO, GMPO and KL-Cov against independent float64 implementations of
their papers' formulas: element-wise Python arithmetic for the value and the analytic derivative
for the gradient, on inputs that cover both signs of the advantage and both sides of every
mask, gate and clip boundary."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.losses import POLICY_LOSSES, aggregate, get_policy_loss

# Probabilities under the behaviour policy (mu) and the current one (pi): every pair, so the
# shift pi - mu ranges over [-0.94, 0.94] and the binary KL from ~0 to large.
MUS = [0.03, 0.3, 0.6, 0.97]
PIS = [0.01, 0.25, 0.32, 0.55, 0.9, 0.999]
ADVS = [1.3, -0.7]


def grid():
    """Every (mu, pi, A) combination as one row of tokens: (B=len(ADVS), T=len(MUS)*len(PIS))."""
    pairs = [(mu, pi) for mu in MUS for pi in PIS]
    old = torch.tensor([[math.log(mu) for mu, _ in pairs]] * len(ADVS), dtype=torch.float64)
    logp = torch.tensor([[math.log(pi) for _, pi in pairs]] * len(ADVS), dtype=torch.float64)
    adv = torch.tensor([[a] * len(pairs) for a in ADVS], dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool)
    mask[:, 1] = False  # a padded position: no gradient, not counted
    return logp.requires_grad_(True), old, adv, mask


def dppo_tv_token(lp, old, a, dl, dh):
    pi, mu = math.exp(lp), math.exp(old)
    r = pi / mu
    blocked = (pi - mu > dh) if a > 0 else (pi - mu < -dl)
    return (0.0, 0.0, True) if blocked else (-r * a, -r * a, False)


def dppo_kl_token(lp, old, a, dl, dh):
    pi, mu = math.exp(lp), math.exp(old)
    r = pi / mu
    d = mu * math.log(mu / pi) + (1 - mu) * math.log((1 - mu) / (1 - pi))
    blocked = (d > dh and pi > mu) if a > 0 else (d > dl and pi < mu)
    return (0.0, 0.0, True) if blocked else (-r * a, -r * a, False)


def sapo_token(lp, old, a, tp, tn):
    r = math.exp(lp - old)
    tau = tp if a > 0 else tn
    s = 1 / (1 + math.exp(-tau * (r - 1)))
    return -4 / tau * s * a, -a * 4 * s * (1 - s) * r, 4 * s * (1 - s)


def check_tokens(name, kwargs, ref, logp, old, adv, mask):
    loss, metrics = get_policy_loss(name)(logp, old, adv, mask, **kwargs)
    value, grad = torch.zeros_like(old), torch.zeros_like(old)
    extra = []
    for i in range(old.shape[0]):
        for j in range(old.shape[1]):
            v, g, e = ref(logp[i, j].item(), old[i, j].item(), adv[i, j].item())
            value[i, j], grad[i, j] = v, g * float(mask[i, j])
            if mask[i, j]:
                extra.append((adv[i, j].item() > 0, e))
    torch.testing.assert_close(loss.detach(), value, rtol=0, atol=1e-12)
    (g_autograd,) = torch.autograd.grad((loss * mask).sum(), logp)
    torch.testing.assert_close(g_autograd, grad, rtol=0, atol=1e-12)
    assert all(not v.requires_grad for v in metrics.values())
    return metrics, extra


@pytest.mark.parametrize(
    ("name", "kwargs", "ref"),
    [
        ("dppo_tv", {}, lambda *x: dppo_tv_token(*x, 0.2, 0.2)),
        ("dppo_tv", {"delta_low": 0.05, "delta_high": 0.4}, lambda *x: dppo_tv_token(*x, 0.05, 0.4)),
        ("dppo_kl", {}, lambda *x: dppo_kl_token(*x, 0.05, 0.05)),
        ("dppo_kl", {"delta_low": 0.3, "delta_high": 0.01}, lambda *x: dppo_kl_token(*x, 0.3, 0.01)),
    ],
)
def test_dppo_masks_value_and_gradient(name, kwargs, ref):
    logp, old, adv, mask = grid()
    metrics, blocked = check_tokens(name, kwargs, ref, logp, old, adv, mask)
    # the grid reaches both sides of the mask at both signs of the advantage
    for positive in (True, False):
        states = {b for pos, b in blocked if pos == positive}
        assert states == {True, False}, (name, kwargs, positive, states)
    share = sum(b for _, b in blocked) / len(blocked)
    assert metrics["clipfrac"].item() == pytest.approx(share, abs=1e-12)
    pos = [b for p, b in blocked if p]
    assert metrics["clipfrac_pos"].item() == pytest.approx(sum(pos) / len(pos), abs=1e-12)


def test_dppo_tv_masks_by_probability_shift_not_ratio():
    """The paper's point: a rare token tripling its probability (ratio 3) stays inside the TV
    region, a confident one moving 0.5 -> 0.75 (ratio 1.5) does not; PPO's clip does the opposite."""
    logp = torch.log(torch.tensor([[0.03, 0.75]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.01, 0.5]], dtype=torch.float64))
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, m = get_policy_loss("dppo_tv")(logp, old, adv, mask)
    (g,) = torch.autograd.grad(get_policy_loss("dppo_tv")(logp, old, adv, mask)[0].sum(), logp)
    assert g[0, 0].item() == pytest.approx(-3.0) and g[0, 1].item() == 0.0
    assert m["clipfrac"].item() == pytest.approx(0.5)
    (g_ppo,) = torch.autograd.grad(get_policy_loss("ppo_clip")(logp, old, adv, mask)[0].sum(), logp)
    assert g_ppo[0, 0].item() == 0.0 and g_ppo[0, 1].item() == 0.0  # both outside [0.8, 1.2]


def test_binary_kl_is_finite_where_defined_and_infinite_at_certainty():
    from rlhf_lightning.losses.trust_regions import binary_kl

    mu = torch.tensor([0.2, 0.2, 1.0], dtype=torch.float64)
    pi = torch.tensor([0.2, 1.0, 0.5], dtype=torch.float64)
    d = binary_kl(pi.log(), mu.log())
    assert d[0].item() == pytest.approx(0.0, abs=1e-15)
    assert d[1].item() == math.inf
    assert d[2].item() == pytest.approx(math.log(2.0))  # mu = 1: only the sampled token's term


@pytest.mark.parametrize(("tp", "tn"), [(1.0, 1.05), (0.5, 4.0)])
def test_sapo_value_and_gradient(tp, tn):
    logp, old, adv, mask = grid()
    kwargs = {"tau_pos": tp, "tau_neg": tn}
    metrics, weights = check_tokens("sapo", kwargs, lambda *x: sapo_token(*x, tp, tn), logp, old, adv, mask)
    # far from r = 1 the gate has all but closed (ratio 0.999/0.03 ~ 33), near it it is open
    ws = [w for _, w in weights]
    assert min(ws) < 1e-3 and max(ws) > 0.9
    assert metrics["gate_weight_mean"].item() == pytest.approx(sum(ws) / len(ws), abs=1e-12)


def test_sapo_temperatures_act_on_their_own_sign():
    """tau_neg changes only the tokens with A <= 0; tau_pos only those with A > 0."""
    logp, old, adv, mask = grid()
    base = get_policy_loss("sapo")(logp, old, adv, mask)[0].detach()
    neg = get_policy_loss("sapo")(logp, old, adv, mask, tau_neg=3.0)[0].detach()
    pos = get_policy_loss("sapo")(logp, old, adv, mask, tau_pos=3.0)[0].detach()
    assert torch.equal(base[0], neg[0]) and not torch.equal(base[1], neg[1])  # row 0: A > 0
    assert torch.equal(base[1], pos[1]) and not torch.equal(base[0], pos[0])


def random_inputs(seed, b=5, t=10, scale=0.4, per_token_adv=False):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    shape = (b, t) if per_token_adv else (b,)
    adv = torch.randn(*shape, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    return logp, old, adv, mask


def gmpo_reference(logp, old, adv, mask, turn_ids, lo, hi):
    """J = 1/B sum_i 1/n_i sum_t -A_t s_g(t), s_g = exp(mean_{j in g} clip_A(log r_j)), and dJ/dlogp.

    clip_A keeps log r unless the advantage's side of [-lo, hi] is crossed (then the bound,
    no gradient). A segment g is a sequence, or a turn with ``turn_ids``."""
    b, t = logp.shape
    a2 = adv if adv.dim() == 2 else adv[:, None].expand(b, t)
    total, grad, clipped = 0.0, torch.zeros(b, t, dtype=torch.float64), 0
    for i in range(b):
        tokens = [j for j in range(t) if mask[i, j]]
        segs: dict[int, list[int]] = {}
        for j in tokens:
            segs.setdefault(0 if turn_ids is None else int(turn_ids[i, j]), []).append(j)
        for members in segs.values():
            pess, active = [], []
            for j in members:
                x, a = logp[i, j].item() - old[i, j].item(), a2[i, j].item()
                if a > 0 and x > hi:
                    pess.append(hi)
                    active.append(False)
                elif a < 0 and x < -lo:
                    pess.append(-lo)
                    active.append(False)
                else:
                    pess.append(x)
                    active.append(True)
            clipped += active.count(False)
            s = math.exp(sum(pess) / len(members))
            weight = sum(-a2[i, j].item() for j in members)  # sum_t -A_t over the segment
            total += weight * s / len(tokens) / b
            for j, on in zip(members, active):
                if on:
                    grad[i, j] = weight * s / len(members) / len(tokens) / b
    return total, grad, clipped


@pytest.mark.parametrize("per_turn", [False, True])
@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize(("lo", "hi"), [(0.4, 0.4), (0.1, 0.25)])
def test_gmpo_value_and_gradient(per_turn, per_token_adv, lo, hi):
    logp, old, adv, mask = random_inputs(seed=3 + per_turn + 2 * per_token_adv, per_token_adv=per_token_adv)
    turn_ids = None
    if per_turn:
        turn_ids = torch.where(mask, torch.arange(10)[None, :].expand(5, 10) // 4, torch.full((5, 10), -1))
    kwargs = {"log_clip_low": lo, "log_clip_high": hi, "turn_ids": turn_ids}
    loss, metrics = get_policy_loss("gmpo")(logp, old, adv, mask, **kwargs)
    j = aggregate(loss, mask, "seq_mean_token_mean")
    expected, expected_grad, clipped = gmpo_reference(logp, old, adv, mask, turn_ids, lo, hi)
    assert 0 < clipped < int(mask.sum())  # tokens on both sides of the clip
    assert j.item() == pytest.approx(expected, abs=1e-12)
    (grad,) = torch.autograd.grad(j, logp)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(clipped / int(mask.sum()), abs=1e-12)


def test_gmpo_is_the_geometric_mean_of_token_ratios():
    """Without clipping, s is (prod r_t)^(1/n): ratios 2 and 1/2 average to 1, not 1.25."""
    logp = torch.log(torch.tensor([[0.4, 0.1]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.2, 0.2]], dtype=torch.float64))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = get_policy_loss("gmpo")(
        logp, old, torch.tensor([2.0], dtype=torch.float64), mask, log_clip_low=1.0, log_clip_high=1.0
    )
    assert loss[0].tolist() == pytest.approx([-2.0, -2.0], abs=1e-12)
    assert m["ratio_mean"].item() == pytest.approx(1.0) and m["clipfrac"].item() == 0.0


def kl_cov_reference(logp, old, adv, mask, k_ratio, coef):
    b, t = logp.shape
    a2 = adv if adv.dim() == 2 else adv[:, None].expand(b, t)
    cells = [(i, j) for i in range(b) for j in range(t) if mask[i, j]]
    mean_a = sum(a2[c].item() for c in cells) / len(cells)
    mean_l = sum(logp[c].item() for c in cells) / len(cells)
    cov = {c: (a2[c].item() - mean_a) * (logp[c].item() - mean_l) for c in cells}
    k = max(1, math.floor(k_ratio * len(cells)))
    chosen = set(sorted(cells, key=lambda c: (-cov[c], c[0] * t + c[1]))[:k])
    value, grad = torch.zeros(b, t, dtype=torch.float64), torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            x, a = logp[i, j].item() - old[i, j].item(), a2[i, j].item()
            r = math.exp(x)
            v, g = -r * a, -r * a
            if (i, j) in chosen:
                v, g = v + coef * abs(x), g + coef * math.copysign(1.0, x)
            value[i, j], grad[i, j] = v, g * float(mask[i, j])
    return value, grad, chosen


@pytest.mark.parametrize(("k_ratio", "coef"), [(0.1, 1.0), (0.25, 0.3), (2e-3, 1.0)])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_kl_cov_value_and_gradient(k_ratio, coef, per_token_adv):
    logp, old, adv, mask = random_inputs(seed=17 + per_token_adv, b=6, t=9, per_token_adv=per_token_adv)
    loss, metrics = get_policy_loss("kl_cov")(logp, old, adv, mask, k_ratio=k_ratio, kl_coef=coef)
    value, grad, chosen = kl_cov_reference(logp, old, adv, mask, k_ratio, coef)
    torch.testing.assert_close(loss.detach(), value, rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    torch.testing.assert_close(g, grad, rtol=0, atol=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(len(chosen) / int(mask.sum()), abs=1e-12)
    assert len(chosen) == max(1, math.floor(k_ratio * int(mask.sum())))
    # advantages of both signs among the inputs, penalised and plain tokens both present
    assert (adv > 0).any() and (adv < 0).any() and len(chosen) < int(mask.sum())


ON_POLICY = ["dppo_tv", "dppo_kl", "sapo", "gmpo"]


@pytest.mark.parametrize("name", ON_POLICY)
def test_on_policy_gradient_is_the_policy_gradient(name):
    """At r = 1 no mask fires, every gate is open and nothing is clipped: the gradient of each
    objective is REINFORCE's (under the aggregation GMPO is defined with)."""
    logp, _, adv, mask = random_inputs(seed=29)
    old = logp.detach().clone()
    agg = "seq_mean_token_mean"
    g1 = torch.autograd.grad(aggregate(get_policy_loss(name)(logp, old, adv, mask)[0], mask, agg), logp)[0]
    g2 = torch.autograd.grad(
        aggregate(get_policy_loss("reinforce")(logp, old, adv, mask)[0], mask, agg), logp
    )[0]
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl", "sapo", "gmpo", "kl_cov"])
def test_new_objectives_are_registered_with_typed_params(name):
    import dataclasses

    meta = POLICY_LOSSES.meta(name)
    params = meta["params"]
    assert dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen
    defaults = {f.name: f.default for f in dataclasses.fields(params)}
    assert all(isinstance(v, float) for v in defaults.values()), defaults
    assert meta.get("takes_turn_ids", False) == (name == "gmpo")
