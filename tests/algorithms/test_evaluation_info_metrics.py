"""An ``eval.info_metrics`` key that no evaluation episode returns as a number (a typo, a key
the env does not have, or one it returns on some episodes only, e.g. on success) is warned about,
once per key, naming the keys the env did return; the run goes on and logs the key's metrics once
an episode returns it. (It used to log nothing, silently; then it ended the run at the first
evaluation, which with eval.before_training runs before any training.)"""

from __future__ import annotations

import logging

import pytest
import torch

from rlhf_lightning.algorithms.evaluation import RolloutEvaluation, global_means
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory


class _Evaluation(RolloutEvaluation):
    """The validation loop on a fake rollout whose episodes' infos hold ``valid_move`` (a
    number), ``note`` (a string) and ``correct``."""

    def __init__(self, info_metrics: tuple[str, ...]) -> None:
        super().__init__(policy=None, hp=None)
        self.source = self  # its own fake rollout source (generate below)
        self.sampling = SamplingParams(4, temperature=1.0)
        self.eval_greedy = self.eval_sampled = True
        self.eval_info_metrics = info_metrics
        self.extra_info: dict[str, object] = {}  # keys the episodes return from now on

    def generate(self, rows, params, *, group_size, evaluation=False):
        info = {"correct": True, "valid_move": 1.0, "note": "ok", **self.extra_info}
        trajs = [
            Trajectory([1], [-1], [0.0], [1.0], 0, 1, infos=[info]) for _ in rows for _ in range(group_size)
        ]
        batch = type("Batch", (), {"returns": torch.tensor([1.0] * len(trajs))})()
        return RolloutResult(batch, trajs, {})  # type: ignore[arg-type]


def evaluate(ev: _Evaluation) -> dict[str, torch.Tensor]:
    ev.on_validation_epoch_start()
    ev.validation_step(torch.tensor([0, 1]), 0)
    assert ev._eval_totals is not None
    return global_means(ev._eval_totals, lambda t: t)  # one process: the sums are the global ones


def evaluated(info_metrics: tuple[str, ...]) -> tuple[_Evaluation, dict[str, torch.Tensor]]:
    ev = _Evaluation(info_metrics)
    return ev, evaluate(ev)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "eval.info_metrics" in r.getMessage()]


def test_a_key_the_env_returns_as_a_number_is_logged(caplog):
    ev, metrics = evaluated(("valid_move",))
    with caplog.at_level(logging.WARNING):
        assert ev.check_info_metrics(metrics) == []
    assert metrics["eval/env_valid_move_greedy"] == metrics["eval/env_valid_move_sampled"] == 1.0
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("keys", [("valid_mvoe",), ("valid_move", "note")])
def test_a_key_no_episode_returns_as_a_number_is_warned_about_not_refused(keys, caplog):
    ev, metrics = evaluated(keys)
    with caplog.at_level(logging.WARNING):
        assert ev.check_info_metrics(metrics) == [keys[-1]]  # no error: the run goes on
    assert warnings_of(caplog) == [
        f"eval.info_metrics: {keys[-1]} came in no evaluation episode as a number at step 0 (the env's "
        "step infos held correct, note, valid_move); eval/env_<key>_* is logged once an episode returns "
        "it: check the spelling if it never is"
    ]


def test_a_key_returned_on_some_evaluations_only_warns_once_and_is_logged_when_it_comes(caplog):
    """An env that returns ``solved_in`` only on success: the evaluation before training has
    none, a later one does. One warning in all, and the later evaluation's metric is logged."""
    ev, metrics = evaluated(("solved_in",))
    with caplog.at_level(logging.WARNING):
        assert ev.check_info_metrics(metrics) == ["solved_in"]
        assert ev.check_info_metrics(evaluate(ev)) == []  # still missing: not warned again
        ev.extra_info = {"solved_in": 3}
        later = evaluate(ev)
        assert ev.check_info_metrics(later) == []
    assert later["eval/env_solved_in_greedy"] == later["eval/env_solved_in_sampled"] == 3.0
    assert len(warnings_of(caplog)) == 1


def test_no_evaluation_episodes_decide_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        assert _Evaluation(("valid_mvoe",)).check_info_metrics({}) == []  # no batch ran: nothing to judge by
    assert warnings_of(caplog) == []
