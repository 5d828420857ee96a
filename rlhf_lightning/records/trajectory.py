"""Trajectories as lists (while they are built) and as a padded tensor batch (for training)."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field, fields
from typing import Any

import torch

# The info key (reset or step info) under which an env may name its state for GiGPO's anchor
# states (``Trajectory.turn_state_ids``); without it a turn's state is its observation's tokens.
ANCHOR_STATE = "anchor_state"


@dataclass
class Trajectory:
    """One episode, token-exact: ``token_ids`` is prompt + generated + observation ids in order.

    ``action_turn[i]`` is the turn index of ``token_ids[i]`` if the engine generated it, else -1.
    ``sampling_logps[i]`` is the engine's log-prob of generated token i (0 elsewhere).
    Per turn k: ``finish_reasons[k]`` is the engine's (``stop`` or ``length``: cut at
    ``max_new_tokens``), ``turn_lengths[k]`` the generated tokens. ``truncated``: the episode
    ended without reaching a terminal state (the env did not terminate it: ``max_turns`` or
    ``max_model_len`` ended it, the env itself truncated it, or a reply was cut before the env
    reached a terminal state); PPO bootstraps such episodes from the critic. ``cut``: some
    reply was cut at ``max_new_tokens``, whether or not the env then terminated the episode
    (``algo.mask_truncated`` and the length metrics use it; a cut reply the env scored as
    final is terminal, never bootstrapped).
    """

    token_ids: list[int]
    action_turn: list[int]
    sampling_logps: list[float]
    rewards: list[float]
    group_id: int
    prompt_len: int
    truncated: bool = False
    cut: bool = False
    prompt_text: str = ""
    completion_text: str = ""
    infos: list[dict[str, Any]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    turn_lengths: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)  # each turn's decoded reply (for reward functions)
    observation: Any = ""  # the env's first observation (str or chat messages)
    observations: list[Any] = field(default_factory=list)  # each later observation the trajectory holds
    task_info: dict[str, Any] = field(default_factory=dict)  # the env's reset info (dataset columns)
    env_rewards: list[float] = field(
        default_factory=list
    )  # the env's own per-turn rewards (before reward=...)
    reward_parts: dict[str, float] = field(default_factory=dict)  # raw score of each reward component
    # Each term of the training return as (weight, return): the env's and each reward component's
    # (after batch standardisation), set by the reward group; for decoupled advantages (gdpo).
    reward_terms: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The policy version (optimizer updates done) that generated each turn: set by asynchronous
    # rollouts (``rollout.mode=async``), empty otherwise (the current weights).
    turn_versions: list[int] = field(default_factory=list)
    # The LoRA adapter that sampled it when one call samples several (a population's members).
    adapter: str | None = None
    # Where each of its sequences starts in ``token_ids``: [0] for one sequence (the whole
    # conversation, ``env.history=full``); with ``last``/``last_k`` each turn's prompt starts one
    # (a sequence of its own: positions restart there and attention stays within it).
    segment_starts: list[int] = field(default_factory=lambda: [0])

    @property
    def num_turns(self) -> int:
        return len(self.rewards)

    def token_versions(self) -> list[int]:
        """The policy version of every token in ``token_ids``: its turn's, -1 where the engine did
        not generate it (and everywhere without ``turn_versions``)."""
        if not self.turn_versions:
            return [-1] * len(self.token_ids)
        return [self.turn_versions[t] if t >= 0 else -1 for t in self.action_turn]

    def segment_lengths(self) -> list[int]:
        """Tokens of each sequence (see ``segment_starts``)."""
        ends = [*self.segment_starts[1:], len(self.token_ids)]
        return [e - s for s, e in zip(self.segment_starts, ends)]

    def turn_starts(self) -> list[int]:
        """Index in ``token_ids`` of each turn's first generated token."""
        starts: list[int] = []
        for i, turn in enumerate(self.action_turn):
            if turn >= 0 and turn == len(starts):
                starts.append(i)
        return starts

    def turn_state_ids(self) -> list[int]:
        """Each turn's state (GiGPO's anchor states): a 63-bit hash, -1 for a turn without
        generated tokens.

        The env's own name for the state when it gives one: ``info["anchor_state"]`` of the reset
        info (turn 0) or of the step that produced the turn's observation (GEM's games name the
        board: the same board is the same state whatever the feedback). Otherwise the tokens that
        came before the turn's reply since the previous reply ended (turn 0: the prompt): with
        ``env.history=full`` the latest observation in its chat-template wrapping (feedback
        included), with ``last`` the instructions and the latest observation, with ``last_k``
        also the kept earlier turns. Equal states give equal ids on every rank.
        """
        named = [self.task_info.get(ANCHOR_STATE), *(info.get(ANCHOR_STATE) for info in self.infos)]
        turns, ids, end = self.action_turn, [], 0
        for k in range(self.num_turns):
            try:
                first = turns.index(k, end)  # list.index: a scan in C, not a Python loop
            except ValueError:
                ids.append(-1)
                continue
            state = named[k] if k < len(named) else None
            ids.append(token_hash(self.token_ids[end:first]) if state is None else text_hash(str(state)))
            # A turn's tokens are one block, followed by an observation (-1), the next turn or the end.
            end = min(_index_or_end(turns, -1, first), _index_or_end(turns, k + 1, first))
        return ids


def _index_or_end(values: list[int], value: int, start: int) -> int:
    try:
        return values.index(value, start)
    except ValueError:
        return len(values)


def token_hash(ids: list[int]) -> int:
    """A 63-bit, process-independent hash of a token sequence (>= 0)."""
    digest = hashlib.blake2b(array("q", ids).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def text_hash(text: str) -> int:
    """A 63-bit, process-independent hash of a string (>= 0)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"anchor_state").digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class TrajectoryBatch:
    """The padded batch every rollout algorithm trains on (right padding).

    Shapes (B trajectories, L = longest sequence, K = max turns):
        input_ids, attention_mask: (B, L)
        action_mask: (B, L-1), True where token t+1 was generated (logits at t predict it)
        turn_ids: (B, L-1), the turn of that generated token, -1 elsewhere
        sampling_logps: (B, L-1), the engine's log-prob of that token, 0 elsewhere
        rewards: (B, K), per-turn rewards, 0 after the last turn
        group_ids: (B,), trajectories of one prompt share an id
        num_turns: (B,), truncated: (B,) (no terminal state reached: see ``Trajectory``)
        cut: (B,), some reply of the episode was cut at ``max_new_tokens``
        turn_lengths: (B, K), generated tokens per turn (0 after the last turn)
        turn_cut: (B, K), True where the engine stopped the turn at ``max_new_tokens``
        turn_starts: (B, K), the (B, L-1) column of each turn's first action token, i.e. where
            the state before the turn is read (-1 after the last turn)
        state_ids: (B, K), each turn's state: a hash of the env's ``info["anchor_state"]``, else
            of the tokens given to the model before its reply (``Trajectory.turn_state_ids``),
            -1 after the last turn; GiGPO's anchor states (``algo.advantage=gigpo``)
        prompt_lens: (B,), tokens before the first action
        prefix_ids: (B,), rows whose first ``prompt_lens`` tokens are identical share an id
            (the policy runs such a shared prompt once: see ``Policy.token_logprobs``)
        position_ids: (B, L) for packed rows (several sequences per row: SFT packing, or the
            turns of an episode with ``env.history=last|last_k``; positions restart at each and
            attention stays within it), None otherwise
        reward_terms, reward_weights: (B, C), each term of the training return (the env's, each
            reward component's) and its weight, when every trajectory has the same terms; None
            otherwise (``Trajectory.reward_terms``)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    turn_ids: torch.Tensor
    sampling_logps: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    num_turns: torch.Tensor
    truncated: torch.Tensor
    cut: torch.Tensor
    prompt_lens: torch.Tensor
    prefix_ids: torch.Tensor
    turn_lengths: torch.Tensor
    turn_cut: torch.Tensor
    turn_starts: torch.Tensor
    state_ids: torch.Tensor
    position_ids: torch.Tensor | None = None
    reward_terms: torch.Tensor | None = None
    reward_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> TrajectoryBatch:
        moved: dict[str, Any] = {
            f.name: _opt(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)
        }
        return TrajectoryBatch(**moved)

    def select(self, index: torch.Tensor) -> TrajectoryBatch:
        """Rows ``index``, with the columns trimmed to the longest selected sequence."""
        sub: dict[str, Any] = {f.name: _opt(getattr(self, f.name), lambda t: t[index]) for f in fields(self)}
        width = int(sub["attention_mask"].sum(-1).max()) if len(index) else 1
        for name in ("input_ids", "attention_mask", "position_ids"):
            sub[name] = _opt(sub[name], lambda t: t[:, :width])
        for name in ("action_mask", "turn_ids", "sampling_logps"):
            sub[name] = sub[name][:, : max(width - 1, 0)]
        return TrajectoryBatch(**sub)

    @property
    def returns(self) -> torch.Tensor:
        """Episode return: the sum of per-turn rewards. Shape: (B,)"""
        return self.rewards.sum(-1)


def _opt(value: torch.Tensor | None, fn: Any) -> torch.Tensor | None:
    return None if value is None else fn(value)


def collate(trajectories: list[Trajectory], pad_token_id: int) -> TrajectoryBatch:
    """Right-pad trajectories into a :class:`TrajectoryBatch`."""
    width = max(len(t.token_ids) for t in trajectories)
    turns = max(max(t.num_turns for t in trajectories), 1)
    # One tensor per field from padded Python lists: a tensor per trajectory costs more than the rest.
    lens = [len(t.token_ids) for t in trajectories]
    input_ids = torch.tensor([t.token_ids + [pad_token_id] * (width - n) for t, n in zip(trajectories, lens)])
    attention_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lens])
    turn_ids = torch.tensor([t.action_turn + [-1] * (width - n) for t, n in zip(trajectories, lens)])
    sampling_logps = torch.tensor(
        [t.sampling_logps + [0.0] * (width - n) for t, n in zip(trajectories, lens)], dtype=torch.float32
    )
    rewards = torch.tensor(
        [t.rewards + [0.0] * (turns - t.num_turns) for t in trajectories], dtype=torch.float32
    )
    prefixes: dict[tuple[int, ...], int] = {}
    prefix_ids = [
        prefixes.setdefault(tuple(t.token_ids[: t.prompt_len]), len(prefixes)) for t in trajectories
    ]

    def per_turn(values: list[list[Any]], pad: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([(v + [pad] * turns)[:turns] for v in values], dtype=dtype)

    # Shift: position t of the (B, L-1) tensors describes token t+1.
    turn_ids = turn_ids[:, 1:]
    segmented = any(len(t.segment_starts) > 1 for t in trajectories)
    return TrajectoryBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=turn_ids >= 0,
        turn_ids=turn_ids,
        sampling_logps=sampling_logps[:, 1:],
        rewards=rewards,
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        num_turns=torch.tensor([t.num_turns for t in trajectories], dtype=torch.long),
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        cut=torch.tensor([t.cut for t in trajectories], dtype=torch.bool),
        prompt_lens=torch.tensor([t.prompt_len for t in trajectories], dtype=torch.long),
        prefix_ids=torch.tensor(prefix_ids, dtype=torch.long),
        turn_lengths=per_turn([t.turn_lengths for t in trajectories], 0, torch.long),
        turn_cut=per_turn(
            [[r == "length" for r in t.finish_reasons] for t in trajectories], False, torch.bool
        ),
        turn_starts=per_turn([[i - 1 for i in t.turn_starts()] for t in trajectories], -1, torch.long),
        state_ids=per_turn([t.turn_state_ids() for t in trajectories], -1, torch.long),
        position_ids=segment_positions([t.segment_lengths() for t in trajectories], width)
        if segmented
        else None,
        **reward_term_tensors(trajectories),
    )


def reward_term_tensors(trajectories: list[Trajectory]) -> dict[str, torch.Tensor | None]:
    """``reward_terms`` and ``reward_weights`` (B, C) from each trajectory's terms in name order,
    when all have the same names; both None otherwise."""
    names = sorted(trajectories[0].reward_terms)
    if not names or any(sorted(t.reward_terms) != names for t in trajectories):
        return {"reward_terms": None, "reward_weights": None}
    pairs = [[t.reward_terms[n] for n in names] for t in trajectories]
    return {
        "reward_terms": torch.tensor([[v for _, v in row] for row in pairs], dtype=torch.float32),
        "reward_weights": torch.tensor([[w for w, _ in row] for row in pairs], dtype=torch.float32),
    }


def segment_positions(lens: list[list[int]], width: int) -> torch.Tensor:
    """Positions restarting at 0 at each sequence of a packed row; the padding continues the last.

    Args:
        lens: per row, the lengths of its sequences in order.
        width: the padded row width (at least each row's total).

    Returns:
        Shape: (len(lens), width)
    """
    rows = []
    for seg in lens:
        parts = [torch.arange(n) for n in seg]
        parts.append(torch.arange(seg[-1], seg[-1] + width - sum(seg)))
        rows.append(torch.cat(parts))
    return torch.stack(rows)
