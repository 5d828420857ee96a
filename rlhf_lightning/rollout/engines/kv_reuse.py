"""The KV cache of one turn, reused by the next turn of the same episodes (HF engine).

With ``env.history=full`` each turn's prompt is the previous turn's prompt and reply plus the new
observation. Re-running that whole prompt every turn costs O(turns^2) prefill per episode; here
the cache ``generate`` returns is kept, and the next call runs only each row's new tokens on top
of it (the observation, and the reply's last token when the cache lacks it).

Rows are matched by content: a new prompt continues the earlier row whose prompt + reply is its
prefix (and whose adapter it has), so the harness's order and its finished episodes need no
bookkeeping. Rows of the earlier call keep their layout: left padding, their reply, then the
columns where they had already stopped (pads that ``generate`` still ran: masked out here). The
new tokens are left-padded into a block after those columns; positions come from the mask, so
every real token sits at the position a fresh prefill would give it. A call where some row
continues nothing (a new episode, a changed adapter) runs from scratch.

Notation:
    B: rows, W: the earlier call's input width, S: tokens it generated, C = W + S - 1: the cache's
    length (the last generated token has no KV yet), N: the widest block of new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_lightning.models.prompt_sharing import cache_kwarg, output_cache


@dataclass
class _Call:
    """What one call leaves for the next."""

    tokens: list[tuple[int, ...]]  # each row's prompt + reply (real tokens only)
    cached: list[int]  # how many of them the cache holds
    sequences: torch.Tensor  # (B, W + S) the call's input columns and generated ones
    valid: torch.Tensor  # (B, C) 1 where the cache holds a real token of the row
    cache: Any  # transformers' cache of C columns
    adapters: list[str] | None


class TurnCache:
    """Keeps the last call's cache while the turns of a batch of episodes run (``HFEngine.turns``)."""

    def __init__(self) -> None:
        self.last: _Call | None = None
        self.reused_calls = 0  # calls that ran only their new tokens
        self.prefilled_tokens = 0  # tokens run before sampling, over every call (the engine counts)

    def forget(self) -> None:
        """Drop the last call's cache: the next call runs from scratch (the weights changed)."""
        self.last = None

    def plan(
        self, rows: list[list[int]], adapters: list[str] | None, pad_token_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any, int] | None:
        """Input ids, attention mask and cache for a call on ``rows`` that continues the last
        call, or None when some row continues none of its rows (then run from scratch).

        Returns:
            (ids (B, C + N), mask (B, C + N), the cache with the matched rows, in order, and the
            tokens left to run: the new ones)
        """
        last = self.last
        if last is None:
            return None
        first: dict[tuple[int, ...], int] = {}
        for j, t in enumerate(last.tokens):
            first.setdefault(t, j)
        lengths = sorted({len(t) for t in last.tokens}, reverse=True)
        match: list[int] = []
        for i, row in enumerate(rows):
            found = [first[tuple(row[:n])] for n in lengths if n < len(row) and tuple(row[:n]) in first]
            if not found or (adapters is not None) != (last.adapters is not None):
                return None
            j = found[0]  # the longest earlier row it continues
            if adapters is not None and last.adapters is not None and adapters[i] != last.adapters[j]:
                return None
            if len(row) <= last.cached[j]:  # nothing new to run: the sampling needs a last token
                return None
            match.append(j)
        news = [row[last.cached[j] :] for row, j in zip(rows, match)]
        width = max(len(n) for n in news)
        block = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        block_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, n in enumerate(news):
            block[i, width - len(n) :] = torch.tensor(n, dtype=torch.long)
            block_mask[i, width - len(n) :] = 1
        sel = torch.tensor(match, device=last.sequences.device)
        columns = last.valid.shape[1]
        ids = torch.cat([last.sequences[sel, :columns], block.to(sel.device)], dim=1)
        mask = torch.cat([last.valid[sel], block_mask.to(sel.device)], dim=1)
        cache = last.cache
        cache.batch_select_indices(sel)
        self.last = None  # its cache now belongs to this call
        self.reused_calls += 1
        return ids, mask, cache, sum(len(n) for n in news)

    def record(
        self,
        prompts: list[list[int]],
        mask: torch.Tensor,
        sequences: torch.Tensor,
        lengths: list[int],
        cache: Any,
        adapters: list[str] | None,
    ) -> None:
        """Keep a finished call: its ``prompts`` (real tokens), input ``mask`` (B, W), the
        generated ``sequences`` (B, W + S), each reply's length and the cache ``generate`` returned."""
        width = mask.shape[1]
        generated = sequences.shape[1] - width
        k = torch.arange(max(generated - 1, 0), device=mask.device)
        replied = (k[None, :] < torch.tensor(lengths, device=mask.device)[:, None]).to(mask.dtype)
        new = sequences[:, width:].tolist()
        self.last = _Call(
            tokens=[(*p, *new[i][: lengths[i]]) for i, p in enumerate(prompts)],
            cached=[len(p) + min(n, generated - 1) for p, n in zip(prompts, lengths)],
            sequences=sequences,
            valid=torch.cat([mask, replied], dim=1),  # (B, C)
            cache=cache,
            adapters=list(adapters) if adapters is not None else None,
        )


MIN_SHARED = 16  # a shorter common prefix is not worth its own forward


def prefill_shared(
    model: Any,
    rows: list[list[int]],
    pad_token_id: int,
    device: Any,
    adapters: list[str] | None = None,
    common_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Any, int] | None:
    """Prompts laid out so that what they share runs once: the prefix every row starts with
    (e.g. an env's instructions, in every turn's prompt with ``env.history=last``) once for all,
    then each distinct rest of a prompt (the rows of a group share their whole prompt) once,
    their KV caches copied to the rows that have them. None when nothing is shared.

    Layout of a row: the shared prefix (P columns), then the rest left-padded to the widest (R
    columns); the cache covers all but the last column, which ``generate`` runs. Positions come
    from the mask, so every token sits where a left-padded prompt would put it. With
    ``adapters`` (one per row) a row's cache is its own adapter's: only whole prompts of the
    same adapter are shared. Without ``common_prefix`` only whole prompts are shared and the
    layout is plain left padding (the repetition penalty reads it).

    Returns:
        (ids (B, P + R), mask (B, P + R), the cache of P + R - 1 columns, tokens run before
        sampling, each row's last one included)
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    keys = [(*r, adapters[i]) if adapters is not None else tuple(r) for i, r in enumerate(rows)]
    first: dict[tuple[Any, ...], int] = {}
    owner = [first.setdefault(k, i) for i, k in enumerate(keys)]
    shortest = min(len(r) for r in rows)
    shared = _common_length(rows) if common_prefix and adapters is None and len(rows) > 1 else 0
    shared = min(shared, shortest - 1)
    shared = shared if shared >= MIN_SHARED else 0
    if shortest < 2 or (shared == 0 and len(first) == len(rows)):
        return None
    rest = [r[shared:] for r in rows]
    width = max(len(r) for r in rest)
    ids = torch.full((len(rows), shared + width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), shared + width), dtype=torch.long)
    for i, r in enumerate(rest):
        ids[i, :shared] = torch.tensor(rows[i][:shared], dtype=torch.long)
        ids[i, shared + width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, :shared] = 1
        mask[i, shared + width - len(r) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    uniq = sorted(first.values())
    slot = {i: k for k, i in enumerate(uniq)}
    cache, ran = None, len(rows)  # each row's last token runs in generate
    if shared:  # the common prefix, once, copied to every distinct prompt
        out = lm(
            input_ids=ids[:1, :shared],
            attention_mask=mask[:1, :shared],
            position_ids=torch.arange(shared, device=device)[None],
            use_cache=True,
        )
        cache = output_cache(out)
        cache.batch_select_indices(torch.zeros(len(uniq), dtype=torch.long, device=device))
        ran += shared
    if width > 1:  # each distinct rest but its last token, on top of the prefix
        u = torch.tensor(uniq, device=device)
        m = mask[u, : shared + width - 1]
        inputs: dict[str, Any] = {
            "input_ids": ids[u, shared : shared + width - 1],
            "attention_mask": m,
            "position_ids": (m.cumsum(-1) - 1).clamp(min=0)[:, shared:],
            "use_cache": True,
        }
        if cache is not None:
            inputs[cache_kwarg(lm)] = cache
        if adapters is not None:  # through the PEFT model, whose forward takes per-row adapters
            out = model(**inputs, adapter_names=[adapters[i] for i in uniq])
        else:
            out = lm(**inputs)
        cache = output_cache(out)
        ran += sum(len(rest[i]) - 1 for i in uniq)
    if cache is None:
        return None
    cache.batch_select_indices(torch.tensor([slot[o] for o in owner], device=device))
    return ids, mask, cache, ran


def _common_length(rows: list[list[int]]) -> int:
    """How many leading tokens every row shares."""
    n = min(len(r) for r in rows)
    first = rows[0]
    for r in rows[1:]:
        while n and r[:n] != first[:n]:
            n = next((k for k in range(n) if r[k] != first[k]), n)
    return n
