"""A toy algorithm family defined outside the package (used by test_spec.py): REINFORCE with
the batch's mean return as the baseline. This module and one YAML file are all it takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_lightning.algorithms import AlgorithmSpec, RolloutModule, register_algorithm
from rlhf_lightning.algorithms.checks import validate_rollout_algo
from rlhf_lightning.config import RolloutAlgoConfig
from rlhf_lightning.learner.family import Family
from rlhf_lightning.learner.objective import PolicyTerm


@dataclass
class ToyConfig(RolloutAlgoConfig):
    name: str = "toy"
    module: str = "tests.algorithms.toy_family"


class ToyFamily(Family):
    def advantages(self, learner, member, traj, rewards, returns, kl_rewards=None) -> torch.Tensor:
        return returns - returns.mean()  # (B,)

    def policy_term(self, hp: RolloutAlgoConfig) -> PolicyTerm:
        return PolicyTerm.bind("reinforce", hp)


class ToyModule(RolloutModule):
    family = ToyFamily


register_algorithm(AlgorithmSpec("toy", ToyModule, ToyConfig, validate=validate_rollout_algo))
