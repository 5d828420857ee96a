"""Preference-optimisation losses on sequence log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("sigmoid", "ipo")


def sequence_logps(token_logps: torch.Tensor, mask: torch.Tensor, *, average: bool = False) -> torch.Tensor:
    """Each response's score from its token log-probs: the sum (log pi(y|x)), or the mean over
    its tokens (``average``).

    IPO (Azar et al. 2023, arXiv 2310.12036) regresses ``h`` onto ``1 / (2 tau)`` (eq. 17). With
    summed log-probs, ``h`` grows with the responses' length while the target does not, so the
    strength of the regularisation depends on length; the paper's authors advised averaging the
    log-likelihoods over tokens when this was discussed with Hugging Face (the "Preference
    Tuning LLMs with Direct Preference Optimization Methods" post, January 2024), and we do the
    same for ``loss_type=ipo``. DPO's sigmoid loss keeps the summed log-probs of its eq. 7.

    Args:
        token_logps: Shape: (B, T)
        mask: the response's tokens. Shape: (B, T)

    Returns:
        Shape: (B,)
    """
    total = (token_logps * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) and IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17).

    The inputs are sequence scores from :func:`sequence_logps`: summed log-probs for DPO, and
    for IPO log-probs averaged over each response's tokens (see there).

    With ``h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))``:
        ``sigmoid``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``
            (``eps = label_smoothing``: conservative DPO, Mitchell 2023);
        ``ipo``: ``(h - 1 / (2 beta))^2``.

    Args:
        policy_chosen, policy_rejected: summed log-probs of each response. Shape: (B,)
        ref_chosen, ref_rejected: the same under the reference policy. Shape: (B,)

    Returns:
        per-pair loss (B,) and detached metrics: implicit rewards ``beta * (log pi - log ref)``
        of chosen and rejected, their margin and the share of pairs ranked correctly.
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"unknown preference loss {loss_type!r}; valid: {', '.join(PREFERENCE_LOSSES)}")
    chosen = beta * (policy_chosen - ref_chosen).detach()
    rejected = beta * (policy_rejected - ref_rejected).detach()
    metrics = {
        "chosen": chosen.mean(),
        "rejected": rejected.mean(),
        "margin": (chosen - rejected).mean(),
        "accuracy": (chosen > rejected).to(chosen.dtype).mean(),
    }
    return loss, metrics
