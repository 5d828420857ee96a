"""Drive a batch of text environments with a rollout engine, token-exactly.

A trajectory's ids are the prompt ids, then for each turn exactly the ids the engine generated,
then the ids of the env's observation formatted as the next user turn. Generated ids are
never decoded and re-encoded: the decoded text only goes to the env.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.config.errors import UserCodeError
from rlhf_lightning.envs.base import Observation, TextEnv
from rlhf_lightning.records.metrics import episode_metrics
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rewards import CombinedReward, reward_value
from rlhf_lightning.rollout.engines.base import AdapterSampler, Sampler
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, latest_view, observation_problem
from rlhf_lightning.rollout.episodes.stepping import EnvStepper, StepOutcome, StepTimeout, check_step_output

__all__ = [
    "SUCCESS_KEYS",
    "ChatFormatter",
    "RolloutHarness",
    "latest_view",
    "reward_value",
    "success_flag",
]

HISTORY = ("full", "last", "last_k")  # env.history
# The info keys whose value on an episode's last turn says it was solved: held-out accuracy
# (eval/accuracy_*) and a population's fitness count them.
SUCCESS_KEYS = ("correct", "success", "solved")

log = logging.getLogger(__name__)

# One reset episode: its env, its observation's key (the text, or the messages as JSON), the
# observation and the reset's info.
_Reset = tuple[TextEnv, str, Observation, dict[str, Any]]


def success_flag(value: Any) -> bool | None:
    """A success field's value (``info["correct"]`` etc.) as a bool: a bool (Python's, NumPy's or
    a one-element tensor's), or a number exactly 0 or 1; None for anything else (the string
    ``"False"``, NaN, 2, None), which must not count as solved or unsolved."""
    if not isinstance(value, (bool, int, float)) and getattr(value, "ndim", None) == 0:
        value = value.item()  # a NumPy scalar or 0-d array/tensor (an env's info: on the host)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


def check_success_fields(env: Any, info: dict[str, Any], method: str = "step") -> None:
    """Refuse (``TypeError`` naming the env class, the field and its value) a success field that
    is not a bool or exactly 0/1: ``bool("False")`` is True, so a string would count as solved."""
    for key in SUCCESS_KEYS:
        if key in info and success_flag(info[key]) is None:
            raise TypeError(
                f"{type(env).__name__}.{method} returned info[{key!r}]={info[key]!r}; a success field "
                f"({', '.join(SUCCESS_KEYS)}: what eval/accuracy_* and population fitness count) must be "
                f"a bool (or 0/1): return e.g. info[{key!r}] = bool(solved)"
            )


def check_reset_output(env: Any, out: Any) -> tuple[Observation, dict[str, Any]]:
    """``env.reset``'s return value, checked: (observation, info) with a string or well-formed
    chat messages, and a dict (or None) of info; a ``TypeError`` names the env class and what is
    wrong (an int would otherwise fail as "'int' object is not iterable" in the harness)."""
    name = f"{type(env).__name__}.reset"
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"{name} must return (observation, info), got {out!r}")
    obs, info = out
    problem = observation_problem(obs)
    if problem is not None:
        raise TypeError(f"{name} returned {problem}")
    if info is not None and not isinstance(info, dict):
        raise TypeError(f"{name} returned info of type {type(info).__name__}; expected a dict")
    return obs, info or {}


class RolloutHarness:
    """Runs episodes for a batch of task rows, one engine call per turn across all live episodes.

    Args:
        env_factory: builds a fresh env (one per trajectory).
        tokenizer: decodes generated ids for the env (never re-encoded).
        formatter: renders observations into prompt ids.
        max_turns: episode length cap.
        max_model_len: a trajectory stops (``truncated``) when its next turn could exceed it.
        on_reward_error: ``raise`` (default) re-raises an exception from ``env.step`` (or its
            timeout) with the prompt and completion shown; ``zero`` scores that reply 0, ends
            the episode and counts it in ``env/reward_errors`` (timeouts also in
            ``env/step_timeouts``).
        reward: the training reward when it is not the env's alone (``reward=function|model``).
        concurrency: envs stepped at once within a turn (1: one after the other).
        step_timeout_s: a step that takes longer is stopped (None: no limit).
        step_workers: where steps run at once or with a limit: ``process`` (worker processes:
            a step past its limit is killed) or ``thread`` (no limit); see ``rollout.stepping``.
        history: what each turn's prompt holds (``env.history``): ``full`` (the conversation
            so far, one growing sequence), ``last`` (the instructions and the latest observation:
            :func:`latest_view`) or ``last_k`` (the first prompt, then the last ``history_k``
            turns' replies and observations, token for token as ``full`` has them). With
            ``last``/``last_k`` each turn's prompt starts a sequence of its own in the trajectory
            (``Trajectory.segment_starts``) and ``max_model_len`` bounds each sequence.
        history_k: turns kept by ``last_k``.
    """

    def __init__(
        self,
        env_factory: Callable[[], TextEnv],
        tokenizer: PreTrainedTokenizerBase,
        formatter: ChatFormatter,
        max_turns: int = 1,
        max_model_len: int = 512,
        on_reward_error: str = "raise",
        reward: CombinedReward | None = None,
        concurrency: int = 1,
        step_timeout_s: float | None = None,
        step_workers: str = "process",
        history: str = "full",
        history_k: int = 2,
    ) -> None:
        if on_reward_error not in ("raise", "zero"):
            raise ValueError(f"on_reward_error must be raise or zero, got {on_reward_error!r}")
        if history not in HISTORY or history_k < 1:
            raise ValueError(
                f"history must be one of {', '.join(HISTORY)} and history_k >= 1, got {history!r}, {history_k}"
            )
        self.history, self.history_k = history, history_k
        self.stepper = EnvStepper(concurrency, step_timeout_s, step_workers)
        self.on_reward_error = on_reward_error
        self.reward = reward
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.max_turns = max_turns
        self.max_model_len = max_model_len

    def rollout(
        self,
        engine: Sampler,
        rows: list[int],
        params: SamplingParams,
        *,
        group_size: int = 1,
        evaluation: bool = False,
        progress: Callable[[str], None] | None = None,
        device: Any = "cpu",
        adapters: list[str] | None = None,
        group_sizes: list[int] | None = None,
    ) -> RolloutResult:
        """``group_size`` episodes for each task row; trajectories are row-major (group-contiguous).
        ``progress`` hears where the rollout is before each turn's generation (the progress bar).
        Training episodes are then scored by ``reward`` (reward models run on ``device``).

        One call may sample several LoRA adapters of one base (a population's members, with an
        :class:`~rlhf_lightning.rollout.engines.base.AdapterSampler`): ``adapters[i]`` samples row i's
        episodes (each trajectory records it), ``group_sizes[i]`` of them (``group_size`` if None).

        A row whose prompt leaves no room for ``params.max_new_tokens`` within ``max_model_len``
        is dropped (with its group) and counted, never cut.
        """
        sizes = list(group_sizes) if group_sizes is not None else [group_size] * len(rows)
        for name, per_row in (("adapters", adapters), ("group_sizes", group_sizes)):
            if per_row is not None and len(per_row) != len(rows):
                raise ValueError(
                    f"RolloutHarness.rollout: {len(per_row)} {name} for {len(rows)} rows (one per row)"
                )
        groups, rendered = self._reset_groups(rows, sizes, evaluation)
        texts = list(rendered.values())
        encoded = self.tokenizer(texts, add_special_tokens=False).input_ids if texts else []
        token_ids = dict(zip(rendered, encoded))
        envs, trajs, dropped = self._start_episodes(groups, rendered, token_ids, params, adapters)
        self._check_dropped(dropped, len(rows), bool(trajs), params.max_new_tokens)
        # history=full: a turn's prompt continues the last one, so an engine may keep its KV cache
        # (an engine offers it as ``turn_session()``, :meth:`~rlhf_lightning.rollout.engines.hf.HFEngine.turn_session`)
        session = (
            getattr(engine, "turn_session", None) if self.history == "full" and self.max_turns > 1 else None
        )
        with session() if callable(session) else nullcontext():
            errors, timeouts = self._run_turns(engine, envs, trajs, params, progress, adapters is not None)
        metrics = episode_metrics(trajs)
        if self.reward is not None and not evaluation:  # evaluation keeps the env's own rewards
            metrics.update(self.reward.apply(trajs, device))
        batch = collate(trajs, self.tokenizer.pad_token_id)
        metrics["rollout/dropped_long_prompts"] = float(dropped)
        metrics["env/reward_errors"] = float(errors)
        if self.stepper.timeout_s is not None:
            metrics["env/step_timeouts"] = float(timeouts)
        return RolloutResult(batch, trajs, metrics)

    def _reset_groups(
        self, rows: list[int], group_sizes: list[int], evaluation: bool
    ) -> tuple[list[list[_Reset]], dict[str, str]]:
        """A fresh env per episode, reset on its row (``group_sizes[i]`` for row i, in row order), and
        each distinct observation's prompt text, rendered once (group members usually share it).

        Returns:
            (per row, its episodes' (env, observation key, observation, info); key -> prompt text)
        """
        rendered: dict[str, str] = {}
        reset: list[list[_Reset]] = []
        for row, group_size in zip(rows, group_sizes):
            reset.append([])
            for _ in range(group_size):
                env = self.env_factory()
                obs, info = check_reset_output(env, env.reset(seed=row, row_index=row, evaluation=evaluation))
                key = obs if isinstance(obs, str) else json.dumps(obs)
                if key not in rendered:
                    rendered[key] = self.formatter.prompt_text(obs)
                reset[-1].append((env, key, obs, info))
        return reset, rendered

    def _start_episodes(
        self,
        groups: list[list[_Reset]],
        rendered: dict[str, str],
        token_ids: dict[str, list[int]],
        params: SamplingParams,
        adapters: list[str] | None = None,
    ) -> tuple[list[TextEnv], list[Trajectory], int]:
        """Each kept episode's env and its trajectory (the prompt ids so far); a group with a
        prompt that leaves no room for ``params.max_new_tokens`` within ``max_model_len`` is
        dropped whole. Returns (envs, trajectories, dropped groups)."""
        envs: list[TextEnv] = []
        trajs: list[Trajectory] = []
        dropped = g = 0
        for row, members in enumerate(groups):
            group = [(env, rendered[key], token_ids[key], obs, info) for env, key, obs, info in members]
            if any(len(ids) + params.max_new_tokens > self.max_model_len for _, _, ids, _, _ in group):
                dropped += 1
                continue
            for env, text, ids, obs, info in group:
                envs.append(env)
                trajs.append(
                    Trajectory(
                        token_ids=list(ids),
                        action_turn=[-1] * len(ids),
                        sampling_logps=[0.0] * len(ids),
                        rewards=[],
                        group_id=g,
                        prompt_len=len(ids),
                        prompt_text=text,
                        observation=obs,
                        task_info=info,
                        adapter=adapters[row] if adapters is not None else None,
                    )
                )
            g += 1
        return envs, trajs, dropped

    def _check_dropped(self, dropped: int, num_rows: int, any_kept: bool, max_new_tokens: int) -> None:
        """Warn about dropped prompts; refuse a batch that kept none."""
        if dropped:
            log.warning(
                "dropped %d of %d prompts: longer than env.max_model_len=%d minus rollout.max_new_tokens=%d",
                dropped,
                num_rows,
                self.max_model_len,
                max_new_tokens,
            )
        if not any_kept:
            raise ValueError(
                f"every prompt of this batch is longer than env.max_model_len={self.max_model_len} minus "
                f"rollout.max_new_tokens={max_new_tokens}; raise env.max_model_len"
            )

    def _run_turns(
        self,
        engine: Sampler,
        envs: list[TextEnv],
        trajs: list[Trajectory],
        params: SamplingParams,
        progress: Callable[[str], None] | None,
        per_adapter: bool = False,
    ) -> tuple[int, int]:
        """Up to ``max_turns`` turns: one engine call for every live episode, then their env steps.
        An episode still going after the last turn is truncated. Returns (env errors, timeouts)."""
        errors = timeouts = 0
        live = list(range(len(trajs)))
        pieces: list[list[list[int]]] = [
            [] for _ in trajs
        ]  # per episode: each turn's reply + observation ids
        for turn in range(self.max_turns):
            if progress is not None:
                turns = f"turn {turn + 1}/{self.max_turns}, " if self.max_turns > 1 else ""
                progress(f"rollout: {turns}{len(live)} episodes")
            # Each episode's current sequence: the conversation so far, or this turn's own prompt.
            prompts = [trajs[i].token_ids[trajs[i].segment_starts[-1] :] for i in live]
            one = replace(params, n=1)
            if per_adapter:  # an AdapterSampler: each episode's own adapter
                names = [cast(str, trajs[i].adapter) for i in live]
                completions = cast(AdapterSampler, engine).generate(prompts, one, adapters=names)
            else:
                completions = engine.generate(prompts, one)
            replies = self.tokenizer.batch_decode(
                [c.token_ids for c in completions], skip_special_tokens=True
            )
            for i, comp, text in zip(live, completions, replies):
                self._append_turn(trajs[i], comp, text, turn)
            # The env steps of this turn, possibly concurrent; handled in episode order.
            outcomes = self.stepper.step_all([envs[i] for i in live], replies)
            still = []
            for i, comp, text, outcome in zip(live, completions, replies, outcomes):
                envs[i] = outcome.env  # a worker process steps a copy of the env
                going, failed = self._after_step(
                    envs[i], trajs[i], comp, text, outcome, params.max_new_tokens, pieces[i]
                )
                errors += failed
                timeouts += failed and isinstance(outcome.error, StepTimeout)
                if going:
                    still.append(i)
            live = still
            if not live:
                break
        for i in live:  # still going after max_turns: cut by the turn limit
            trajs[i].truncated = True
        return errors, timeouts

    @staticmethod
    def _append_turn(traj: Trajectory, comp: Completion, text: str, turn: int) -> None:
        """Append one generated turn (``text``: its decoded ids, for the env only)."""
        traj.token_ids += comp.token_ids
        traj.action_turn += [turn] * len(comp.token_ids)
        traj.sampling_logps += comp.logprobs
        traj.finish_reasons.append(comp.finish_reason)
        traj.turn_lengths.append(len(comp.token_ids))
        traj.completion_text += text if turn == 0 else f"\n[turn {turn}] {text}"
        traj.replies.append(text)

    def _after_step(
        self,
        env: TextEnv,
        traj: Trajectory,
        comp: Completion,
        text: str,
        outcome: StepOutcome,
        max_new_tokens: int,
        pieces: list[list[int]] | None = None,
    ) -> tuple[bool, bool]:
        """Record the env's reply to the turn just appended, and the next turn's prompt ids
        (``pieces``: the episode's earlier turns' reply + observation ids, for ``last_k``).
        Returns (episode goes on, the env raised or timed out)."""
        failed = False
        out: Any
        if outcome.error is not None:
            err = outcome.error
            what = (
                f"timed out: it {err} (env.step_timeout_s)"
                if isinstance(err, StepTimeout)
                else f"raised {type(err).__name__}: {err}"
            )
            if self.on_reward_error == "raise":
                raise UserCodeError(
                    f"{type(env).__name__}.step {what}\n"
                    f"  prompt: {traj.prompt_text!r}\n  completion: {text!r}\n"
                    "Set env.on_reward_error=zero to score such replies 0 (counted in env/reward_errors)."
                ) from err
            out, failed = ("", 0.0, True, False, {}), True
        else:
            out = outcome.output
        obs, reward, terminated, truncated, info = check_step_output(env, out)
        check_success_fields(env, info)
        traj.rewards.append(reward)
        traj.infos.append(info)
        # A reply cut at max_new_tokens ends the episode (no well-formed next turn can follow).
        # It is terminal when the env says so (its reward is the outcome, nothing follows);
        # otherwise the episode stops in a non-terminal state, like the env's own truncation.
        cut = comp.finish_reason == "length"
        traj.cut = traj.cut or cut
        traj.truncated = traj.truncated or (not terminated and (truncated or cut))
        if terminated or truncated or cut:
            return False, failed
        problem = observation_problem(obs)  # the next turn's prompt: rendered by the chat template
        if problem is not None:
            raise TypeError(f"{type(env).__name__}.step returned {problem}")
        held_before = len(traj.token_ids) - traj.segment_starts[-1] if self.history == "full" else 0
        if held_before + self.formatter.fewest_tokens(obs) + max_new_tokens > self.max_model_len:
            traj.truncated = True  # the next turn cannot fit: known without tokenizing the observation
            return False, failed
        ids, fresh = self._next_prompt(traj, comp, obs, pieces if pieces is not None else [])
        held = len(ids) if fresh else len(traj.token_ids) - traj.segment_starts[-1] + len(ids)
        if held + max_new_tokens > self.max_model_len:
            traj.truncated = True  # the next turn would not fit
            return False, failed
        if fresh:  # the next turn's prompt is a sequence of its own
            traj.segment_starts.append(len(traj.token_ids))
        traj.token_ids += ids
        traj.action_turn += [-1] * len(ids)
        traj.sampling_logps += [0.0] * len(ids)
        traj.observations.append(obs)
        return True, failed

    def _next_prompt(
        self, traj: Trajectory, comp: Completion, obs: Observation, pieces: list[list[int]]
    ) -> tuple[list[int], bool]:
        """The ids that come before the next turn's reply, and whether they start a new sequence.

        ``full``: the observation as the next user turn, appended to the conversation. ``last``:
        the instructions and the latest observation rendered as a fresh prompt. ``last_k``: the
        first prompt's ids, then the last ``history_k`` turns' reply and observation ids (the
        same ids ``full`` holds for those turns)."""
        if self.history == "last":
            instructions = traj.task_info.get("instructions", traj.observation)
            return self.formatter.prompt_ids(latest_view(instructions, obs)), True
        ids = self.formatter.observation_ids(obs)
        if self.history == "full":
            return ids, False
        pieces.append(list(comp.token_ids) + ids)
        kept = [t for piece in pieces[-self.history_k :] for t in piece]
        return traj.token_ids[: traj.prompt_len] + kept, True

    def close(self) -> None:
        """Stop the stepper's worker processes and threads (a later rollout starts new ones)."""
        self.stepper.close()

    def shutdown(self) -> None:
        """The run's end: :meth:`close`, and what the env factory holds when it has a ``close``
        (env=openenv: the server the run started; no rollout can follow)."""
        self.close()
        close = getattr(self.env_factory, "close", None)
        if callable(close):
            close()
