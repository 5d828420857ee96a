"""Guess the number: a multi-turn game with "higher" / "lower" feedback."""

from __future__ import annotations

import random
from typing import Any

from rlhf_lightning.envs.arithmetic import final_integer


class GuessNumberEnv:
    """The env picks a secret integer in [low, high]; each turn the model guesses, the env answers
    "higher" or "lower" until the guess is right or ``max_turns`` guesses are used.

    Rewards per turn: ``solve_reward - turn_penalty * turn`` on the solving turn (solving early is
    worth more), ``-invalid_penalty`` for a reply with no integer in [low, high], 0 otherwise.
    ``info``: ``solved``, ``valid``, ``turns``.
    """

    def __init__(
        self,
        low: int = 1,
        high: int = 20,
        max_turns: int = 5,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 200,
        solve_reward: float = 1.0,
        turn_penalty: float = 0.1,
        invalid_penalty: float = 0.1,
    ) -> None:
        if low >= high:
            raise ValueError(f"GuessNumberEnv: need low < high, got low={low}, high={high}")
        self.low, self.high, self.max_turns, self.seed = low, high, max_turns, seed
        self.train_size, self.eval_size = train_size, eval_size
        self.solve_reward, self.turn_penalty, self.invalid_penalty = (
            solve_reward,
            turn_penalty,
            invalid_penalty,
        )
        self.secret: int | None = None
        self.turn = 0

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        key = (
            f"{self.seed}:{'eval' if evaluation else 'train'}:{row_index if row_index is not None else seed}"
        )
        self.secret = random.Random(key).randint(self.low, self.high)
        self.turn = 0
        prompt = (
            f"I am thinking of a number between {self.low} and {self.high}. Guess it: reply with one number. "
            f"After each guess I say higher or lower. You have {self.max_turns} guesses."
        )
        return prompt, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.secret is None:
            raise RuntimeError("GuessNumberEnv.step called before reset")
        self.turn += 1
        guess = final_integer(action)
        valid = guess is not None and self.low <= guess <= self.high
        info: dict[str, Any] = {"valid": valid, "solved": False, "turns": self.turn}
        if guess == self.secret:
            info["solved"] = True
            return "Correct!", self.solve_reward - self.turn_penalty * (self.turn - 1), True, False, info
        out_of_turns = self.turn >= self.max_turns
        reward = 0.0 if valid else -self.invalid_penalty
        if not valid:
            reply = f"Reply with one number between {self.low} and {self.high}."
        else:
            reply = "Higher." if guess is not None and guess < self.secret else "Lower."
        return reply, reward, out_of_turns, False, info
