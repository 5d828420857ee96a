"""Typed schemas of on-policy distillation, a term any rollout algorithm can carry
(``algo.teacher``, ``algo.distill``; ``algo=distill`` is GRPO with the task reward off).

The student samples; the teacher (another model with the same tokenizer) scores every token
the student generated; the per-token reverse KL to the teacher is the learning signal
(``learner/scoring.py``, ``learner/teacher.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TeacherConfig:
    path: str | None = (
        None  # a local model directory or Hub id with the student's tokenizer; None: no distillation
    )
    revision: str | None = None
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (the checkpoint's)
    offload: bool = True  # on the CPU between scoring passes (a GPU trainer keeps it only while scoring)


@dataclass
class DistillConfig:
    coef: float = 1.0  # weight of the per-token reverse KL (in the advantages; estimator=full: in the loss)
    task_reward: bool = True  # false: pure distillation (the task's advantages are dropped)
    # sampled: log pi_s(y) - log pi_t(y) at each sampled token, in the advantages (one teacher pass
    # a batch); full: the exact KL(pi_s || pi_t) over the vocabulary at each token, a loss term (a
    # teacher pass in every update micro-batch; one tokenizer, the chunked op: no (N, V) logits)
    estimator: str = "sampled"
