"""``env=verifiers`` in the worker process: the environment loaded once per process and kept
serving, one rollout per call (:func:`run_episode`, what
:meth:`~rlhf_lightning.envs.verifiers.VerifiersEnv.worker_call` hands the runner), and the
helpers the run's process shares (loading a taskset, a task's prompt).

``verifiers.v1`` is imported at the top: a worker imports the call's module before the call's
deadline starts (:mod:`rlhf_lightning.runtime.workers`), so its ~5 s import does not count
against ``env.step_timeout_s``; loading the environment and starting its tool servers, in a
worker's first episode, does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import verifiers.v1 as vf

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.verifiers_chat import HARNESS_ID, register

API_KEY_VAR = "RLHF_LIGHTNING_VERIFIERS_KEY"  # set to a dummy value in the worker: our endpoint needs none
MODEL_NAME = "policy"


class VerifiersRolloutError(RuntimeError):
    """verifiers marked a rollout failed; the message is its own error text."""


def taskset_tasks(taskset_id: str, args: dict[str, Any], max_tasks: int | None) -> list[Any]:
    """The tasks of ``taskset_id`` loaded with ``args`` (its first ``max_tasks``)."""
    config = vf.taskset_config_type(taskset_id).model_validate({**args, "id": taskset_id})
    taskset = vf.load_taskset(config)
    if max_tasks is not None:
        taskset = taskset.take(max_tasks)
    elif not taskset.bounded:
        raise ConfigError("env.kwargs.max_tasks", None, f"a number: the taskset of {taskset_id} is infinite")
    return list(taskset)


def question(data: Any) -> str | list[dict[str, Any]]:
    """A task's prompt as the run's formatter takes it (the trajectory of an episode that made
    no model call, and the logged prompt text)."""
    prompt = data.prompt
    messages = (
        [{"role": "user", "content": prompt or ""}]
        if prompt is None or isinstance(prompt, str)
        else [m.model_dump(mode="json", exclude_none=True) for m in prompt]
    )
    if data.system_prompt:
        messages = [{"role": "system", "content": data.system_prompt}, *messages]
    if len(messages) == 1 and messages[0]["role"] == "user" and isinstance(messages[0]["content"], str):
        return str(messages[0]["content"])
    return messages


class _Loaded:
    """One worker's verifiers environment, serving on its own event loop between episodes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        register()
        os.environ.setdefault(API_KEY_VAR, "rlhf-lightning")
        self.spec = spec
        self.loop = asyncio.new_event_loop()
        self.env = vf.load_environment(vf.resolve_env_config(self.env_config()))
        train = self.env.taskset if spec["max_tasks"] is None else self.env.taskset.take(spec["max_tasks"])
        self.tasks = {"args": {t.data.idx: t for t in train}}
        if spec["eval_args"] is not None:
            self.tasks["eval_args"] = {
                t.data.idx: t for t in taskset_tasks(spec["id"], spec["eval_args"], spec["max_tasks"])
            }
        self.stack = contextlib.AsyncExitStack()
        self.loop.run_until_complete(self.stack.enter_async_context(self.env.serving()))

    def env_config(self) -> dict[str, Any]:
        """The environment's config: its taskset, and every agent seat on the local subprocess
        runtime with the harness the spec asks (:mod:`rlhf_lightning.envs.verifiers`)."""
        spec = self.spec
        cls = vf.env_config_type(spec["id"])
        bundled = vf.default_harness_id(spec["id"]) == spec["id"]
        harness = spec["harness"] or (None if bundled else HARNESS_ID)
        roles: dict[str, Any] = {}
        for name, field in cls.model_fields.items():
            if isinstance(field.default, vf.AgentConfig):
                role: dict[str, Any] = {"runtime": {"type": "subprocess"}, "max_turns": spec["max_turns"]}
                if field.default.harness is None and harness is not None:
                    role["harness"] = {"id": harness}
                roles[name] = role
        return {"taskset": {**spec["args"], "id": spec["id"]}, **roles}

    def play(self, base_url: str, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
        t = self.tasks[task["split"]].get(task["idx"])
        if t is None or t.key != task["key"]:
            raise VerifiersRolloutError(
                f"task {task['idx']} of {self.spec['id']} differs in this worker (its taskset does not load the same way twice)"
            )
        ctx = vf.ModelContext(
            model=MODEL_NAME, client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        )
        episode = self.loop.run_until_complete(self.env.run_episode(t, ctx))
        errors = [*episode.errors, *(e for tr in episode.traces for e in tr.errors)]
        if not episode.ok or errors or not episode.traces:
            text = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
            raise VerifiersRolloutError(
                f"verifiers marked the rollout failed (ok={episode.ok}): {text}"[:2000]
            )
        infos: dict[str, float] = {}
        for tr in episode.traces:
            for name, r in tr.rewards.items():
                if r is None:
                    raise VerifiersRolloutError(
                        f"verifiers did not score the reward {name!r} of a finished rollout"
                    )
                infos[name] = infos.get(name, 0.0) + r.score / len(episode.traces)
            for name, v in tr.metrics.items():
                if v is not None:
                    infos[name] = infos.get(name, 0.0) + float(v) / len(episode.traces)
        reward = sum(tr.reward for tr in episode.traces) / len(episode.traces)
        return float(reward), infos


_LOADED: dict[str, _Loaded] = {}


def run_episode(spec: dict[str, Any], base_url: str, task: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """One rollout of ``task`` against ``base_url`` in a worker process: ``(reward, infos)``, or
    :class:`VerifiersRolloutError` with verifiers' error text."""
    key = repr(sorted(spec.items()))
    if key not in _LOADED:
        _LOADED[key] = _Loaded(spec)
    return _LOADED[key].play(base_url, task)
