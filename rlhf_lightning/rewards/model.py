"""A sequence-classification reward model (``reward=model reward.model_path=DIR``).

It has its own tokenizer and chat template, so it need not share the policy's architecture or
vocabulary: each episode is rendered as ``[prompt messages..., {"role": "assistant", "content":
replies}]`` with the reward model's template (or ``prompt\\nreply`` when it has none), scored in
batches on the trainer's device, and moved back to the CPU between rollouts (``offload``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_lightning.config.errors import ConfigError, check_model_path
from rlhf_lightning.rewards import Episode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelReward:
    """Scores = the reward model's scalar output (``num_labels == 1``) per episode.

    Args:
        path: a local directory or Hub id of an ``AutoModelForSequenceClassification``.
        batch_size: episodes per forward pass.
        max_len: tokens kept per episode (cut from the left, so the reply stays whole).
        normalize: ``none`` or ``batch``: ``score`` returns raw scores either way; with ``batch``
            the training step standardises them over its whole global batch, once (every rank,
            every dynamic-sampling round: ``CombinedReward.finalize``).
        offload: keep the model on the CPU except while scoring.
        dtype: the model's dtype (``float32``, ``bfloat16``, ``float16``).
    """

    name = "model"

    def __init__(
        self,
        path: str,
        batch_size: int = 32,
        max_len: int = 1024,
        normalize: str = "none",
        offload: bool = True,
        dtype: str = "float32",
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if path is None:
            raise ConfigError(
                "reward.model_path", path, "a sequence-classification model directory or Hub id"
            )
        check_model_path("reward.model_path", path)
        if normalize not in ("none", "batch"):
            raise ConfigError("reward.normalize", normalize, "none or batch")
        if dtype not in DTYPES:
            raise ConfigError("reward.model_dtype", dtype, f"one of {', '.join(DTYPES)}")
        if batch_size <= 0 or max_len <= 0:
            raise ConfigError("reward.model_batch_size", batch_size, "positive batch size and max_len")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            fallback = self.tokenizer.eos_token or self.tokenizer.unk_token
            if fallback is None:
                raise ConfigError(
                    "reward.model_path",
                    path,
                    "a reward model whose tokenizer has a pad, eos or unk token (episodes are "
                    "padded into batches); this one has none: set one and save it, e.g. "
                    "tok.add_special_tokens({'pad_token': '[PAD]'}); model.resize_token_embeddings"
                    "(len(tok)); tok.save_pretrained(DIR); model.save_pretrained(DIR)",
                )
            self.tokenizer.pad_token = fallback
        model = AutoModelForSequenceClassification.from_pretrained(
            path, torch_dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        if model.config.num_labels != 1:
            raise ConfigError(
                "reward.model_path",
                path,
                f"a reward model with one output (num_labels=1), not {model.config.num_labels}",
            )
        model.config.pad_token_id = self.tokenizer.pad_token_id  # the last non-pad token is scored
        self.model = model.eval().requires_grad_(False)
        self.path = str(Path(path))
        self.batch_size, self.max_len = batch_size, max_len
        self.normalize, self.offload = normalize, offload

    def text(self, episode: Episode) -> str:
        """One episode as the reward model reads it."""
        reply = "\n".join(episode.replies)
        prompt = episode.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer.chat_template:
            out = self.tokenizer.apply_chat_template(
                [*messages, {"role": "assistant", "content": reply}], tokenize=False
            )
            return str(out)
        return "\n".join(m["content"] for m in messages) + "\n" + reply

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], device: Any) -> list[float]:
        self.model.to(device)
        try:
            texts = [self.text(e) for e in episodes]
            scores = []
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_len,
                    add_special_tokens=not self.tokenizer.chat_template,
                    return_tensors="pt",
                ).to(device)
                scores.append(self.model(**enc).logits[:, 0].float().cpu())
        finally:
            if self.offload:
                self.model.to("cpu")
        out = torch.cat(scores) if scores else torch.zeros(0)
        return out.tolist()  # raw: normalize=batch is applied over the step's global batch
