"""PPO on an agent's episodes: each recorded call is one turn-level step, whose state value is the
critic's at the call's first action token, whether the call extended the sequence or restarted it."""

from __future__ import annotations

import torch

from rlhf_lightning.learner.critic import reduce_to_steps, step_index
from rlhf_lightning.records.trajectory import collate
from rlhf_lightning.rollout.agents.assembly import Call, trajectory


def call(prompt, completion):
    return Call(prompt, completion, [-0.5] * len(completion), "stop")


def test_each_call_is_a_step_valued_at_its_first_action_token():
    first = call([1, 2, 3], [10, 11])
    extends = call([1, 2, 3, 10, 11, 4, 5], [12, 13, 14])  # tool result 4 5, then the reply
    restarts = call([1, 9, 4], [15])  # the agent dropped its history: a new sequence
    t = trajectory([first, extends, restarts], reward=1.0, group_id=0)
    assert t.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 1, 9, 4, 15] and t.segment_starts == [0, 10]
    batch = collate([t], pad_token_id=0)
    idx, steps = step_index(batch.action_mask, batch.turn_ids, "turn")
    assert steps == 3
    # the value at column j is read before token j + 1: a state value of j means "before token j + 1"
    values = torch.arange(idx.shape[1], dtype=torch.float64)[None, :]
    state = reduce_to_steps(values, idx, steps, "state")
    first_tokens = [3, 7, 13]  # 10, 12 and 15 in token_ids
    assert state.tolist() == [[p - 1.0 for p in first_tokens]]
    # every generated token belongs to its call's step, nothing else does
    got = [(j + 1, int(s)) for j, s in enumerate(idx[0].tolist()) if s >= 0]
    assert got == [(3, 0), (4, 0), (7, 1), (8, 1), (9, 1), (13, 2)]
