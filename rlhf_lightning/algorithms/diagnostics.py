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

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
Metrics = dict[str, torch.Tensor]

MAX_TURN_METRICS = 8
IS_GAP_WARN, IS_CLIP_WARN = 0.1, 0.02  # nats; share of truncated weights


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


def rollout_metrics(traj: Any, harness_metrics: dict[str, float]) -> dict[str, torch.Tensor]:
    """A training batch's ``rollout/*`` metrics (reward, length, empty share, turns) and the
    harness's own, on the CPU. ``traj``: the step's
    :class:`~rlhf_lightning.records.trajectory.TrajectoryBatch`."""
    returns = traj.returns.float()
    out = {
        "rollout/reward_mean": returns.mean(),
        "rollout/reward_std": returns.std() if len(returns) > 1 else torch.zeros(()),
        "rollout/completion_len": traj.action_mask.sum(-1).float().mean(),
        # at most one token (an eos): what a collapsed policy produces
        "rollout/empty_frac": (traj.action_mask.sum(-1) <= 1).float().mean(),
    }
    out.update(turn_metrics(traj.turn_lengths, traj.rewards, traj.truncated))
    out.update({k: torch.tensor(v) for k, v in harness_metrics.items()})
    return {k: v.detach().float().cpu() for k, v in out.items()}


def warn_on_engine_gap(metrics: dict[str, torch.Tensor], tis_cap: float | None) -> bool:
    """Warn when the engine's and the trainer's log-probs disagree noticeably (``is/gap_mean``
    above :data:`IS_GAP_WARN` nats, or ``is/clip_frac`` above :data:`IS_CLIP_WARN`); returns
    whether it warned."""
    gap, clip = metrics.get("is/gap_mean"), metrics.get("is/clip_frac")
    if gap is None or clip is None or (float(gap) <= IS_GAP_WARN and float(clip) <= IS_CLIP_WARN):
        return False
    log.warning(
        "rollout engine and trainer log-probs differ: mean gap %.3f nats (warn > %.2f), "
        "%.1f%% of importance weights truncated at %s (warn > %.0f%%); check dtype and sampling settings",
        float(gap),
        IS_GAP_WARN,
        100 * float(clip),
        tis_cap,
        100 * IS_CLIP_WARN,
    )
    return True


def sample_rows(trajectories: list[Any]) -> list[dict[str, Any]]:
    """Prompt, completion and reward of each trajectory (the samples table, ``samples.num``)."""
    return [
        {"prompt": t.prompt_text, "completion": t.completion_text, "reward": sum(t.rewards)}
        for t in trajectories
    ]


def mean_over_members(per_member: list[Metrics]) -> Metrics:
    """Each metric's mean over the members that report it."""
    keys = sorted(set().union(*per_member))
    return {k: torch.stack([m[k].float() for m in per_member if k in m]).mean() for k in keys}
