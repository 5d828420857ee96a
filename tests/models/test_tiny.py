from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rlhf_lightning.envs.arithmetic import make_problem


def test_auto_and_fast_tokenizer_give_identical_ids(tiny_path):
    """transformers rebuilds a Qwen2Tokenizer for model_type=qwen2: it must not change our ids."""
    auto = AutoTokenizer.from_pretrained(tiny_path)
    fast = PreTrainedTokenizerFast.from_pretrained(tiny_path)
    texts = [make_problem(0, i, i % 2 == 0, 10, 99).question for i in range(50)]
    texts += ["<|im_start|>user\nWhat is 1234 + 56?<|im_end|>\n", "  spaces\n\nand 3.14159, -42"]
    for text in texts:
        assert auto(text).input_ids == fast(text).input_ids


def test_digits_are_single_tokens_and_chat_template(tiny_tokenizer):
    ids = tiny_tokenizer("12345", add_special_tokens=False).input_ids
    assert len(ids) == 5
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.eos_token == "<|im_end|>" and tiny_tokenizer.pad_token == "<|endoftext|>"


def test_shipped_checkpoint_is_small_and_partially_trained(tiny_path, tiny_model):
    size = sum(f.stat().st_size for f in Path(tiny_path).iterdir())
    assert size < 8 * 2**20
    n = sum(p.numel() for p in tiny_model.parameters())
    assert 0.5e6 < n < 2e6
    info = json.loads((Path(tiny_path) / "build_info.json").read_text())
    assert 0.15 <= info["eval_accuracy_sampled_t1"] <= 0.45
