"""A rollout module calls its own hooks (``on_phase``, ``on_rollout_end``) on the callbacks that
subclass ``RolloutHooks``, by type: a callback that merely has a method of that name is not one."""

from __future__ import annotations

import types

import lightning as L

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.callbacks.progress import StepProgressBar
from rlhf_lightning.rollout.engines.callback import RolloutEngineCallback
from rlhf_lightning.rollout.hooks import RolloutHooks, hook_callbacks


class Recorder(RolloutHooks, L.Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_phase(self, trainer, pl_module, text) -> None:
        self.calls.append(("phase", text))

    def on_rollout_end(self, trainer, pl_module) -> None:
        self.calls.append(("rollout_end",))


class LooksAlike(L.Callback):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_phase(self, trainer, pl_module, text) -> None:
        self.calls.append(("phase", text))


def module_with(callbacks: list) -> types.SimpleNamespace:
    trainer = types.SimpleNamespace(callbacks=callbacks)
    fake = types.SimpleNamespace(_trainer=trainer, trainer=trainer)
    for name in ("report_phase", "rollouts_done"):
        setattr(fake, name, types.MethodType(getattr(RolloutModule, name), fake))
    return fake


def test_hooks_reach_rollout_hook_callbacks_only():
    rec, alike = Recorder(), LooksAlike()
    m = module_with([alike, rec])
    m.report_phase("update 1/2")
    m.rollouts_done()
    assert rec.calls == [("phase", "update 1/2"), ("rollout_end",)]
    assert alike.calls == []


def test_the_packages_own_callbacks_take_the_hooks():
    assert issubclass(StepProgressBar, RolloutHooks) and issubclass(RolloutEngineCallback, RolloutHooks)
    assert hook_callbacks(types.SimpleNamespace(callbacks=[])) == [] and hook_callbacks(None) == []
