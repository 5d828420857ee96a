"""reward.normalize=batch: one standardisation over the step's global batch (every rollout round
of dynamic sampling, every rank), not one per harness call and per rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lightning.records.trajectory import Trajectory
from rlhf_lightning.rewards import STD_EPS, CombinedReward

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "rewards" / "normalize_worker.py"


class Rounds:
    """A component returning the next scripted round of raw scores on each call."""

    def __init__(self, name: str, rounds: list[list[float]], normalize: str = "none") -> None:
        self.name, self.rounds, self.normalize = name, list(rounds), normalize

    def score(self, episodes, device):
        return self.rounds.pop(0)


def traj(env_rewards: list[float]) -> Trajectory:
    return Trajectory(
        token_ids=[1], action_turn=[-1], sampling_logps=[0.0], rewards=list(env_rewards), group_id=0,
        prompt_len=1, observation="Q?", replies=["r"] * len(env_rewards),
    )  # fmt: skip


def standardized_by_hand(values: list[float]) -> list[float]:
    """(x - mean) / (std + 1e-6), std unbiased (n - 1), in float64 Python arithmetic."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + 1e-6) for v in values]


class CountingSum:
    """``all_sum`` of one process (the identity), counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t):
        self.calls += 1
        return t


def test_two_rounds_are_standardised_once_over_their_union():
    rm_rounds = [[1.0, 2.0, 4.0], [0.0, -3.0, 7.0, 2.5, 1.0]]
    fn_rounds = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6, 0.7, 0.8]]
    reward = CombinedReward(
        [Rounds("model", rm_rounds, "batch"), Rounds("f", fn_rounds)],
        {"env": 0.5, "model": 2.0},
        use_env=True,
    )
    envs = [[1.0, 0.5], [0.0], [1.0], [0.0], [1.0], [0.25], [0.0], [1.0]]
    first = [traj(e) for e in envs[:3]]
    second = [traj(e) for e in envs[3:]]
    reward.apply(first)
    reward.apply(second)
    # apply writes rewards from the raw scores (what dynamic sampling filters groups on)
    assert first[0].rewards == pytest.approx([0.5, 0.25 + 2.0 * 1.0 + 0.1])
    assert [t.reward_parts for t in first] == [{"model": 1.0, "f": 0.1}, {"model": 2.0, "f": 0.2},
                                              {"model": 4.0, "f": 0.3}]  # fmt: skip
    counting = CountingSum()
    batch = first + second
    metrics = reward.finalize(batch, counting)
    assert counting.calls == 1  # one collective per step, whatever the components
    raw = rm_rounds[0] + rm_rounds[1]
    fn = fn_rounds[0] + fn_rounds[1]
    norm = standardized_by_hand(raw)
    for t, e, z, f in zip(batch, envs, norm, fn):
        expected = [0.5 * r for r in e]
        expected[-1] += 2.0 * z + f
        assert t.rewards == pytest.approx(expected, abs=1e-12)
        assert t.env_rewards == e
    # not what standardising each round on its own gives (the old per-call behaviour)
    per_round = standardized_by_hand(rm_rounds[0]) + standardized_by_hand(rm_rounds[1])
    assert max(abs(a - b) for a, b in zip(norm, per_round)) > 0.1
    assert metrics["reward/model"] == pytest.approx(sum(raw) / 8, abs=1e-12)  # the raw scores' mean
    assert metrics["reward/f"] == pytest.approx(sum(fn) / 8, abs=1e-12)
    assert metrics["reward/env"] == pytest.approx(sum(map(sum, envs)) / 8, abs=1e-12)
    assert metrics["reward/total"] == pytest.approx(sum(sum(t.rewards) for t in batch) / 8, abs=1e-12)
    assert STD_EPS == 1e-6


def test_finalize_without_a_normalised_component_keeps_the_raw_rewards_and_needs_no_collective():
    reward = CombinedReward([Rounds("f", [[1.0, -2.0]])], {"env": 2.0}, use_env=True)
    trajs = [traj([1.0]), traj([0.0, 0.5])]
    reward.apply(trajs)
    before = [list(t.rewards) for t in trajs]
    counting = CountingSum()
    reward.finalize(trajs, counting)
    assert counting.calls == 0
    assert [t.rewards for t in trajs] == before == [[3.0], [0.0, -1.0]]


def test_apply_keeps_the_env_rewards_once_and_finalize_needs_apply():
    reward = CombinedReward([Rounds("f", [[1.0], [1.0]])], {"env": 2.0}, use_env=True)
    trajs = [traj([0.5])]
    reward.apply(trajs)
    reward.apply(trajs)  # the env rewards are not weighted twice
    assert trajs[0].env_rewards == [0.5] and trajs[0].rewards == [2.0]
    fresh = CombinedReward([Rounds("f", [], "batch")], {}, use_env=True)
    with pytest.raises(RuntimeError, match=r"no \['f'\] scores; apply must run first"):
        fresh.finalize([traj([1.0])], lambda t: t)


def test_a_single_score_standardises_to_zero():
    reward = CombinedReward([Rounds("model", [[3.5]], "batch")], {}, use_env=False)
    trajs = [traj([1.0])]
    reward.apply(trajs)
    reward.finalize(trajs, lambda t: t)
    assert trajs[0].rewards == [0.0]


@pytest.mark.slow
def test_two_ranks_standardise_over_the_union_of_their_scores(tmp_path):
    # rank 0: two rounds (3 + 2 episodes); rank 1: one round of 4: unequal counts on purpose
    raw = [[[0.5, 1.5, -1.0], [2.0, 0.0]], [[3.0, -2.5, 1.0, 4.5]]]
    env = [[1.0, 0.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    spec = {
        "world": 2,
        "init_file": str(tmp_path / "init"),
        "out": str(tmp_path / "out"),
        "raw": raw,
        "env": env,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path / "spec.json"), str(rank)], cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    flat = [[s for round_ in rank for s in round_] for rank in raw]
    union = standardized_by_hand(flat[0] + flat[1])
    expected = [union[: len(flat[0])], union[len(flat[0]) :]]
    for rank in range(2):
        out = json.loads((tmp_path / f"out.{rank}.json").read_text())
        got = [r[-1] for r in out["rewards"]]
        assert got == pytest.approx([e + 0.5 * z for e, z in zip(env[rank], expected[rank])], abs=1e-12)
        # metrics: means over this rank's trajectories (the module averages over ranks)
        assert out["metrics"]["reward/model"] == pytest.approx(sum(flat[rank]) / len(flat[rank]), abs=1e-12)
        assert out["metrics"]["reward/total"] == pytest.approx(sum(got) / len(got), abs=1e-12)
