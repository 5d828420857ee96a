"""``experiment=tool_use`` on the embedded tools model: the model directory loads with one
tokenizer behaviour whichever class reads it and keeps the tools prompt short, the preset
composes and validates for GRPO and PPO with its own budget, and two steps play real calculator
episodes (calls, tool results in their own turn, answers) and move the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.tool_tasks import CalculatorToolEnv
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, env_tools
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config, fit_steps, spy_collect, trainable_snapshot

MODEL = ASSETS / "tiny_tools"
TEMPLATE = ASSETS / "chat_templates" / "tools.jinja"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "35 * 41 - 13"}}</tool_call>'
DIALOGUE = [
    {
        "role": "user",
        "content": "What is 35 * 41 - 13? Use the calculator tool if it helps, then reply with the number.",
    },
    {"role": "assistant", "content": CALL},
    {"role": "tool", "name": "calculator", "content": "1422"},
    {"role": "assistant", "content": "1422"},
]


def tools() -> list[dict]:
    schemas = env_tools(CalculatorToolEnv)
    assert schemas is not None
    return schemas


def test_model_directory_tokenizes_the_same_through_autotokenizer_and_keeps_prompts_short():
    auto = AutoTokenizer.from_pretrained(MODEL)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(MODEL / "tokenizer.json"))
    text = auto.apply_chat_template(DIALOGUE, tools=tools(), tokenize=False)
    probes = [text, "What is 12 * 99 + 7?", "error: malformed tool call (invalid JSON)", "-40 x 3 ü"]
    for s in probes:
        assert auto(s, add_special_tokens=False).input_ids == fast(s, add_special_tokens=False).input_ids, s
    assert auto.chat_template == TEMPLATE.read_text()  # the model's own template is tools.jinja
    assert (auto.eos_token, auto.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # Digits are single tokens (copying numbers is copying tokens).
    assert [auto.decode([i]) for i in auto("1422", add_special_tokens=False).input_ids] == list("1422")
    # The system turn with the calculator's schema and the question: short on this tokenizer.
    prompt = ChatFormatter(auto, tools=tools()).prompt_ids(DIALOGUE[0]["content"])
    assert len(prompt) < 240
    assert len(auto(CALL, add_special_tokens=False).input_ids) <= 32
    # Four turns fit the positions the model has.
    config = AutoConfig.from_pretrained(MODEL)
    assert config.max_position_embeddings >= compose_config(["env=tools"]).env.max_model_len
    info = json.loads((MODEL / "build_info.json").read_text())
    assert info["vocab_size"] == len(auto) == config.vocab_size
    assert {"sft_steps", "seconds", "data", "eval", "history"} <= set(info)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_preset_composes_and_validates_with_its_budget(algo):
    overrides = ["experiment=tool_use"] + ([f"algo={algo}"] if algo != "grpo" else [])
    cfg = compose_config(overrides, output_dir=Path("/tmp/unused"))
    validate(cfg)
    assert (cfg.name, cfg.algo.name, cfg.model.name) == ("tool_use", algo, "tiny_tools")
    assert cfg.model.path == str(MODEL) and cfg.model.chat_template is None  # the model's own
    assert cfg.env._target_ == "rlhf_lightning.envs.tool_tasks.CalculatorToolEnv"
    assert cfg.env.kwargs.parser == "hermes" and cfg.env.max_turns == 4
    assert cfg.rollout.max_new_tokens >= 32  # room for a call
    assert cfg.algo.prompts_per_step * cfg.algo.group_size <= 64
    assert cfg.algo.lr == 2e-3  # conf/tuned/tiny_tools/


def test_a_real_model_keeps_the_algorithm_defaults():
    cfg = compose_config(["experiment=tool_use", "model=qwen0.5b"], output_dir=Path("/tmp/unused"))
    assert cfg.model.name != "tiny_tools" and cfg.algo.lr != 2e-3


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_two_steps_play_calculator_episodes_and_move_the_weights(tmp_path, algo):
    cfg = compose_config(
        [
            "experiment=tool_use",
            f"algo={algo}",
            "algo.prompts_per_step=4",
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
    trajs = [t for r in results for t in r.trajectories]
    assert len(trajs) == 32
    called = [t for t in trajs if t.num_turns >= 2]
    assert called, [t.completion_text for t in trajs]  # the SFT-ed model calls the tool
    for t in called:
        # the calculator's answer came back as a tool message, in its own <tool_response> turn
        assert "<tool_call>" in t.replies[0]
        assert isinstance(t.observations[0], list) and t.observations[0][0]["role"] == "tool"
        assert "calculator" in t.prompt_text
    for t in trajs:
        assert 1 <= t.num_turns <= 4 and len(t.token_ids) <= 1024
        assert t.infos[-1]["correct"] == (sum(t.rewards) == 1.0)  # no shaping by default
    returns = [[sum(t.rewards) for t in r.trajectories] for r in results]
    learned = any(len(set(ret[g : g + 4])) > 1 for ret in returns for g in range(0, 16, 4))
    moved = any(not torch.equal(p, initial[n]) for n, p in module.policy.named_parameters() if n in initial)
    assert moved or not learned
