"""The typed action and observation of the guessing game (pydantic models, as OpenEnv's are)."""

from __future__ import annotations

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """One reply of the player: free text; the first whole number in it is the guess."""

    text: str = Field(..., description="the player's reply")


class GuessObservation(Observation):
    """What the player sees after a reply (``reward`` and ``done`` come with every observation)."""

    text: str = Field(default="", description="the game's message")
    guesses: int = Field(default=0, description="guesses made so far")
    distance: int = Field(default=-1, description="|guess - secret| of the last guess (-1: none yet)")
    solved: bool = Field(default=False, description="the secret was guessed")
