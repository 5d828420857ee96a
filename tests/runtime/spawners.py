"""Calls for worker processes that start processes of their own, or are slow to import: module
level and free of heavy imports (a worker unpickles them by importing this module)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def spawn_and_hang(pid_file: str) -> None:
    """Starts ``sleep 60``, writes its pid to ``pid_file``, then hangs (a step past its limit)."""
    child = subprocess.Popen(["sleep", "60"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(3600)


def spawn_and_return() -> int:
    """Starts ``sleep 60`` in the background and returns its pid (a tool that leaves a process)."""
    return subprocess.Popen(["sleep", "60"]).pid


def quick() -> str:
    return "ok"
