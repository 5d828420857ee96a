"""Masked reductions shared by the losses (no host syncs)."""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over ``mask`` (-inf... replaced by 0 when the mask is empty)."""
    filled = x.masked_fill(~mask.bool(), float("-inf")).max()
    return torch.where(torch.isfinite(filled), filled, torch.zeros_like(filled))


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of ``x`` over ``mask`` (0 when the mask is empty)."""
    return -masked_max(-x, mask)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population standard deviation of ``x`` over ``mask`` (0 when the mask is empty)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask).sqrt()


def broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-sequence ``(B,)`` advantages broadcast over tokens to ``(B, T)``; ``(B, T)`` passes."""
    return advantages.unsqueeze(-1).expand_as(like) if advantages.dim() == 1 else advantages
