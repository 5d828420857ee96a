"""The package's one error type for bad input, and the checks that raise it. A leaf module: it
imports nothing from the package, so every layer (models, envs, data, rewards, run) can raise
``ConfigError`` without importing the start-up validation and what it reaches."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An invalid config value: ``field=value``, and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        shown = value.value if isinstance(value, Enum) else value  # a closed choice as its string
        super().__init__(f"invalid config: {field}={shown!r}: {allowed}")


class UserCodeError(RuntimeError):
    """Code of the user's failed (a reward function, an env's ``step``): the message names it and
    the way out, and the cause is the user's exception. ``train.py`` shows the cause's traceback
    and this message, without the trainer's frames between them."""


def check(ok: bool, field: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


def is_hub_id(path: str) -> bool:
    """``org/name`` with no local meaning (not absolute, not ./ or ~, no such directory)."""
    p = path.strip()
    return (
        p.count("/") == 1
        and not p.startswith(("/", ".", "~"))
        and not Path(p).exists()
        and all(part and " " not in part for part in p.split("/"))
    )


def check_model_path(field: str, path: str) -> None:
    if is_hub_id(path):
        return
    p = Path(path).expanduser()
    check(
        p.is_dir(),
        field,
        path,
        "no such directory; give an existing local model directory or a Hub id 'org/name'",
    )
    check(
        (p / "config.json").is_file(),
        field,
        path,
        "the directory has no config.json; point it at a saved model (save_pretrained output)",
    )
