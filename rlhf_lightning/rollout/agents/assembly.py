"""An agent's recorded model calls, assembled token-exactly into one :class:`Trajectory`.

An agent that drives its own conversation calls the policy's endpoint once per turn; the endpoint
records each call's prompt ids (the run's chat template over the messages the agent sent), the
engine's completion ids and their log-probs. Those ids are the trajectory: nothing is re-tokenised.

Call ``k`` **extends** the episode's current sequence when its prompt ids begin with everything that
sequence holds so far (the previous call's prompt and completion): the new prompt's remaining ids
(the tool result, the user's next message, the template's turn markers) follow as observation
tokens, then the completion. Otherwise (a template that drops earlier reasoning, an agent that
edits its history or starts a fresh conversation) the call **restarts**: its whole prompt opens a
new sequence in the same row (``Trajectory.segment_starts``, packed as ``env.history=last``'s turns
are: positions restart and attention stays within it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_lightning.records.trajectory import Trajectory


@dataclass
class Call:
    """One model call of an episode, as the endpoint served it.

    ``prompt_ids``: the rendered prompt; ``completion_ids``/``logprobs``: what the engine generated
    and its log-probs; ``finish_reason``: ``stop`` or ``length``; ``version``: the policy version
    current when the call started; ``text``: the decoded completion; ``main``: the call belongs to
    the episode's own conversation (its first message is the first call's), not another purpose.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int = 0
    text: str = ""
    main: bool = True


@dataclass
class Assembly:
    """The trajectory's token fields (see :class:`Trajectory`) and how its calls joined."""

    token_ids: list[int] = field(default_factory=list)
    action_turn: list[int] = field(default_factory=list)
    sampling_logps: list[float] = field(default_factory=list)
    segment_starts: list[int] = field(default_factory=list)
    turn_lengths: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    turn_versions: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    extended: int = 0  # calls that continued the sequence before them
    restarted: int = 0  # calls after the first that opened a new sequence

    @property
    def prompt_len(self) -> int:
        """Tokens before the first action token."""
        return self.action_turn.index(0) if 0 in self.action_turn else len(self.token_ids)


def assemble(calls: list[Call]) -> Assembly:
    """The calls of one episode (in the order they were served) as one token-exact row."""
    out = Assembly()
    seq_start = 0
    for k, call in enumerate(calls):
        current = out.token_ids[seq_start:]
        if k > 0 and call.prompt_ids[: len(current)] == current:
            observation = call.prompt_ids[len(current) :]
            out.extended += 1
        else:
            if k > 0:
                out.restarted += 1
            seq_start = len(out.token_ids)
            out.segment_starts.append(seq_start)
            observation = call.prompt_ids
        out.token_ids += observation
        out.action_turn += [-1] * len(observation)
        out.sampling_logps += [0.0] * len(observation)
        out.token_ids += call.completion_ids
        out.action_turn += [k] * len(call.completion_ids)
        out.sampling_logps += list(call.logprobs)
        out.turn_lengths.append(len(call.completion_ids))
        out.finish_reasons.append(call.finish_reason)
        out.turn_versions.append(call.version)
        out.replies.append(call.text)
    return out


def trajectory(calls: list[Call], reward: float, group_id: int, *, truncated: bool = False) -> Trajectory:
    """One episode's :class:`Trajectory`: its calls assembled, the episode's reward on the last
    call (the turns before it 0). ``calls`` must not be empty."""
    if not calls:
        raise ValueError("an episode without model calls has no trajectory")
    a = assemble(calls)
    return Trajectory(
        token_ids=a.token_ids,
        action_turn=a.action_turn,
        sampling_logps=a.sampling_logps,
        rewards=[0.0] * (len(calls) - 1) + [float(reward)],
        group_id=group_id,
        prompt_len=a.prompt_len,
        truncated=truncated,
        cut=any(r == "length" for r in a.finish_reasons),
        completion_text="".join(
            text if k == 0 else f"\n[turn {k}] {text}" for k, text in enumerate(a.replies)
        ),
        finish_reasons=a.finish_reasons,
        turn_lengths=a.turn_lengths,
        replies=a.replies,
        turn_versions=a.turn_versions,
        segment_starts=a.segment_starts,
    )
