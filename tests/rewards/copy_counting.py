"""A column value that counts its deep copies (in the process that makes them). Light on imports:
a reward worker process imports this module to unpickle it."""

from __future__ import annotations

from typing import Any


class CountsDeepCopies:
    deepcopies = 0  # in this process

    def __init__(self, text: str) -> None:
        self.text = text

    def __deepcopy__(self, memo: dict[int, Any]) -> CountsDeepCopies:
        CountsDeepCopies.deepcopies += 1
        return CountsDeepCopies(self.text)

    def __len__(self) -> int:
        return len(self.text)
