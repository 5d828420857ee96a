"""The guessing game with an MCP tool (``uvicorn tests.envs.openenv_tools:app``): an OpenEnv
``MCPEnvironment`` whose ``compare(n)`` tool says whether the secret is higher, lower or equal;
the text action is the final answer (reward 1.0 when its first number is the secret, else 0;
the episode ends)."""

from __future__ import annotations

import random
import re
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.types import State

from examples.openenv_guess.models import GuessAction, GuessObservation
from examples.openenv_guess.server import HIGH


class ToolGuess(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("guess")

        @mcp.tool()
        def compare(n: int) -> str:
            """Compare a number with the secret.

            Args:
                n: the number to compare
            """
            return "higher" if n < self.secret else "lower" if n > self.secret else "equal"

        super().__init__(mcp)
        self.secret = 1
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> GuessObservation:
        self.secret = random.Random(seed).randint(1, HIGH)
        return GuessObservation(text=f"Find my number from 1 to {HIGH}; the compare tool helps.", reward=0.0)

    def _step_impl(self, action: Any, timeout_s: float | None = None, **_: Any) -> GuessObservation:
        found = re.search(r"\d+", getattr(action, "text", ""))
        solved = bool(found) and int(found.group()) == self.secret
        return GuessObservation(text="Done.", solved=solved, reward=1.0 if solved else 0.0, done=True)

    @property
    def state(self) -> State:
        return self._state


app = create_app(ToolGuess, GuessAction, GuessObservation, env_name="tool_guess", max_concurrent_envs=64)
