"""The hooks a rollout module calls on its callbacks beside Lightning's own: a callback that
wants them subclasses :class:`RolloutHooks` (the module calls them on those callbacks only, by
type, never by a method name looked up on any callback)."""

from __future__ import annotations

from typing import Any


class RolloutHooks:
    """No-op hooks; override the ones you need."""

    def on_rollout_end(self, trainer: Any, pl_module: Any) -> None:
        """The step's rollouts are collected, before any training forward (the engine may sleep)."""

    def on_phase(self, trainer: Any, pl_module: Any, text: str) -> None:
        """Where a long training step is (``rollout: turn 2/5, 37 episodes``, ``update 2/4``)."""


def hook_callbacks(trainer: Any) -> list[RolloutHooks]:
    """``trainer``'s callbacks that take the rollout hooks (none without a trainer)."""
    return [cb for cb in getattr(trainer, "callbacks", None) or [] if isinstance(cb, RolloutHooks)]
