"""Multi-turn envs and a third-party env (selected only through env._target_) train end to end."""

from __future__ import annotations

import lightning as L
import pytest

from rlhf_lightning.run import build
from tests.conftest import FAST, compose_config, fit_steps


class CountLettersEnv:
    """A third-party env: count the letters of a word, two tries. Knows nothing of rlhf_lightning."""

    def __init__(self, words: str = "cat,horse,owl,tiger", bonus: float = 0.0) -> None:
        self.words, self.bonus = words.split(","), bonus

    def num_rows(self, evaluation: bool) -> int:
        return 8 if evaluation else 64

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.word = self.words[(row_index or 0) % len(self.words)]
        self.tries = 0
        return f"How many letters are in {self.word}?", {}

    def step(self, action):
        self.tries += 1
        ok = str(len(self.word)) in action
        if ok or self.tries >= 2:
            return "", float(ok) + self.bonus, True, False, {"correct": ok}
        return "Try again.", 0.0, False, False, {"correct": False}


def custom_cfg(tmp_path, *extra):
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    return compose_config(
        [*overrides, "env=custom", "env._target_=tests.algorithms.test_env_training.CountLettersEnv", *extra],
        output_dir=tmp_path / "run",
    )


@pytest.mark.slow
def test_third_party_env_selected_by_target_trains(tmp_path):
    cfg = custom_cfg(tmp_path, "+env.kwargs.words='ant,bee,eel'", "env.max_turns=2", "algo.lr=1e-2")
    module, _ = build(cfg, tmp_path)
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    module, trainer = fit_steps(cfg, tmp_path, steps=3)
    assert any(not p.detach().equal(before[n]) for n, p in module.named_parameters() if p.requires_grad)
    assert "env/correct" in trainer.callback_metrics
    assert module.harness.env_factory().words == ["ant", "bee", "eel"]


@pytest.mark.slow
@pytest.mark.parametrize("env", ["guess_number", "sudoku", "tool_calc", "math"])
def test_multi_turn_envs_train_end_to_end(fast_cfg, tmp_path, env):
    overrides = (
        [f"env={env}", "rollout.max_new_tokens=6", "env.max_turns=3"] if env != "math" else ["env=math"]
    )
    cfg = compose_config(
        [o for o in FAST if not o.startswith("env.kwargs")] + overrides, output_dir=tmp_path / "run"
    )
    _, trainer = fit_steps(cfg, tmp_path, steps=2)
    metrics = trainer.callback_metrics
    assert metrics["rollout/num_turns"].item() >= 1
    if env != "math":
        assert metrics["rollout/num_turns"].item() <= 3


def test_eval_pass_at_k(tmp_path):
    cfg = custom_cfg(tmp_path, "eval.num_samples=4", "eval.greedy=false")
    module, dm = build(cfg, tmp_path)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=dm, verbose=False)
    m = trainer.callback_metrics
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/accuracy_sampled"} <= set(m)
    assert m["eval/pass@1"].item() == pytest.approx(m["eval/accuracy_sampled"].item(), abs=1e-6)
    assert m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@4"]
    assert "eval/accuracy_greedy" not in m
