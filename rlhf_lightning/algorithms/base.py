"""One training skeleton for every rollout algorithm.

    rows -> rollout (generate with the current policy, score in the env)
         -> advantages -> no-grad old / reference log-probs
         -> for epoch, mini-batch, micro-batch: loss -> manual_backward -> clip -> step
         -> namespaced metrics

Subclasses override :meth:`compute_advantages` and :meth:`policy_loss` (and may add terms
through :meth:`extra_loss`); everything else lives here once.
"""

from __future__ import annotations

import time
from typing import Any, cast

import lightning as L
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_lightning.algorithms.schedule import warmup_cosine
from rlhf_lightning.envs.harness import RolloutHarness, RolloutResult
from rlhf_lightning.envs.trajectory import TrajectoryBatch
from rlhf_lightning.losses import aggregate, kl
from rlhf_lightning.losses.masked import masked_mean
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.rollout.engine import RolloutEngine, SamplingParams

Metrics = dict[str, torch.Tensor]


def _rows(x: torch.Tensor | None, index: torch.Tensor, width: int) -> torch.Tensor | None:
    """Rows ``index`` of a (B, L-1) tensor, trimmed to ``width`` columns."""
    return None if x is None else x[index][:, :width]


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
                self.weights[k] = torch.ones(())
                continue
            w = torch.as_tensor(weight, dtype=torch.float32, device=v.device)
            self.sums[k] = self.sums.get(k, 0) + v * w
            self.weights[k] = self.weights.get(k, 0) + w

    def result(self) -> Metrics:
        return {k: self.sums[k] / self.weights[k].clamp(min=1e-12).to(self.sums[k].device) for k in self.sums}


class RolloutModule(L.LightningModule):
    """The rollout-algorithm skeleton (manual optimization).

    Args:
        policy: the trainable policy (actor adapter or full model, plus its reference).
        harness: turns task rows into scored trajectory batches.
        engine: the rollout engine (HF ``generate`` on the policy, or vLLM).
        sampling: training sampling parameters (``n`` is ignored: see ``hp.group_size``).
        hp: the algorithm's config dataclass (e.g. :class:`~rlhf_lightning.config.GRPOConfig`).
        eval_greedy, eval_sampled: which evaluations the validation loop runs.
    """

    def __init__(
        self,
        policy: Policy,
        harness: RolloutHarness,
        engine: RolloutEngine,
        sampling: SamplingParams,
        hp: Any,
        *,
        eval_greedy: bool = True,
        eval_sampled: bool = True,
        num_samples_to_keep: int = 4,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = (
            False  # checkpoints hold trainable weights only; the frozen base reloads from model.path
        )
        self.policy = policy
        self.harness = harness
        self.engine = engine
        self.sampling = sampling
        self.hp = hp
        self.eval_greedy, self.eval_sampled = eval_greedy, eval_sampled
        self.num_samples_to_keep = num_samples_to_keep
        self.last_samples: list[dict[str, Any]] = []
        self.last_eval_step = -1
        self._eval_outputs: dict[str, list[torch.Tensor]] = {}

    # ---------------------------------------------------------------- hooks for subclasses
    def compute_advantages(self, traj: TrajectoryBatch) -> torch.Tensor:
        """Advantages per trajectory (B,) or per token (B, L-1)."""
        raise NotImplementedError

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, Metrics]:
        """Per-token policy loss (B, T) and detached metrics."""
        raise NotImplementedError

    def extra_loss(
        self, traj: TrajectoryBatch, index: torch.Tensor, norm: dict[str, Any]
    ) -> tuple[torch.Tensor, Metrics]:
        """Additional scalar loss for a micro-batch (e.g. a critic's value loss)."""
        return torch.zeros((), device=self.device), {}

    # ---------------------------------------------------------------- the training step
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        t_start = time.perf_counter()
        # 1. Rollout: group_size episodes per prompt row, sampled from the current policy.
        result = self.rollout(batch.tolist(), self.sampling, group_size=self.hp.group_size)
        traj = result.batch.to(self.device)
        t_rollout = time.perf_counter() - t_start
        # 2. Score: episode returns -> advantages.
        adv = self.compute_advantages(traj)
        # 3. Log-probs the update needs, computed once without gradients.
        old_logp = self.old_logprobs(traj)  # None when every update is on-policy
        ref_logp = self.batched_logprobs(traj, reference=True) if self.hp.beta > 0 else None
        # 4. Optimize: update_epochs x mini-batches, each an accumulation over micro-batches.
        metrics = self.update(traj, adv, old_logp, ref_logp)
        # 5. Log.
        step_s = time.perf_counter() - t_start
        action_tokens = traj.action_mask.sum()
        metrics.update(self.rollout_metrics(traj, result))
        metrics["perf/step_s"] = torch.tensor(step_s)
        metrics["perf/rollout_s"] = torch.tensor(t_rollout)
        metrics["perf/tokens_per_s"] = action_tokens.float().cpu() / step_s
        self.log_metrics(metrics)
        self.log("reward", metrics["rollout/reward_mean"], prog_bar=True, logger=False)
        self.keep_samples(result)

    def rollout(
        self, rows: list[int], params: SamplingParams, *, group_size: int, evaluation: bool = False
    ) -> RolloutResult:
        return self.harness.rollout(self.engine, rows, params, group_size=group_size, evaluation=evaluation)

    @property
    def on_policy(self) -> bool:
        """One epoch over one mini-batch: old log-probs equal the current ones (ratio 1)."""
        return (
            self.hp.update_epochs == 1
            and self.mini_batch_size(self.rollout_batch_size) == self.rollout_batch_size
        )

    @property
    def rollout_batch_size(self) -> int:
        return self.hp.prompts_per_step * self.hp.group_size

    def mini_batch_size(self, n: int) -> int:
        return min(self.hp.mini_batch_size or n, n)

    def old_logprobs(self, traj: TrajectoryBatch) -> torch.Tensor | None:
        return None if self.on_policy else self.batched_logprobs(traj)

    @torch.no_grad()
    def batched_logprobs(self, traj: TrajectoryBatch, reference: bool = False) -> torch.Tensor:
        """No-grad log-probs of every action token, micro-batch by micro-batch. Shape: (B, L-1)"""
        out = torch.zeros(traj.action_mask.shape, device=self.device)
        micro = self.hp.micro_batch_size or len(traj)
        for index in torch.arange(len(traj), device=self.device).split(micro):
            sub = traj.select(index)
            logp, _ = self.policy.token_logprobs(
                sub.input_ids,
                sub.attention_mask,
                sub.action_mask,
                temperature=self.sampling.temperature,
                chunk_rows=self.hp.chunk_rows,
                reference=reference,
                prompt_lens=sub.prompt_lens,
                prefix_ids=sub.prefix_ids,
            )
            out[index, : logp.shape[1]] = logp.float()
        return out

    def update(
        self,
        traj: TrajectoryBatch,
        adv: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
    ) -> Metrics:
        opt = cast(LightningOptimizer, self.optimizers())
        sched = cast(LRScheduler, self.lr_schedulers())
        n = len(traj)
        mini = self.mini_batch_size(n)
        micro = min(self.hp.micro_batch_size or mini, mini)
        # Rows whose advantage is 0 everywhere contribute no gradient when no KL term is used.
        seq_adv = adv if adv.dim() == 1 else (adv * traj.action_mask).abs().sum(-1)
        skip_zero = self.hp.skip_zero_advantage and self.hp.beta == 0 and self.can_skip_zero_advantage()
        acc = MetricAccumulator()
        for _ in range(self.hp.update_epochs):
            order = torch.randperm(n, device=self.device) if n > mini else torch.arange(n, device=self.device)
            for mb in order.split(mini):
                # Normalisers of the whole mini-batch (summed over ranks under DDP).
                norm = self.normalisers(traj.action_mask[mb])
                run = mb[seq_adv[mb] != 0] if skip_zero else mb
                mb_loss = torch.zeros((), device=self.device)
                for index in run.split(micro) if len(run) else ():
                    loss, m = self.micro_step(traj, adv, old_logp, ref_logp, index, norm)
                    self.manual_backward(loss)
                    mb_loss = mb_loss + loss.detach()
                    acc.add(m, weight=traj.action_mask[index].sum())
                max_norm = self.hp.grad_clip if self.hp.grad_clip is not None else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), max_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                sched.step()
                acc.add({"actor/loss": mb_loss, "actor/grad_norm": grad_norm.detach()})
        out = acc.result()
        out["actor/lr"] = torch.tensor(sched.get_last_lr()[0])
        out["actor/skipped_rows_frac"] = (seq_adv == 0).float().mean() if skip_zero else torch.zeros(())
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def can_skip_zero_advantage(self) -> bool:
        """Whether a row with zero advantage adds no gradient (false once e.g. an entropy bonus is added)."""
        return True

    def normalisers(self, mask: torch.Tensor) -> dict[str, Any]:
        """:func:`aggregate`'s denominators for a mini-batch.

        Summed over ranks, then divided by the world size to undo DDP's gradient averaging, so
        the update equals the one of the global mini-batch.
        """
        tokens = mask.sum().float()
        seqs = torch.tensor(float(mask.shape[0]), device=mask.device)
        world = self.trainer.world_size if self._trainer is not None else 1
        if world > 1:
            tokens = self.trainer.strategy.reduce(tokens, reduce_op="sum")
            seqs = self.trainer.strategy.reduce(seqs, reduce_op="sum")
        return {"num_tokens": tokens / world, "num_seqs": seqs / world}

    def micro_step(
        self,
        traj: TrajectoryBatch,
        adv: torch.Tensor,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        index: torch.Tensor,
        norm: dict[str, Any],
    ) -> tuple[torch.Tensor, Metrics]:
        """The loss of one micro-batch, already normalised for the whole mini-batch."""
        sub = traj.select(index)
        width, mask = sub.action_mask.shape[1], sub.action_mask
        logp, _ = self.policy.token_logprobs(
            sub.input_ids,
            sub.attention_mask,
            mask,
            temperature=self.sampling.temperature,
            chunk_rows=self.hp.chunk_rows,
            prompt_lens=sub.prompt_lens,
            prefix_ids=sub.prefix_ids,
        )
        old = _rows(old_logp, index, width)
        old = logp.detach() if old is None else old
        a = adv[index] if adv.dim() == 1 else adv[index][:, :width]
        per_token, m = self.policy_loss(logp, old, a, mask)
        metrics = {f"actor/{k}": v for k, v in m.items()}
        if ref_logp is not None:
            kl_t = kl(logp, ref_logp[index][:, :width], self.hp.kl_estimator, self.hp.kl_clamp)
            per_token = per_token + self.hp.beta * kl_t
            metrics["actor/kl"] = masked_mean(kl_t.detach(), mask)
        loss = aggregate(per_token, mask, self.hp.loss_agg_mode, max_len=self.max_len_norm, **norm)
        extra, extra_metrics = self.extra_loss(traj, index, norm)
        metrics.update(extra_metrics)
        return loss + extra, metrics

    @property
    def max_len_norm(self) -> int:
        return self.hp.max_len_norm or self.sampling.max_new_tokens

    # ---------------------------------------------------------------- metrics and samples
    def rollout_metrics(self, traj: TrajectoryBatch, result: RolloutResult) -> Metrics:
        returns = traj.returns.float()
        out = {
            "rollout/reward_mean": returns.mean(),
            "rollout/reward_std": returns.std() if len(returns) > 1 else torch.zeros(()),
            "rollout/completion_len": traj.action_mask.sum(-1).float().mean(),
        }
        out.update({k: torch.tensor(v) for k, v in result.metrics.items()})
        return {k: v.detach().float().cpu() for k, v in out.items()}

    def keep_samples(self, result: RolloutResult) -> None:
        self.last_samples = [
            {"prompt": t.prompt_text, "completion": t.completion_text, "reward": sum(t.rewards)}
            for t in result.trajectories[: self.num_samples_to_keep]
        ]

    # ---------------------------------------------------------------- evaluation
    def on_validation_epoch_start(self) -> None:
        self._eval_outputs = {}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        rows = batch.tolist()
        modes = []
        if self.eval_greedy:
            modes.append(("greedy", SamplingParams(self.sampling.max_new_tokens, temperature=0.0)))
        if self.eval_sampled:
            modes.append(("sampled", self.sampling))
        for name, params in modes:
            result = self.rollout(rows, params, group_size=1, evaluation=True)
            self._eval_outputs.setdefault(f"eval/accuracy_{name}", []).append(
                torch.tensor([_success(t) for t in result.trajectories], dtype=torch.float32)
            )
            self._eval_outputs.setdefault(f"eval/return_{name}", []).append(result.batch.returns.float())

    def on_validation_epoch_end(self) -> None:
        metrics = {}
        for key, chunks in self._eval_outputs.items():
            metrics[key] = cast(torch.Tensor, self.all_gather(torch.cat(chunks))).float().mean().cpu()
        self.log_metrics(metrics)
        for key, short in (("eval/accuracy_greedy", "acc"), ("eval/accuracy_sampled", "acc_sampled")):
            if key in metrics:
                self.log(short, metrics[key], prog_bar=True, logger=False)
        self.last_eval_step = self.global_step

    def log_metrics(self, metrics: Metrics) -> None:
        """Send metrics to every logger at ``step`` = optimizer updates done so far (0 before training),
        and keep them in ``trainer.callback_metrics``."""
        if self._trainer is None:
            return
        values = {k: float(v) for k, v in metrics.items()}
        for logger in self.loggers:
            logger.log_metrics(values, step=self.global_step)
        self.trainer.callback_metrics.update({k: v.detach().cpu() for k, v in metrics.items()})

    # ---------------------------------------------------------------- optimisation
    def configure_optimizers(self) -> Any:
        hp = self.hp
        opt = torch.optim.AdamW(
            self.policy.trainable_parameters(),
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            betas=tuple(hp.adam_betas),
            eps=hp.adam_eps,
        )
        total = self.total_optimizer_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt,
            lambda s: warmup_cosine(
                s, warmup_steps=hp.warmup_steps, total_steps=total, min_lr_ratio=hp.min_lr_ratio
            ),
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def total_optimizer_steps(self) -> int:
        trainer = self._trainer
        if trainer is None:
            return 1
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        per_batch = self.hp.update_epochs * (
            self.rollout_batch_size // self.mini_batch_size(self.rollout_batch_size)
        )
        return max(int(trainer.estimated_stepping_batches) * per_batch, 1)

    # ---------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep trainable weights only: the frozen base is reloaded from its path on resume."""
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["trainable_only"] = True


def _success(traj: Any) -> float:
    """An episode counts as solved when its last info says so (``correct``/``success``), else return > 0."""
    last = traj.infos[-1] if traj.infos else {}
    for key in ("correct", "success", "solved"):
        if key in last:
            return float(bool(last[key]))
    return float(sum(traj.rewards) > 0)
