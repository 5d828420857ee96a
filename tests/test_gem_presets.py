"""The GEM presets on their embedded models (experiment=gem_guess_number on model=tiny_gem,
experiment=gem_sudoku on model=tiny_sudoku): each model directory loads with the tokenizer it was
trained with, the presets compose and validate whatever the algorithm, and a step plays GEM's game
and moves the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gem", reason="env=gem needs the gem extra: pip install 'rlhf_lightning[gem]'")

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlhf_lightning.config import ASSETS
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config, fit_steps, spy_collect, trainable_snapshot

GEM_MODEL = ASSETS / "tiny_gem"
SUDOKU_MODEL = ASSETS / "tiny_sudoku"
PRESETS = {  # experiment: (GEM id, GEM's own turn limit, model, env.max_model_len, env.history)
    "gem_sudoku": ("game:Sudoku-v0-easy", 15, "tiny_sudoku", 640, "last"),
    "gem_guess_number": ("game:GuessTheNumber-v0-easy", 4, "tiny_gem", 2560, "full"),
}
SAMPLE = (
    "You are playing A simple version of Sudoku.\nHere is the current board layout:\n   C1 C2   C3 C4  \n"
    "R1  .  2 |  3  .\nEnter your move.<|im_end|>\n<|im_start|>assistant\n\\boxed{1 1 4}ü 12 345"
)


def test_model_dir_loads_with_its_own_tokenizer_and_holds_a_whole_episode():
    auto = AutoTokenizer.from_pretrained(GEM_MODEL)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(GEM_MODEL / "tokenizer.json"))
    for text in (SAMPLE, "At turn 3, you guessed 7, and the target number is lower than 7.\n\\boxed{5}"):
        assert auto(text).input_ids == fast(text).input_ids
        assert auto.decode(auto(text).input_ids) == text
    config = json.loads((GEM_MODEL / "config.json").read_text())
    assert config["vocab_size"] == len(auto) and config["max_position_embeddings"] >= 2560
    info = json.loads((GEM_MODEL / "build_info.json").read_text())
    assert info["built_with"].startswith("scripts/build_tiny_gem_model.py")
    assert sum(f.stat().st_size for f in GEM_MODEL.iterdir()) < 8 << 20  # a few MB


def test_sudoku_model_reads_every_cell_as_one_token():
    tok = AutoTokenizer.from_pretrained(SUDOKU_MODEL)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(SUDOKU_MODEL / "tokenizer.json"))
    row = "R1  .  2 |  3  .\n"
    assert tok(row).input_ids == fast(row).input_ids and tok.decode(tok(row).input_ids) == row
    cells = [tok.convert_tokens_to_ids(c) for c in ("  .", "  1", "  2", "  3", "  4")]
    assert tok.unk_token_id not in cells and len(set(cells)) == 5
    ids = tok(row, add_special_tokens=False).input_ids
    assert sum(i in cells for i in ids) == 4  # the row's four cells, one token each
    config = json.loads((SUDOKU_MODEL / "config.json").read_text())
    assert config["vocab_size"] >= len(tok) and config["max_position_embeddings"] >= 640
    info = json.loads((SUDOKU_MODEL / "build_info.json").read_text())
    assert info["built_with"].startswith("scripts/build_tiny_sudoku_model.py")
    assert sum(f.stat().st_size for f in SUDOKU_MODEL.iterdir()) < 8 << 20


@pytest.mark.parametrize("algo", ["grpo", "cispo", "ppo"])
@pytest.mark.parametrize("experiment", sorted(PRESETS))
def test_gem_presets_compose_and_validate(experiment, algo):
    cfg = compose_config([f"experiment={experiment}", f"algo={algo}"], output_dir=Path("/tmp/unused"))
    validate(cfg)
    env_id, turns, model, max_len, history = PRESETS[experiment]
    assert cfg.model.path == str(ASSETS / model) and cfg.model.name == model
    assert (cfg.name, cfg.env._target_, cfg.env.kwargs.id, cfg.algo.name) == (
        experiment,
        "rlhf_lightning.envs.gem.GemEnv",
        env_id,
        algo,
    )
    assert cfg.env.max_turns == turns and cfg.env.max_model_len == max_len and cfg.env.history == history
    assert cfg.algo.lr == 2e-3 and cfg.algo.prompts_per_step * cfg.algo.group_size <= 64
    if algo == "ppo":
        assert cfg.algo.advantage_granularity == "turn"
    if experiment == "gem_sudoku":  # each batch reused: 4 optimizer steps of 8 episodes
        assert cfg.algo.prompts_per_step * cfg.algo.group_size == 4 * cfg.algo.mini_batch_size
        assert algo == "ppo" or cfg.algo.advantage.name == "gigpo"  # per-move credit (PPO: its critic's)


def test_real_model_override_keeps_the_game():
    cfg = compose_config(["experiment=gem_sudoku", "model=qwen0.5b"], output_dir=Path("/tmp/unused"))
    assert cfg.model.name == "qwen0.5b" and cfg.env.kwargs.id == "game:Sudoku-v0-easy"
    assert cfg.algo.lr != 2e-3  # tuned/tiny_sudoku applies to model=tiny_sudoku only


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(PRESETS))
def test_two_steps_play_gem_and_move_the_weights(tmp_path, experiment):
    cfg = compose_config(
        [
            f"experiment={experiment}",
            "algo=cispo",
            "algo.prompts_per_step=2",
            "algo.group_size=4",
            "num_threads=1",
            "trainer.enable_progress_bar=false",
        ],
        output_dir=tmp_path / "run",
    )
    results, initial = [], {}

    def hook(module):
        initial.update(trainable_snapshot(module))
        spy_collect(module, results)

    module, trainer = fit_steps(cfg, tmp_path, steps=2, module_hook=hook)
    assert trainer.global_step == 2 and len(results) == 2 and initial
    for result in results:
        assert len(result.trajectories) == 8
        turns = [i for t in result.trajectories for i in t.infos]
        assert result.metrics["env/valid_move"] == pytest.approx(
            sum(i["valid_move"] for i in turns) / len(turns)
        )
        for t in result.trajectories:
            assert t.task_info["gem_seed"] < 100_000 and 1 <= t.num_turns <= PRESETS[experiment][1]
            assert max(t.segment_lengths()) <= PRESETS[experiment][3]
    # A group (4 contiguous episodes of one row) whose returns differ has non-zero advantages.
    returns = [[sum(t.rewards) for t in r.trajectories] for r in results]
    learned = any(len(set(ret[g : g + 4])) > 1 for ret in returns for g in range(0, 8, 4))
    moved = any(not torch.equal(p, initial[n]) for n, p in module.policy.named_parameters() if n in initial)
    assert moved or not learned
