"""``env.kwargs`` of ``env=openenv``, checked and resolved before any model loads: the client
class, how a reply becomes an action and an observation a message, the seeds of the two splits.

Every refusal is a :class:`ConfigError` naming the field (``env.kwargs.client``, ...) and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlhf_lightning.config.errors import ConfigError

EXTRA = 'pip install -e ".[openenv]"'  # or pip install 'rlhf_lightning[openenv]'
# The observation fields the default observation -> message takes, in this order (the first that
# the observation declares and holds a string); an observation without one is sent as its JSON.
TEXT_FIELDS = ("text", "message", "prompt", "content", "feedback", "observation", "output")
# Fields every OpenEnv observation has that are not its content (reward and done are the
# StepResult's; metadata never reaches the client).
BASE_FIELDS = ("done", "reward", "metadata")


def import_openenv(field_name: str, value: Any) -> Any:
    """``openenv.core``, or a ConfigError naming ``field_name`` and the extra to install."""
    try:
        return importlib.import_module("openenv.core")
    except ImportError as err:
        raise ConfigError(
            field_name, value, f"an installed OpenEnv: env=openenv needs the openenv extra ({err}): {EXTRA}"
        ) from None


def import_object(path: str, field_name: str, what: str) -> Any:
    """The object ``module:name`` (or ``module.name``) names; a ConfigError naming the field."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(field_name, path, f"the import path of {what}, module:name")
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(field_name, path, f"the import path of {what}, module:name")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            field_name, path, f"the import path of {what}: {module} does not import ({err})"
        ) from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ConfigError(field_name, path, f"the import path of {what}: {module} has no {name}")
        obj = getattr(obj, part)
    return obj


def client_class(path: str) -> type:
    """The ``EnvClient`` subclass ``env.kwargs.client`` names."""
    core = import_openenv("env.kwargs.client", path)
    cls = import_object(path, "env.kwargs.client", "an OpenEnv client class (an EnvClient subclass)")
    if not (isinstance(cls, type) and issubclass(cls, core.EnvClient)):
        raise ConfigError(
            "env.kwargs.client", path, f"an EnvClient subclass (openenv.core.EnvClient); it names {cls!r}"
        )
    return cls


def action_class(client: type) -> type | None:
    """The action type a client declares: ``EnvClient[Action, Observation, State]``'s first
    argument, else the annotation of ``_step_payload``'s action (None: neither)."""
    for klass in client.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    try:
        hints = typing.get_type_hints(getattr(client, "_step_payload", None))
    except Exception:
        return None
    hint = next((h for name, h in hints.items() if name != "return"), None)
    return hint if isinstance(hint, type) else None


def text_field(action_cls: type, client_path: str) -> str:
    """The action model's one string field (``metadata`` aside): where a reply goes by default."""
    fields = getattr(action_cls, "model_fields", None)
    if fields is None:
        raise ConfigError(
            "env.kwargs.action",
            None,
            f"a function text -> action (module:name): {client_path}'s action type {action_cls.__name__} "
            "is not a pydantic model, so no default can be built",
        )
    names = [n for n, f in fields.items() if n != "metadata" and f.annotation is str]
    others = [n for n, f in fields.items() if n != "metadata" and f.annotation is not str and f.is_required()]
    if len(names) != 1 or others:
        raise ConfigError(
            "env.kwargs.action",
            None,
            f"a function text -> action (module:name): {action_cls.__name__} has {len(names)} string "
            f"fields {names} and other required fields {others}; the default takes exactly one string "
            "field and nothing else required",
        )
    return names[0]


def default_action(action_cls: type, name: str) -> Callable[[str], Any]:
    """text -> ``action_cls(**{name: text})``."""

    def to_action(text: str) -> Any:
        return action_cls(**{name: text})

    to_action.__qualname__ = f"{action_cls.__name__}({name}=...)"
    return to_action


def observation_fields(obs: Any) -> dict[str, Any]:
    """An observation's declared fields (not ``done``, ``reward``, ``metadata``) as plain values."""
    if hasattr(obs, "model_dump"):
        data = obs.model_dump(mode="json")
    elif isinstance(obs, Mapping):
        data = dict(obs)
    else:
        return {}
    return {k: v for k, v in data.items() if k not in BASE_FIELDS}


def default_message(obs: Any) -> str:
    """The first of :data:`TEXT_FIELDS` the observation holds as a string, else its JSON."""
    if isinstance(obs, str):
        return obs
    data = observation_fields(obs)
    for name in TEXT_FIELDS:
        if isinstance(data.get(name), str):
            return str(data[name])
    return json.dumps(data, sort_keys=True, default=str)


def numbers(obs: Any) -> dict[str, Any]:
    """The observation's number and boolean fields (logged as ``env/<key>``)."""
    return {
        k: v for k, v in observation_fields(obs).items() if isinstance(v, (int, float, bool)) and k != "seed"
    }


def check_seeds(seed: int, train_size: int, eval_size: int, eval_seeds: list[int] | None) -> tuple[int, ...]:
    """The eval seeds: ``eval_seeds`` as given, else ``seed + train_size + j``; refused when one of
    them is a training seed (``seed .. seed + train_size - 1``), naming it."""
    for name, value in (("train_size", train_size), ("eval_size", eval_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"env.kwargs.{name}", value, "a positive number of rows (seeds)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("env.kwargs.seed", seed, "an integer (the first training seed)")
    if eval_seeds is None:
        return tuple(range(seed + train_size, seed + train_size + eval_size))
    if not isinstance(eval_seeds, (list, tuple)) or not eval_seeds:
        raise ConfigError("env.kwargs.eval_seeds", eval_seeds, "a non-empty list of integer seeds, or null")
    bad = [s for s in eval_seeds if isinstance(s, bool) or not isinstance(s, int)]
    if bad:
        raise ConfigError("env.kwargs.eval_seeds", eval_seeds, f"integer seeds; {bad} are not")
    shared = sorted({s for s in eval_seeds if seed <= s < seed + train_size})
    if shared:
        raise ConfigError(
            "env.kwargs.eval_seeds",
            eval_seeds,
            f"seeds no training episode plays: {shared[:10]}{' ...' if len(shared) > 10 else ''} are training "
            f"seeds (env.kwargs.seed={seed} .. seed + train_size - 1 = {seed + train_size - 1}); pick "
            "others, or move env.kwargs.seed",
        )
    return tuple(eval_seeds)


@dataclass(frozen=True)
class Settings:
    """``env.kwargs`` of ``env=openenv``, checked (see :class:`~rlhf_lightning.envs.openenv.OpenEnvEnv`)."""

    client: str
    url: str | None = None
    app: str | None = None
    action: str | None = None
    observation: str | None = None
    reset_kwargs: dict[str, Any] = field(default_factory=dict)
    eval_seeds: tuple[int, ...] = ()
    seed: int = 0
    train_size: int = 100_000
    timeout_s: float = 60.0
    start_timeout_s: float = 120.0
    run_dir: str | None = None
    tools: bool = False
    parser: str = "hermes"
    max_tool_calls: int = 3

    @property
    def eval_size(self) -> int:
        return len(self.eval_seeds)

    def episode_seed(self, row: int, evaluation: bool) -> int:
        """Train row ``i`` plays seed ``seed + i % train_size``; eval row ``j`` ``eval_seeds[j % n]``."""
        if evaluation:
            return self.eval_seeds[row % self.eval_size]
        return self.seed + row % self.train_size


def check_settings(
    client: str,
    url: str | None,
    app: str | None,
    action: str | None,
    observation: str | None,
    reset_kwargs: dict[str, Any] | None,
    eval_seeds: list[int] | None,
    seed: int,
    train_size: int,
    eval_size: int,
    timeout_s: float,
    start_timeout_s: float,
    run_dir: str | None,
    tools: bool = False,
    parser: str = "hermes",
    max_tool_calls: int = 3,
) -> Settings:
    """The cheap checks (no import of the client, no network): one of url and app, their forms,
    the seeds, the time limits."""
    if (url is None) == (app is None):
        which = "both" if url is not None else "neither"
        raise ConfigError(
            "env.kwargs.url",
            url,
            f"exactly one of env.kwargs.url (a server someone started, http://host:port) and "
            f"env.kwargs.app (module:app, a server the run starts); {which} is set",
        )
    if url is not None and not (
        isinstance(url, str) and url.startswith(("http://", "https://", "ws://", "wss://"))
    ):
        raise ConfigError("env.kwargs.url", url, "an http://host:port (or ws://) URL of an OpenEnv server")
    if app is not None:
        module, sep, attr = str(app).partition(":")
        if not sep or not module or not attr:
            raise ConfigError(
                "env.kwargs.app", app, "module:attribute of an ASGI app (my_pkg.server.app:app)"
            )
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                "env.kwargs.app",
                app,
                f"module:app of an importable module; {module} is not found on sys.path",
            )
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"env.kwargs.{name}", value, "a positive number of seconds")
    if not isinstance(reset_kwargs, (dict, type(None))):
        raise ConfigError("env.kwargs.reset_kwargs", reset_kwargs, "a mapping of keyword arguments for reset")
    if reset_kwargs and "seed" in reset_kwargs:
        raise ConfigError(
            "env.kwargs.reset_kwargs",
            reset_kwargs,
            "no seed: each episode's seed comes from env.kwargs.seed / eval_seeds",
        )
    seeds = check_seeds(seed, train_size, eval_size, list(eval_seeds) if eval_seeds is not None else None)
    if not isinstance(tools, bool):
        raise ConfigError("env.kwargs.tools", tools, "true (offer the env's MCP tools) or false")
    if tools:
        from rlhf_lightning.envs.tool_parsers import TOOL_PARSERS

        if parser not in TOOL_PARSERS:
            raise ConfigError("env.kwargs.parser", parser, f"one of {', '.join(TOOL_PARSERS.names())}")
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 1:
            raise ConfigError(
                "env.kwargs.max_tool_calls", max_tool_calls, "a positive number of calls per episode"
            )
    return Settings(
        client=client,
        url=url.rstrip("/") if url else None,
        app=app,
        action=action,
        observation=observation,
        reset_kwargs=dict(reset_kwargs or {}),
        eval_seeds=seeds,
        seed=seed,
        train_size=train_size,
        timeout_s=float(timeout_s),
        start_timeout_s=float(start_timeout_s),
        run_dir=run_dir,
        tools=tools,
        parser=parser,
        max_tool_calls=max_tool_calls,
    )


@dataclass(frozen=True)
class Codec:
    """How replies become actions and observations messages (resolved once per run)."""

    to_action: Callable[[str], Any]
    to_message: Callable[[Any], str]
    client_cls: type


def resolve_codec(s: Settings) -> Codec:
    """Import the client and the two functions; build the default action maker."""
    cls = client_class(s.client)
    if s.action is not None:
        to_action = import_object(s.action, "env.kwargs.action", "a function text -> action")
        if not callable(to_action):
            raise ConfigError("env.kwargs.action", s.action, "a callable text -> action")
    else:
        act = action_class(cls)
        if act is None:
            raise ConfigError(
                "env.kwargs.action",
                None,
                f"a function text -> action (module:name): {s.client} does not declare its action type "
                "(EnvClient[Action, Observation, State])",
            )
        to_action = default_action(act, text_field(act, s.client))
    to_message: Callable[[Any], str] = default_message
    if s.observation is not None:
        to_message = import_object(s.observation, "env.kwargs.observation", "a function observation -> text")
        if not callable(to_message) or not inspect.signature(to_message).parameters:
            raise ConfigError("env.kwargs.observation", s.observation, "a callable observation -> text")
    return Codec(to_action, to_message, cls)
