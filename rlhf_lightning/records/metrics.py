"""The metrics every episode driver reports for a rollout, from its trajectories alone: the
harness (:class:`~rlhf_lightning.rollout.episodes.harness.RolloutHarness`) and the agents'
runner (:class:`~rlhf_lightning.rollout.agents.runner.AgentRunner`) share them, so a dashboard
reads ``env/*`` and ``rollout/*`` the same way whichever drove the episodes."""

from __future__ import annotations

from rlhf_lightning.records.trajectory import Trajectory


def episode_metrics(trajs: list[Trajectory], *, missing: str = "skip") -> dict[str, float]:
    """``env/<key>``: the mean of each numeric info value; ``rollout/*``: the episodes' shape.

    ``missing`` says what an info dict without a key counts as:

    - ``skip``: nothing; the mean is over the infos that carry the key (an env reports some keys
      at some turns only, e.g. ``correct`` at the last).
    - ``zero``: 0, the mean over the episodes (each with one info dict): an agent's episode that
      failed has none of the agent's numbers, and it was not ``correct``.

    Returns ``env/<key>`` per key, ``rollout/truncated_frac``, ``rollout/cut_frac``,
    ``rollout/num_turns`` (turns, or an agent's calls, per episode) and
    ``rollout/episode_tokens`` (the tokens an episode costs in the update: all its sequences).
    """
    if missing not in ("skip", "zero"):
        raise ValueError(f"missing must be skip or zero, got {missing!r}")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for t in trajs:
        for info in t.infos:
            for k, v in info.items():
                if isinstance(v, (bool, int, float)):
                    sums[k] = sums.get(k, 0.0) + float(v)
                    counts[k] = counts.get(k, 0) + 1
    n = max(len(trajs), 1)
    out = {f"env/{k}": sums[k] / (counts[k] if missing == "skip" else n) for k in sums}
    out["rollout/truncated_frac"] = sum(t.truncated for t in trajs) / n
    out["rollout/cut_frac"] = sum(t.cut for t in trajs) / n
    out["rollout/num_turns"] = sum(t.num_turns for t in trajs) / n
    out["rollout/episode_tokens"] = sum(len(t.token_ids) for t in trajs) / n
    return out
