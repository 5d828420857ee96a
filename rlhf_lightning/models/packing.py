"""Packed rows (several sequences in one row) run as separate sequences.

A packed row holds sequences one after the other, its positions restarting at 0 at each: SFT
packing, or the turns of an episode with ``env.history=last|last_k`` (each turn's prompt is a
fresh sequence). Attention must stay within a sequence. Flash attention does that from the
positions alone; every other implementation would build a dense (L, L) mask per row, so here the
sequences are cut out into a batch of their own (right-padded to the longest) and run through
the transformer body: memory and attention cost follow the sequences' lengths, not the row's.
What every sequence starts with (an env's instructions, repeated in each turn's prompt) runs once.

Notation:
    B: rows, L: row width, S: sequences in the batch, M: the longest sequence, H: hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lightning.models.prompt_sharing import shared_prefix_hidden

MIN_SHARED = 16  # a shorter common prefix is not worth a second pass of the body


def sequence_layout(
    position_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Where each token of a packed batch goes in the unpacked one.

    Args:
        position_ids: 0 at the first token of each sequence, counting up within it. Shape: (B, L)
        attention_mask: 1 on real tokens (right padding). Shape: (B, L)

    Returns:
        (real: the real tokens (B, L) bool; seq: each real token's sequence number (N,);
        pos: its position in it (N,); S sequences; M the longest)
    """
    real = attention_mask.bool()
    starts = (position_ids == 0) & real
    starts[:, 0] |= real[:, 0]
    per_row = starts.sum(-1)  # (B,)
    offset = per_row.cumsum(0) - per_row  # first sequence number of each row
    seq_of = starts.long().cumsum(-1) - 1 + offset[:, None]  # (B, L)
    pos = position_ids[real]
    count = int(per_row.sum())
    longest = int(pos.max()) + 1 if pos.numel() else 1
    return real, seq_of[real], pos, count, longest


def unpacked_action_rows(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    action_mask: torch.Tensor,
    share_prefix: bool = True,
) -> torch.Tensor:
    """The body's final hidden states at the action positions of a packed batch, each sequence
    run on its own (row-major: the order ``hidden[:, :-1][action_mask]`` gives).

    With ``share_prefix``, the tokens every sequence starts with (e.g. an env's instructions,
    repeated in every turn's prompt with ``env.history=last``) run once and their KV cache is
    copied to every sequence (:func:`~rlhf_lightning.models.prompt_sharing.shared_prefix_hidden`).

    Args:
        body: the transformer body (``get_decoder()`` of a CausalLM).
        input_ids, attention_mask, position_ids: the packed rows. Shape: (B, L)
        action_mask: True where token t+1 is an action. Shape: (B, L-1)

    Returns:
        Shape: (N, H), N = ``action_mask.sum()``
    """
    real, seq, pos, count, longest = sequence_layout(position_ids, attention_mask)
    device = input_ids.device
    ids = torch.zeros((count, longest), dtype=input_ids.dtype, device=device)
    mask = torch.zeros((count, longest), dtype=attention_mask.dtype, device=device)
    ids[seq, pos] = input_ids[real]
    mask[seq, pos] = 1
    # Each token's place in the unpacked batch.
    seq_at = torch.full(input_ids.shape, -1, dtype=torch.long, device=device)
    pos_at = torch.full(input_ids.shape, -1, dtype=torch.long, device=device)
    seq_at[real], pos_at[real] = seq, pos
    # Each action's predicting token (column t of the row: the token before the action, in the
    # same sequence; or, for a value read after a row's last token, that token itself).
    b, t = action_mask.nonzero(as_tuple=True)
    acts = torch.zeros((count, longest), dtype=torch.bool, device=device)
    acts[seq_at[b, t], pos_at[b, t]] = True  # (S, M); order kept: (b, t) -> (s, p) is monotone
    shared = common_prefix(ids, mask, acts) if share_prefix and count > 1 else 0
    if shared >= 2:
        lens = torch.full((count,), shared, dtype=torch.long, device=device)
        return shared_prefix_hidden(body, ids, mask, acts, lens, torch.zeros_like(lens))
    hidden = body(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (S, M, H)
    return hidden[acts]


def flat_action_rows(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    action_mask: torch.Tensor,
) -> torch.Tensor:
    """The body's final hidden states at the action positions of a packed batch, every real token
    in one flat row (for flash attention's variable-length path, which transformers takes from the
    positions only when the batch is a single row). Row-major, as ``hidden[:, :-1][action_mask]``.

    Args:
        body: the transformer body (``get_decoder()`` of a CausalLM) under flash attention.
        input_ids, attention_mask, position_ids: the packed rows, right-padded. Shape: (B, L)
        action_mask: True where token t+1 is an action. Shape: (B, L-1)

    Returns:
        Shape: (N, H), N = ``action_mask.sum()``
    """
    real = attention_mask.bool()
    flat_ids = input_ids[real][None]  # (1, R), R real tokens
    flat_pos = position_ids[real][None]  # (1, R): 0 at every sequence's first token
    hidden = body(input_ids=flat_ids, position_ids=flat_pos, use_cache=False).last_hidden_state[0]  # (R, H)
    at = (
        real.flatten().long().cumsum(0).view(real.shape) - 1
    )  # (B, L): each real token's place in the flat row
    b, t = action_mask.nonzero(as_tuple=True)
    return hidden[at[b, t]]  # the predicting token (b, t) of an action is a real token


def common_prefix(ids: torch.Tensor, mask: torch.Tensor, acts: torch.Tensor) -> int:
    """How many leading tokens every sequence shares, up to each one's first action: the part
    :func:`~rlhf_lightning.models.prompt_sharing.shared_prefix_hidden` can run once (0 when it
    is shorter than :data:`MIN_SHARED`).

    Args:
        ids, mask: right-padded sequences. Shape: (S, M)
        acts: True at the positions whose hidden states are read. Shape: (S, M)
    """
    same = ((ids == ids[:1]) & mask.bool() & mask[:1].bool()).all(0)  # (M,)
    n = int(same.long().cumprod(0).sum())
    has = acts.any(-1)
    if bool(has.any()):  # the shared part ends at the first predicting position of any action
        first = acts.float().argmax(-1)[has].min()
        n = min(n, int(first) + 1)
    return n if n >= MIN_SHARED else 0


def uses_flash_attention(model: Any) -> bool:
    """Whether ``model`` attends with a flash-attention kernel (packed rows by positions alone)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    return "flash" in str(impl)
