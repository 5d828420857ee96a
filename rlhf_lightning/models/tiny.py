"""The offline tiny model: a byte-level BPE tokenizer and a ~1M-parameter Qwen2-style LM.

Everything here runs without the Hugging Face Hub. ``scripts/build_tiny_model.py`` uses it to
build the warm-started checkpoint shipped in ``rlhf_lightning/assets/tiny_arithmetic``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlhf_lightning.config import ASSETS

TINY_MODEL_DIR = ASSETS / "tiny_arithmetic"

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2's pre-tokenizer pattern: every digit is its own pre-token, so numbers are digit
# sequences (what lets a tiny model learn carries). Using Qwen2's pattern also keeps
# AutoTokenizer (which rebuilds a Qwen2Tokenizer for model_type=qwen2) identical to ours.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` (in memory, well under a second)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=IM_END, padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    vocab_size: int,
    hidden_size: int = 128,
    intermediate_size: int = 512,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    pad_token_id: int = 0,
    eos_token_id: int = 2,
) -> Qwen2ForCausalLM:
    """A Qwen2-architecture causal LM (tied embeddings, head_dim 32) of about 1M parameters."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


def save_untrained(tokenizer: PreTrainedTokenizerFast, directory: Path) -> Qwen2ForCausalLM:
    """A random tiny model sized to ``tokenizer`` (its pad and eos ids set for generation too),
    saved with the tokenizer in ``directory`` like any local model, ready for SFT."""
    model = build_tiny_model(
        len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}")
    return model
