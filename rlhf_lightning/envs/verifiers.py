"""``env=verifiers``: a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment
(0.4.0, its ``verifiers.v1`` API) plays its rollouts against the run's policy endpoint.

    python train.py env=verifiers model=tiny_tools env.kwargs.id=my_env \
        'env.kwargs.args={path: /data/tasks.jsonl}'

``env.kwargs.id`` names an installed verifiers environment: the importable top-level module (or
a package under ``verifiers.v1.tasksets``) that exports its ``Taskset`` subclass in ``__all__``
(``-`` read as ``_``, as verifiers reads it), and may bundle an ``Env`` (multi-agent play) and a
``Harness`` (the program that plays a seat). ``env.kwargs.args`` are its taskset config's fields.

What happens per episode, in a worker process
(:func:`~rlhf_lightning.envs.verifiers_worker.run_episode`): the environment is loaded
once per process and kept serving (its interception server, its shared tool servers); one
rollout of the task runs with every agent seat on the local ``subprocess`` runtime and the model
client pointed at the episode's address on the run's endpoint (API key: a dummy value in
:data:`~rlhf_lightning.envs.verifiers_worker.API_KEY_VAR`), never verifiers' hosted defaults (the Prime sandbox runtime and inference
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

import importlib.util
import json
import sys
from collections.abc import Callable
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.agent import AgentEnv, check_runner_settings, require_extra
from rlhf_lightning.envs.dataset_splits import holdout

ID_FIELD = "env.kwargs.id"


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
        check_runner_settings(other_calls, batching)
        if sys.version_info < (3, 11) or importlib.util.find_spec("verifiers") is None:
            raise ConfigError(
                ID_FIELD, id, 'the verifiers extra installed (Python 3.11+): pip install -e ".[verifiers]"'
            )
        require_extra(ID_FIELD, id, "verifiers")
        if not 0.0 < eval_fraction < 1.0:
            raise ConfigError("env.kwargs.eval_fraction", eval_fraction, "between 0 and 1 (exclusive)")
        from rlhf_lightning.envs.verifiers_worker import question, taskset_tasks

        try:
            tasks = taskset_tasks(id, dict(args or {}), max_tasks)
            evals = taskset_tasks(id, dict(eval_args), max_tasks) if eval_args is not None else None
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
        held_prompts = {json.dumps(question(t.data), sort_keys=True) for t in evals}
        train = [t for t in tasks if json.dumps(question(t.data), sort_keys=True) not in held_prompts]
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
            False: [(question(t.data), {"split": "args", "idx": t.data.idx, "key": t.key}) for t in train],
            True: [(question(t.data), {"split": split, "idx": t.data.idx, "key": t.key}) for t in evals],
        }

    def worker_call(
        self, base_url: str, task: dict[str, Any], timeout_s: float | None
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        from rlhf_lightning.envs.verifiers_worker import run_episode

        return run_episode, (self.spec, base_url, task)

    def num_rows(self, evaluation: bool) -> int:
        return len(self.rows[evaluation])

    def task(self, row: int, evaluation: bool) -> tuple[Any, dict[str, Any]]:
        part = self.rows[evaluation]
        question, task = part[row % len(part)]
        return question, dict(task)
