"""``env=verifiers``: a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment
(0.4.0, its ``verifiers.v1`` API) plays its rollouts against the run's policy endpoint.

    python train.py env=verifiers model=tiny_tools env.kwargs.id=my_env \
        'env.kwargs.args={path: /data/tasks.jsonl}'

``env.kwargs.id`` names an installed verifiers environment: the importable top-level module (or
a package under ``verifiers.v1.tasksets``) that exports its ``Taskset`` subclass in ``__all__``
(``-`` read as ``_``, as verifiers reads it), and may bundle an ``Env`` (multi-agent play) and a
``Harness`` (the program that plays a seat). ``env.kwargs.args`` are its taskset config's fields.

What happens per episode, in a worker process (:func:`run_episode`): the environment is loaded
once per process and kept serving (its interception server, its shared tool servers); one
rollout of the task runs with every agent seat on the local ``subprocess`` runtime and the model
client pointed at the episode's address on the run's endpoint (API key: a dummy value in
:data:`API_KEY_VAR`), never verifiers' hosted defaults (the Prime sandbox runtime and inference
URL). Its reward is the environment's own (its ``@reward`` functions and judges, summed with
their weights; the mean over an episode's traces when it plays several agents); its rewards and
metrics are logged as ``env/<name>``. The run trains on the token ids its endpoint recorded for
every call, never a re-tokenised message log (:mod:`rlhf_lightning.rollout.agents.runner`).

A rollout verifiers marks failed (``ok`` false or errors: a harness that exited non-zero, a
scorer that raised, a timeout) raises with verifiers' error text, even when it carries reward 0
and no rewards: the runner counts it in ``env/reward_errors`` and scores it by
``env.on_reward_error``, never as a silent zero.

The agent program (``env.kwargs.harness``): null (default) plays each seat with the environment's
own bundled harness if it ships one, else with :mod:`~rlhf_lightning.envs.verifiers_chat`, an
in-process chat loop with the task's MCP tools, which needs nothing more on the machine. A
verifiers harness by id (``null``, ``bash``, ...) runs as verifiers runs it: a ``uv`` script
(``uv`` on ``PATH``, ``pip install uv``; its packages fetched from PyPI on first use) in a
subprocess, and ``bash`` lets the model run shell commands on this machine. Tool servers (MCP
``Toolset``) start as ``python -m <their module>`` with this interpreter: their module must be
importable (installed, or on ``PYTHONPATH``).

Tasks: a bounded taskset is read whole (``max_tasks`` bounds an infinite one). Evaluation rows
are never training rows: with ``eval_args`` they are the taskset loaded with those arguments
(its eval split, e.g. ``{split: test}``) and training drops any task whose prompt is among
theirs; without, a fixed pseudo-random ``eval_fraction`` of the tasks is held out
(:func:`~rlhf_lightning.envs.dataset_splits.holdout`, the dataset envs' rule), and a training task
with the same prompt as a held-out one is dropped too.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.agent import AgentEnv
from rlhf_lightning.envs.dataset_splits import holdout

ID_FIELD = "env.kwargs.id"
API_KEY_VAR = "RLHF_LIGHTNING_VERIFIERS_KEY"  # set to a dummy value in the worker: our endpoint needs none
MODEL_NAME = "policy"


class VerifiersRolloutError(RuntimeError):
    """verifiers marked a rollout failed; the message is its own error text."""


def _taskset_tasks(taskset_id: str, args: dict[str, Any], max_tasks: int | None) -> list[Any]:
    """The tasks of ``taskset_id`` loaded with ``args`` (its first ``max_tasks``)."""
    import verifiers.v1 as vf

    config = vf.taskset_config_type(taskset_id).model_validate({**args, "id": taskset_id})
    taskset = vf.load_taskset(config)
    if max_tasks is not None:
        taskset = taskset.take(max_tasks)
    elif not taskset.bounded:
        raise ConfigError("env.kwargs.max_tasks", None, f"a number: the taskset of {taskset_id} is infinite")
    return list(taskset)


def _question(data: Any) -> str | list[dict[str, Any]]:
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


class VerifiersEnv(AgentEnv):
    """The tasks of a verifiers environment, played by it (see the module's docstring).

    Args:
        id: the installed environment (its taskset id).
        args: its taskset config's fields.
        eval_args: the taskset loaded with these for evaluation (its eval split); None: a
            held-out ``eval_fraction`` of the tasks.
        eval_fraction: the share of tasks held out when ``eval_args`` is None.
        max_tasks: read only the first ``max_tasks`` tasks (required for an infinite taskset).
        harness: a verifiers harness id for every seat that pins none; None: the environment's
            bundled harness, else the in-process chat loop.
        max_turns: model calls per agent run (verifiers' ``max_turns``; None: no limit).
        other_calls, batching: as ``env=agent``'s (:class:`~rlhf_lightning.envs.agent.AgentEnv`).
    """

    def __init__(
        self,
        id: str,
        args: dict[str, Any] | None = None,
        eval_args: dict[str, Any] | None = None,
        eval_fraction: float = 0.1,
        max_tasks: int | None = None,
        harness: str | None = None,
        max_turns: int | None = 8,
        other_calls: str = "train",
        batching: str = "rounds",
    ) -> None:
        if other_calls not in ("train", "exclude"):
            raise ConfigError("env.kwargs.other_calls", other_calls, "train or exclude")
        if batching not in ("rounds", "window"):
            raise ConfigError("env.kwargs.batching", batching, "rounds or window")
        if sys.version_info < (3, 11) or importlib.util.find_spec("verifiers") is None:
            raise ConfigError(
                ID_FIELD, id, 'the verifiers extra installed (Python 3.11+): pip install -e ".[verifiers]"'
            )
        for needed in ("openai", "aiohttp"):
            if importlib.util.find_spec(needed) is None:
                raise ConfigError(
                    ID_FIELD,
                    id,
                    f'the verifiers extra installed: pip install -e ".[verifiers]" ({needed} is missing)',
                )
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError("env.kwargs.eval_fraction", eval_fraction, "between 0 and 1 (exclusive)")
        try:
            tasks = _taskset_tasks(id, dict(args or {}), max_tasks)
            evals = _taskset_tasks(id, dict(eval_args), max_tasks) if eval_args is not None else None
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(
                ID_FIELD,
                id,
                f"an installed verifiers environment loading with env.kwargs.args ({type(err).__name__}: {err})"[
                    :600
                ],
            ) from None
        if evals is None:
            if len(tasks) < 2:
                raise ConfigError(
                    ID_FIELD, id, f"a taskset of at least 2 tasks to hold some out (it has {len(tasks)})"
                )
            held = holdout(len(tasks), eval_fraction)
            evals = [t for i, t in enumerate(tasks) if i in held]
            tasks = [t for i, t in enumerate(tasks) if i not in held]
        held_prompts = {json.dumps(_question(t.data), sort_keys=True) for t in evals}
        train = [t for t in tasks if json.dumps(_question(t.data), sort_keys=True) not in held_prompts]
        if not train or not evals:
            raise ConfigError(
                ID_FIELD, id, f"training and evaluation tasks (got {len(train)} and {len(evals)})"
            )
        self.agent = f"verifiers environment {id}"  # how the runner names the episode's player
        self.other_calls, self.batching = other_calls, batching
        self.spec = {
            "id": id,
            "args": dict(args or {}),
            "eval_args": None if eval_args is None else dict(eval_args),
            "max_tasks": max_tasks,
            "harness": harness,
            "max_turns": max_turns,
        }
        split = "eval_args" if eval_args is not None else "args"
        self.rows = {
            False: [(_question(t.data), {"split": "args", "idx": t.data.idx, "key": t.key}) for t in train],
            True: [(_question(t.data), {"split": split, "idx": t.data.idx, "key": t.key}) for t in evals],
        }

    def worker_call(
        self, base_url: str, task: dict[str, Any], timeout_s: float | None
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return run_episode, (self.spec, base_url, task)

    def num_rows(self, evaluation: bool) -> int:
        return len(self.rows[evaluation])

    def task(self, row: int, evaluation: bool) -> tuple[Any, dict[str, Any]]:
        part = self.rows[evaluation]
        question, task = part[row % len(part)]
        return question, dict(task)


# ---------------------------------------------------------------- in the worker process
class _Loaded:
    """One worker's verifiers environment, serving on its own event loop between episodes."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        from rlhf_lightning.envs import verifiers_chat

        verifiers_chat.register()
        os.environ.setdefault(API_KEY_VAR, "rlhf-lightning")
        self.vf, self.spec = vf, spec
        self.loop = asyncio.new_event_loop()
        self.env = vf.load_environment(vf.resolve_env_config(self.env_config()))
        train = self.env.taskset if spec["max_tasks"] is None else self.env.taskset.take(spec["max_tasks"])
        self.tasks = {"args": {t.data.idx: t for t in train}}
        if spec["eval_args"] is not None:
            self.tasks["eval_args"] = {
                t.data.idx: t for t in _taskset_tasks(spec["id"], spec["eval_args"], spec["max_tasks"])
            }
        self.stack = contextlib.AsyncExitStack()
        self.loop.run_until_complete(self.stack.enter_async_context(self.env.serving()))

    def env_config(self) -> dict[str, Any]:
        """The environment's config: its taskset, and every agent seat on the local subprocess
        runtime with the harness the spec asks (see the module's docstring)."""
        from rlhf_lightning.envs.verifiers_chat import HARNESS_ID

        vf, spec = self.vf, self.spec
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
        vf = self.vf
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
