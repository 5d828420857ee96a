"""How to sample (:class:`SamplingParams`) and what one sample is (:class:`Completion`): the
records every engine takes and returns, whoever drives the episode."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    stop: tuple[str, ...] = ()  # stop strings
    repetition_penalty: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    # An engine with its own generator (vLLM) seeds prompt i of the call with seed + i, so the
    # call draws the same again (the async producer's regenerated batches); None: the engine's
    # running generator. The HF engine always draws from torch's global generator.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the distribution it was actually
    sampled from: ``log_softmax`` of the processed scores, i.e. the logits after the repetition
    penalty, divided by the temperature, then min-p, top-k and top-p filtered (vLLM's order;
    filtered tokens are -inf). Greedy (T = 0) uses the penalised logits at temperature 1 with
    no filtering. Both engines return this kind (vLLM: ``logprobs_mode="processed_logprobs"``).
    With no penalty and no filtering it equals ``log_softmax(logits / T)``, which the trainer
    recomputes; otherwise the gap shows in ``is/gap_mean`` and truncated importance sampling
    corrects for it.
    """

    token_ids: list[int]
    logprobs: list[float]
    # "stop" (a stop token, kept, or a stop string, ending on the token that completed it) or
    # "length" (cut at max_new_tokens)
    finish_reason: str
    prompt_index: int = 0
    extra: dict = field(default_factory=dict)
