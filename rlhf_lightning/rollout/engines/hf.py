"""Generation with the policy itself through transformers' ``generate`` (the CPU default).

Sampling is specified by :class:`SamplingParams` alone. ``generate`` fills every field a
``GenerationConfig`` leaves unset from the checkpoint's own ``generation_config`` (Qwen2.5-Instruct
ships ``repetition_penalty=1.05``, ``top_k=20``, ...), so the engine hides that config for the call
and applies every logits transform itself, in vLLM's order (repetition penalty, temperature, min-p,
top-k, top-p): both engines sample the same distribution and return the same log-prob kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_lightning.models.mixed_lora import grouped_mixed_batches
from rlhf_lightning.models.prompt_sharing import cache_kwarg, output_cache
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.engines.base import EngineBase
from rlhf_lightning.rollout.engines.kv_reuse import TurnCache, prefill_shared


class HFEngine(EngineBase):
    """Samples from the live policy module, so there are no weights to sync.

    Args:
        model_fn: returns the model to sample from (the PEFT-wrapped policy), read at every
            call so the engine always samples the current weights.
        pad_token_id: left-padding id for batched prompts.
        eos_token_ids: ids that end a completion (included in it).
        max_batch_size: prompts x n per ``generate`` call (bounds memory); None: all at once.
        share_prefill: run the prompt forward once per distinct prompt and copy its KV cache to
            every sample of that prompt (group members share their prompt): same samples, a
            fraction of the prefill cost.
        tokenizer: decodes completions to match ``SamplingParams.stop`` strings; required only
            when stop strings are used.
        reuse_turn_cache: inside :meth:`turn_session`, a call that continues the previous call's rows
            (the next turn of the same episodes) runs only their new tokens on the previous
            call's KV cache (:mod:`~rlhf_lightning.rollout.engines.kv_reuse`).
    """

    def __init__(
        self,
        model_fn: Callable[[], Any],
        pad_token_id: int,
        eos_token_ids: list[int],
        max_batch_size: int | None = None,
        share_prefill: bool = True,
        tokenizer: Any = None,
        reuse_turn_cache: bool = True,
    ) -> None:
        self.model_fn = model_fn
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.share_prefill = share_prefill
        self.tokenizer = tokenizer
        self.reuse_turn_cache = reuse_turn_cache
        self.turn_cache: TurnCache | None = None  # set inside turn_session()

    @contextmanager
    def turn_session(self) -> Iterator[TurnCache | None]:
        """The calls inside are the turns of one batch of episodes (the harness opens it with
        ``env.history=full``): each reuses the KV cache of the call before where its rows continue
        that call's rows. The cache is dropped on exit. Yields the :class:`TurnCache` (None when
        ``reuse_turn_cache`` is off)."""
        self.turn_cache = TurnCache() if self.reuse_turn_cache else None
        try:
            yield self.turn_cache
        finally:
            self.turn_cache = None

    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams,
        adapters: list[str] | None = None,
    ) -> list[Completion]:
        """``params.n`` completions of each prompt, prompt-major. ``adapters``: the LoRA adapter of
        each prompt (e.g. a population's members), all sampled in one batch, each row under its
        own adapter (PEFT's mixed-adapter batches; by slices when each adapter's prompts are
        contiguous, :mod:`~rlhf_lightning.models.mixed_lora`); None: the model's active adapter."""
        if adapters is not None and len(adapters) != len(prompt_token_ids):
            raise ValueError(
                f"HFEngine: {len(adapters)} adapters for {len(prompt_token_ids)} prompts (one per prompt)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"HFEngine: stop strings {list(params.stop)} need a tokenizer to decode completions; "
                "build the engine with HFEngine(..., tokenizer=tokenizer)"
            )
        rows = [ids for ids in prompt_token_ids for _ in range(params.n)]
        index = [i for i in range(len(prompt_token_ids)) for _ in range(params.n)]
        names = [adapters[i] for i in index] if adapters is not None else None
        size = self.max_batch_size or max(len(rows), 1)
        if self.turn_cache is not None and len(rows) > size:
            self.turn_cache.last = None  # split calls run from scratch (one cache per call)
        out: list[Completion] = []
        for s in range(0, len(rows), size):
            chunk = names[s : s + size] if names is not None else None
            out.extend(self._generate_batch(rows[s : s + size], index[s : s + size], params, chunk))
        return out

    def _generate_batch(
        self,
        rows: list[list[int]],
        index: list[int],
        params: SamplingParams,
        adapters: list[str] | None = None,
    ) -> list[Completion]:
        model = self.model_fn()
        per_row = {"adapter_names": adapters} if adapters is not None else {}
        device = next(model.parameters()).device
        stop_ids = self.eos_token_ids + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        # The repetition penalty reads each row's left padding: it takes the left-padded layout.
        plain = params.repetition_penalty != 1.0
        turns = self.turn_cache if not plain else None
        grouped = grouped_mixed_batches() if adapters is not None else nullcontext()
        with _eval_mode(model), _checkpoint_generation_config_hidden(model), grouped:
            # The prompts, laid out with a KV cache for all but their last column: the last
            # call's (the next turn of the same episodes), or their shared parts run once
            # (prefill_shared); else left-padded, no cache.
            laid = turns.plan(rows, adapters, self.pad_token_id) if turns is not None else None
            if laid is None and self.share_prefill:
                laid = prefill_shared(
                    model, rows, self.pad_token_id, device, adapters, common_prefix=not plain
                )
            if laid is None:
                ids, mask = left_pad(rows, self.pad_token_id, device)
                cache, ran = {}, sum(len(r) for r in rows)
            else:
                ids, mask, past, ran = laid
                ids, mask, cache = ids.to(device), mask.to(device), {cache_kwarg(_base(model)): past}
            if turns is not None:
                turns.prefilled_tokens += ran
            width = ids.shape[1]
            stop_strings = StopStrings(self.tokenizer, params.stop, width, len(rows)) if params.stop else None
            out = model.generate(
                **per_row,
                input_ids=ids,
                attention_mask=mask,
                generation_config=clean_generation_config(params, stop_ids, self.pad_token_id),
                logits_processor=logits_processors(params, pad_lengths=width - mask.sum(-1)),
                stopping_criteria=StoppingCriteriaList([stop_strings] if stop_strings else []),
                **cache,
            )
        new = out.sequences[:, width:]  # (B, S)
        logps = processed_logprobs(out.scores, new)  # (B, S)
        ends: list[int | None] = list(stop_strings.ended_at) if stop_strings else [None] * len(rows)
        lengths, stopped = completion_ends(new, stop_ids, ends)
        if turns is not None:
            turns.record(rows, mask, out.sequences, lengths, output_cache(out), adapters)
        new_l, logp_l = new.tolist(), logps.tolist()
        return [
            Completion(new_l[i][:n], logp_l[i][:n], "stop" if stopped[i] else "length", index[i])
            for i, n in enumerate(lengths)
        ]


def _base(model: Any) -> Any:
    """The CausalLM under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ---------------------------------------------------------------- sampling configuration
def left_pad(rows: list[list[int]], pad_token_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (the last prompt token sits at the right edge). Shape: (B, W)"""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def clean_generation_config(
    params: SamplingParams, stop_ids: list[int], pad_token_id: int
) -> GenerationConfig:
    """A ``GenerationConfig`` whose own transforms are all off: sampling (or greedy argmax) of the
    scores that :func:`logits_processors` produce, stopping at ``stop_ids`` or the length limit.

    ``top_k=0`` is explicit because ``generate`` would otherwise fill in its global default of 50.
    """
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if not params.greedy else {}
    return GenerationConfig(
        do_sample=not params.greedy,
        num_beams=1,
        num_return_sequences=1,
        repetition_penalty=1.0,
        max_new_tokens=params.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_token_id,
        output_scores=True,  # the processed scores sampled from: their log_softmax is what we return
        return_dict_in_generate=True,
        use_cache=True,
        **sampling,
    )


def logits_processors(params: SamplingParams, pad_lengths: torch.Tensor) -> LogitsProcessorList:
    """The score transforms of ``params`` in vLLM's sampler order: repetition penalty, then (when
    sampling) temperature, min-p, top-k, top-p. Greedy decoding takes the argmax of the penalized
    logits (temperature 1, no filtering), as vLLM does.

    Args:
        pad_lengths: left padding of each row, not part of its prompt. Shape: (B,)
    """
    out = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(params.repetition_penalty, pad_lengths))
    if params.greedy:
        return out
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.min_p > 0.0:
        out.append(MinPLogitsWarper(params.min_p))
    if params.top_k > 0:
        out.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(params.top_p))
    return out


class RepetitionPenalty(LogitsProcessor):
    """vLLM's repetition penalty (CTRL, Keskar et al. 2019): the logit of every token id that occurs
    in the prompt or the completion so far is divided by ``penalty`` if positive, else multiplied.

    Unlike transformers' own processor, left padding does not count as "seen": the pad id is
    penalized only where it really occurs, as in vLLM, which never sees padding.

    Args:
        penalty: > 0; 1.0 is a no-op.
        pad_lengths: left padding of each row. Shape: (B,)
    """

    def __init__(self, penalty: float, pad_lengths: torch.Tensor) -> None:
        self.penalty = penalty
        self.pad_lengths = pad_lengths

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids: (B, L) prompt + completion so far; scores: (B, V) -> (B, V)"""
        b, length = input_ids.shape
        vocab = scores.shape[-1]
        real = torch.arange(length, device=input_ids.device)[None, :] >= self.pad_lengths[:, None]
        ids = torch.where(real, input_ids, vocab).clamp(max=vocab)  # padding -> a dropped column
        seen = torch.zeros(b, vocab + 1, dtype=torch.bool, device=scores.device)
        seen = seen.scatter_(1, ids, True)[:, :vocab]
        penalized = torch.where(scores > 0, scores / self.penalty, scores * self.penalty)
        return torch.where(seen, penalized, scores)


class StopStrings(StoppingCriteria):
    """Ends a row once its completion text contains a stop string, with vLLM's rule: anywhere in
    the decoded completion (prompt excluded, special tokens skipped), checked after every token,
    so the row ends on the token that completes the string. Records that length per row.

    Only the last ``window`` tokens are decoded each step: a stop string of b UTF-8 bytes spans at
    most b tokens that decode to text (byte-level BPE, SentencePiece byte fallback), plus two of
    leading context. This costs one host sync and one small batch decode per step.

    Args:
        tokenizer: decodes token ids.
        stop: the stop strings.
        prompt_width: columns of (left-padded) prompt before the first generated token.
        batch_size: rows.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_width: int, batch_size: int) -> None:
        self.tokenizer, self.stop, self.prompt_width = tokenizer, list(stop), prompt_width
        self.window = max(len(s.encode()) for s in self.stop) + 2
        self.ended_at: list[int | None] = [None] * batch_size  # completion length at the first match

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_width
        tail = input_ids[:, max(self.prompt_width, input_ids.shape[1] - self.window) :]
        texts = self.tokenizer.batch_decode(tail.tolist(), skip_special_tokens=True)
        hit = [any(s in t for s in self.stop) for t in texts]
        for i, h in enumerate(hit):
            if h and self.ended_at[i] is None:
                self.ended_at[i] = generated
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)


# ---------------------------------------------------------------- outputs
def processed_logprobs(scores: Sequence[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each sampled token under the distribution it was sampled from.

    Args:
        scores: per step, the processed scores (after penalty, temperature and filtering; -inf
            for filtered tokens). S tensors of shape (B, V)
        tokens: the sampled tokens. Shape: (B, S)

    Returns:
        ``log_softmax(scores)`` at the sampled tokens, float32. Shape: (B, S)
    """
    logps = torch.stack(list(scores), dim=1).float().log_softmax(-1)  # (B, S, V)
    return logps.gather(-1, tokens[..., None]).squeeze(-1)


def completion_ends(
    tokens: torch.Tensor, stop_ids: list[int], string_ends: list[int | None]
) -> tuple[list[int], list[bool]]:
    """Length and stop flag of each completion: through its first stop token or the token that
    completed a stop string, whichever comes first; else all S tokens.

    Args:
        tokens: generated tokens; rows that stopped early are padded after their end. Shape: (B, S)
        stop_ids: token ids that end a completion (kept in it).
        string_ends: per row, the length at which a stop string was completed, or None.
    """
    width = tokens.shape[1]
    is_stop = torch.isin(tokens, torch.tensor(stop_ids, device=tokens.device))
    has_stop = is_stop.any(-1)
    first = torch.where(has_stop, is_stop.int().argmax(-1) + 1, width).tolist()
    ends = [min(f, width if s is None else s) for f, s in zip(first, string_ends)]
    stopped = [t or s is not None for t, s in zip(has_stop.tolist(), string_ends)]
    return ends, stopped


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextmanager
def _checkpoint_generation_config_hidden(model: Any) -> Iterator[None]:
    """Give the model a blank ``generation_config`` for the call: ``generate`` fills every field our
    config leaves unset (``suppress_tokens``, ``no_repeat_ngram_size``, ...) from it."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = lm.generation_config
    lm.generation_config = GenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved
