"""4x4 Sudoku, one move per turn: the small sibling of the GEM Sudoku task."""

from __future__ import annotations

import random
import re
from typing import Any

_MOVE = re.compile(r"([1-4])\D{0,3}([1-4])\D{0,3}([1-4])")


def solution_grid(rng: random.Random) -> list[list[int]]:
    """A random valid 4x4 Sudoku: a base pattern with permuted digits, rows and columns within bands."""
    base = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    digits = rng.sample([1, 2, 3, 4], 4)
    grid = [[digits[v - 1] for v in row] for row in base]
    bands = [rng.sample([0, 1], 2), rng.sample([2, 3], 2)]
    rows = [r for band in rng.sample(bands, 2) for r in band]
    grid = [grid[r] for r in rows]
    stacks = [rng.sample([0, 1], 2), rng.sample([2, 3], 2)]
    cols = [c for stack in rng.sample(stacks, 2) for c in stack]
    return [[row[c] for c in cols] for row in grid]


def is_valid_grid(grid: list[list[int]]) -> bool:
    """Every row, column and 2x2 box holds 1..4 exactly once."""
    full = {1, 2, 3, 4}
    rows = all(set(r) == full for r in grid)
    cols = all({grid[r][c] for r in range(4)} == full for c in range(4))
    boxes = all(
        {grid[r][c] for r in range(br, br + 2) for c in range(bc, bc + 2)} == full
        for br in (0, 2)
        for bc in (0, 2)
    )
    return rows and cols and boxes


def render(grid: list[list[int]]) -> str:
    return "\n".join(" ".join(str(v) if v else "." for v in row) for row in grid)


class SudokuEnv:
    """Fill the blanks of a 4x4 Sudoku, one move per turn: ``row col value`` (1-based, e.g. ``2 3 4``).

    The env checks each move (in range, cell empty, no repeated digit in the row, column or 2x2
    box) and replies with the board. Rewards: ``solve_reward`` when the board is complete,
    ``-invalid_penalty`` for an invalid move (the episode ends after ``max_invalid`` of them),
    ``move_reward`` for a valid one. ``info``: ``valid``, ``solved``, ``filled``.
    """

    def __init__(
        self,
        blanks: int = 4,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 200,
        solve_reward: float = 1.0,
        move_reward: float = 0.1,
        invalid_penalty: float = 0.1,
        max_invalid: int = 2,
    ) -> None:
        if not 1 <= blanks <= 12:
            raise ValueError(f"SudokuEnv: blanks must be in [1, 12], got {blanks}")
        self.blanks, self.seed = blanks, seed
        self.train_size, self.eval_size = train_size, eval_size
        self.solve_reward, self.move_reward = solve_reward, move_reward
        self.invalid_penalty, self.max_invalid = invalid_penalty, max_invalid
        self.board: list[list[int]] = []
        self.invalid = 0

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        rng = random.Random(
            f"{self.seed}:{'eval' if evaluation else 'train'}:{row_index if row_index is not None else seed}"
        )
        self.board = solution_grid(rng)
        for r, c in rng.sample([(r, c) for r in range(4) for c in range(4)], self.blanks):
            self.board[r][c] = 0
        self.invalid = 0
        prompt = (
            "Solve this 4x4 Sudoku (each row, column and 2x2 box holds 1 to 4). "
            "Reply with one move: row column value, e.g. 1 3 2.\n" + render(self.board)
        )
        return prompt, {}

    def check(self, r: int, c: int, v: int) -> bool:
        if self.board[r][c]:
            return False
        if v in self.board[r] or v in (self.board[i][c] for i in range(4)):
            return False
        br, bc = r - r % 2, c - c % 2
        return v not in (self.board[i][j] for i in range(br, br + 2) for j in range(bc, bc + 2))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self.board:
            raise RuntimeError("SudokuEnv.step called before reset")
        m = _MOVE.search(action)
        valid = False
        if m:
            r, c, v = (int(g) - 1 for g in m.groups())
            valid = self.check(r, c, v + 1)
            if valid:
                self.board[r][c] = v + 1
        filled = sum(v != 0 for row in self.board for v in row)
        info: dict[str, Any] = {"valid": valid, "solved": False, "filled": filled}
        if not valid:
            self.invalid += 1
            done = self.invalid >= self.max_invalid
            reply = "Invalid move. " + ("Game over." if done else "Board:\n" + render(self.board))
            return reply, -self.invalid_penalty, done, False, info
        if filled == 16:
            info["solved"] = is_valid_grid(self.board)
            return "Solved!", self.move_reward + self.solve_reward, True, False, info
        return "Board:\n" + render(self.board), self.move_reward, False, False, info
