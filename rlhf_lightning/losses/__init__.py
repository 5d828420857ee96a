"""Pure loss, advantage and KL functions, selectable by config name."""

# trust_regions registers dppo_tv, dppo_kl, sapo, gmpo and kl_cov in POLICY_LOSSES;
# step_advantages registers gigpo (per-turn, GiGPO) in ADVANTAGE_ESTIMATORS.
from rlhf_lightning.losses import step_advantages, trust_regions  # noqa: F401
from rlhf_lightning.losses.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator, group_stats
from rlhf_lightning.losses.aggregate import AGGREGATION_MODES, aggregate
from rlhf_lightning.losses.kl import KL_ESTIMATORS, kl
from rlhf_lightning.losses.policy import POLICY_LOSSES, get_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "aggregate",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_stats",
    "kl",
]
