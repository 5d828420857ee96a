"""Turn-level diagnostics: how long episodes are, how they end, and where reward, value and
advantage sit across turns, so a user can watch credit being assigned in multi-turn runs.

Metrics (per training step, averaged over ranks like every other):
    rollout/num_turns           generated turns per episode (from the harness)
    rollout/env_ended_frac      share of episodes the env ended (the rest were truncated)
    rollout/reward_turn_<k>     mean reward of turn k (0-based) over the episodes that reached it
    critic/value_turn_<k>       PPO, turn-level steps: the critic's mean value of turn k
    critic/adv_turn_<k>         PPO, turn-level steps: the mean GAE advantage of turn k (before whitening)
Turns beyond :data:`MAX_TURN_METRICS` are left out (a metric per turn would flood dashboards).
"""

from __future__ import annotations

import torch

MAX_TURN_METRICS = 8


def per_turn_means(values: torch.Tensor, present: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """``{name_<k>: mean of values[:, k] where present[:, k]}`` for the turns some episode reached.

    Shapes: values, present (B, K)."""
    values, present = values.detach().float().cpu(), present.detach().cpu()
    out = {}
    for k in range(min(values.shape[1], MAX_TURN_METRICS)):
        n = int(present[:, k].sum())
        if n:
            out[f"{name}_{k}"] = values[present[:, k], k].sum() / n
    return out


def turn_metrics(
    turn_lengths: torch.Tensor, rewards: torch.Tensor, truncated: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Episode shape and per-turn reward. Shapes: turn_lengths, rewards (B, K); truncated (B,)."""
    reached = turn_lengths.detach().cpu() > 0  # (B, K): turn k was generated
    out = {"rollout/env_ended_frac": (~truncated.detach().cpu()).float().mean()}
    out.update(per_turn_means(rewards, reached, "rollout/reward_turn"))
    return out
