"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman 2020, "Approximating KL divergence")."""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: str = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate.

    With ``log_r = ref_logp - logp``:
        ``k1 = -log_r`` (unbiased, high variance, can be negative);
        ``k2 = log_r**2 / 2`` (biased, low variance);
        ``k3 = exp(log_r) - 1 - log_r`` (unbiased, non-negative; GRPO's choice, DeepSeekMath eq. 4).

    Args:
        logp: log pi_theta of the sampled tokens. Shape: (B, T)
        ref_logp: log pi_ref of the same tokens. Shape: (B, T)
        estimator: ``k1`` | ``k2`` | ``k3``.
        clamp: if set, each token's estimate is clamped to [-clamp, clamp].

    Returns:
        Shape: (B, T)
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        out = -log_r
    elif estimator == "k2":
        out = 0.5 * log_r.square()
    elif estimator == "k3":
        out = torch.exp(log_r) - 1.0 - log_r
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return out if clamp is None else out.clamp(-clamp, clamp)


def kl_shaped_advantages(
    advantages: torch.Tensor, kl_tokens: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """KL advantage shaping: ``A_t = A - beta * kl_t`` on every action token.

    Args:
        advantages: Shape: (B,) or (B, T)
        kl_tokens: per-token KL estimates (no gradient). Shape: (B, T)
        mask: Shape: (B, T)

    Returns:
        Shape: (B, T)
    """
    adv = advantages.unsqueeze(-1).expand_as(kl_tokens) if advantages.dim() == 1 else advantages
    return (adv - beta * kl_tokens.detach()) * mask.to(kl_tokens.dtype)


def kl_penalized_returns(
    returns: torch.Tensor, kl_tokens: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """KL in the reward: ``R - beta * sum_t kl_t`` per trajectory (InstructGPT, arXiv 2203.02155, eq. 2).

    Args:
        returns: Shape: (B,)
        kl_tokens: Shape: (B, T)
        mask: Shape: (B, T)
    """
    return returns - beta * (kl_tokens.detach() * mask.to(kl_tokens.dtype)).sum(-1)
