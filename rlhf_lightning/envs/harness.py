"""Drive a batch of text environments with a rollout engine, token-exactly.

A trajectory's ids are the prompt ids, then for each turn exactly the ids the engine generated,
then the ids of the env's observation formatted as the next user turn. Generated ids are
never decoded and re-encoded: the decoded text only goes to the env.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlhf_lightning.envs.base import Observation, TextEnv
from rlhf_lightning.envs.trajectory import Trajectory, TrajectoryBatch, collate
from rlhf_lightning.rollout.engine import Completion, RolloutEngine, SamplingParams


class ChatFormatter:
    """Turns observations into token ids with the tokenizer's chat template (or raw text)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.apply_chat_template = apply_chat_template

    def messages(self, observation: Observation) -> list[dict[str, str]]:
        msgs = (
            [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        )
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return cast(
            str,
            self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            ),
        )

    def prompt_text(self, observation: Observation) -> str:
        if not self.apply_chat_template:
            if not isinstance(observation, str):
                return "\n".join(m["content"] for m in observation)
            return observation if not self.system_prompt else f"{self.system_prompt}\n{observation}"
        return self.render(self.messages(observation), add_generation_prompt=True)

    def prompt_ids(self, observation: Observation) -> list[int]:
        return self.tokenizer(self.prompt_text(observation), add_special_tokens=False).input_ids

    def observation_text(self, observation: Observation) -> str:
        """The text between an assistant turn's end-of-turn token (already generated) and the
        next generation prompt: the env's observation as the next user turn."""
        if not self.apply_chat_template:
            text = (
                observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)
            )
            return f"\n{text}\n"
        probe = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
        new = (
            [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        )
        base = self.render(probe)
        full = self.render(probe + new, add_generation_prompt=True)
        if not full.startswith(base):
            raise ValueError(
                "the chat template renders earlier turns differently once a turn is added; multi-turn needs a prefix-stable template"
            )
        tail = base[base.rindex("A") + 1 :]  # what closes the assistant turn, e.g. "<|im_end|>\n"
        eos = str(self.tokenizer.eos_token or "")
        if eos and tail.startswith(eos):
            tail = tail[len(eos) :]  # the engine generated it already
        return tail + full[len(base) :]

    def observation_ids(self, observation: Observation) -> list[int]:
        return self.tokenizer(self.observation_text(observation), add_special_tokens=False).input_ids


@dataclass
class RolloutResult:
    batch: TrajectoryBatch
    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)


def _check_step_output(env: TextEnv, out: Any) -> tuple[Observation, float, bool, bool, dict]:
    name = f"{type(env).__name__}.step"
    if not isinstance(out, tuple) or len(out) != 5:
        raise TypeError(f"{name} must return (observation, reward, terminated, truncated, info), got {out!r}")
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, (str, list)):
        raise TypeError(
            f"{name} returned observation of type {type(obs).__name__}; expected str or list of messages"
        )
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise TypeError(f"{name} returned reward={reward!r}; expected a finite float")
    for fname, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} returned {fname}={flag!r}; expected a bool")
    if not isinstance(info, dict):
        raise TypeError(f"{name} returned info of type {type(info).__name__}; expected a dict")
    return obs, float(reward), terminated, truncated, info


class RolloutHarness:
    """Runs episodes for a batch of task rows, one engine call per turn across all live episodes.

    Args:
        env_factory: builds a fresh env (one per trajectory).
        tokenizer: decodes generated ids for the env (never re-encoded).
        formatter: renders observations into prompt ids.
        max_turns: episode length cap.
        max_model_len: a trajectory stops (``truncated``) when its next turn could exceed it.
    """

    def __init__(
        self,
        env_factory: Callable[[], TextEnv],
        tokenizer: PreTrainedTokenizerBase,
        formatter: ChatFormatter,
        max_turns: int = 1,
        max_model_len: int = 512,
    ) -> None:
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.formatter = formatter
        self.max_turns = max_turns
        self.max_model_len = max_model_len

    def rollout(
        self,
        engine: RolloutEngine,
        rows: list[int],
        params: SamplingParams,
        *,
        group_size: int = 1,
        evaluation: bool = False,
    ) -> RolloutResult:
        """``group_size`` episodes for each task row; trajectories are row-major (group-contiguous)."""
        envs: list[TextEnv] = []
        trajs: list[Trajectory] = []
        rendered: dict[str, tuple[str, list[int]]] = {}  # group members usually share their prompt
        for g, row in enumerate(rows):
            for _ in range(group_size):
                env = self.env_factory()
                obs, _info = env.reset(seed=row, row_index=row, evaluation=evaluation)
                key = obs if isinstance(obs, str) else json.dumps(obs)
                if key not in rendered:
                    text = self.formatter.prompt_text(obs)
                    rendered[key] = (text, self.tokenizer(text, add_special_tokens=False).input_ids)
                text, ids = rendered[key]
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
                    )
                )
        live = list(range(len(trajs)))
        for turn in range(self.max_turns):
            fits = [i for i in live if len(trajs[i].token_ids) + params.max_new_tokens <= self.max_model_len]
            for i in set(live) - set(fits):
                trajs[i].truncated = True
            live = fits
            if not live:
                break
            completions = engine.generate([trajs[i].token_ids for i in live], replace(params, n=1))
            still = []
            for i, comp in zip(live, completions):
                if self._step(envs[i], trajs[i], comp, turn):
                    still.append(i)
            live = still
        for t in trajs:
            if not t.rewards:  # stopped before its first turn
                t.rewards.append(0.0)
        batch = collate(trajs, self.tokenizer.pad_token_id)
        return RolloutResult(batch, trajs, self._metrics(trajs))

    def _step(self, env: TextEnv, traj: Trajectory, comp: Completion, turn: int) -> bool:
        """Append one generated turn and the env's reply; True while the episode goes on."""
        traj.token_ids += comp.token_ids
        traj.action_turn += [turn] * len(comp.token_ids)
        traj.sampling_logps += comp.logprobs
        text = cast(str, self.tokenizer.decode(comp.token_ids, skip_special_tokens=True))
        traj.completion_text += text
        obs, reward, terminated, truncated, info = _check_step_output(env, env.step(text))
        traj.rewards.append(reward)
        traj.infos.append(info)
        if comp.finish_reason == "length" and not terminated:
            truncated = True
        traj.truncated = traj.truncated or truncated
        if terminated or truncated:
            return False
        ids = self.formatter.observation_ids(obs)
        traj.token_ids += ids
        traj.action_turn += [-1] * len(ids)
        traj.sampling_logps += [0.0] * len(ids)
        return True

    @staticmethod
    def _metrics(trajs: list[Trajectory]) -> dict[str, float]:
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for t in trajs:
            for info in t.infos:
                for k, v in info.items():
                    if isinstance(v, (bool, int, float)) and not isinstance(v, str):
                        sums[k] = sums.get(k, 0.0) + float(v)
                        counts[k] = counts.get(k, 0) + 1
        out = {f"env/{k}": sums[k] / counts[k] for k in sums}
        out["rollout/truncated_frac"] = sum(t.truncated for t in trajs) / max(len(trajs), 1)
        out["rollout/num_turns"] = sum(t.num_turns for t in trajs) / max(len(trajs), 1)
        return out
