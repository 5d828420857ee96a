"""Steps, step values, step rewards and explained variance, by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.learner.critic import explained_variance, reduce_to_steps, step_index, step_rewards

# Two trajectories over 7 positions; row 0 has turns 0 (2 tokens) and 1 (3 tokens); row 1 one turn.
TURNS = torch.tensor([[-1, 0, 0, -1, 1, 1, 1], [-1, -1, 0, 0, 0, -1, -1]])
ACTION = TURNS >= 0


def test_turn_and_token_step_ids():
    idx, s = step_index(ACTION, TURNS, "turn")
    assert s == 2 and idx.tolist() == TURNS.tolist()
    idx, s = step_index(ACTION, TURNS, "token")
    assert s == 5
    assert idx.tolist() == [[-1, 0, 1, -1, 2, 3, 4], [-1, -1, 0, 1, 2, -1, -1]]


def test_reduce_to_steps_mean_and_final():
    v = torch.tensor([[9.0, 1.0, 3.0, 9.0, 2.0, 4.0, 6.0], [9.0, 9.0, 5.0, 7.0, 0.0, 9.0, 9.0]])
    idx, s = step_index(ACTION, TURNS, "turn")
    assert reduce_to_steps(v, idx, s, "mean").tolist() == [[2.0, 4.0], [4.0, 0.0]]
    assert reduce_to_steps(v, idx, s, "final_value").tolist() == [[3.0, 6.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="one of state, mean, final_value"):
        reduce_to_steps(v, idx, s, "max")


def test_step_rewards_turn_and_token():
    rewards = torch.tensor([[0.5, 1.0], [2.0, 0.0]])
    idx, s = step_index(ACTION, TURNS, "turn")
    got = step_rewards(rewards, idx, s, "turn", extra=torch.tensor([0.1, -0.2]))
    torch.testing.assert_close(got, torch.tensor([[0.5, 1.1], [1.8, 0.0]]))
    single = torch.tensor([[1.0], [3.0]])
    idx, s = step_index(ACTION, TURNS, "token")
    got = step_rewards(single, idx, s, "token")
    assert got.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0, 0.0]]


def test_token_step_rewards_of_several_turns():
    """Each turn's reward lands on that turn's last action token: row 0's turn 0 ends at its
    step 1 and turn 1 at step 4; ``extra`` goes to the last step."""
    rewards = torch.tensor([[0.5, 1.0], [2.0, 0.0]])
    idx, s = step_index(ACTION, TURNS, "token")
    got = step_rewards(rewards, idx, s, "token", extra=torch.tensor([0.25, 0.0]), turn_ids=TURNS)
    assert got.tolist() == [[0.0, 0.5, 0.0, 0.0, 1.25], [0.0, 0.0, 2.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="need the turn ids"):
        step_rewards(rewards, idx, s, "token")


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.ones_like(r, dtype=torch.bool)
    assert explained_variance(r, r, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, m).item() == pytest.approx(0.0)
    v = torch.tensor([[1.5, 1.5, 3.5, 3.5]])
    expected = 1 - torch.var(r - v) / torch.var(r)
    assert explained_variance(v, r, m).item() == pytest.approx(expected.item())
