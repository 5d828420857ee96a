"""``warn_shared_rows`` compares rows by a fixed-size digest of their content: it kept every
training row's whole JSON text in a set, so its memory grew with the dataset's size."""

from __future__ import annotations

import logging
import tracemalloc

from rlhf_lightning.envs.files import row_digest, warn_shared_rows

ROW_CHARS = 100_000


def big_rows(n: int, tag: str) -> list[dict[str, str]]:
    return [{"question": f"{tag}{i}:" + "x" * ROW_CHARS, "answer": str(i)} for i in range(n)]


def test_the_memory_it_holds_does_not_grow_with_the_rows_text():
    train, held_out = big_rows(100, "t"), big_rows(2, "t") + big_rows(3, "e")  # 10 MB of training text
    tracemalloc.start()
    try:
        shared = warn_shared_rows(train, held_out, "rows.jsonl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert shared == 2
    # One row's JSON at a time (~0.1 MB, and its bytes) plus 100 digests; the old set held 10 MB.
    assert peak < 1_000_000, f"peak {peak / 1e6:.1f} MB for {len(train) * ROW_CHARS / 1e6:.0f} MB of rows"


def test_rows_compare_by_content_whatever_the_key_order(caplog):
    train = [{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}]
    held_out = [{"a": 4, "q": "2+2"}, {"q": "2+2", "a": "4"}, {"q": "3+3", "a": 6}]
    with caplog.at_level(logging.WARNING, logger="rlhf_lightning.envs.files"):
        assert warn_shared_rows(train, held_out, "eval.jsonl") == 1  # "4" is not 4
    assert "1 of 3 held-out rows (eval.jsonl) are also training rows" in caplog.text
    assert len(row_digest(train[0])) == 16
    assert row_digest(train[1]) == row_digest(held_out[0]) != row_digest(held_out[1])
