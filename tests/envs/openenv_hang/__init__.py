"""The guessing game of examples/openenv_guess, whose step never returns: the server for the
deadline tests (``uvicorn tests.envs.openenv_hang:app``)."""

from __future__ import annotations

import time
from typing import Any

from openenv.core.env_server.http_server import create_app

from examples.openenv_guess.models import GuessAction, GuessObservation
from examples.openenv_guess.server import GuessEnvironment


class HangingGuess(GuessEnvironment):
    def step(self, action: GuessAction, timeout_s: float | None = None, **_: Any) -> GuessObservation:  # type: ignore[override]
        time.sleep(3600)
        raise AssertionError("unreachable")


app = create_app(
    HangingGuess, GuessAction, GuessObservation, env_name="hanging_guess", max_concurrent_envs=64
)
