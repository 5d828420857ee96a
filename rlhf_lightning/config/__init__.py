"""The run's configuration, below every other layer: the typed schemas Hydra composes
(``schemas``: every group but ``algo``; ``algo``: the algorithm families'), the checks of common
values that run before the heavy imports (``early``) and the one error type for bad input
(``errors``).

``from rlhf_lightning.config import GRPOConfig, register_configs, ASSETS`` keeps working: the
package hands out the schemas module's names on first use, so importing ``config.errors``
alone (as every layer does) loads neither Hydra nor OmegaConf.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ASSETS",
    "CheckpointConfig",
    "Config",
    "DPOConfig",
    "EnvConfig",
    "EvalConfig",
    "GRPOConfig",
    "GuardConfig",
    "LoggerConfig",
    "LoraSettings",
    "ModelConfig",
    "OfflineConfig",
    "OptimConfig",
    "PPOConfig",
    "PopulationConfig",
    "ProgressConfig",
    "RewardConfig",
    "RolloutAlgoConfig",
    "RolloutConfig",
    "SFTConfig",
    "SamplesConfig",
    "StrategyConfig",
    "TrainerConfig",
    "VLLMRolloutConfig",
    "VLLMServerRolloutConfig",
    "register_configs",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("rlhf_lightning.config.schemas"), name)
    raise AttributeError(f"module 'rlhf_lightning.config' has no attribute {name!r}")
