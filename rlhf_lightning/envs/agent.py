"""``env=agent``: a program of yours drives each episode through an OpenAI-compatible endpoint.

    python train.py env=agent env.kwargs.agent=my_pkg.agents:solve env.kwargs.data.path=tasks.jsonl

The agent is ``async def solve(client, task) -> float | dict``: ``client`` an
``openai.AsyncOpenAI`` bound to the episode's own address on the run's policy endpoint
(:mod:`rlhf_lightning.rollout.agents.endpoint`), ``task`` one row of the dataset (its columns and
``gold``, the extracted answer). It returns the episode's reward, or a dict with ``reward`` and
other numbers (logged as ``env/<key>``; ``correct`` counts for evaluation accuracy). Every call it
makes to the model is recorded token for token and is what the run trains on
(:mod:`rlhf_lightning.rollout.agents.assembly`).

Tasks come from ``env.kwargs.data``: the keyword arguments of
:class:`~rlhf_lightning.envs.dataset.DatasetEnv` (a local file or a Hub dataset, with its rules for
held-out rows: evaluation rows are never training rows).

Agents run in worker processes (``env.concurrency`` at once), each episode under
``env.step_timeout_s`` as a whole: an agent that hangs is killed with its worker, one that raises
or returns a bad value costs its episode (``env.on_reward_error``), never the run.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import math
from collections.abc import Callable
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.dataset import DatasetEnv

AGENT_FIELD = "env.kwargs.agent"


def load_agent(path: str) -> Callable[..., Any]:
    """``module:function`` (or ``module.function``) -> the agent coroutine function."""
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(AGENT_FIELD, path, "module:function, e.g. my_pkg.agents:solve")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            AGENT_FIELD, path, f"an importable async function ({type(err).__name__}: {err})"
        ) from None
    if not asyncio.iscoroutinefunction(fn):
        raise ConfigError(
            AGENT_FIELD, path, "an async function: async def solve(client, task) -> float | dict"
        )
    return fn


def check_runner_settings(other_calls: str, batching: str) -> None:
    """The endpoint runner's own ``env.kwargs`` (``other_calls``, ``batching``), named when bad."""
    if other_calls not in ("train", "exclude"):
        raise ConfigError("env.kwargs.other_calls", other_calls, "train or exclude")
    if batching not in ("rounds", "window"):
        raise ConfigError("env.kwargs.batching", batching, "rounds or window")


def require_extra(
    field: str, value: Any, extra: str, modules: tuple[str, ...] = ("openai", "aiohttp")
) -> None:
    """Refuse ``field=value`` when a module the endpoint's agents need is missing, naming the extra."""
    for needed in modules:
        if importlib.util.find_spec(needed) is None:
            raise ConfigError(
                field,
                value,
                f'the {extra} extra installed: pip install -e ".[{extra}]" ({needed} is missing)',
            )


def check_result(value: Any) -> tuple[float, dict[str, float]]:
    """An agent's return value as (reward, numeric infos); anything else is refused, naming it."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise TypeError(f"the agent returned a dict without 'reward': {sorted(value)}")
        infos = {k: v for k, v in value.items() if k != "reward"}
        bad = {k: v for k, v in infos.items() if not isinstance(v, (bool, int, float))}
        if bad:
            raise TypeError(f"the agent returned non-numeric values: {bad!r}"[:300])
        reward, extra = value["reward"], {k: float(v) for k, v in infos.items()}
    else:
        reward, extra = value, {}
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise TypeError(
            f"the agent must return a finite number or a dict with one as 'reward', got {reward!r}"[:300]
        )
    return float(reward), extra


def run_agent(
    agent: str, base_url: str, task: dict[str, Any], timeout_s: float | None
) -> tuple[float, dict[str, float]]:
    """One episode in a worker process: the agent with an ``AsyncOpenAI`` client on ``base_url``."""
    import openai

    fn = load_agent(agent)

    async def episode() -> Any:
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key="rlhf-lightning", max_retries=0, timeout=timeout_s
        )
        try:
            return await fn(client, task)
        finally:
            await client.close()

    return check_result(asyncio.run(episode()))


class AgentEnv:
    """The tasks of ``env=agent`` and the agent that plays them (see the module's docstring).

    Args:
        agent: ``module:function`` of the agent.
        data: :class:`DatasetEnv`'s keyword arguments (``path``, ``question_key``, ...).
        other_calls: ``train`` (default): calls the agent makes for other purposes (a first
            message unlike its conversation's, e.g. a summariser) are trained on too, as they
            shaped the episode; ``exclude``: served and counted, not trained on.
        batching: how the endpoint batches the agents' calls into engine calls. ``rounds``
            (default): once every running episode has a call waiting, all of them, in a fixed
            order: the engine sees the same batches whatever the timing, so a run repeats exactly
            and lockstep asynchronous rollouts equal synchronous ones; an agent that works long
            between calls (a slow tool) holds its round. ``window``: the calls that arrive within
            a few milliseconds of the first: agents of uneven pace wait less, but the batches (so
            the samples) depend on timing.
    """

    def __init__(
        self, agent: str, data: dict[str, Any], other_calls: str = "train", batching: str = "rounds"
    ) -> None:
        check_runner_settings(other_calls, batching)
        require_extra(AGENT_FIELD, agent, "agent")
        load_agent(agent)  # a bad path fails before any model loads
        self.agent, self.other_calls, self.batching = agent, other_calls, batching
        try:
            self.tasks = DatasetEnv(**dict(data))
        except ConfigError as err:  # the dataset env's fields live under env.kwargs.data here
            field = err.field.replace("env.kwargs.", "env.kwargs.data.", 1)
            raise ConfigError(field, err.value, err.allowed) from None

    def worker_call(
        self, base_url: str, task: dict[str, Any], timeout_s: float | None
    ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """What a worker process runs for one episode: a picklable function and its arguments,
        returning ``(reward, infos)`` (:func:`check_result`'s form). Subclasses that play episodes
        another way (``env=verifiers``) override it."""
        return run_agent, (self.agent, base_url, task, timeout_s)

    def num_rows(self, evaluation: bool) -> int:
        return self.tasks.num_rows(evaluation)

    def task(self, row: int, evaluation: bool) -> tuple[Any, dict[str, Any]]:
        """Row ``row``'s question (as the dataset env renders it) and the task handed to the agent."""
        return self.tasks.reset(row_index=row, evaluation=evaluation)

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> Any:
        return self.task(row_index if row_index is not None else seed or 0, evaluation)

    def step(self, action: str) -> Any:
        raise RuntimeError("env=agent is driven by its agent through the policy endpoint, not stepped")

    def __call__(self) -> AgentEnv:  # its own factory: one task source for the run
        return self

    @classmethod
    def shared_factory(cls, **kwargs: Any) -> AgentEnv:
        return cls(**kwargs)
