"""The environment contract: a gym-like text environment.

A dataset of prompts is the one-step case: ``reset`` returns the prompt, the first ``step``
scores the completion and terminates.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

Message = dict[str, str]
Observation = str | list[Message]


@runtime_checkable
class TextEnv(Protocol):
    """Text in, text out. One instance drives one trajectory at a time.

    ``reset`` picks a task (``row_index`` selects a row of the train or eval split; ``seed``
    drives any randomness) and returns the first observation: a user message as a string, or a
    list of chat messages. ``step`` takes the model's reply and returns the next observation,
    the reward for this turn, and whether the episode ended (``terminated``) or was cut
    (``truncated``). ``info`` values that are numbers or booleans are logged as ``env/<key>``.
    """

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[Observation, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]: ...


def num_rows(env: object, evaluation: bool) -> int | None:
    """Rows in an env's train or eval split when the env knows it (dataset-backed envs)."""
    fn = getattr(env, "num_rows", None)
    return int(fn(evaluation)) if callable(fn) else None
