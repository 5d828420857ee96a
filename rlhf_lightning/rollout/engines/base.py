"""The rollout-engine contract: token ids in, token ids and sampled-token log-probs out."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from rlhf_lightning.records.sampling import Completion, SamplingParams


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
