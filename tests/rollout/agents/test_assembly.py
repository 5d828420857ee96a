"""An agent's recorded calls assembled into one token-exact trajectory: calls whose prompt
extends what came before stay one sequence; others restart a packed sequence in the row."""

from __future__ import annotations

import pytest

from rlhf_lightning.rollout.agents.assembly import Call, assemble, trajectory


def call(prompt, completion, version=0, reason="stop"):
    return Call(
        prompt, completion, [-0.5 - i for i in range(len(completion))], reason, version, text=str(completion)
    )


def test_calls_that_extend_are_one_sequence_the_new_prompt_tokens_are_observations():
    first = call([1, 2, 3], [10, 11])
    second = call([1, 2, 3, 10, 11, 4, 5], [12], version=1)
    a = assemble([first, second])
    assert a.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert a.action_turn == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert a.sampling_logps == [0.0, 0.0, 0.0, -0.5, -1.5, 0.0, 0.0, -0.5]
    assert a.segment_starts == [0] and (a.extended, a.restarted) == (1, 0)
    assert a.turn_lengths == [2, 1] and a.turn_versions == [0, 1] and a.prompt_len == 3


def test_a_call_that_does_not_extend_opens_a_new_sequence_with_its_whole_prompt():
    first = call([1, 2, 3], [10, 11])
    edited = call([1, 2, 9, 4], [12, 13])  # the agent rewrote its history
    third = call([1, 2, 9, 4, 12, 13, 7], [14])  # extends the second
    a = assemble([first, edited, third])
    assert a.token_ids == [1, 2, 3, 10, 11, 1, 2, 9, 4, 12, 13, 7, 14]
    assert a.action_turn == [-1, -1, -1, 0, 0, -1, -1, -1, -1, 1, 1, -1, 2]
    assert a.segment_starts == [0, 5] and (a.extended, a.restarted) == (1, 1)


def test_a_prompt_that_repeats_only_part_of_the_last_completion_restarts():
    a = assemble([call([1, 2], [10, 11]), call([1, 2, 10], [12])])  # 11 dropped (re-tokenised)
    assert a.segment_starts == [0, 4] and a.restarted == 1


def test_the_trajectory_puts_the_reward_on_the_last_call_and_packs_its_sequences():
    from rlhf_lightning.records.trajectory import collate

    t = trajectory([call([1, 2], [10], reason="length"), call([5, 6], [11, 12])], 0.75, group_id=3)
    assert t.rewards == [0.0, 0.75] and t.group_id == 3 and t.cut
    assert t.segment_lengths() == [3, 4] and t.turn_starts() == [2, 5]
    batch = collate([t], pad_token_id=0)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert batch.turn_starts.tolist() == [[1, 4]] and batch.returns.tolist() == [0.75]


def test_an_episode_without_calls_has_no_trajectory_of_calls():
    with pytest.raises(ValueError, match="without model calls"):
        trajectory([], 1.0, 0)
