"""SFT dialogues of GEM's games (``env=gem``: Sudoku, GuessTheNumber), played by scripted policies of mixed quality.

Every dialogue is an episode of the real :class:`~rlhf_lightning.envs.gem.GemEnv`:
``reset(row_index=row)`` as the rollout harness calls it (train row ``i`` is GEM seed
``seed + i``), then ``step`` with each scripted reply, so every user turn is exactly what GEM
says during RL (its instructions and board, then its feedback and the new board) and every
reward is GEM's. Dialogues are in the layout of ``make_chat_sft_data.py`` (no system message,
no final observation, replies without an end-of-turn token).

The policy sees only the conversation, like the model: it parses the last board shown (GEM's
``R1  .  2 |  3  .`` rows), solves it (the puzzles have one solution) and lists each empty
cell's candidates (digits not yet in its row, column or box). Each decision is good with
probability ``quality``:

- good: ``\\boxed{row col value}`` for an empty cell with a single candidate (every
  ``game:Sudoku-v0-easy`` board of seeds 0-1999 solves by such cells alone), chosen at random
  among them; the value is the solution's. GEM rewards it 1/#empty cells.
- a mistake (else), drawn by ``mistakes`` weights: ``wrong`` a wrong digit in an empty cell
  (GEM: "violates Sudoku rules", reward 0, the turn is spent); ``filled`` a digit in a filled
  cell ("already filled", 0); ``malformed`` a reply without a parsable move (``\\boxed{r c}``:
  GEM scores -0.1 and ends the episode, so it is rare).

An episode is solved when GEM says "Congratulations!" (all 8-10 empty cells right within GEM's
15 turns), so a policy whose moves are right half the time solves about a fifth of its boards.
``game:GuessTheNumber-v0-easy`` (1..10 in 4 guesses) has its own player, :func:`guess_policy`:
good = a new guess the hints allow, drawn uniformly (not bisection). ``valid_moves`` counts the
turns GEM accepted (``info["valid_move"]`` of :class:`GemEnv`).

    python scripts/make_gem_sft_data.py --out gem_sft.jsonl --game sudoku --rows 4000 --quality 0.6

Each JSONL line: ``{"messages", "env", "row", "return", "success", "valid_moves", "turns"}``
(``algo.data_path`` reads ``messages``; ``valid_moves``: replies GEM accepted).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from a checkout

from make_chat_sft_data import Message, Policy, play, write_jsonl

from rlhf_lightning.envs.gem import GemEnv

Board = list[list[int]]  # rows of digits, 0 for an empty cell

SUDOKU_ID = "game:Sudoku-v0-easy"
MAX_TURNS = 15  # game:Sudoku-v0-easy's own limit (GEM truncates there); conf/env/gem.yaml
BOARD_HEADER = "Here is the current board layout:"
_ROW = re.compile(r"^R(\d+) (.*)$")
DEFAULT_MISTAKES = {"wrong": 0.75, "filled": 0.2, "malformed": 0.05}


def parse_board(text: str) -> Board:
    """The last board in ``text`` (GEM's rendering: a column header, rows ``R<i>`` of digits and
    ``.``, ``|`` between boxes, dashed lines between box rows) as a list of rows (0 = empty)."""
    start = text.rfind(BOARD_HEADER)
    if start < 0:
        raise ValueError(f"no {BOARD_HEADER!r} in the observation {text[-200:]!r}")
    rows: Board = []
    for line in text[start:].splitlines()[1:]:
        m = _ROW.match(line.strip())
        if m is None:
            continue
        cells = [c for c in m.group(2).split() if c != "|"]
        rows.append([0 if c == "." else int(c) for c in cells])
    n = len(rows)
    if n == 0 or any(len(r) != n for r in rows) or math.isqrt(n) ** 2 != n:
        raise ValueError(f"not a square Sudoku board: {rows} (from {text[start:]!r})")
    return rows


def candidates(board: Board, r: int, c: int) -> set[int]:
    """Digits an empty cell may still take: none of its row, column or box (empty for a filled cell)."""
    if board[r][c]:
        return set()
    n, b = len(board), math.isqrt(len(board))
    r0, c0 = b * (r // b), b * (c // b)
    used = set(board[r]) | {board[i][c] for i in range(n)}
    used |= {board[i][j] for i in range(r0, r0 + b) for j in range(c0, c0 + b)}
    return set(range(1, n + 1)) - used


def solve(board: Board) -> Board | None:
    """A solution of ``board`` (backtracking on the cell with fewest candidates), or None."""
    grid = [row[:] for row in board]
    empty = [(r, c) for r in range(len(grid)) for c in range(len(grid)) if not grid[r][c]]
    if not empty:
        return grid
    r, c = min(empty, key=lambda rc: len(candidates(grid, *rc)))
    for v in sorted(candidates(grid, r, c)):
        grid[r][c] = v
        solved = solve(grid)
        if solved is not None:
            return solved
    return None


def singles(board: Board) -> list[tuple[int, int]]:
    """Empty cells (0-based) with exactly one candidate, in reading order."""
    n = len(board)
    return [(r, c) for r in range(n) for c in range(n) if len(candidates(board, r, c)) == 1]


def move(r: int, c: int, v: int) -> str:
    """GEM's Sudoku move for 0-based cell (r, c)."""
    return f"\\boxed{{{r + 1} {c + 1} {v}}}"


def sudoku_policy(quality: float, mistakes: Mapping[str, float] | None = None) -> Policy:
    """The scripted Sudoku player of the module doc: a good move with probability ``quality``,
    else a mistake drawn by the ``mistakes`` weights (:data:`DEFAULT_MISTAKES`)."""
    weights = {**DEFAULT_MISTAKES, **(mistakes or {})}
    unknown = sorted(set(weights) - set(DEFAULT_MISTAKES))
    if unknown or not 0.0 <= quality <= 1.0:
        raise ValueError(f"quality in [0, 1] (got {quality}) and mistakes among {sorted(DEFAULT_MISTAKES)}")
    kinds, kind_weights = list(weights), list(weights.values())

    def policy(messages: list[Message], rng: random.Random) -> str:
        board = parse_board(messages[-1]["content"])
        solution = solve(board)
        if solution is None:
            raise ValueError(f"the board has no solution: {board}")
        n = len(board)
        empty = [(r, c) for r in range(n) for c in range(n) if not board[r][c]]
        if rng.random() < quality:
            r, c = rng.choice(singles(board) or empty)
            return move(r, c, solution[r][c])
        kind = rng.choices(kinds, kind_weights)[0]
        filled = [(r, c) for r in range(n) for c in range(n) if board[r][c]]
        if kind == "malformed":
            r, c = rng.choice(empty)
            return f"\\boxed{{{r + 1} {c + 1}}}"
        if kind == "filled" and filled:
            r, c = rng.choice(filled)
            return move(r, c, rng.randint(1, n))
        r, c = rng.choice(empty)
        return move(r, c, rng.choice([v for v in range(1, n + 1) if v != solution[r][c]]))

    return policy


# ---------------------------------------------------------------------------------------------
# game:GuessTheNumber-v0-easy

GUESS_ID = "game:GuessTheNumber-v0-easy"
GUESS_MAX_TURNS = 4  # game:GuessTheNumber-v0-easy's own limit (1..10 in 4 guesses)
_RANGE = re.compile(r"guess the number between (\d+) and (\d+)")
_HINT = re.compile(r"you guessed (\d+), and the target number is (higher|lower) than")
_GUESS = re.compile(r"\\boxed\{(\d+)\}")
DEFAULT_GUESS_MISTAKES = {"inconsistent": 0.6, "repeat": 0.25, "out_of_range": 0.1, "malformed": 0.05}


def guess_state(messages: list[Message]) -> tuple[int, int, int, int, list[int]]:
    """GEM's range (low, high), the interval its hints still allow, and the guesses so far."""
    m = _RANGE.search(messages[0]["content"])
    if m is None:
        raise ValueError(f"not a GuessTheNumber game: {messages[0]['content'][:200]!r}")
    low, high = int(m.group(1)), int(m.group(2))
    lo, hi = low, high
    for turn in messages[2::2]:
        hint = _HINT.search(turn["content"])
        if hint is not None:
            g = int(hint.group(1))
            lo, hi = (max(lo, g + 1), hi) if hint.group(2) == "higher" else (lo, min(hi, g - 1))
    guesses = [int(g.group(1)) for reply in messages[1::2] if (g := _GUESS.search(reply["content"]))]
    return low, high, lo, hi, guesses


def guess_policy(quality: float, mistakes: Mapping[str, float] | None = None) -> Policy:
    """A GuessTheNumber player: with probability ``quality`` a new guess the hints allow, drawn
    uniformly (not bisection, so it sometimes runs out of turns); else a mistake drawn by the
    ``mistakes`` weights (:data:`DEFAULT_GUESS_MISTAKES`): ``inconsistent`` a new in-range guess the
    hints rule out (GEM accepts it, the turn is wasted), ``repeat`` an earlier guess and
    ``out_of_range`` a number past the range (GEM refuses both, reward 0), ``malformed`` a reply
    without ``\\boxed{number}`` (-0.1, the episode ends)."""
    weights = {**DEFAULT_GUESS_MISTAKES, **(mistakes or {})}
    if set(weights) - set(DEFAULT_GUESS_MISTAKES) or not 0.0 <= quality <= 1.0:
        raise ValueError(
            f"quality in [0, 1] (got {quality}) and mistakes among {sorted(DEFAULT_GUESS_MISTAKES)}"
        )
    kinds, kind_weights = list(weights), list(weights.values())

    def policy(messages: list[Message], rng: random.Random) -> str:
        low, high, lo, hi, guesses = guess_state(messages)
        allowed = [g for g in range(lo, hi + 1) if g not in guesses] or [lo]
        if rng.random() < quality:
            return f"\\boxed{{{rng.choice(allowed)}}}"
        kind = rng.choices(kinds, kind_weights)[0]
        ruled_out = [g for g in range(low, high + 1) if g not in guesses and not lo <= g <= hi]
        if kind == "malformed":
            return str(rng.choice(allowed))
        if kind == "repeat" and guesses:
            return f"\\boxed{{{rng.choice(guesses)}}}"
        if kind == "inconsistent" and ruled_out:
            return f"\\boxed{{{rng.choice(ruled_out)}}}"
        return f"\\boxed{{{high + rng.randint(1, 3)}}}"

    return policy


# ---------------------------------------------------------------------------------------------
# dialogues

GAMES: dict[str, tuple[str, int, Callable[..., Policy]]] = {  # name: (GEM id, turn limit, policy)
    "sudoku": (SUDOKU_ID, MAX_TURNS, sudoku_policy),
    "guess_the_number": (GUESS_ID, GUESS_MAX_TURNS, guess_policy),
}


def gem_dialogues(
    game: str,
    n: int,
    quality: float,
    seed: int = 0,
    first_row: int = 0,
    env_kwargs: Mapping[str, Any] | None = None,
    max_turns: int | None = None,
    mistakes: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """``n`` episodes of ``game`` (a key of :data:`GAMES`) through :class:`GemEnv` on train rows
    ``first_row ...``, played by its scripted policy; see the module doc. ``env_kwargs``: GemEnv's
    (e.g. ``{"kwargs": {"clues": 12, "max_turns": 6}}``); ``max_turns``: the harness's limit
    (default the game's own). Deterministic in its arguments."""
    if game not in GAMES:
        raise ValueError(f"unknown game {game!r}; choose from {sorted(GAMES)}")
    env_id, own_turns, make_policy = GAMES[game]
    env = GemEnv(**{"id": env_id, **(env_kwargs or {})})
    policy = make_policy(quality, mistakes)
    turns = own_turns if max_turns is None else max_turns
    rows = []
    for row in range(first_row, first_row + n):
        rng = random.Random(f"gem-sft:{game}:{seed}:{row}")
        messages, rewards, infos = play(env, row, policy, rng, turns)
        rows.append(
            {
                "messages": messages,
                "env": game,
                "row": row,
                "return": round(sum(rewards), 6),
                "success": bool(infos[-1].get("solved", False)),
                "valid_moves": sum(bool(i.get("valid_move")) for i in infos),
                "turns": len(rewards),
            }
        )
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Solve rate, valid-move rate (valid replies / replies), turns per episode of ``rows``."""
    turns = sum(r["turns"] for r in rows)
    return {
        "solved": round(sum(r["success"] for r in rows) / len(rows), 4),
        "valid_move_rate": round(sum(r["valid_moves"] for r in rows) / turns, 4),
        "turns": round(turns / len(rows), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--game", choices=sorted(GAMES), default="sudoku")
    ap.add_argument("--rows", type=int, default=4000, help="dialogues (train rows first-row ...)")
    ap.add_argument("--first-row", type=int, default=0)
    ap.add_argument("--quality", type=float, default=0.6, help="probability of a good move")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = gem_dialogues(args.game, args.rows, args.quality, seed=args.seed, first_row=args.first_row)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} dialogues to {args.out}: {summary(rows)}")


if __name__ == "__main__":
    main()
