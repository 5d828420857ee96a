"""The version plan of asynchronous rollouts (``rollout/asynchronous/plan.py``): which version each
batch and turn uses, the seeds, where each rank's producer runs, and the staleness a batch's
tokens carry (by hand)."""

from __future__ import annotations

import itertools

import pytest

from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.asynchronous.driver import batch_metrics
from rlhf_lightning.rollout.asynchronous.plan import (
    Placement,
    Produced,
    batch_seed,
    is_stale,
    placement,
    turn_versions,
)
from tests.algorithms.test_async_units import trajectory


# ---------------------------------------------------------------- the version plan and seeds
@pytest.mark.parametrize(
    ("step", "staleness", "partial", "max_turns", "expected"),
    [
        (5, 0, False, 3, [5]),  # K = 0: the current weights
        (5, 1, False, 3, [4]),
        (5, 2, False, 3, [3]),
        (1, 2, False, 3, [0]),  # step < K: version 0, never negative
        (5, 0, True, 3, [5, 5, 5]),  # K = 0 partial: nothing newer than the step
        (5, 2, True, 4, [3, 4, 5, 5]),  # one newer version per turn, capped at the step
        (0, 2, True, 3, [0, 0, 0]),
        (1, 2, True, 3, [0, 1, 1]),
        (5, 2, True, 0, [3]),  # no turns given: still the first version
    ],
)
def test_turn_versions_by_hand(step, staleness, partial, max_turns, expected):
    assert turn_versions(step, staleness, partial, max_turns) == expected


def test_turn_versions_never_negative_nor_ahead_nor_older_than_k():
    for step, k, turns, partial in itertools.product(range(7), range(4), range(1, 5), (False, True)):
        vs = turn_versions(step, k, partial, turns)
        assert vs[0] == max(0, step - k) and all(max(0, step - k) <= v <= step for v in vs)
        assert vs == sorted(vs)  # a later turn never runs on older weights
        assert len(vs) == (turns if partial else 1)


def test_batch_seed_distinct_deterministic_in_range():
    for seed in (0, 1, 2**32 - 1):
        seeds = [batch_seed(seed, r, b) for r in range(8) for b in range(1000)]
        assert len(set(seeds)) == len(seeds) and all(0 <= v < 2**63 for v in seeds)  # one per rank, step
    assert batch_seed(7, 1, 3) == batch_seed(7, 1, 3)
    assert batch_seed(7, 1, 3) != batch_seed(7, 0, 3) != batch_seed(7, 1, 4)
    assert batch_seed(0, 0, 0) == 1  # (0 + 0 + 0 + 1) mod 2**63, by hand


# ---------------------------------------------------------------- staleness of a batch
def result_of(trajs: list[Trajectory]) -> RolloutResult:
    return RolloutResult(collate(trajs, 0), trajs, {})


def produced_of(trajs: list[Trajectory], wait_s: float = 1.25, work_s: float = 0.5) -> Produced:
    return Produced(5, result_of(trajs), [3, 4], wait_s, work_s)


def test_staleness_metrics_are_token_weighted_and_unversioned_is_current():
    # At step 5: turns of 2 and 3 tokens at versions 3, 4; 4 tokens unversioned; 1 token at 5.
    two_turns = trajectory([1, 2], [[10, 11], [12, 13, 14]], versions=[3, 4])
    refill = trajectory([1], [[10, 11, 12, 13]])  # no versions: generated now (current)
    fresh = trajectory([3], [[10]], versions=[5])
    metrics = batch_metrics(produced_of([two_turns, refill, fresh]), step=5, waited=0.25)
    ages = [2, 2, 1, 1, 1] + [0] * 4 + [0]  # by hand, one per generated token
    assert metrics["async/staleness_mean"].item() == pytest.approx(sum(ages) / len(ages), abs=1e-7)
    assert metrics["async/staleness_max"].item() == 2.0
    assert metrics["async/trainer_wait_s"].item() == pytest.approx(0.25)
    assert metrics["async/producer_wait_s"].item() == pytest.approx(1.25)
    assert metrics["async/producer_work_s"].item() == pytest.approx(0.5)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    empty = trajectory([1, 2], [[]], versions=[3])  # a turn that generated nothing: no age
    nothing = batch_metrics(produced_of([empty]), step=5, waited=0.0)
    assert nothing["async/staleness_mean"].item() == nothing["async/staleness_max"].item() == 0.0


def test_is_stale_when_any_turn_is_older_than_the_step():
    two_turns = trajectory([1], [[10], [11]], versions=[3, 4])
    current = trajectory([1], [[10]], versions=[5])
    unversioned = trajectory([1], [[10]])
    assert is_stale(result_of([current, two_turns]), 5)
    assert is_stale(result_of([two_turns]), 4)  # turn 0 at version 3
    assert not is_stale(result_of([two_turns]), 3)
    assert not is_stale(result_of([current, unversioned]), 5)
    assert is_stale(result_of([current]), 6)
    assert not is_stale(result_of([unversioned]), 100)  # synchronous: the current weights


def test_token_versions_map_generated_tokens_to_their_turn():
    traj = trajectory([1, 2], [[10, 11], [12, 13, 14]], versions=[3, 4])
    assert traj.action_turn == [-1, -1, 0, 0, -1, 1, 1, 1]
    assert traj.token_versions() == [-1, -1, 3, 3, -1, 4, 4, 4]
    assert trajectory([1, 2], [[10]]).token_versions() == [-1, -1, -1]  # synchronous: no versions


def test_placement_is_the_ranks_device_or_the_trainers():
    assert placement(None, 1, 2, "cuda:1") == Placement("cuda:1", 1, 2)  # colocated
    assert placement(None, 0, 1, "cpu") == Placement("cpu", 0, 1)
    assert placement((2, 3), 1, 2, "cuda:1") == Placement("cuda:3", 1, 2)  # rank 1: devices[1]
    assert placement((2, 3), 1, 2, "cuda:1").cuda_index == 3 and Placement().cuda_index is None
    with pytest.raises(ValueError, match=r"rollout.devices=\[2\] has no device for rank 1 of 2"):
        placement((2,), 1, 2, "cuda:1")
