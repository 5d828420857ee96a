"""The micro-batch objective from an algorithm config: the one place where the config's loss,
KL, entropy and correction fields become the plain arguments of the objective's terms."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_lightning.config.algo import RolloutAlgoConfig
from rlhf_lightning.learner.liger_path import LigerObjective
from rlhf_lightning.learner.objective import (
    CriticTerm,
    KLTerm,
    Objective,
    PolicyObjective,
    PolicyTerm,
    TeacherKLTerm,
)
from rlhf_lightning.learner.teacher import distills_full_kl
from rlhf_lightning.models.policy import Policy


def build_objective(
    hp: RolloutAlgoConfig,
    policy_term: Callable[[], PolicyTerm],
    *,
    critic: CriticTerm | None,
    entropy_coef: float,
    temperature: float,
    max_len: int,
    world_size: int,
    liger: bool,
    teacher: Policy | None = None,
) -> Objective:
    """Liger's fused kernel (``liger``) or our :class:`PolicyObjective`.

    Args:
        hp: the algorithm config (``loss_agg_mode``, ``chunk_rows``, the KL fields, ``tis_cap``
            and ``old_logprobs_source``).
        policy_term: builds the family's policy-gradient term, its hyper-parameters bound.
        critic: a critic trained with the actor (PPO), or None.
        entropy_coef: the entropy bonus's weight (0: none).
        temperature: the sampling temperature the log-probs are taken at.
        max_len: ``seq_mean_token_sum_norm``'s constant.
        world_size: ranks the gradient is averaged over (Liger's normalisers).
        teacher: the distillation teacher's policy (used with ``algo.distill.estimator=full``).
    """
    # Truncated importance weights correct trainer/engine mismatch; with the engine's own
    # log-probs as the behaviour ones there is nothing to correct.
    tis_cap = hp.tis_cap if hp.old_logprobs_source == "trainer" else None
    if liger:
        return LigerObjective(
            hp,
            temperature=temperature,
            chunk_rows=hp.chunk_rows,
            max_len=max_len,
            tis_cap=tis_cap,
            world_size=world_size,
        )
    kl_term = None
    if hp.beta > 0 and hp.kl_mode == "loss":
        kl_term = KLTerm(hp.beta, hp.kl_estimator, hp.kl_clamp, hp.kl_importance_weighted)
    return PolicyObjective(
        policy_term(),
        agg_mode=hp.loss_agg_mode,
        max_len=max_len,
        temperature=temperature,
        chunk_rows=hp.chunk_rows,
        kl_term=kl_term,
        entropy_coef=entropy_coef,
        tis_cap=tis_cap,
        critic=critic,
        teacher_kl=TeacherKLTerm(hp.distill.coef, teacher)
        if teacher is not None and distills_full_kl(hp)
        else None,
    )
