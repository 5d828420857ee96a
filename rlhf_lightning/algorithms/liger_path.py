"""The Liger path of the rollout update (``algo.use_liger_loss``): a mixin of :class:`RolloutModule`."""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlhf_lightning.algorithms.common import Metrics, ModuleMixin
from rlhf_lightning.envs.trajectory import TrajectoryBatch
from rlhf_lightning.losses.corrections import truncated_importance_weights
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.ops.liger import liger_available, liger_policy_loss, liger_unsupported
from rlhf_lightning.ops.logprobs import chunked_logprobs
from rlhf_lightning.rollout.engine import SamplingParams

log = logging.getLogger(__name__)


class LigerPath(ModuleMixin):
    """Chooses Liger's fused loss at fit start (GPU, supported objective) and computes a
    micro-batch's loss through it; everything else stays in :class:`RolloutModule`."""

    hp: Any
    policy: Policy
    sampling: SamplingParams
    use_liger: bool = False

    def on_fit_start(self) -> None:
        self.use_liger = self.resolve_liger()

    def resolve_liger(self) -> bool:
        """``algo.use_liger_loss``: Liger on a GPU where it reproduces our loss; else our op, with one warning."""
        if not getattr(self.hp, "use_liger_loss", False):
            return False
        if self.device.type != "cuda":
            log.warning(
                "algo.use_liger_loss=true: Liger's kernels need a GPU; using the chunked log-prob op on %s",
                self.device,
            )
            return False
        if not liger_available():
            raise ImportError(
                "algo.use_liger_loss=true needs liger-kernel: pip install 'rlhf_lightning[liger]'"
            )
        reason = liger_unsupported(self.hp)
        if reason is not None:
            log.warning(
                "algo.use_liger_loss=true: Liger does not cover %s; using the chunked log-prob op", reason
            )
            return False
        return True

    def liger_micro_step(
        self,
        sub: TrajectoryBatch,
        adv: torch.Tensor,
        mask: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        norm: dict[str, Any],
    ) -> tuple[torch.Tensor, Metrics]:
        """:meth:`micro_step` through Liger's fused linear GRPO loss (GPU, ``algo.use_liger_loss``)."""
        hp = self.hp
        rows, head = self.policy.action_hidden(
            sub.input_ids,
            sub.attention_mask,
            sub.action_mask,
            prompt_lens=sub.prompt_lens,
            prefix_ids=sub.prefix_ids,
        )
        targets = sub.input_ids[:, 1:][sub.action_mask]
        weights, metrics = None, {}
        if hp.tis_cap is not None and hp.old_logprobs_source == "trainer":
            if old is None:  # on-policy: the trainer's old log-probs are the current ones
                with torch.no_grad():
                    cur = chunked_logprobs(
                        rows.detach(),
                        head.weight,
                        targets,
                        head.bias,
                        self.sampling.temperature,
                        hp.chunk_rows,
                    )
                old_for_is = torch.zeros(sub.action_mask.shape, device=self.device).masked_scatter(
                    sub.action_mask, cur
                )
            else:
                old_for_is = old
            weights, tm = truncated_importance_weights(old_for_is, sub.sampling_logps, mask, hp.tis_cap)
            metrics.update({f"is/{k}": v for k, v in tm.items()})
        # Liger packs action tokens from the mask it is given: it must be the action mask itself.
        loss, m = liger_policy_loss(
            rows,
            head,
            targets,
            sub.action_mask,
            adv,
            old,
            ref,
            None if weights is None else weights * mask,
            hp,
            temperature=self.sampling.temperature,
            max_len=self.hp.max_len_norm or self.sampling.max_new_tokens,
            world_size=self.trainer.world_size if self._trainer is not None else 1,
            num_tokens=norm["num_tokens"],
            num_seqs=norm["num_seqs"],
        )
        metrics.update({f"actor/{k}": v for k, v in m.items()})
        metrics["actor/loss_part"] = loss.detach()
        return loss, metrics
