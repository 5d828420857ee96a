"""Reward functions for the time-limit tests: module level and free of heavy imports (a worker
process imports this module to unpickle them)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def hangs(prompts, completions, **kwargs):
    """Never returns (a judge that waits for ever); starts a ``sleep`` first, whose pid goes to
    the file named by the env column ``pid_file`` when there is one."""
    pid_file = kwargs.get("pid_file")
    if pid_file:
        Path(pid_file[0]).write_text(str(subprocess.Popen(["sleep", "60"]).pid))
    time.sleep(3600)


def spins(prompts, completions, **kwargs):
    """Loops for ever in pure Python, holding the GIL."""
    n = 0
    while True:
        n = (n * 31 + 7) % 1_000_003


def lengths(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def raises(prompts, completions, **kwargs):
    raise ValueError("no judge today")
