"""Micro-batches of a mini-batch: a fixed number of rows, or as many rows as fit a token budget.

A micro-batch of rows ``i..j`` is padded to its longest row, so its forward and backward hold
``rows x longest`` tokens of activations. With ``algo.micro_batch_tokens=N`` consecutive rows
are packed while that product stays within N (verl's dynamic batch size): short single-turn rows
go many at a time, a long multi-turn trajectory alone, without shrinking every micro-batch to
fit the longest one. The update is the same either way up to float rounding: every micro-batch's
loss is already normalised for the whole mini-batch (``normalisers``), so only the order in
which the gradient is summed changes.
"""

from __future__ import annotations

import torch


def split_rows(index: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """``index`` in consecutive chunks of ``rows`` (the last may be shorter). Shape: (n,) -> [(<=rows,)]"""
    return list(index.split(max(rows, 1))) if len(index) else []


def split_by_tokens(index: torch.Tensor, lengths: list[int], budget: int) -> list[torch.Tensor]:
    """``index`` in consecutive chunks whose padded size, rows x the longest row's length, is at
    most ``budget`` tokens; a row longer than ``budget`` on its own is a chunk of one.

    Args:
        index: row indices of the mini-batch, in the order they run. Shape: (n,)
        lengths: every row's sequence length (prompt and completion tokens; indexed by row,
            not by position in ``index``), read once per update on the host.
        budget: ``algo.micro_batch_tokens``.

    Returns:
        The chunks, in order; their concatenation is ``index``. Shapes: [(k_i,)] with sum k_i = n.
    """
    chunks: list[torch.Tensor] = []
    start, longest = 0, 0
    order = index.tolist()
    for pos, row in enumerate(order):
        length = lengths[row]
        grown = max(longest, length)
        if pos > start and grown * (pos - start + 1) > budget:
            chunks.append(index[start:pos])
            start, grown = pos, length
        longest = grown
    if order:
        chunks.append(index[start:])
    return chunks
