"""The update plan: how one step's rollouts become optimizer steps on this rank.

    rollout batch (B rows) -> update_epochs x mini-batches (one optimizer step each)
                           -> micro-batches (one forward/backward each, by rows or tokens)

Every batch size in the config is global; the plan holds them per rank, so the arithmetic is
done once, where the sizes are split. The counts that must agree across ranks (optimizer steps;
FSDP's forward passes) are agreed by :meth:`UpdatePlan.mini_batch_count` and :func:`lockstep`:
the only collectives here, run by every rank in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.microbatch import split_by_tokens, split_rows
from rlhf_lightning.records.trajectory import TrajectoryBatch
from rlhf_lightning.runtime.distributed import agree_max
from rlhf_lightning.runtime.strategies import split_global


@dataclass(frozen=True)
class UpdatePlan:
    """Per-rank batch sizes of a rollout algorithm's update.

    Attributes:
        update_epochs: passes over the rollout batch.
        rollout_batch_size: trajectories per training step on this rank.
        mini_batch_size: trajectories per optimizer step on this rank (None: the whole batch).
        micro_batch_size: rows per forward/backward on this rank (None: the whole mini-batch).
        micro_batch_tokens: a padded-token budget per micro-batch instead (None: by rows).
    """

    update_epochs: int
    rollout_batch_size: int
    mini_batch_size: int | None
    micro_batch_size: int | None
    micro_batch_tokens: int | None
    world_size: int = 1

    @classmethod
    def from_hp(cls, hp: RolloutAlgoConfig, world_size: int) -> UpdatePlan:
        """The plan of an algorithm config's (global) sizes on ``world_size`` ranks; a size that
        does not split evenly is refused with its field."""

        def per_rank(size: int | None, field: str) -> int | None:
            return None if size is None else split_global(size, world_size, f"algo.{field}")

        prompts = per_rank(hp.prompts_per_step, "prompts_per_step")
        return cls(
            update_epochs=hp.update_epochs,
            rollout_batch_size=(prompts or 0) * hp.group_size,
            mini_batch_size=per_rank(hp.mini_batch_size, "mini_batch_size"),
            micro_batch_size=per_rank(hp.micro_batch_size, "micro_batch_size"),
            micro_batch_tokens=hp.micro_batch_tokens,
            world_size=world_size,
        )

    def mini(self, n: int) -> int:
        """Rows per optimizer step for a batch of ``n`` rows."""
        return min(self.mini_batch_size or n, n)

    def micro(self, n: int) -> int:
        """Rows per micro-batch of a mini-batch of ``n`` rows (fixed-size micro-batching)."""
        return min(self.micro_batch_size or n, n)

    def is_on_policy(self, n: int) -> bool:
        """One epoch over one mini-batch: old log-probs equal the current ones (ratio 1)."""
        return self.update_epochs == 1 and self.mini(n) == n

    def optimizer_steps_per_batch(self) -> int:
        """Optimizer steps one training step of a full rollout batch takes."""
        n = self.rollout_batch_size
        return self.update_epochs * (n // self.mini(n))

    def row_lengths(self, traj: TrajectoryBatch) -> list[int]:
        """Every row's sequence length when micro-batches follow a token budget (one host sync
        per pass), else nothing (fixed-size micro-batches do not need them)."""
        return traj.attention_mask.sum(-1).tolist() if self.micro_batch_tokens is not None else []

    def micro_chunks(
        self, index: torch.Tensor, lengths: list[int], n: int, extra: int = 0
    ) -> list[torch.Tensor]:
        """Rows ``index`` (of a mini-batch of ``n``) as micro-batches: packed within
        ``micro_batch_tokens`` padded tokens (``lengths`` from :meth:`row_lengths`, plus ``extra``
        padding columns the pass adds), else ``micro_batch_size`` rows at a time."""
        if self.micro_batch_tokens is not None:
            return split_by_tokens(index, [length + extra for length in lengths], self.micro_batch_tokens)
        return split_rows(index, self.micro(n))

    def mini_batch_count(self, n: int, device: torch.device) -> int:
        """Optimizer steps per epoch, the same on every rank (a collective): a rank with fewer
        rows after dynamic sampling runs empty mini-batches."""
        return agree_max(-(-n // self.mini(n)), self.world_size, device)

    def epoch_batches(self, n: int, count: int, device: torch.device) -> list[torch.Tensor]:
        """One epoch's mini-batches (row indices), shuffled when there is more than one, padded
        with empty ones to ``count``. Shapes: [(<=mini,)] * count"""
        mini = self.mini(n)
        order = torch.randperm(n, device=device) if n > mini else torch.arange(n, device=device)
        batches = list(order.split(mini))
        return batches + [order[:0]] * (count - len(batches))


def lockstep(
    chunks: list[torch.Tensor], sharded: bool, world_size: int, device: torch.device
) -> list[tuple[torch.Tensor, float]]:
    """The micro-batches (row indices) to run, each with its loss weight.

    Under FSDP (``sharded``) a forward is a collective, so every rank runs as many micro-batches
    as the rank with the most: the others pad with zero-weight passes over their row 0.
    Otherwise ranks run what they have (gradients are averaged once per step).
    """
    out = [(index, 1.0) for index in chunks]
    if not sharded:
        return out
    count = agree_max(len(chunks), world_size, device)
    pad = torch.zeros(1, dtype=torch.long, device=device)
    return out + [(pad, 0.0)] * (count - len(chunks))


@torch.no_grad()
def no_grad_head(
    policy: Any,
    traj: TrajectoryBatch,
    plan: UpdatePlan,
    head: str,
    temperature: float,
    chunk_rows: int | None,
    reference: bool = False,
) -> torch.Tensor:
    """One head of ``policy`` (``logp`` or ``value``) for the whole batch without gradients, in
    the plan's micro-batches (so a no-grad pass fits where the update's passes fit).

    Returns:
        Shape: (B, L-1), on the batch's device.
    """
    device = traj.action_mask.device
    out = torch.zeros(traj.action_mask.shape, device=device)
    rows = torch.arange(len(traj), device=device)
    for index in plan.micro_chunks(rows, plan.row_lengths(traj), len(traj)):
        value = policy.forward_heads(
            traj.select(index), (head,), temperature=temperature, chunk_rows=chunk_rows, reference=reference
        )[head]
        out[index, : value.shape[1]] = value.float()
    return out
