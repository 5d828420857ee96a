"""An ``eval.info_metrics`` key that no evaluation episode returns as a number (a typo, or a
key the env does not have) is refused at the first evaluation, naming the field and the keys
the env did return; it used to log nothing, silently."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.algorithms.evaluation import RolloutEvaluation, global_means
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.rollout.engine import SamplingParams
from rlhf_lightning.rollout.harness import RolloutResult
from rlhf_lightning.rollout.trajectory import Trajectory


class _Evaluation(RolloutEvaluation):
    """The validation loop on a fake rollout whose episodes' infos hold ``valid_move`` (a
    number), ``note`` (a string) and ``correct``."""

    def __init__(self, info_metrics: tuple[str, ...]) -> None:
        super().__init__(policy=None, hp=None)
        self.sampling = SamplingParams(4, temperature=1.0)
        self.eval_greedy = self.eval_sampled = True
        self.eval_info_metrics = info_metrics

    def rollout(self, rows, params, *, group_size, evaluation=False):
        info = {"correct": True, "valid_move": 1.0, "note": "ok"}
        trajs = [
            Trajectory([1], [-1], [0.0], [1.0], 0, 1, infos=[info]) for _ in rows for _ in range(group_size)
        ]
        batch = type("Batch", (), {"returns": torch.tensor([1.0] * len(trajs))})()
        return RolloutResult(batch, trajs, {})  # type: ignore[arg-type]


def evaluated(info_metrics: tuple[str, ...]) -> tuple[_Evaluation, dict[str, torch.Tensor]]:
    ev = _Evaluation(info_metrics)
    ev.on_validation_epoch_start()
    ev.validation_step(torch.tensor([0, 1]), 0)
    assert ev._eval_totals is not None
    return ev, global_means(ev._eval_totals, lambda t: t)  # one process: the sums are the global ones


def test_a_key_the_env_returns_as_a_number_is_logged():
    ev, metrics = evaluated(("valid_move",))
    ev.check_info_metrics(metrics)
    assert metrics["eval/env_valid_move_greedy"] == metrics["eval/env_valid_move_sampled"] == 1.0


@pytest.mark.parametrize("keys", [("valid_mvoe",), ("valid_move", "note")])
def test_a_key_no_episode_returns_as_a_number_is_refused(keys):
    ev, metrics = evaluated(keys)
    with pytest.raises(ConfigError) as err:
        ev.check_info_metrics(metrics)
    assert str(err.value) == (
        f"invalid config: eval.info_metrics={list(keys)!r}: info keys the env returns as numbers: {keys[-1]} "
        "came in no evaluation episode (the env's step infos held correct, note, valid_move); fix or drop them"
    )


def test_no_evaluation_episodes_decide_nothing():
    _Evaluation(("valid_mvoe",)).check_info_metrics({})  # no batch ran: nothing to judge by
