"""LightningModules, one per algorithm family, keyed by ``algo.module``."""

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.dpo import DPOModule
from rlhf_lightning.algorithms.grpo import GRPOModule
from rlhf_lightning.algorithms.offline import OfflineModule
from rlhf_lightning.algorithms.ppo import PPOModule
from rlhf_lightning.algorithms.sft import SFTModule

ROLLOUT_MODULES: dict[str, type[RolloutModule]] = {"grpo": GRPOModule, "ppo": PPOModule}
OFFLINE_MODULES: dict[str, type[OfflineModule]] = {"sft": SFTModule, "dpo": DPOModule}

__all__ = [
    "OFFLINE_MODULES",
    "ROLLOUT_MODULES",
    "DPOModule",
    "GRPOModule",
    "PPOModule",
    "RolloutModule",
    "SFTModule",
]
