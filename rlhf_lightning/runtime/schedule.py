"""Learning-rate schedules."""

from __future__ import annotations

import math


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
