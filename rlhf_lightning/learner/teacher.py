"""The teacher of on-policy distillation: another causal LM with the student's tokenizer that
scores every token the student generated (``algo.teacher``).

The student samples; :class:`Teacher` gives the log-prob of each generated token under the
teacher, through the same forward as the policy's (packed sequences, shared prompts, the chunked
log-probs op: no (B, L, V) logits tensor), without gradients, in the update's micro-batches.
With ``offload`` it sits on the CPU between scoring passes (as the reward model does), so a GPU
trainer holds it only while scoring.

A teacher whose tokenizer is not the student's cannot score the student's token ids: it is
refused (:func:`check_teacher_tokenizer`) before either model loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.learner.plan import UpdatePlan, no_grad_head
from rlhf_lightning.models.build import load_model, load_tokenizer
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.trajectory import TrajectoryBatch

FIELD = "algo.teacher.path"


def distills_full_kl(hp: Any) -> bool:
    """``hp`` distils with the exact full-vocabulary KL as a loss term (``algo.distill.estimator=full``)."""
    teacher, distill = getattr(hp, "teacher", None), getattr(hp, "distill", None)
    if teacher is None or distill is None:
        return False
    return teacher.path is not None and distill.coef != 0 and distill.estimator == "full"


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher``'s token ids do not mean what ``student``'s do (None: they do): the vocab,
    token for id, and the special tokens the episodes use."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:3]
        moved = [tok for tok in s_vocab if tok in t_vocab and s_vocab[tok] != t_vocab[tok]][:3]
        return (
            f"the vocabularies differ ({len(s_vocab)} vs {len(t_vocab)} tokens; "
            f"the student's alone, e.g. {only_s}; with other ids, e.g. {moved})"
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} differs ({getattr(student, name, None)} vs {getattr(teacher, name, None)})"
    return None


def check_teacher_tokenizer(student: Any, path: str, revision: str | None = None) -> None:
    """Refuse a teacher whose tokenizer is not the student's, naming the difference."""
    try:
        teacher = load_tokenizer(path, revision=revision, need_chat_template=False, field=FIELD)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:
        raise ConfigError(FIELD, path, f"a model directory or Hub id with a tokenizer ({err})") from None
    why = tokenizer_mismatch(student, teacher)
    if why is not None:
        raise ConfigError(
            FIELD,
            path,
            f"a teacher with the student's tokenizer: {why}; the teacher scores the student's token ids, "
            "so they must mean the same tokens",
        )


class Teacher:
    """A frozen causal LM that scores trajectories (see the module's docstring).

    Args:
        model: the teacher's causal LM (its parameters are frozen here).
        offload: keep it on the CPU except while scoring.
    """

    def __init__(self, model: torch.nn.Module, offload: bool = True) -> None:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.policy = Policy(model)  # the policy's forward, with nothing to train
        self.offload = offload

    @classmethod
    def load(
        cls, path: str, *, revision: str | None = None, dtype: str = "auto", offload: bool = True
    ) -> Teacher:
        return cls(load_model(path, revision=revision, dtype=dtype), offload=offload)

    @contextmanager
    def on(self, device: torch.device) -> Iterator[Policy]:
        self.policy.to(device)
        try:
            yield self.policy
        finally:
            if self.offload and torch.device(device).type != "cpu":
                self.policy.to("cpu")

    @torch.no_grad()
    def logprobs(
        self, traj: TrajectoryBatch, plan: UpdatePlan, temperature: float, chunk_rows: int | None
    ) -> torch.Tensor:
        """The teacher's log-prob of every action token (0 elsewhere), at the student's sampling
        ``temperature`` (the distribution the student's own log-probs are of). Shape: (B, L-1)"""
        with self.on(traj.action_mask.device) as policy:
            return no_grad_head(policy, traj, plan, "logp", temperature, chunk_rows)
