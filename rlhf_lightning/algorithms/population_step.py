"""One training step of a whole population (``population.size=N``): one rollout, N updates.

    rows -> one engine call for every member's episodes (per-row adapters; one call per distinct
            temperature when members differ in it)
         -> split by member -> each member's rewards, advantages and update, in member order,
            with its own hyper-parameters, optimizer and schedule (:class:`MemberAPI`)
         -> ``member_k/*`` metrics, and their mean over members under the plain names

Every member draws the same prompt rows (the step's batch); member ``k`` samples its own
``group_size`` completions of each at its own temperature. Every rank runs the members in the
same order, so each runs the same passes and collectives.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import torch

from rlhf_lightning.algorithms.common import Metrics
from rlhf_lightning.algorithms.diagnostics import rollout_metrics
from rlhf_lightning.algorithms.members import MemberAPI, MemberBank
from rlhf_lightning.rollout.harness import RolloutHarness, RolloutResult
from rlhf_lightning.rollout.trajectory import Trajectory, collate


def split_by_adapter(
    trajs: list[Trajectory], adapters: list[str], pad_token_id: int
) -> dict[str, RolloutResult]:
    """Each adapter's trajectories of one mixed rollout as a batch of its own, group ids from 0
    (a member's groups are contiguous in the rollout), with its own harness metrics."""
    out: dict[str, RolloutResult] = {}
    for name in adapters:
        mine = [t for t in trajs if t.adapter == name]
        if not mine:
            raise RuntimeError(f"the population rollout returned no episode of {name}")
        first = mine[0].group_id
        for t in mine:
            t.group_id -= first
        out[name] = RolloutResult(collate(mine, pad_token_id), mine, RolloutHarness._metrics(mine))
    return out


class PopulationStep(MemberAPI):
    """:meth:`population_step` and :meth:`score_members` for :class:`RolloutModule`."""

    harness: Any
    engine: Any
    device: Any

    def member_rollouts(
        self, rows: list[int], evaluation: bool = False, temperature: float | None = None
    ) -> tuple[dict[str, RolloutResult], dict[str, float]]:
        """Every member's episodes for ``rows``, sampled side by side: one engine call per distinct
        temperature (``temperature``: one for all, e.g. fitness); evaluation: one episode per row.
        Also the metrics the calls report for all their episodes at once (:func:`call_metrics`)."""
        bank = cast(MemberBank, self.members)
        module = cast(Any, self)
        if hasattr(self.engine, "sync_adapters"):  # vLLM: one LoRA slot per member, loaded in place
            self.engine.sync_adapters(self.policy, bank.adapters)
        calls: dict[float, list[int]] = {}
        for k in range(bank.size):
            t = temperature if temperature is not None else self.member_sampling(k).temperature
            calls.setdefault(float(t), []).append(k)
        out: dict[str, RolloutResult] = {}
        whole: list[dict[str, float]] = []
        for t, ks in calls.items():
            params = dataclasses.replace(self.member_sampling(ks[0]), temperature=t)
            sizes = [1 if evaluation else int(self.member_hp(k).group_size) for k in ks for _ in rows]
            names = [bank.adapters[k] for k in ks for _ in rows]
            result = module.rollout(
                rows * len(ks), params, group_size=1, evaluation=evaluation, adapters=names, group_sizes=sizes
            )
            split = split_by_adapter(result.trajectories, [bank.adapters[k] for k in ks], self.pad_id)
            out.update(split)
            own = set().union(*(r.metrics for r in split.values()))
            whole.append({k: v for k, v in result.metrics.items() if k not in own})
        return {name: out[name] for name in bank.adapters}, call_metrics(whole)

    @property
    def pad_id(self) -> int:
        return int(self.harness.tokenizer.pad_token_id)

    def population_step(self, batch: torch.Tensor) -> None:
        """One rollout for every member, then each member's update on its own rows."""
        module = cast(Any, self)
        bank = cast(MemberBank, self.members)
        t_start = time.perf_counter()
        results, whole = self.member_rollouts(batch.tolist())
        module.rollouts_done()
        t_rollout = time.perf_counter() - t_start
        per_member: list[Metrics] = []
        for k, name in enumerate(bank.adapters):
            with self.use_member(k):
                module.report_phase(f"member {k + 1}/{bank.size}")
                result = module.finalize_rewards(results[name])
                traj, scored, old_logp, ref_logp = module.scored_batch(result)
                metrics = {**scored.metrics, **module.update(traj, scored, old_logp, ref_logp)}
                metrics.update(rollout_metrics(traj, result.metrics))
            per_member.append(metrics)
        step_s = time.perf_counter() - t_start
        shown = mean_over_members(per_member)
        for k, m in enumerate(per_member):
            shown.update({f"member_{k}/{key}": v for key, v in m.items()})
        shown.update({k: torch.tensor(v) for k, v in whole.items()})  # once, for the whole rollout
        shown["perf/step_s"] = torch.tensor(step_s)
        shown["perf/rollout_s"] = torch.tensor(t_rollout)
        shown["population/member_updates"] = torch.tensor(float(module.global_step))
        module.log_step(shown)
        module.log("reward", shown["rollout/reward_mean"], prog_bar=True, logger=False)
        module.keep_samples(results[bank.adapters[0]])

    @torch.no_grad()
    def score_members(self, rows: list[int], temperature: float) -> list[RolloutResult]:
        """Every member's evaluation episodes for ``rows`` at one ``temperature``, in one call."""
        bank = cast(MemberBank, self.members)
        results, _ = self.member_rollouts(rows, evaluation=True, temperature=temperature)
        return [results[name] for name in bank.adapters]


# Counts a rollout call reports for all its episodes: summed over the calls of a step.
CALL_COUNTS = ("rollout/dropped_long_prompts", "env/reward_errors", "env/step_timeouts")


def call_metrics(calls: list[dict[str, float]]) -> dict[str, float]:
    """The metrics that rollout calls report for all their episodes at once, not per member
    (dropped prompts, env errors and timeouts, a reward model's batch statistics): counts summed
    over the calls, anything else their mean. Logged once under the plain names, never copied
    into every ``member_k/*``."""
    keys = sorted(set().union(*calls)) if calls else []
    out = {}
    for k in keys:
        values = [c[k] for c in calls if k in c]
        out[k] = float(sum(values)) if k in CALL_COUNTS else float(sum(values) / len(values))
    return out


def mean_over_members(per_member: list[Metrics]) -> Metrics:
    """Each metric's mean over the members that report it."""
    keys = sorted(set().union(*per_member))
    return {k: torch.stack([m[k].float() for m in per_member if k in m]).mean() for k in keys}
