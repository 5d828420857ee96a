"""The game and its server: ``uvicorn examples.openenv_guess.server:app`` (``env.kwargs.app``).

A secret number from 1 to ``HIGH`` drawn from the reset's seed; each reply's first whole number
is a guess, answered "Higher." or "Lower."; the game ends at the right guess or after
``MAX_GUESSES``. Per-turn rewards: 1.0 for the right guess, 0.0 for a wrong one, -0.1 for a reply
without a number in range.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from examples.openenv_guess.models import GuessAction, GuessObservation

HIGH = 16
MAX_GUESSES = 4
RULES = f"I picked a whole number from 1 to {HIGH}. Guess it: reply with one number. You have {MAX_GUESSES} guesses."


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every WebSocket session plays its own game

    def __init__(self) -> None:
        super().__init__()
        self.secret, self.guesses = 1, 0
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, HIGH)
        self.guesses = 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=RULES, reward=0.0, done=False)

    def step(self, action: GuessAction, timeout_s: float | None = None, **_: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        self.guesses += 1
        found = re.search(r"\d+", action.text)
        guess = int(found.group()) if found else 0
        out_of_guesses = self.guesses >= MAX_GUESSES
        if not 1 <= guess <= HIGH:
            text = f"Reply with a whole number from 1 to {HIGH}."
            return GuessObservation(text=text, guesses=self.guesses, reward=-0.1, done=out_of_guesses)
        distance = abs(guess - self.secret)
        if distance == 0:
            text = f"Correct! It was {self.secret}."
            return GuessObservation(
                text=text, guesses=self.guesses, distance=0, solved=True, reward=1.0, done=True
            )
        text = "Higher." if guess < self.secret else "Lower."
        return GuessObservation(
            text=text, guesses=self.guesses, distance=distance, reward=0.0, done=out_of_guesses
        )

    @property
    def state(self) -> State:
        return self._state


# One game per WebSocket session; enough sessions for a batch of episodes at once (every episode
# of a rollout holds its session from reset to its end).
app = create_app(
    GuessEnvironment, GuessAction, GuessObservation, env_name="guess_number", max_concurrent_envs=256
)
