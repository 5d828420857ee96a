"""LightningModules, one per algorithm family, keyed by ``algo.module``."""

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.grpo import GRPOModule

ALGORITHM_MODULES: dict[str, type[RolloutModule]] = {"grpo": GRPOModule}

__all__ = ["ALGORITHM_MODULES", "GRPOModule", "RolloutModule"]
