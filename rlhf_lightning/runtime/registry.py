"""A name -> function registry: raises on duplicates, lists valid names on a miss.

A dotted name (``my_pkg.losses.scaled_pg``) imports its module (``my_pkg.losses``), which
registers the entry under its last part (``scaled_pg``); the dotted name is then an alias of it.
So an objective or estimator defined outside the package is selected from the command line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions keyed by the names used in config (``algo.loss=cispo``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[F], F]:
        """Register under ``name``; ``meta`` are facts about the entry (e.g. its params class)."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._entries[name].__qualname__})"
                )
            self._entries[name] = fn
            self._meta[name] = meta
            return fn

        return decorator

    def meta(self, name: str) -> dict[str, Any]:
        """The facts registered with ``name`` (empty when none)."""
        self.get(name)
        return self._meta[name]

    def _load(self, name: str) -> None:
        """Import a dotted name's module and alias the entry it registers (see the module doc)."""
        if name in self._entries or not isinstance(name, str) or "." not in name:
            return
        module, last = name.rsplit(".", 1)
        try:
            importlib.import_module(module)
        except ImportError:
            return  # get() names the miss
        if last in self._entries:
            self._entries[name], self._meta[name] = self._entries[last], self._meta[last]

    def get(self, name: str) -> F:
        self._load(name)
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}, or the dotted "
                "path of one a module registers (my_pkg.module.name)"
            ) from None

    def names(self) -> list[str]:
        """The registered names (dotted aliases left out)."""
        return sorted(n for n in self._entries if "." not in n)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, str):
            self._load(name)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())  # as iteration: dotted aliases are not entries of their own

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
