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


@runtime_checkable
class Sampler(Protocol):
    """What the rollout harness needs of an engine: batched generation."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@runtime_checkable
class AdapterSampler(Protocol):
    """An engine that samples several LoRA adapters of one base in one call: ``adapters[i]``
    is prompt i's adapter, by name (e.g. a population's members); None: the active adapter.
    Each row gives what its adapter gives alone. Both engines are one."""

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, adapters: list[str] | None = None
    ) -> list[Completion]: ...


@runtime_checkable
class RolloutEngine(Sampler, Protocol):
    """A generation engine as the module, its evaluation, the engine callback and the population
    drive it; every method is called directly (an engine without a use for one makes it a no-op).

    - ``bind_rank(rank, world_size, local_rank)``: the process's place in the run, once the
      trainer has set up its processes and before the engine starts.
    - ``wake`` / ``sleep``: around each generation phase (free memory while the trainer works).
    - ``sync_weights(model)``: push the trainable weights now; ``ensure_synced(policy, version)``
      pushes them unless ``version`` (optimizer steps taken) was pushed already, and
      ``invalidate()`` forgets the pushed version (the policy's weights were swapped, e.g. for
      another population member), so the next ``ensure_synced`` pushes.
    - ``shutdown``: free everything at the end of the fit or on an exception.
    """

    def bind_rank(self, rank: int, world_size: int, local_rank: int) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def sync_weights(self, model: nn.Module) -> None: ...

    def ensure_synced(self, policy: nn.Module, version: int) -> None: ...

    def invalidate(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineBase:
    """No-op lifecycle methods of :class:`RolloutEngine`, for an engine that samples the trainer's
    live module (the HF engine) or one written for a test: subclass it and define ``generate``."""

    def bind_rank(self, rank: int, world_size: int, local_rank: int) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def sync_weights(self, model: nn.Module) -> None:
        pass

    def ensure_synced(self, policy: nn.Module, version: int) -> None:
        pass

    def invalidate(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
