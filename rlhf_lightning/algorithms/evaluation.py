"""Held-out evaluation for rollout algorithms: greedy and sampled episodes on the eval split.

With several processes each rank evaluates its own rows (``rlhf_lightning.data.prompts``:
every row on exactly one rank); a metric is the global sum over the global count, so it equals
the one-process value on the same episodes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from rlhf_lightning.algorithms.common import ModuleMixin
from rlhf_lightning.config.sections import pass_ks
from rlhf_lightning.data.prompts import PAD_ROW
from rlhf_lightning.envs.mix import MIX_KEY
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.episodes.harness import SUCCESS_KEYS, reward_value, success_flag
from rlhf_lightning.runtime import rng

log = logging.getLogger(__name__)


def episode_success(traj: Any) -> float:
    """Solved when the last turn's info says so (``correct``/``success``/``solved``: a bool, or
    exactly 0/1), else when the return is > 0. Any other value of a success field (the string
    ``"False"``, NaN) is refused with a ``TypeError``: ``bool()`` would count it as solved."""
    last = traj.infos[-1] if traj.infos else {}
    for key in SUCCESS_KEYS:
        if key in last:
            flag = success_flag(last[key])
            if flag is None:
                raise TypeError(
                    f"an episode's last info[{key!r}]={last[key]!r}: a success field must be a bool (or 0/1); "
                    f"the env must return e.g. info[{key!r}] = bool(solved)"
                )
            return float(flag)
    return float(sum(traj.rewards) > 0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021, arXiv 2107.03374, eq. 1):
    ``1 - C(n - c, k) / C(n, k)``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def episode_values(result: RolloutResult, n: int) -> dict[str, torch.Tensor]:
    """The values the metrics average, from ``n`` episodes per problem: ``accuracy`` and
    ``return`` per episode (E,), and with n > 1 ``pass@k`` per problem (E / n,), k in
    :func:`pass_ks`. Episodes are row-major (a problem's n episodes are contiguous)."""
    success = torch.tensor([episode_success(t) for t in result.trajectories], dtype=torch.float64)
    out = {"accuracy": success, "return": result.batch.returns.detach().double().cpu()}
    if n > 1:
        correct = success.view(-1, n).sum(-1).long().tolist()  # (E / n,) per problem
        for k in pass_ks(n):
            out[f"pass@{k}"] = torch.tensor([pass_at_k(n, c, k) for c in correct], dtype=torch.float64)
    return out


def member_values(
    result: RolloutResult, values: dict[str, torch.Tensor], names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """``env=mix``: the per-episode ``accuracy`` and ``return`` of ``values`` split by the member
    that played each episode (its reset info's ``mix_env``), as ``<name>/accuracy`` and
    ``<name>/return``; every name of ``names`` is present (empty where no episode was its own).
    Shape: (episodes of that member,)"""
    played = [t.task_info.get(MIX_KEY) for t in result.trajectories]
    out = {}
    for name in names:
        mine = torch.tensor([m == name for m in played], dtype=torch.bool)
        for key in ("accuracy", "return"):
            out[f"{name}/{key}"] = values[key][mine]
    return out


def info_values(result: RolloutResult, key: str) -> torch.Tensor:
    """Every turn's ``info[key]`` over ``result``'s episodes, where it is a finite number or a
    bool (True counts 1). Shape: (n,)"""
    found = (info[key] for t in result.trajectories for info in t.infos if key in info)
    values = [float(v) if isinstance(v, bool) else reward_value(v) for v in found]
    return torch.tensor([v for v in values if v is not None], dtype=torch.float64)


def add_total(totals: dict[str, torch.Tensor], key: str, values: torch.Tensor, counted: bool = True) -> None:
    """Add the sum and the number of ``values`` (any shape) to ``totals[key]``, a float64
    ``[sum, count]``. ``counted=False`` adds only the key (a padding batch: every rank then holds
    the same keys, in the same order, for the one collective at the epoch's end)."""
    total = totals.setdefault(key, torch.zeros(2, dtype=torch.float64))
    if counted:
        total += torch.stack([values.detach().double().sum().cpu(), torch.tensor(float(values.numel()))])


def global_means(
    totals: dict[str, torch.Tensor], sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Each metric's global mean: the sum over the count, both summed over the ranks, in one
    ``sum_over_ranks`` of the (K, 2) stack of every key's ``[sum, count]`` (sorted keys: the same
    order on every rank). Not a mean of per-rank means (ranks hold different numbers of rows).
    A metric with no values anywhere is left out. Values: float32 0-d tensors on the CPU."""
    keys = sorted(totals)
    if not keys:  # no validation batches (then on no rank)
        return {}
    summed = sum_over_ranks(torch.stack([totals[k] for k in keys])).cpu()  # (K, 2)
    return {k: (s / c).float() for k, (s, c) in zip(keys, summed) if c > 0}


class RolloutEvaluation(ModuleMixin):
    """Validation loop: ``eval/accuracy_{greedy,sampled}``, ``eval/return_{greedy,sampled}`` (with
    ``env=mix`` also per member: ``eval/<name>/accuracy_*``, ``eval/<name>/return_*``) and,
    with ``eval_num_samples`` n > 1 sampled completions per problem, ``eval/pass@k`` for k <= n.

    Expects ``self.sampling``, ``self.eval_greedy``, ``self.eval_sampled``,
    ``self.eval_num_samples`` and ``self.source`` (a
    :class:`~rlhf_lightning.rollout.source.RolloutSource`). Batches are eval row indices; a batch of
    ``PAD_ROW`` only (a rank with fewer rows, :func:`~rlhf_lightning.data.prompts.rank_eval_rows`)
    runs the same rollouts on a stand-in row and counts none of them.
    """

    sampling: SamplingParams
    source: Any
    eval_greedy: bool
    eval_sampled: bool
    eval_num_samples: int = 1
    eval_info_metrics: tuple[str, ...] = ()  # eval.info_metrics (set by run/fit.py)
    last_eval_step: int
    _eval_outputs: dict[str, list[torch.Tensor]]  # per-example values of subclasses (each counted once)
    _eval_totals: dict[str, torch.Tensor] | None = None  # [sum, count] per metric, this rank
    _rng_before_eval: dict[str, Any] | None = None
    _eval_info_keys: set[str]  # the info keys this rank's evaluation episodes returned
    _info_metrics_warned: set[str]  # eval.info_metrics keys already warned about (once each)

    def sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (one all-reduce; ``t`` itself with one process)."""
        return self.trainer.strategy.reduce(t.to(self.device), reduce_op="sum")

    def on_validation_start(self) -> None:
        # Evaluation samples from the global RNGs; put them back afterwards, so training draws
        # the same numbers whether or not (and however often) it evaluates: a resumed run,
        # which skips the evaluation after its checkpoint, then continues exactly.
        self._rng_before_eval = rng.capture()

    def restore_training_rng(self) -> None:
        """At the end of the validation epoch: before any callback saves a checkpoint."""
        state = self._rng_before_eval
        if state is not None:
            rng.restore(state)
            self._rng_before_eval = None

    def on_validation_epoch_start(self) -> None:
        self._eval_outputs = {}
        self._eval_totals = {}
        self._eval_info_keys = set()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self._eval_totals is None:  # called outside a validation epoch
            self._eval_totals, self._eval_info_keys = {}, set()
        rows = [r for r in batch.tolist() if r != PAD_ROW]
        padding = not rows  # this rank has no row left: the same rollouts, on row 0, uncounted
        modes = []
        if self.eval_greedy:
            modes.append(("greedy", dataclasses.replace(self.sampling, temperature=0.0, n=1)))
        if self.eval_sampled:
            modes.append(("sampled", self.sampling))
        for name, params in modes:
            n = self.eval_num_samples if name == "sampled" else 1
            result = self.source.generate(rows or [0], params, group_size=n, evaluation=True)
            per_episode = episode_values(result, n)
            for key, values in per_episode.items():
                metric = f"eval/{key}" if key.startswith("pass@") else f"eval/{key}_{name}"
                add_total(self._eval_totals, metric, values, counted=not padding)
            for key, values in member_values(result, per_episode, self.mix_members()).items():
                add_total(self._eval_totals, f"eval/{key}_{name}", values, counted=not padding)
            for key in self.eval_info_metrics:  # keys from the config: the same on every rank
                add_total(self._eval_totals, f"eval/env_{key}_{name}", info_values(result, key), not padding)
            if self.eval_info_metrics:  # for the message when a configured key never comes
                self._eval_info_keys.update(k for t in result.trajectories for info in t.infos for k in info)

    def mix_members(self) -> tuple[str, ...]:
        """``env=mix``'s member names (from the harness's env factory; none for other envs): the
        same on every rank, so each rank holds the same ``eval/<name>/*`` keys."""
        factory = getattr(getattr(self.source, "harness", None), "env_factory", None)
        return tuple(getattr(factory, "member_names", ()))

    def check_info_metrics(self, metrics: dict[str, torch.Tensor]) -> list[str]:
        """Warn (once per key, rank 0) about an ``eval.info_metrics`` key that no evaluation
        episode returned as a number: a typo would otherwise log nothing, silently. Not an
        error: an env may return a key on some episodes only (e.g. on success), so the first
        evaluation, before any training, can lack it. ``metrics`` are global: every rank
        decides the same. Returns the keys warned about now."""
        ran = [mode for mode in ("greedy", "sampled") if f"eval/accuracy_{mode}" in metrics]
        warned: set[str] = getattr(self, "_info_metrics_warned", set())
        self._info_metrics_warned = warned
        missing = [
            k
            for k in self.eval_info_metrics
            if ran and k not in warned and all(f"eval/env_{k}_{m}" not in metrics for m in ran)
        ]
        warned.update(missing)
        if missing and self.global_rank == 0:
            seen = sorted(getattr(self, "_eval_info_keys", set()))
            log.warning(
                "eval.info_metrics: %s came in no evaluation episode as a number at step %d (the env's "
                "step infos held %s); eval/env_<key>_* is logged once an episode returns it: check "
                "the spelling if it never is",
                ", ".join(missing),
                self.global_step,
                ", ".join(seen) or "nothing",
            )
        return missing

    def on_validation_epoch_end(self) -> None:
        totals = self._eval_totals if self._eval_totals is not None else {}
        for key, chunks in self._eval_outputs.items():
            add_total(totals, key, torch.cat(chunks))
        metrics = global_means(totals, self.sum_over_ranks)
        self.check_info_metrics(metrics)
        self.log_metrics(metrics)
        for key, short in (("eval/accuracy_greedy", "acc"), ("eval/accuracy_sampled", "acc_sampled")):
            if key in metrics:
                self.log(short, metrics[key], prog_bar=True, logger=False)
        self.last_eval_step = self.global_step
        self.restore_training_rng()
