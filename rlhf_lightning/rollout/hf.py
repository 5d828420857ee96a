"""Generation with the policy itself through transformers' ``generate`` (the CPU default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlhf_lightning.models.policy import cache_kwarg, output_cache
from rlhf_lightning.rollout.engine import Completion, SamplingParams


class HFEngine:
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
    """

    def __init__(
        self,
        model_fn: Callable[[], Any],
        pad_token_id: int,
        eos_token_ids: list[int],
        max_batch_size: int | None = None,
        share_prefill: bool = True,
    ) -> None:
        self.model_fn = model_fn
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.share_prefill = share_prefill

    def sleep(self) -> None:  # shares the trainer's weights: nothing to free
        pass

    def wake(self) -> None:
        pass

    def sync_weights(self, model: nn.Module) -> None:  # samples the live module
        pass

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        rows = [ids for ids in prompt_token_ids for _ in range(params.n)]
        index = [i for i in range(len(prompt_token_ids)) for _ in range(params.n)]
        size = self.max_batch_size or max(len(rows), 1)
        out: list[Completion] = []
        for s in range(0, len(rows), size):
            out.extend(self._generate_batch(rows[s : s + size], index[s : s + size], params))
        return out

    def _generate_batch(
        self, rows: list[list[int]], index: list[int], params: SamplingParams
    ) -> list[Completion]:
        model = self.model_fn()
        device = next(model.parameters()).device
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: the last prompt token sits at the right edge
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        stop = self.eos_token_ids + [t for t in params.stop_token_ids if t not in self.eos_token_ids]
        sampling = (
            {"do_sample": False}
            if params.greedy
            else {
                "do_sample": True,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
            }
        )
        ids, mask = ids.to(device), mask.to(device)
        was_training = model.training
        model.eval()
        try:
            cache = self._shared_prefill(model, rows, ids, mask) if self.share_prefill else {}
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=stop,
                pad_token_id=self.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
                **cache,
                **sampling,
            )
        finally:
            model.train(was_training)
        new = out.sequences[:, width:]  # (n, S)
        temperature = 1.0 if params.greedy else params.temperature
        logits = torch.stack(out.logits, dim=1).float() / temperature  # (n, S, V)
        logps = logits.log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)  # (n, S)
        is_stop = torch.isin(new, torch.tensor(stop, device=new.device))
        # Length of each completion: through the first stop token, else all S tokens.
        first_stop = torch.where(is_stop.any(-1), is_stop.int().argmax(-1) + 1, new.shape[1])
        new_l, logp_l, len_l, stopped = (
            new.tolist(),
            logps.tolist(),
            first_stop.tolist(),
            is_stop.any(-1).tolist(),
        )
        return [
            Completion(
                new_l[i][: len_l[i]], logp_l[i][: len_l[i]], "stop" if stopped[i] else "length", index[i]
            )
            for i in range(len(rows))
        ]

    @staticmethod
    def _shared_prefill(
        model: Any, rows: list[list[int]], ids: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, Any]:
        """KV cache of all but the last prompt token, computed once per distinct prompt."""
        first: dict[tuple[int, ...], int] = {}
        owner = [first.setdefault(tuple(r), i) for i, r in enumerate(rows)]
        if len(first) == len(rows) or ids.shape[1] < 2:
            return {}
        uniq = torch.tensor(sorted(first.values()), device=ids.device)
        slot = {i: k for k, i in enumerate(uniq.tolist())}
        expand = torch.tensor([slot[o] for o in owner], device=ids.device)
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        m = mask[uniq, :-1]
        positions = (m.cumsum(-1) - 1).clamp(min=0)
        cache = output_cache(
            lm(input_ids=ids[uniq, :-1], attention_mask=m, position_ids=positions, use_cache=True)
        )
        cache.batch_select_indices(expand)
        return {cache_kwarg(lm): cache}
