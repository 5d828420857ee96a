"""Pieces every algorithm module shares: metric averaging, logging at the optimizer step,
the AdamW + warm-up/cosine optimiser, and checkpoints that hold trainable weights only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning as L
import torch

from rlhf_lightning.algorithms.schedule import warmup_cosine

Metrics = dict[str, torch.Tensor]


class MetricAccumulator:
    """Averages detached metrics over micro-batches (weighted) and updates; ``*_max`` keys keep the max."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def add(self, metrics: Metrics, weight: torch.Tensor | float = 1.0) -> None:
        for k, v in metrics.items():
            v = v.detach().float()
            if k.endswith("_max"):
                self.sums[k] = torch.maximum(self.sums[k], v) if k in self.sums else v
                self.weights[k] = torch.ones((), device=v.device)
                continue
            w = torch.as_tensor(weight, dtype=torch.float32, device=v.device)
            self.sums[k] = self.sums.get(k, 0) + v * w
            self.weights[k] = self.weights.get(k, 0) + w

    def result(self) -> Metrics:
        return {k: self.sums[k] / self.weights[k].clamp(min=1e-12) for k in self.sums}


def adamw_with_schedule(params: Iterable[Any], hp: Any, total_steps: int) -> dict[str, Any]:
    """AdamW and a per-step warm-up + cosine schedule, from an algorithm config's fields.

    ``params``: parameters, or param-group dicts (a group may set its own ``lr``)."""
    opt = torch.optim.AdamW(
        list(params), lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.adam_betas), eps=hp.adam_eps
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: warmup_cosine(
            s, warmup_steps=hp.warmup_steps, total_steps=total_steps, min_lr_ratio=hp.min_lr_ratio
        ),
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ModuleMixin(L.LightningModule):
    """Logging at ``step`` = optimizer updates done, and trainable-only checkpoints."""

    def log_metrics(self, metrics: Metrics) -> None:
        """Send metrics to every logger at ``step`` = optimizer updates done so far (0 before
        training), and keep them in ``trainer.callback_metrics``."""
        if self._trainer is None:
            return
        values = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers:
            logger.log_metrics(values, step=self.global_step)
        self.trainer.callback_metrics.update({k: v.detach().cpu() for k, v in metrics.items()})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep trainable weights (and a reference adapter, which may move) only: the frozen base
        is reloaded from its path on resume."""
        keep = {n for n, p in self.named_parameters() if p.requires_grad or ".reference." in n}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["trainable_only"] = True
