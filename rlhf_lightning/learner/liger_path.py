"""The Liger implementation of the micro-batch objective (``algo.use_liger_loss``, GPU).

Liger's fused linear loss computes the lm-head logits, the policy term, the KL term and their
gradients chunk by chunk. It implements the same :class:`~rlhf_lightning.learner.objective.Objective`
as :class:`~rlhf_lightning.learner.objective.PolicyObjective` for the combinations that
:func:`liger_unsupported` accepts (validation refuses the others at
start-up), and it is tested equal to it on the CPU through Liger's PyTorch path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rlhf_lightning.config.algo import registered_name
from rlhf_lightning.learner.objective import Backward, MicroBatch
from rlhf_lightning.learner.records import Metrics
from rlhf_lightning.learner.teacher import distills_full_kl
from rlhf_lightning.losses.corrections import truncated_importance_weights
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.ops.liger import (
    LigerLoss,
    liger_available,
    liger_combinations,
    liger_loss_type,
    liger_policy_loss,
)
from rlhf_lightning.ops.logprobs import chunked_logprobs

log = logging.getLogger(__name__)


def liger_unsupported(hp: Any) -> str | None:
    """Why Liger's loss cannot reproduce the algorithm config ``hp`` exactly, or None when it can
    (start-up and population mutations are refused with this reason)."""
    if hp.module != "grpo":
        return f"algo.module={hp.module} (Liger's loss has no critic or entropy term; GRPO family only)"
    if hp.mask_truncated:
        return "algo.mask_truncated=true (Liger takes the action mask as the loss mask)"
    if hp.offpolicy_token_bounds is not None or hp.offpolicy_seq_threshold:
        return "off-policy masks (algo.offpolicy_token_bounds / offpolicy_seq_threshold)"
    loss = registered_name(hp.loss)
    if liger_loss_type(loss, hp.loss_agg_mode) is None:
        supported = ", ".join(liger_combinations())
        return f"algo.loss={loss} with algo.loss_agg_mode={hp.loss_agg_mode} (Liger covers {supported})"
    if loss == "cispo" and hp.clip_low is not None:
        return "algo.clip_low must be null for CISPO (Liger's CISPO has no lower bound)"
    if loss == "gspo" and (hp.is_level != "sequence" or hp.is_pooling != "mean"):
        return "GSPO with turn-level or product pooling"
    if distills_full_kl(hp):
        return "algo.distill.estimator=full (the teacher's KL is a term of our objective)"
    if hp.clip_ratio_c is not None:
        return "algo.clip_ratio_c (dual clip)"
    if hp.beta > 0 and (hp.kl_mode != "loss" or hp.kl_estimator != "k3" or hp.kl_clamp is not None):
        return "a KL term other than k3 in the loss without clamp (set algo.kl_clamp=null)"
    return None


def use_liger(hp: Any, device: torch.device) -> bool:
    """``algo.use_liger_loss``: Liger on a GPU; on a CPU our op, with one warning."""
    if not getattr(hp, "use_liger_loss", False):
        return False
    if device.type != "cuda":
        log.warning(
            "algo.use_liger_loss=true: Liger's kernels need a GPU; using the chunked log-prob op on %s",
            device,
        )
        return False
    if not liger_available():
        raise ImportError("algo.use_liger_loss=true needs liger-kernel: pip install 'rlhf_lightning[liger]'")
    return True


class LigerObjective:
    """Liger's fused linear GRPO loss as the micro-batch objective.

    Args:
        hp: the algorithm config (objective name, clip bounds, KL settings, aggregation): read
            once here to build Liger's loss, as :class:`PolicyObjective` binds its terms.
        temperature, chunk_rows, max_len: as in :class:`PolicyObjective`.
        tis_cap: truncated importance weights trainer/engine (None: off).
        world_size: ranks the gradient is averaged over.
        compiled: let Liger ``torch.compile`` its chunk function (off in CPU tests).
    """

    def __init__(
        self,
        hp: Any,
        *,
        temperature: float,
        chunk_rows: int | None,
        max_len: int,
        tis_cap: float | None,
        world_size: int = 1,
        compiled: bool = True,
    ) -> None:
        self.loss = LigerLoss(
            registered_name(hp.loss),
            hp.loss_agg_mode,
            hp.clip_low,
            hp.clip_high,
            hp.beta,
            hp.kl_importance_weighted,
        )
        self.temperature, self.chunk_rows, self.max_len = temperature, chunk_rows, max_len
        self.tis_cap, self.world_size, self.compiled = tis_cap, world_size, compiled

    def __call__(
        self, policy: Policy, mb: MicroBatch, norm: dict[str, Any], backward: Backward, actor: bool = True
    ) -> tuple[torch.Tensor, Metrics]:
        sub = mb.sub
        rows, head = policy.batch_hidden(sub)
        targets = sub.input_ids[:, 1:][sub.action_mask]
        weights, metrics = None, {}
        if self.tis_cap is not None:
            old = mb.old_logp if mb.old_logp is not None else self._current(rows, head, targets, sub)
            weights, tm = truncated_importance_weights(old, sub.sampling_logps, mb.mask, self.tis_cap)
            metrics.update({f"is/{k}": v for k, v in tm.items()})
        # Liger packs action tokens from the mask it is given: it must be the action mask itself.
        # Validation refuses loss masks that differ from it (mask_truncated, off-policy masks).
        loss, m = liger_policy_loss(
            rows,
            head,
            targets,
            sub.action_mask,
            mb.adv,
            mb.old_logp,
            mb.ref_logp,
            None if weights is None else weights * mb.mask,
            self.loss,
            temperature=self.temperature,
            max_len=self.max_len,
            world_size=self.world_size,
            num_tokens=norm["num_tokens"],
            num_seqs=norm["num_seqs"],
            compiled=self.compiled,
        )
        metrics.update({f"actor/{k}": v for k, v in m.items()})
        metrics["actor/loss_part"] = loss.detach()
        return loss, metrics

    def _current(self, rows: torch.Tensor, head: Any, targets: torch.Tensor, sub: Any) -> torch.Tensor:
        """On-policy: the trainer's behaviour log-probs are the current ones (no gradient)."""
        with torch.no_grad():
            cur = chunked_logprobs(
                rows.detach(), head.weight, targets, head.bias, self.temperature, self.chunk_rows
            )
        return torch.zeros(sub.action_mask.shape, device=rows.device).masked_scatter(sub.action_mask, cur)
