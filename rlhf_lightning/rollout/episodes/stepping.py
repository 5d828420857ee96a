"""Step many envs at once, each with a time limit: one slow env no longer serialises a turn of
the batch, and a step past its limit is stopped, not abandoned.

``env.concurrency`` steps run at once; results come back in episode order, so trajectories are
the same as stepping them one by one. Where they run (``env.step_workers``):

- ``process`` (the default): each step runs in a worker process
  (:class:`~rlhf_lightning.runtime.workers.WorkerPool`, ``env.concurrency`` workers). The env
  travels to the worker pickled and comes back stepped, so envs must be picklable (module-level
  classes; state such as a private RNG travels with them) and cannot share mutable state with
  the trainer. ``env.step_timeout_s`` then stops a step for real: its worker is killed and a
  new one started, the env keeps its state from before the step, and the episode gets a
  :class:`StepTimeout`, handled like an exception from ``step`` (``env.on_reward_error``).
  Nothing of the stopped step keeps running.
- ``thread``: steps run on ``env.concurrency`` threads of this process (for envs that cannot be
  pickled, e.g. ones holding a network client). A thread cannot be stopped, so this mode takes
  no ``env.step_timeout_s``.

With ``env.concurrency=1`` and no time limit steps are plain calls, one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.runtime.workers import CallTimeout, WorkerPool

StepTimeout = CallTimeout  # ``env.step`` did not return within ``env.step_timeout_s``
STEP_WORKERS = ("process", "thread")


@dataclass
class StepOutcome:
    """What one ``env.step`` call gave: its output, or the exception it raised (or a timeout),
    and the env after the step (the same object, or the copy a worker stepped)."""

    output: Any = None
    error: BaseException | None = None
    env: Any = None


def step_env(env: Any, action: str) -> tuple[Any, Any]:
    """``env.step(action)`` in a worker: the stepped env travels back with the output."""
    return env, env.step(action)


def _step_here(env: Any, action: str) -> StepOutcome:
    try:
        return StepOutcome(output=env.step(action), env=env)
    except Exception as err:
        return StepOutcome(error=err, env=env)


class EnvStepper:
    """Runs ``step(action)`` for a batch of envs (see the module docstring).

    Args:
        concurrency: steps at once (threads, or worker processes).
        timeout_s: a step's time limit (None: none); needs ``workers="process"``.
        workers: ``process`` or ``thread``.
    """

    def __init__(
        self, concurrency: int = 1, timeout_s: float | None = None, workers: str = "process"
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"env.concurrency must be at least 1, got {concurrency}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"env.step_timeout_s must be > 0 seconds or null, got {timeout_s}")
        if workers not in STEP_WORKERS:
            raise ValueError(f"env.step_workers must be one of {', '.join(STEP_WORKERS)}, got {workers!r}")
        if workers == "thread" and timeout_s is not None:
            raise ValueError(
                f"env.step_timeout_s={timeout_s} needs env.step_workers=process: a step on a thread "
                "cannot be stopped (set env.step_timeout_s=null to step on threads)"
            )
        self.concurrency, self.timeout_s, self.workers = concurrency, timeout_s, workers
        self._threads: ThreadPoolExecutor | None = None
        self._pool: WorkerPool | None = None

    @property
    def in_processes(self) -> bool:
        return self.workers == "process" and (self.concurrency > 1 or self.timeout_s is not None)

    def step_all(self, envs: Sequence[Any], actions: Sequence[str]) -> list[StepOutcome]:
        """One outcome per env, in order."""
        pairs = list(zip(envs, actions, strict=True))
        if not self.in_processes:
            if self.concurrency == 1 or len(pairs) <= 1:
                return [_step_here(env, a) for env, a in pairs]
            return list(self._thread_pool().map(lambda p: _step_here(*p), pairs))
        if self._pool is None:
            self._pool = WorkerPool(self.concurrency)
        pool = self._pool

        def stepped(pair: tuple[Any, str]) -> StepOutcome:
            try:
                outcome = pool.call(step_env, pair, timeout_s=self.timeout_s)
            except TypeError as err:
                raise TypeError(
                    f"{type(pair[0]).__name__} cannot be stepped in a worker process "
                    f"(env.step_workers=process, which env.concurrency > 1 and env.step_timeout_s use): "
                    f"{err}. Define the env class at module level, or set env.step_workers=thread "
                    "(with env.step_timeout_s=null)"
                ) from err
            if outcome.error is not None:
                return StepOutcome(error=outcome.error, env=pair[0])
            env, output = outcome.output
            return StepOutcome(output=output, env=env)

        if len(pairs) <= 1 or self.concurrency == 1:
            return [stepped(p) for p in pairs]
        return list(self._thread_pool().map(stepped, pairs))  # threads that wait on the workers

    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.concurrency, thread_name_prefix="env-stepper")
        return self._threads

    def close(self) -> None:
        """Stop the worker processes and threads (the next step starts new ones)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def check_step_output(env: Any, out: Any) -> tuple[Any, float, bool, bool, dict]:
    """``env.step``'s return value, checked: (observation, reward as a float, terminated,
    truncated, info); a ``TypeError`` names what is wrong."""
    # imported here: a step worker process imports this module, and rewards brings torch (~2 s a
    # fresh worker, which a stopped step's replacement would wait for)
    from rlhf_lightning.rewards import reward_value

    name = f"{type(env).__name__}.step"
    if not isinstance(out, tuple) or len(out) != 5:
        raise TypeError(f"{name} must return (observation, reward, terminated, truncated, info), got {out!r}")
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, (str, list)):
        raise TypeError(
            f"{name} returned observation of type {type(obs).__name__}; expected str or list of messages"
        )
    value = reward_value(reward)
    if value is None:
        raise TypeError(
            f"{name} returned reward={reward!r}; expected a finite real number "
            "(float, int, NumPy scalar or 0-d tensor; not a bool)"
        )
    for fname, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} returned {fname}={flag!r}; expected a bool")
    if not isinstance(info, dict):
        raise TypeError(f"{name} returned info of type {type(info).__name__}; expected a dict")
    return obs, value, terminated, truncated, info
