"""Step many envs at once, each with a time limit: one slow env (or tool) no longer serialises
a turn of the batch.

``env.concurrency`` workers step the live episodes of a turn; results come back in episode
order, so trajectories are the same as stepping them one by one (envs must not share mutable
state, e.g. the global ``random`` stream: each env draws from its own seeded generator).
``env.step_timeout_s`` cuts a step that takes longer: the step runs in a daemon thread that is
abandoned (Python cannot kill a thread), and the episode gets a :class:`StepTimeout` instead of
an output, handled like an exception from ``step`` (``env.on_reward_error``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


class StepTimeout(TimeoutError):
    """``env.step`` did not return within ``env.step_timeout_s``."""


@dataclass
class StepOutcome:
    """What one ``env.step`` call gave: its output, or the exception it raised (or a timeout)."""

    output: Any = None
    error: BaseException | None = None


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None) -> StepOutcome:
    """``fn()`` with a time limit (None: none). Exceptions are returned, not raised."""
    if timeout_s is None:
        try:
            return StepOutcome(output=fn())
        except Exception as err:
            return StepOutcome(error=err)
    box: list[StepOutcome] = []

    def target() -> None:
        try:
            box.append(StepOutcome(output=fn()))
        except BaseException as err:  # delivered to the caller, whatever it is
            box.append(StepOutcome(error=err))

    worker = threading.Thread(target=target, daemon=True, name="env-step")
    worker.start()
    worker.join(timeout_s)
    if not box:
        return StepOutcome(error=StepTimeout(f"did not return within {timeout_s:g} s"))
    return box[0]


class EnvStepper:
    """Runs ``step(action)`` for a batch of envs: serially (``concurrency=1``, no timeout: plain
    calls, exactly as before), or on ``concurrency`` worker threads, each step with its own time
    limit."""

    def __init__(self, concurrency: int = 1, timeout_s: float | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"env.concurrency must be at least 1, got {concurrency}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"env.step_timeout_s must be > 0 seconds or null, got {timeout_s}")
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self._pool: ThreadPoolExecutor | None = None

    def step_all(self, envs: Sequence[Any], actions: Sequence[str]) -> list[StepOutcome]:
        """One outcome per env, in order."""
        calls = [(lambda env=env, a=a: env.step(a)) for env, a in zip(envs, actions, strict=True)]
        if self.concurrency == 1 or len(calls) <= 1:
            return [call_with_timeout(c, self.timeout_s) for c in calls]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="env-stepper")
        return list(self._pool.map(lambda c: call_with_timeout(c, self.timeout_s), calls))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
