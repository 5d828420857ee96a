"""Liger's fused linear GRPO loss as an alternative path for the policy loss (GPU).

Liger (``pip install 'rlhf_lightning[liger]'``) computes the lm-head logits, the objective and
its gradients chunk by chunk in one fused pass. It covers a subset of our objectives;
:func:`~rlhf_lightning.learner.liger_path.liger_unsupported` names what it does not cover, and the module falls back to our
chunked op then. Aggregation is mapped onto Liger's ``loss_type`` and rescaled so that the
loss is normalised over the whole accumulation window exactly like :func:`aggregate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# our (objective, aggregation) -> Liger loss_type
_LOSS_TYPES = {
    ("ppo_clip", "token_mean"): "dapo",
    ("ppo_clip", "seq_mean_token_mean"): "grpo",
    ("ppo_clip", "seq_mean_token_sum_norm"): "dr_grpo",
    ("cispo", "token_mean"): "cispo",
    ("gspo", "seq_mean_token_mean"): "grpo",
}


def liger_available() -> bool:
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class LigerLoss:
    """The objective Liger's fused loss computes, as plain values (read from the algorithm config
    at the module boundary).

    Attributes:
        loss: our policy loss (``ppo_clip``, ``cispo``, ``gspo``).
        agg_mode: our aggregation (``token_mean``, ``seq_mean_token_mean``, ...).
        clip_low, clip_high: the ratio's clip offsets (CISPO's ``clip_high`` is its cap - 1).
        beta: the k3 KL term's coefficient (0: none).
        kl_importance_weighted: the KL term weighted by the ratio (bias correction).
    """

    loss: str
    agg_mode: str
    clip_low: float | None
    clip_high: float | None
    beta: float = 0.0
    kl_importance_weighted: bool = False

    @property
    def loss_type(self) -> str:
        """Liger's ``loss_type`` for this (loss, aggregation): see :func:`liger_loss_type`."""
        loss_type = liger_loss_type(self.loss, self.agg_mode)
        if loss_type is None:
            raise ValueError(f"Liger has no loss_type for {self.loss} with {self.agg_mode}")
        return loss_type


def liger_loss_type(loss: str, agg_mode: str) -> str | None:
    """Liger's ``loss_type`` that equals our ``loss`` aggregated by ``agg_mode``, or None."""
    return _LOSS_TYPES.get((loss, agg_mode))


def liger_combinations() -> list[str]:
    """The (loss, aggregation) pairs Liger covers, as ``loss+agg_mode``."""
    return [f"{a}+{b}" for a, b in _LOSS_TYPES]


def pack_actions(rows: torch.Tensor, action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major action rows (N, ...) -> left-packed (B, A, ...) and its mask (B, A), differentiably."""
    counts = action_mask.sum(-1)
    width = int(counts.max()) if counts.numel() else 0
    bi, _ = action_mask.nonzero(as_tuple=True)
    pos = (action_mask.cumsum(-1) - 1)[action_mask]
    packed = rows.new_zeros((action_mask.shape[0], width, *rows.shape[1:])).index_put((bi, pos), rows)
    mask = torch.arange(width, device=action_mask.device)[None, :] < counts[:, None]
    return packed, mask


def liger_policy_loss(
    rows: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    action_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    objective: LigerLoss,
    *,
    temperature: float,
    max_len: int,
    num_tokens: torch.Tensor,
    num_seqs: torch.Tensor,
    world_size: int = 1,
    compiled: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch loss through Liger, normalised for the whole window like our path.

    Args:
        rows: hidden states of the action positions, row-major. Shape: (N, H)
        head: the lm head (``weight`` (V, H), ``bias``)
        targets: the action token ids, row-major. Shape: (N,)
        action_mask: Shape: (B, T)
        advantages: per sequence. Shape: (B,)
        old_logp, ref_logp, is_weights: per token, or None. Shape: (B, T)
        objective: the loss, aggregation, clip bounds and KL term to compute.
        num_tokens, num_seqs: the window's normalisers (as passed to :func:`aggregate`).

    Returns:
        (scalar loss, metrics ``clipfrac`` and, with a KL term, ``kl``)
    """
    loss_type = objective.loss_type
    fn = _liger_loss(objective, loss_type, temperature=temperature, max_len=max_len, compiled=compiled)
    hidden, mask = pack_actions(rows, action_mask)
    ids, _ = pack_actions(targets, action_mask)

    def pack(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else pack_actions(x[action_mask], action_mask)[0]

    extra, scale = _window_normaliser(
        loss_type, action_mask.shape[0], num_tokens, num_seqs, world_size, rows.device
    )
    loss, metrics = fn(
        hidden,
        head.weight,
        ids,
        mask.long(),
        advantages,
        bias=head.bias,
        ref_per_token_logps=pack(ref_logp),
        old_per_token_logps=pack(old_logp),
        vllm_is_ratio=pack(is_weights),
        **extra,
    )
    out = {"clipfrac": metrics[-1].detach()}
    if objective.beta > 0:
        out["kl"] = metrics[0].detach()
    return loss * scale, out


def _liger_loss(o: LigerLoss, loss_type: str, *, temperature: float, max_len: int, compiled: bool) -> Any:
    """Liger's ``LigerFusedLinearGRPOLoss`` set up for our objective: clip bounds (CISPO's cap is
    absolute in Liger), sequence-level ratios for GSPO, a precomputed reference for the KL term."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    high = o.clip_high
    if o.loss == "cispo" and high is not None:
        high = 1.0 + high  # Liger's CISPO cap is absolute
    return LigerFusedLinearGRPOLoss(
        beta=o.beta,
        compiled=compiled,
        use_ref_model=o.beta > 0,  # with precomputed ref_per_token_logps (no second model)
        epsilon_low=o.clip_low if o.clip_low is not None else 0.0,
        epsilon_high=high,
        loss_type=loss_type,
        max_completion_length=max_len,
        importance_sampling_level="sequence" if o.loss == "gspo" else "token",
        temperature=temperature,
        use_bias_correction_kl=o.kl_importance_weighted,
    )


def _window_normaliser(
    loss_type: str,
    b: int,
    num_tokens: torch.Tensor,
    num_seqs: torch.Tensor,
    world_size: int,
    device: torch.device,
) -> tuple[dict[str, Any], torch.Tensor]:
    """What makes Liger's loss normalised over the whole accumulation window like :func:`aggregate`:
    the extra keyword arguments of the call and the factor its loss is multiplied by.

    Token-level types (``dapo``, ``cispo``) take the window's token count (times the world size,
    which Liger divides by); per-sequence ones divide by the micro-batch's ``b`` rows, rescaled
    to the window's ``num_seqs``.
    """
    extra: dict[str, Any] = {}
    if loss_type in ("dapo", "cispo"):
        extra["num_items_in_batch"] = num_tokens * world_size  # Liger divides by the world size
        scale = torch.ones((), device=device)
    else:  # per-sequence normalisers: Liger divides by this micro-batch's B
        scale = b / num_seqs
    return extra, scale
