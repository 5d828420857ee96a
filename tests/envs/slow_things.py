"""Tools and envs that are slow, hang, loop for ever or fail: module-level and free of heavy
imports, so a worker process unpickles them in milliseconds (it imports this module)."""

from __future__ import annotations

import os
import random
import time


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"boom {x}")


def sleepy(seconds: float) -> str:
    """Sleeps, then answers.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def spin(n: int) -> int:
    """Loops for ever (a runaway tool): pure Python, holding the GIL while it runs.

    Args:
        n: anything
    """
    while True:
        n = (n * 31 + 7) % 1_000_003


def suicide(code: int) -> int:
    """Ends its own process (a crash in native code looks the same to the caller).

    Args:
        code: the exit code
    """
    os._exit(code)


class SlowGuess:
    """A 3-turn env whose step sleeps a seeded, episode-specific time (so concurrent steps
    finish out of order) and whose reward depends on the episode and the turn."""

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.turn, self.row = delay, 0, 0

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row, self.turn = int(row_index or 0), 0
        self.rng = random.Random(self.row)  # its own stream: concurrent envs share nothing
        return f"Round for row {self.row}", {}

    def step(self, action):
        time.sleep(self.delay * self.rng.random())
        self.turn += 1
        reward = (self.row % 5) / 10 + self.turn / 100 + len(action) / 1000
        return f"feedback {self.turn} for {self.row}", reward, self.turn >= 3, False, {"turn": self.turn}


class Hangs:
    """Odd rows sleep 3 s in their step; even rows answer at once."""

    def reset(self, seed=None, *, row_index=None, evaluation=False):
        self.row = int(row_index or 0)
        return "Q", {}

    def step(self, action):
        if self.row % 2:
            time.sleep(3.0)
        return "", 1.0, True, False, {}


class Boom(Hangs):
    def step(self, action):
        raise KeyError("no such cell")


class Dies(Hangs):
    """Row 1's step kills its own process."""

    def step(self, action):
        if self.row == 1:
            os._exit(9)
        return "", 1.0, True, False, {}


def shouts(n: int) -> str:
    """Fails with a long message (a tool that dumps its input into its error).

    Args:
        n: how many characters the message has
    """
    raise ValueError("x" * n)
