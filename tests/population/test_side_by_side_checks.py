"""Members side by side (``population.batched=true``) without training: the start-up and
mutation checks, the ranks' agreement on member weights, each member's guard record, the
metrics of several rollout calls."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.population.bank import SideBySide
from rlhf_lightning.population.members import Member
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config
from tests.population.test_side_by_side import POP


def test_mutations_are_checked_before_they_reach_a_member():
    """A value that fails the start-up rules never reaches a member: set_hparams raises before
    it changes anything."""
    from types import SimpleNamespace

    from rlhf_lightning.config import GRPOConfig
    from rlhf_lightning.population.checks import check_member

    bank = object.__new__(SideBySide)  # the checks only: no policy, no adapters
    bank.hparams = [{"lr": 1e-3}]
    bank.check = check_member  # what the population passes
    bank.base_hp = GRPOConfig(prompts_per_step=4, group_size=4, micro_batch_size=8)
    bank.module = SimpleNamespace(world_size=1)
    with pytest.raises(ConfigError, match=r"population\.mutate\.group_size=3.*micro_batch_size=8"):
        bank.set_hparams(0, {"lr": 1e-3, "group_size": 3})
    with pytest.raises(ConfigError, match=r"population\.mutate\.lr=-1"):
        bank.set_hparams(0, {"lr": -1.0})
    assert bank.hparams == [{"lr": 1e-3}]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["model.finetune=full"], "model.finetune"),
        (["algo=dapo"], "algo.dynamic_sampling"),
    ],
)
def test_what_side_by_side_does_not_cover_is_refused_with_the_fix(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=rf"{field.replace('.', '[.]')}=.*population\.batched=false"):
        validate(compose_config([*POP, *extra], output_dir=tmp_path))


class FakeMembers:
    """Two ranks' member weights: ``all_gather`` stacks this rank's digest with rank 1's, which
    :func:`two_ranks` computes from rank 1's own (perturbed) weights."""

    world_size, device = 2, "cpu"

    def __init__(self, weights: list[dict[str, torch.Tensor]]) -> None:
        self.weights = weights
        self.other: SideBySidePopulation | None = None

    def member_weights(self, k):
        return self.weights[k]

    def all_gather(self, t):
        assert self.other is not None
        return torch.stack([t, self.other.digest_rows()])


def two_ranks(rank1: list[dict[str, torch.Tensor]]) -> SideBySidePopulation:
    """Rank 0's population (two members, two tensors each), whose rank 1 holds ``rank1``."""
    base = [
        {"0:a": torch.arange(4.0).reshape(2, 2) + k, "0:b": torch.arange(4.0).reshape(2, 2) * (k + 2)}
        for k in range(2)
    ]
    pops = []
    for weights in (base, rank1):
        pop = SideBySidePopulation(2, 1, {}, "/tmp/unused")
        pop.module = FakeMembers(weights)
        pop.member_schedule = pop.module  # type: ignore[assignment]  (member_weights only)
        pop.members = [Member(0, {"lr": 1e-3}), Member(1, {"lr": 2e-3})]
        pops.append(pop)
    pops[0].module.other = pops[1]
    return pops[0]


def test_ranks_whose_member_weights_differ_stop_the_run():
    """The digest compares each member's weights tensor by tensor: the same ids and
    hyper-parameters with other weights on rank 1 stop the run, even where a sum of all the
    member's weights is the same (values moved, drifts that cancel, tensors swapped)."""

    def rank1(change):
        weights = [{n: w.clone() for n, w in m.items()} for m in two_ranks([{}, {}]).module.weights]
        change(weights)
        return weights

    def cancelling(w):  # +d and -d in one tensor: the member's sum is unchanged
        w[1]["0:a"][0, 0] += 0.5
        w[1]["0:a"][1, 1] -= 0.5

    def moved(w):  # two values of one tensor swap places
        a = w[0]["0:b"]
        a[0, 0], a[0, 1] = a[0, 1].clone(), a[0, 0].clone()

    def swapped(w):  # member 1's tensors in each other's slot
        w[1]["0:a"], w[1]["0:b"] = w[1]["0:b"], w[1]["0:a"]

    for change in (cancelling, moved, swapped):
        weights = rank1(change)
        assert sum(float(t.sum()) for m in weights for t in m.values()) == sum(
            float(t.sum()) for m in rank1(lambda w: None) for t in m.values()
        )  # a plain sum cannot tell
        with pytest.raises(RuntimeError, match="ranks disagree after selection"):
            two_ranks(weights).check_ranks_agree()
    two_ranks(rank1(lambda w: None)).check_ranks_agree()  # the same weights: no error


def test_a_clone_has_no_fitness_until_it_is_scored():
    parent = Member(3, {"lr": 1e-3}, fitness=0.75)
    assert parent.clone(7).fitness is None and parent.clone(7).parent == 3


def test_each_member_has_its_own_non_finite_streak_and_it_is_checkpointed():
    """Member 1 is non-finite on every step, member 0 never: member 1's streak grows (a shared
    streak was reset by member 0 every step, so the guard never tripped), and a checkpoint
    keeps each member's."""
    from rlhf_lightning.algorithms.common import ModuleMixin
    from rlhf_lightning.learner.optimizer import StepHealth

    class Two(ModuleMixin):
        def __init__(self) -> None:
            super().__init__(torch.nn.Linear(1, 1), None)
            self.records = [StepHealth(), StepHealth()]  # one per member, as members side by side hold them

        def guard_records(self):
            return self.records

    module = Two()
    params = list(module.policy.parameters())
    for _ in range(3):
        for k, norm in ((0, 1.0), (1, float("nan"))):
            module.records[k].skip_if_nonfinite([torch.tensor(norm)], params, counted=True)
    assert [h.nonfinite_streak for h in module.records] == [0, 3]
    assert module.nonfinite_streak == 3 and module.skipped_steps == 3
    checkpoint: dict = {"state_dict": {}}
    module.checkpoint_keys = lambda: set()  # type: ignore[method-assign]
    module.rng_generators = lambda: {}  # type: ignore[method-assign]
    ModuleMixin.on_save_checkpoint(module, checkpoint)
    again = Two()
    again.on_load_checkpoint(checkpoint)
    assert [h.nonfinite_streak for h in again.records] == [0, 3]
    old = Two()
    old.on_load_checkpoint({"guard": {"nonfinite_streak": 2, "skipped_steps": 5}})  # a checkpoint from before
    assert old.nonfinite_streak == 2 and old.skipped_steps == 5


def test_whole_rollout_counts_are_summed_over_calls_and_other_call_metrics_averaged():
    from rlhf_lightning.population.bank import call_metrics

    calls = [
        {"rollout/dropped_long_prompts": 2.0, "env/reward_errors": 1.0, "reward/model_mean": 0.5},
        {"rollout/dropped_long_prompts": 1.0, "env/step_timeouts": 3.0, "reward/model_mean": 0.25},
    ]
    assert call_metrics(calls) == {
        "env/reward_errors": 1.0,
        "env/step_timeouts": 3.0,
        "reward/model_mean": 0.375,
        "rollout/dropped_long_prompts": 3.0,
    }
    assert call_metrics([]) == {}
