"""The multi-turn presets on the embedded chat model: they compose, validate and keep their
budget whatever the algorithm, and a step of ``experiment=guess_number`` plays real multi-turn
episodes whose tokens carry their turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_lightning.config import ASSETS
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config, fit_steps, spy_collect

CHAT_MODEL = ASSETS / "tiny_chat"
PRESETS = {  # experiment: env class
    "tool_calc": "rlhf_lightning.envs.tool_calc.ToolCalcEnv",
    "guess_number": "rlhf_lightning.envs.guess_number.GuessNumberEnv",
}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("experiment", sorted(PRESETS))
def test_multiturn_presets_compose_and_validate(experiment, algo):
    overrides = [f"experiment={experiment}"] + ([f"algo={algo}"] if algo != "grpo" else [])
    cfg = compose_config(overrides, output_dir=Path("/tmp/unused"))
    validate(cfg)
    assert cfg.model.path == str(CHAT_MODEL) and (CHAT_MODEL / "config.json").is_file()
    assert (cfg.name, cfg.env._target_, cfg.algo.name) == (experiment, PRESETS[experiment], algo)
    assert cfg.rollout.max_new_tokens == 16 and cfg.env.max_turns >= 4
    # The preset's budget, not the algorithm's default of 32 prompts per step.
    assert cfg.algo.prompts_per_step * cfg.algo.group_size <= 64


@pytest.mark.slow
def test_guess_number_step_plays_multiturn_episodes_with_consistent_turn_ids(tmp_path):
    cfg = compose_config(
        [
            "experiment=guess_number",
            "algo.prompts_per_step=4",
            "algo.group_size=4",
            "trainer.enable_progress_bar=false",
            "num_threads=1",
        ],
        output_dir=tmp_path / "run",
    )
    results = []

    fit_steps(cfg, tmp_path, steps=1, module_hook=lambda m: spy_collect(m, results))
    assert len(results) == 1
    b, trajs = results[0].batch, results[0].trajectories
    assert len(trajs) == 16
    assert b.num_turns.float().mean() >= 2.0, [t.completion_text for t in trajs]
    for i, t in enumerate(trajs):
        n = t.num_turns
        assert b.num_turns[i] == n and len(t.turn_lengths) == n
        row = b.turn_ids[i]
        generated = row[row >= 0].tolist()
        # Turn ids rise by one from turn to turn, each turn one block of its generated tokens.
        assert generated == sorted(generated)
        assert generated == [k for k in range(n) for _ in range(t.turn_lengths[k])]
        assert torch.equal(b.action_mask[i], row >= 0)
        for k in range(n):
            start = int(b.turn_starts[i, k])
            assert row[start] == k and (start == 0 or row[start - 1] != k)
        assert b.turn_starts[i, n:].eq(-1).all() and b.turn_lengths[i, n:].eq(0).all()
        # Each turn's env reply (an observation, no action) separates it from the next.
        for k in range(1, n):
            assert (row[int(b.turn_starts[i, k]) - 1] == -1).item()
