"""LightningModules, one per algorithm family; importing a family's module registers its
:class:`~rlhf_lightning.algorithms.spec.AlgorithmSpec` under its ``algo.module`` name."""

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.dpo import DPOModule
from rlhf_lightning.algorithms.grpo import GRPOModule
from rlhf_lightning.algorithms.offline import OfflineModule
from rlhf_lightning.algorithms.ppo import PPOModule
from rlhf_lightning.algorithms.sft import SFTModule
from rlhf_lightning.algorithms.spec import ALGORITHMS, AlgorithmSpec, get_algorithm, register_algorithm

__all__ = [
    "ALGORITHMS",
    "AlgorithmSpec",
    "DPOModule",
    "GRPOModule",
    "OfflineModule",
    "PPOModule",
    "RolloutModule",
    "SFTModule",
    "get_algorithm",
    "register_algorithm",
]
