"""The rollout-engine contract: token ids in, token ids and sampled-token log-probs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import nn


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable them.

    ``n`` completions are drawn per prompt; results come back prompt-major
    (prompt 0's n completions, then prompt 1's, ...).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the sampling distribution at
    temperature ``T`` before top-k/top-p filtering (``log_softmax(logits / T)``; T = 1 when
    greedy), which is what the trainer recomputes for importance ratios.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was generated, and is included) or "length"
    prompt_index: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def sync_weights(self, model: nn.Module) -> None: ...
