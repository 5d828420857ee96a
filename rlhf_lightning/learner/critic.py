"""Steps for actor-critic credit assignment: each generated turn (or each action token) is one
RL step. Pure functions over the trajectory batch layout.

Notation:
    B: trajectories, T = L-1 token positions, S: steps per trajectory (turns, or action tokens).
"""

from __future__ import annotations

import torch


def step_index(
    action_mask: torch.Tensor, turn_ids: torch.Tensor, granularity: str
) -> tuple[torch.Tensor, int]:
    """The step each action token belongs to (-1 elsewhere) and the number of step columns.

    ``turn``: a step is a generated turn (``turn_ids``). ``token``: a step is an action token,
    numbered in order within the trajectory.

    Args:
        action_mask, turn_ids: Shape: (B, T)

    Returns:
        (step ids of shape (B, T), S)
    """
    if granularity == "turn":
        idx = torch.where(action_mask, turn_ids, torch.full_like(turn_ids, -1))
    elif granularity == "token":
        idx = torch.where(action_mask, action_mask.long().cumsum(-1) - 1, torch.full_like(turn_ids, -1))
    else:
        raise ValueError(f"advantage granularity must be turn or token, got {granularity!r}")
    return idx, int(idx.max()) + 1 if idx.numel() and int(idx.max()) >= 0 else 1


STEP_VALUE_REDUCTIONS = ("state", "mean", "final_value")


def reduce_to_steps(
    values: torch.Tensor, idx: torch.Tensor, steps: int, reduction: str = "state"
) -> torch.Tensor:
    """Per-step values from per-token values.

    The value at a token's position is read from the hidden state before that token, so the
    value of a step's *state* is the one at its first token (``state``: ``V(s_k)``, the
    baseline that does not depend on the action). ``mean`` (all the step's tokens) and
    ``final_value`` (its last token) have already seen part of the action; they exist for
    compatibility with AgileRL's choices and bias the policy gradient.

    Args:
        values: Shape: (B, T)
        idx: step ids from :func:`step_index`. Shape: (B, T)

    Returns:
        Shape: (B, S); 0 for steps that do not exist.
    """
    if reduction not in STEP_VALUE_REDUCTIONS:
        raise ValueError(
            f"turn_value_reduction must be one of {', '.join(STEP_VALUE_REDUCTIONS)}, got {reduction!r}"
        )
    b = values.shape[0]
    valid = idx >= 0
    flat = (torch.arange(b, device=idx.device)[:, None] * steps + idx.clamp(min=0))[valid]
    out = torch.zeros(b * steps, dtype=values.dtype, device=values.device)
    if reduction == "mean":
        total = out.index_add(0, flat, values[valid])
        count = torch.zeros_like(out).index_add(0, flat, torch.ones_like(values[valid]))
        return (total / count.clamp(min=1.0)).view(b, steps)
    # state: the step's first position; final_value: its last.
    positions = torch.arange(values.shape[1], device=values.device).expand_as(values)[valid]
    pick_op, fill = ("amin", values.shape[1]) if reduction == "state" else ("amax", -1)
    chosen = torch.full((b * steps,), fill, device=values.device, dtype=torch.long).scatter_reduce(
        0, flat, positions, pick_op
    )
    hit = positions == chosen[flat]
    return out.index_copy(0, flat[hit], values[valid][hit]).view(b, steps)


def step_rewards(
    turn_rewards: torch.Tensor,
    idx: torch.Tensor,
    steps: int,
    granularity: str,
    extra: torch.Tensor | None = None,
    turn_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rewards per step: per-turn rewards as they are (turn), or each turn's reward on that
    turn's last action token (token; multi-turn rewards need ``turn_ids``). ``extra`` (B,),
    e.g. a length penalty or KL, is added to the last step.

    Args:
        turn_rewards: Shape: (B, K)
        idx: Shape: (B, T)
        turn_ids: Shape: (B, T)

    Returns:
        Shape: (B, S)
    """
    b, k_turns = turn_rewards.shape
    rows = torch.arange(b, device=turn_rewards.device)
    out = torch.zeros(b, steps, dtype=turn_rewards.dtype, device=turn_rewards.device)
    n_steps = (idx.max(-1).values + 1).clamp(min=0)  # (B,)
    if granularity == "turn":
        k = min(steps, k_turns)
        out[:, :k] = turn_rewards[:, :k]
    elif turn_ids is not None:
        valid = idx >= 0
        cell = (rows[:, None] * k_turns + turn_ids.clamp(0, k_turns - 1))[valid]
        last = torch.full((b * k_turns,), -1, dtype=idx.dtype, device=idx.device)
        last = last.scatter_reduce(0, cell, idx[valid], "amax").view(b, k_turns)  # turn's last step
        has = last >= 0
        out.view(-1).index_add_(0, (rows[:, None] * steps + last.clamp(min=0))[has], turn_rewards[has])
    else:
        if k_turns > 1 and bool((turn_rewards[:, 1:] != 0).any()):
            raise ValueError("token-level rewards of several turns need the turn ids")
        out[rows, (n_steps - 1).clamp(min=0)] = turn_rewards[:, 0]
    if extra is not None:
        out[rows, (n_steps - 1).clamp(min=0)] += extra.to(out.dtype)
    return out * (torch.arange(steps, device=out.device)[None, :] < n_steps[:, None])


def token_sums_to_steps(x: torch.Tensor, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """Per-token quantities summed into their step (e.g. each token's KL penalty: a token-level
    step gets its own, a turn-level step the sum over its tokens).

    Args:
        x: Shape: (B, T)
        idx: step ids from :func:`step_index` (-1 outside actions). Shape: (B, T)

    Returns:
        Shape: (B, S)
    """
    b = x.shape[0]
    valid = idx >= 0
    flat = (torch.arange(b, device=idx.device)[:, None] * steps + idx.clamp(min=0))[valid]
    out = torch.zeros(b * steps, dtype=x.dtype, device=x.device)
    return out.index_add(0, flat, x[valid]).view(b, steps)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(R - V) / Var(R)`` over valid steps (1: perfect, 0: no better than a constant)."""
    m = mask.bool()
    r, v = returns[m].float(), values[m].float()
    if r.numel() < 2:
        return torch.zeros((), device=returns.device)
    var_r = r.var()
    return torch.where(var_r > 0, 1 - (r - v).var() / var_r.clamp(min=1e-12), torch.zeros_like(var_r))
