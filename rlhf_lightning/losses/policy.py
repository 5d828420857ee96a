"""Policy-gradient objectives, one pure function each, registered under their config names.

Contract (every function): ``fn(logp, old_logp, advantages, mask, **hparams) ->
(per_token_loss, metrics)``. The loss is per token and unreduced: aggregation over tokens and
sequences is :func:`rlhf_lightning.losses.aggregate`'s job, so normalisation stays correct
under gradient accumulation. ``metrics`` holds detached scalar tensors.

Notation:
    B: sequences in the (micro-)batch, T: token positions.
    r = exp(logp - old_logp): the per-token importance ratio.
    Clip bounds are offsets from 1 as in the papers: the ratio is kept in
    [1 - clip_low, 1 + clip_high]; ``None`` removes that side's bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlhf_lightning.losses.masked import broadcast_advantages, masked_max, masked_mean, masked_min, masked_std
from rlhf_lightning.runtime.registry import Registry

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered objective called ``name`` (``ppo_clip``, ``cispo``, ...)."""
    return POLICY_LOSSES.get(name)


# Each objective's hyper-parameters with their defaults, one frozen dataclass per loss: the field
# names are the objective's keyword arguments (the algorithm module binds them by name from its
# config, at its boundary; nothing here reads a config). ``uses_ratio=False``: no importance
# ratio, so only one on-policy epoch over one mini-batch is an unbiased gradient.
@dataclass(frozen=True)
class ClipParams:
    clip_low: float | None = 0.2
    clip_high: float | None = 0.2
    clip_ratio_c: float | None = None


@dataclass(frozen=True)
class CISPOParams:
    clip_low: float | None = None
    clip_high: float | None = 4.0


@dataclass(frozen=True)
class GSPOParams:
    clip_low: float | None = 3e-4
    clip_high: float | None = 4e-4
    is_pooling: str = "mean"


@dataclass(frozen=True)
class NoParams:
    """An objective without hyper-parameters."""


def loss_kwargs(params: Any) -> dict[str, Any]:
    """A params object as the objective's keyword arguments."""
    return asdict(params)


def _bounds(clip_low: float | None, clip_high: float | None) -> tuple[float | None, float | None]:
    low = None if clip_low is None else 1.0 - clip_low
    high = None if clip_high is None else 1.0 + clip_high
    return low, high


def _ratio_metrics(ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    ratio, clipped = ratio.detach(), clipped.detach()
    return {
        "clipfrac": masked_mean(clipped.to(ratio.dtype), mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        "ratio_std": masked_std(ratio, mask),  # the spread: 0 on-policy, where every ratio is 1
    }


@POLICY_LOSSES.register("ppo_clip", params=ClipParams)
def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float | None = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with decoupled bounds.

    ``loss = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)``. Separate bounds give
    GRPO (0.2/0.2), DAPO's clip-higher (0.2/0.28, arXiv 2503.14476 eq. 10) and Dr.GRPO.
    ``clip_ratio_c`` (> 1) adds the dual-clip bound for negative advantages
    (Ye et al. 2020, arXiv 1912.09729): ``loss = min(loss, -clip_ratio_c * A)`` where A < 0.

    Args:
        logp: log pi_theta of the taken tokens. Shape: (B, T)
        old_logp: log pi_old of the same tokens (no gradient). Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: 1 on action tokens. Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics ``clipfrac`` (share of action tokens whose
        gradient the clip removed), ``ratio_mean``, ``ratio_max``.
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp - old_logp.detach())
    low, high = _bounds(clip_low, clip_high)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, low, high) * adv
    loss = torch.maximum(unclipped, clipped)
    if clip_ratio_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -clip_ratio_c * adv), loss)
    return loss, _ratio_metrics(ratio, clipped > unclipped, mask)


@POLICY_LOSSES.register("cispo", params=CISPOParams)
def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585, eq. 4-5).

    ``loss = -sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp``. Unlike PPO-clip, no
    token's gradient is dropped: the importance weight is clipped and detached, and the
    gradient flows through ``logp`` only. The paper imposes no lower bound
    (``clip_low=None``) and tunes only the upper one; the default ``clip_high=4.0`` caps the
    weight at 5.0, the same cap as TRL's ``epsilon_high=5.0`` (an absolute cap there).

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)

    Returns:
        per-token loss (B, T) and metrics; ``clipfrac`` is the share of action tokens whose
        weight was clipped.
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp.detach() - old_logp.detach())
    low, high = _bounds(clip_low, clip_high)
    weight = torch.clamp(ratio, low, high)
    loss = -weight * adv * logp
    return loss, _ratio_metrics(ratio, weight != ratio, mask)


@POLICY_LOSSES.register("reinforce", params=NoParams, uses_ratio=False)
def reinforce_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE (Williams 1992): ``loss = -A * logp``, no ratio; on-policy, one epoch.

    Args:
        logp: Shape: (B, T)
        old_logp: only for the ratio metrics. Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)
    """
    adv = broadcast_advantages(advantages, logp)
    ratio = torch.exp(logp.detach() - old_logp.detach())
    return -adv * logp, _ratio_metrics(ratio, torch.zeros_like(mask, dtype=torch.bool), mask)


def pooled_log_ratio(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    turn_ids: torch.Tensor | None = None,
    pooling: str = "mean",
) -> torch.Tensor:
    """Pool per-token log-ratios over each sequence (or each turn) and broadcast back.

    ``pooling="mean"``: the geometric-mean ratio (GSPO's length-normalised sequence ratio);
    ``pooling="sum"``: the product of the token ratios.

    Args:
        log_ratio: logp - old_logp. Shape: (B, T)
        mask: action tokens. Shape: (B, T)
        turn_ids: the turn of each action token (-1 elsewhere) to pool per turn; None pools
            per sequence. Shape: (B, T)

    Returns:
        each token's pooled log-ratio (0 outside the mask). Shape: (B, T)
    """
    b, t = log_ratio.shape
    m = mask.to(log_ratio.dtype)
    if turn_ids is None:
        segment = torch.arange(b, device=log_ratio.device)[:, None].expand(b, t)
        n_seg = b
    else:
        k = int(turn_ids.max()) + 1 if turn_ids.numel() else 1
        segment = torch.arange(b, device=log_ratio.device)[:, None] * max(k, 1) + turn_ids.clamp(min=0)
        n_seg = b * max(k, 1)
    seg = segment.reshape(-1)
    total = torch.zeros(n_seg, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
        0, seg, (log_ratio * m).reshape(-1)
    )
    if pooling == "mean":
        count = torch.zeros(n_seg, dtype=log_ratio.dtype, device=log_ratio.device).index_add(
            0, seg, m.reshape(-1)
        )
        total = total / count.clamp(min=1.0)
    elif pooling != "sum":
        raise ValueError(f"unknown ratio pooling {pooling!r}; valid: mean, sum")
    return total[segment] * m


@POLICY_LOSSES.register("gspo", params=GSPOParams, takes_turn_ids=True)
def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = 3e-4,
    clip_high: float | None = 4e-4,
    is_pooling: str = "mean",
    turn_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: group sequence policy optimisation (Qwen, arXiv 2507.18071, eq. 5-7 and 13).

    The importance ratio is the sequence's geometric-mean ratio
    ``s_i = exp(mean_t(logp - old_logp))``, clipped per sequence to
    [1 - clip_low, 1 + clip_high] (the paper: 3e-4 and 4e-4). Every token of sequence i
    carries ``-min(s_i * A, clip(s_i) * A)`` (differentiable through all of the sequence's
    tokens), so aggregating with ``seq_mean_token_mean`` gives exactly the paper's
    ``-1/G sum_i min(s_i A_i, clip(s_i) A_i)``. Per-token advantages (B, T) weight the pooled
    ratio token by token.

    Multi-turn: with ``turn_ids`` the ratio is pooled per turn instead
    (``is_pooling="mean"``: geometric mean; ``"sum"``: the product of the turn's token ratios),
    and each turn counts with its token share under ``seq_mean_token_mean``.

    Args:
        logp: Shape: (B, T)
        old_logp: Shape: (B, T)
        advantages: Shape: (B,) or (B, T)
        mask: Shape: (B, T)
        turn_ids: Shape: (B, T) or None

    Returns:
        per-token loss (B, T); ``clipfrac`` counts tokens whose pooled ratio was clipped;
        ``ratio_mean`` / ``ratio_max`` are over the pooled ratios.
    """
    adv = broadcast_advantages(advantages, logp)
    # (B, T): every token of sequence (or turn) i carries s_i, differentiable w.r.t. all its tokens.
    ratio = torch.exp(pooled_log_ratio(logp - old_logp.detach(), mask, turn_ids, is_pooling))
    low, high = _bounds(clip_low, clip_high)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, low, high) * adv
    loss = torch.maximum(unclipped, clipped)
    return loss, _ratio_metrics(ratio, clipped > unclipped, mask)
