"""A toy algorithm family defined outside the package (used by test_spec.py): REINFORCE with
the batch's mean return as the baseline. This module and one YAML file are all it takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_lightning.algorithms import AlgorithmSpec, RolloutModule, register_algorithm
from rlhf_lightning.algorithms.checks import validate_rollout_algo
from rlhf_lightning.config import RolloutAlgoConfig
from rlhf_lightning.learner.objective import PolicyTerm


@dataclass
class ToyConfig(RolloutAlgoConfig):
    name: str = "toy"
    module: str = "tests.algorithms.toy_family"


class ToyModule(RolloutModule):
    def compute_advantages(self, traj, rewards: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
        return returns - returns.mean()  # (B,)

    def policy_term(self) -> PolicyTerm:
        return PolicyTerm.bind("reinforce", self.hp)


register_algorithm(AlgorithmSpec("toy", ToyModule, ToyConfig, validate=validate_rollout_algo))
