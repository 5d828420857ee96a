"""Trust regions other than ratio clipping: divergence masks (DPPO), soft gates (SAPO), the
geometric mean of clipped token ratios (GMPO) and covariance-targeted KL (KL-Cov).

Registered in :data:`~rlhf_lightning.losses.policy.POLICY_LOSSES` under their config names
with the same contract as the objectives there: ``fn(logp, old_logp, advantages, mask,
**hparams) -> (per_token_loss, metrics)``, the loss per token and unreduced (aggregation is
:func:`rlhf_lightning.losses.aggregate`'s job), metrics detached scalars.

Notation:
    B: sequences in the (micro-)batch, T: token positions.
    r = exp(logp - old_logp): the per-token importance ratio; pi = exp(logp) and
    mu = exp(old_logp) the sampled token's probability under the current and behaviour policy.
    A: the advantage, (B,) per sequence or (B, T) per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_lightning.losses.masked import broadcast_advantages, masked_max, masked_mean
from rlhf_lightning.losses.policy import POLICY_LOSSES, pooled_log_ratio


@dataclass(frozen=True)
class DPPOTVParams:
    """DPPO-Binary-TV's thresholds on ``pi - mu`` (prime-rl's default objective: 0.2 / 0.2)."""

    delta_low: float = 0.2
    delta_high: float = 0.2


@dataclass(frozen=True)
class DPPOKLParams:
    """DPPO-Binary-KL's thresholds on the binary KL divergence."""

    delta_low: float = 0.05
    delta_high: float = 0.05


@dataclass(frozen=True)
class SAPOParams:
    """SAPO's gate temperatures for A > 0 and A <= 0 (the paper's 1.0 and 1.05)."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05


@dataclass(frozen=True)
class GMPOParams:
    """GMPO's clip range in log space: each token's ratio kept in [e^-low, e^high]."""

    log_clip_low: float = 0.4
    log_clip_high: float = 0.4


@dataclass(frozen=True)
class KLCovParams:
    """KL-Cov: the share of action tokens penalised and the penalty's weight."""

    k_ratio: float = 2e-3
    kl_coef: float = 1.0


def _mask_metrics(
    ratio: torch.Tensor, blocked: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor
) -> dict[str, torch.Tensor]:
    ratio, blocked = ratio.detach(), blocked.detach()
    m = mask.bool()
    return {
        "clipfrac": masked_mean(blocked.to(ratio.dtype), m),
        "clipfrac_pos": masked_mean(blocked.to(ratio.dtype), m & (adv > 0)),
        "clipfrac_neg": masked_mean(blocked.to(ratio.dtype), m & (adv < 0)),
        "ratio_mean": masked_mean(ratio, m),
        "ratio_max": masked_max(ratio, m),
    }


def _masked_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, blocked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-(1 - M) * r * A`` with the mask M carrying no gradient; returns (loss, r)."""
    ratio = torch.exp(logp - old_logp.detach())
    keep = (~blocked.detach()).to(ratio.dtype)
    return -keep * ratio * adv, ratio


@POLICY_LOSSES.register("dppo_tv", params=DPPOTVParams)
def dppo_tv_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV: a trust region from the total-variation divergence instead of ratio clipping
    (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879,
    the masked surrogate eq. 12 with the binary approximation eq. 14; prime-rl's default loss).

    ``loss = -(1 - M) * r * A`` where the mask (no gradient) removes a token whose update moves
    the policy out of the trust region in the direction the advantage pushes it:
    ``M = [pi - mu > delta_high]`` for A > 0 and ``M = [pi - mu < -delta_low]`` for A <= 0.
    ``|pi - mu|`` is the total variation between the Bernoulli distributions "the sampled
    token / any other token" under the two policies (the binary approximation). Unlike PPO's
    ratio, it is small for rare tokens and large for confident ones. The gradient is
    ``-(1 - M) * A * r * grad logp``; inside the region it is the importance-weighted policy
    gradient.

    Args:
        logp: log pi_theta of the taken tokens. Shape: (B, T)
        old_logp: log pi_old (the behaviour policy: the trainer's recomputed or the engine's
            log-probs, ``algo.old_logprobs_source``). Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: 1 on action tokens. Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics ``clipfrac`` (share of action tokens masked),
        ``clipfrac_pos`` / ``clipfrac_neg`` (among tokens with A > 0 / A < 0), ``ratio_mean``,
        ``ratio_max``, ``tv_mean`` (mean ``|pi - mu|``).
    """
    adv = broadcast_advantages(advantages, logp)
    shift = torch.exp(logp.detach()) - torch.exp(old_logp.detach())  # pi - mu
    blocked = torch.where(adv > 0, shift > delta_high, shift < -delta_low)
    loss, ratio = _masked_surrogate(logp, old_logp, adv, blocked)
    metrics = _mask_metrics(ratio, blocked, mask, adv)
    metrics["tv_mean"] = masked_mean(shift.abs(), mask)
    return loss, metrics


def binary_kl(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(mu) || Bern(pi)) = mu log(mu/pi) + (1 - mu) log((1 - mu)/(1 - pi))``, no gradient.

    The sampled token against the rest of the vocabulary (DPPO's binary approximation); a
    policy certain of the token (``pi = 1``) while ``mu < 1`` is infinitely far.
    Shapes: (B, T) -> (B, T)
    """
    lp, lo = logp.detach(), old_logp.detach()
    mu = torch.exp(lo)
    # log(1 - p) from log p, exact near p = 1 (expm1); -inf at p = 1.
    log_rest_mu, log_rest_pi = torch.log(-torch.expm1(lo)), torch.log(-torch.expm1(lp))
    rest = 1.0 - mu
    tail = torch.where(rest > 0, rest * (log_rest_mu - log_rest_pi), torch.zeros_like(rest))
    return mu * (lo - lp) + tail


@POLICY_LOSSES.register("dppo_kl", params=DPPOKLParams)
def dppo_kl_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta_low: float = 0.05,
    delta_high: float = 0.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL: DPPO's trust region measured by the binary KL divergence (arXiv 2602.04879,
    eq. 12 with the binary KL of eq. 14).

    ``loss = -(1 - M) * r * A`` with ``D = KL(Bern(mu) || Bern(pi))`` (:func:`binary_kl`) and
    ``M = [D > delta_high and pi > mu]`` for A > 0, ``M = [D > delta_low and pi < mu]`` for
    A <= 0: a token is masked only when its divergence is too large AND the update moved it in
    the direction the advantage pushes.

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics as :func:`dppo_tv_loss`, with ``kl_mean`` (the mean
        binary KL; infinite values counted as 0) instead of ``tv_mean``.
    """
    adv = broadcast_advantages(advantages, logp)
    div = binary_kl(logp, old_logp)
    up = logp.detach() > old_logp.detach()  # pi > mu
    down = logp.detach() < old_logp.detach()
    blocked = torch.where(adv > 0, (div > delta_high) & up, (div > delta_low) & down)
    loss, ratio = _masked_surrogate(logp, old_logp, adv, blocked)
    metrics = _mask_metrics(ratio, blocked, mask, adv)
    metrics["kl_mean"] = masked_mean(torch.where(torch.isfinite(div), div, torch.zeros_like(div)), mask)
    return loss, metrics


@POLICY_LOSSES.register("sapo", params=SAPOParams)
def sapo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: soft adaptive policy optimisation (Qwen, Gao et al. 2025, arXiv 2511.20347: its
    objective with the soft gate f_{i,t}, replacing GRPO's clip).

    ``loss = -f(r) * A`` with the gate ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau`` and
    ``tau = tau_pos`` for A > 0, ``tau_neg`` for A <= 0. Its gradient is
    ``-A * w * r * grad logp`` with ``w = 4 s (1 - s)``, ``s = sigmoid(tau * (r - 1))``: exactly
    the policy gradient on policy (``w = 1`` at r = 1), smoothly down-weighted as r leaves 1, and
    never cut to 0 as a hard clip does. A larger ``tau_neg`` (the paper: 1.05 > 1.0) damps
    negative-advantage updates faster. The paper aggregates per sequence
    (``algo.loss_agg_mode=seq_mean_token_mean``).

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics ``ratio_mean``, ``ratio_max`` and ``gate_weight_mean``
        (the mean gradient weight ``w``; 1 on policy).
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp - old_logp.detach())
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    s = torch.sigmoid(tau * (ratio.detach() - 1.0))
    metrics = {
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "ratio_max": masked_max(ratio.detach(), mask),
        "gate_weight_mean": masked_mean(4.0 * s * (1.0 - s), mask),
    }
    return -gate * adv, metrics


@POLICY_LOSSES.register("gmpo", params=GMPOParams, takes_turn_ids=True)
def gmpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    log_clip_low: float = 0.4,
    log_clip_high: float = 0.4,
    turn_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673: its objective
    with token-level clipping in log space; the paper's range is (e^-0.4, e^0.4)).

    Per sequence i with |o_i| action tokens the objective is
    ``(prod_t |min(r_t A, clip(r_t, e^-low, e^high) A)|)^(1/|o_i|) * sgn(A)``, computed in log
    space: each token's log-ratio is clipped PPO-style on the side the advantage pushes
    (``min(log r, clip(log r))`` for A > 0, ``max`` for A < 0), the clipped log-ratios are
    averaged over the sequence, and ``s_i = exp(mean)`` is the geometric mean of the clipped
    ratios. Every token of sequence i carries ``-A * s_i`` (differentiable through all of the
    sequence's unclipped tokens), so ``seq_mean_token_mean`` gives the paper's
    ``-1/G sum_i A_i s_i``. Its gradient weights each token by ``s_i / |o_i|`` instead of its
    own ratio: one outlier ratio moves the weight by a root, not a factor.

    Per-token advantages (B, T): each token's sign picks its clip side and each token carries
    ``-A_t * s_i``. Multi-turn (``turn_ids``, ``algo.is_level=turn``): the mean is per turn.

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)
        turn_ids: the turn of each action token (-1 elsewhere) to pool per turn. Shape: (B, T) or None

    Returns:
        per-token loss (B, T); ``clipfrac`` counts tokens whose log-ratio the clip changed;
        ``ratio_mean`` / ``ratio_max`` are over the pooled ratios s.
    """
    adv = broadcast_advantages(advantages, logp)
    log_r = logp - old_logp.detach()
    clamped = log_r.clamp(-log_clip_low, log_clip_high)
    # PPO's pessimistic side in log space: exp is monotone, so min over ratios = min over logs.
    pessimistic = torch.where(
        adv > 0, torch.minimum(log_r, clamped), torch.where(adv < 0, torch.maximum(log_r, clamped), log_r)
    )
    # (B, T): every token of sequence (or turn) i carries s_i.
    ratio = torch.exp(pooled_log_ratio(pessimistic, mask, turn_ids, "mean"))
    clipped = pessimistic.detach() != log_r.detach()
    metrics = {
        "clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": masked_mean(ratio.detach(), mask),
        "ratio_max": masked_max(ratio.detach(), mask),
    }
    return -adv * ratio, metrics


def top_share(scores: torch.Tensor, mask: torch.Tensor, share: float) -> torch.Tensor:
    """The ``max(1, floor(share * n))`` masked entries with the largest scores (n: the masked
    count; ties by position, first wins), as a boolean mask, without a host sync.

    Shapes: scores, mask (B, T) -> (B, T)
    """
    m = mask.bool()
    flat = scores.detach().masked_fill(~m, float("-inf")).reshape(-1)
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    k = torch.floor(m.sum().to(torch.float64) * share).clamp(min=1)
    return (rank.reshape(scores.shape) < k) & m


@POLICY_LOSSES.register("kl_cov", params=KLCovParams)
def kl_cov_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_ratio: float = 2e-3,
    kl_coef: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617: its KL-Cov objective; verl's ``kl_cov``).

    Policy entropy falls where a token's log-probability and its advantage co-vary. Each action
    token's centred covariance ``c_t = (A_t - mean(A)) * (logp_t - mean(logp))`` (means over
    the action tokens of this batch, no gradient) ranks the tokens; the top
    ``max(1, floor(k_ratio * n))`` of the n action tokens get a KL penalty, the rest the plain
    importance-weighted policy gradient, without clipping:
    ``loss = -r * A + kl_coef * |log r| * [t in top-k]``. ``|log r|`` is the token's KL estimate
    as in the authors' implementation (merged into verl). Defaults: k = 2e-3, kl_coef = 1
    (verl's config ships k = 2e-4 and 0.1; the right share depends on the batch's token count).

    The covariance is over the tokens this call sees: one micro-batch (``algo.micro_batch_size``;
    rows with zero advantage are skipped by default, ``algo.skip_zero_advantage``), as in verl.

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics ``clipfrac`` (share of action tokens penalised),
        ``ratio_mean``, ``ratio_max``, ``cov_mean`` (mean covariance over action tokens).
    """
    adv = broadcast_advantages(advantages, logp)
    log_r = logp - old_logp.detach()
    ratio = torch.exp(log_r)
    m = mask.to(logp.dtype)
    lp = logp.detach()
    cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
    penalised = top_share(cov, mask, k_ratio)
    loss = -ratio * adv + kl_coef * log_r.abs() * penalised.to(logp.dtype)
    metrics = _mask_metrics(ratio, penalised, mask, adv)
    del metrics["clipfrac_pos"], metrics["clipfrac_neg"]
    metrics["cov_mean"] = masked_mean(cov.detach(), mask)
    return loss, metrics
