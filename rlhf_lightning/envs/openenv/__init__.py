"""OpenEnv environments (github.com/meta-pytorch/OpenEnv, ``pip install -e ".[openenv]"``) as
TextEnvs: ``env=openenv``.

    python train.py env=openenv model=tiny_chat     # the guessing game of examples/openenv_guess/
    python train.py env=openenv env.kwargs.app=my_pkg.server.app:app env.kwargs.client=my_pkg.client:MyEnv
    python train.py env=openenv env.kwargs.app=null env.kwargs.url=http://host:8000 env.kwargs.client=...

An OpenEnv env is a FastAPI server with typed actions and observations, reached through an
``EnvClient`` subclass. A thin adapter: the env's own rewards and ``done`` come back unchanged
(``StepResult.reward``, ``StepResult.done`` as ``terminated``; a missing reward counts 0); a reply
becomes an action through ``env.kwargs.action`` (default: the action model's one string field);
an observation becomes the next user message through ``env.kwargs.observation`` (default: its
first field among :data:`~rlhf_lightning.envs.openenv.settings.TEXT_FIELDS` holding a string, else
its JSON). The observation's declared number and boolean fields are the step's ``info`` (logged
as ``env/<key>``; OpenEnv never sends an observation's ``metadata`` to the client).

Sessions. OpenEnv keeps a game's state in the client's WebSocket session (its plain HTTP
``/step`` starts a fresh game on every call), so each episode opens its own session at
``reset`` and closes it at its end (``done``), when the env is dropped (an episode the harness
cut at ``env.max_turns``), or at :meth:`OpenEnvEnv.close`. Every episode of a batch holds a
session at once: the server's ``max_concurrent_envs`` must allow that many.

Deadlines: the adapter's own, not a worker process. A live WebSocket session cannot be pickled
into a step worker (``env.step_workers=process``) and back, so env=openenv steps on threads
(``env.step_workers=thread``, ``env.concurrency`` at once; ``conf/env/openenv.yaml``) and bounds
every call itself: connecting, ``reset`` and ``step`` each run on one event loop thread under
``env.step_timeout_s`` (the adapter's ``timeout_s``); past it the call is cancelled, its session closed (nothing of it keeps
running in the trainer; the server ends the session), and the step fails with
:class:`~rlhf_lightning.envs.openenv.endpoint.OpenEnvTimeout` (a step timeout:
``env.on_reward_error`` decides), naming the env and the call. This also bounds ``reset``, which
the harness runs outside any worker; the harness's own step deadline (worker processes) is off.

Servers. ``env.kwargs.url``: a server someone started (it must answer ``/health`` at start-up).
``env.kwargs.app``: the run starts ``uvicorn <app>`` on 127.0.0.1 and a free port, its log in
``<run>/servers/openenv-<i>.log``, waits for ``/health`` (``env.kwargs.start_timeout_s``), and stops
it when the process exits (``RolloutHarness.close``, with the run), when the run's env factory is
garbage collected, at exit, or at :func:`stop_servers`; it dies with the trainer on ``kill -9``
(:mod:`~rlhf_lightning.runtime.local_server`). A server that dies mid-run ends the run naming it,
its log and the checkpoint to resume from
(:class:`~rlhf_lightning.envs.openenv.endpoint.EnvServerGone`).

Seeds: train row ``i`` resets with seed ``seed + i`` (modulo ``train_size``), eval row ``j`` with
``eval_seeds[j]`` (default: the ``eval_size`` seeds after the training ones); eval seeds that are
training seeds are refused.

MCP tools (``env.kwargs.tools=true``, an OpenEnv ``MCPEnvironment``): the env's tools reach the
chat template, a reply's tool calls run in the episode's session and answer with tool messages,
and a reply without calls is the env's text action (:mod:`~rlhf_lightning.envs.openenv.tools`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import weakref
from typing import Any

from rlhf_lightning.envs.openenv.endpoint import (
    Endpoint,
    EnvServerGone,
    OpenEnvTimeout,
    call,
    fire_and_forget,
    stop_servers,
)
from rlhf_lightning.envs.openenv.settings import Codec, Settings, check_settings, numbers, resolve_codec
from rlhf_lightning.envs.openenv.tools import call_tool, list_tools, no_tools_error
from rlhf_lightning.envs.tool_parsers import MalformedCall

__all__ = ["EnvServerGone", "OpenEnvEnv", "OpenEnvFactory", "OpenEnvTimeout", "stop_servers"]

CLOSE_S = 2.0  # how long closing a session may take (the server ends it either way)


async def _open(codec: Codec, url: str, timeout_s: float, seed: int, kwargs: dict[str, Any]) -> Any:
    """A connected client and its first StepResult (the session closed if anything fails)."""
    try:
        client = codec.client_cls(base_url=url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s)
    except TypeError:  # a client whose __init__ takes the base URL only
        client = codec.client_cls(base_url=url)
    try:
        await client.connect()
        return client, await client.reset(seed=seed, **kwargs)
    except BaseException:
        await _close(client)
        raise


async def _close(client: Any) -> None:
    """Ask the server to end the session and let it close the connection first (OpenEnv 0.3.0's
    server logs a traceback for every session whose client closed the socket before it did)."""
    ws = getattr(client, "_ws", None)
    with contextlib.suppress(BaseException):
        if ws is not None:
            await ws.send('{"type": "close"}')
            await asyncio.wait_for(ws.wait_closed(), CLOSE_S)
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(client.close(), CLOSE_S)


def _close_soon(client: Any) -> None:
    fire_and_forget(_close(client))


async def _tool_schemas(codec: Codec, s: Settings, url: str) -> list[dict[str, Any]]:
    """The env's MCP tools, listed in a session of their own (reset with the first training seed)."""
    client, _ = await _open(codec, url, s.timeout_s, s.seed, s.reset_kwargs)
    try:
        return await list_tools(client)
    finally:
        await _close(client)


class OpenEnvEnv:
    """One episode's OpenEnv session (see the module docstring).

    Args:
        client: ``module:Class`` of the env's ``EnvClient`` subclass.
        url: a running server (``http://host:port``); or
        app: ``module:app`` of its ASGI app, which the run serves itself (exactly one of the two).
        action: ``module:function`` text -> action (default: the action model's one string field).
        observation: ``module:function`` observation -> message text (default: its text field, else
            its JSON).
        reset_kwargs: more keyword arguments for every ``reset`` (the seed comes from below).
        eval_seeds: the eval rows' seeds (default: ``eval_size`` seeds after the training seeds);
            none may be a training seed.
        seed, train_size, eval_size: train row ``i`` plays seed ``seed + i % train_size``.
        timeout_s: every call's deadline (connect + reset, step).
        start_timeout_s: how long a server the run starts may take to answer ``/health``.
        run_dir: where ``servers/openenv-<i>.log`` goes (``${output_dir}``; null: Hydra's job
            directory, else a temporary one).
        tools: offer the env's MCP tools through the chat template (an ``MCPEnvironment``).
        parser: how tool calls are read from a reply (``envs.tool_parsers``: hermes, ...).
        max_tool_calls: tool calls run per episode.
    """

    def __init__(
        self,
        client: str,
        url: str | None = None,
        app: str | None = None,
        action: str | None = None,
        observation: str | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        eval_seeds: list[int] | None = None,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 200,
        timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        run_dir: str | None = None,
        tools: bool = False,
        parser: str = "hermes",
        max_tool_calls: int = 3,
    ) -> None:
        s = check_settings(
            client, url, app, action, observation, reset_kwargs, eval_seeds, seed, train_size, eval_size,
            timeout_s, start_timeout_s, run_dir, tools, parser, max_tool_calls,
        )  # fmt: skip
        codec = resolve_codec(s)
        endpoint = Endpoint(s)
        self._owner = weakref.finalize(self, endpoint.close)  # this env started the endpoint
        schemas = None
        if s.tools:
            try:
                schemas = call(_tool_schemas(codec, s, endpoint.url), s.timeout_s, "MCP tools/list")
            except Exception as err:
                self._owner()
                raise no_tools_error(
                    s.client, f"answered tools/list with {type(err).__name__}: {err}"
                ) from None
            if not schemas:
                self._owner()
                raise no_tools_error(s.client, "lists no tools")
        self._attach(s, codec, endpoint, schemas)

    @classmethod
    def shared_factory(cls, **kwargs: Any) -> OpenEnvFactory:
        """The run's env factory (:func:`~rlhf_lightning.envs.factory.env_factory`): one server
        and one check of the settings for every episode's env."""
        return OpenEnvFactory(**kwargs)

    def _attach(
        self, s: Settings, codec: Codec, endpoint: Endpoint, schemas: list[dict[str, Any]] | None
    ) -> None:
        self.settings, self.codec, self.endpoint, self.schemas = s, codec, endpoint, schemas
        self.client: Any = None
        self._session: weakref.finalize | None = None
        self._turn = self._calls = 0
        if schemas is not None:  # read by the chat formatter (rollout.episodes.chat.env_tools)
            from rlhf_lightning.envs.tool_parsers import get_tool_parser

            self.parse = get_tool_parser(s.parser)
            self.tool_schemas = lambda: copy.deepcopy(schemas)

    def sibling(self) -> OpenEnvEnv:
        """A fresh env on the same server and settings (it does not own the server)."""
        env = OpenEnvEnv.__new__(OpenEnvEnv)
        env._attach(self.settings, self.codec, self.endpoint, self.schemas)
        return env

    def num_rows(self, evaluation: bool) -> int:
        return self.settings.eval_size if evaluation else self.settings.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        self.end_session()
        row = row_index if row_index is not None else seed or 0
        s = self.settings
        episode_seed = s.episode_seed(row, evaluation)
        what = f"OpenEnvEnv.reset(seed={episode_seed}) of {s.client}"
        try:
            client, result = call(
                _open(self.codec, self.endpoint.url, s.timeout_s, episode_seed, s.reset_kwargs),
                s.timeout_s,
                what,
            )
        except OpenEnvTimeout:
            raise
        except Exception as err:
            raise self.endpoint.failure(what, err) from err
        self.client = client
        self._session = weakref.finalize(self, _close_soon, client)
        self._turn = self._calls = 0
        return self._message(result.observation), {
            **numbers(result.observation),
            "openenv_seed": episode_seed,
        }

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.client is None:
            raise RuntimeError("OpenEnvEnv.step called before reset (or after its episode ended)")
        self._turn += 1
        what = f"OpenEnvEnv.step (turn {self._turn}) of {self.settings.client}"
        if self.schemas is not None:
            parsed = self.parse(action)
            if parsed.has_calls:
                return self._run_calls(parsed.items, what)
        act = self.codec.to_action(action)
        try:
            result = call(self.client.step(act), self.settings.timeout_s, what)
        except OpenEnvTimeout:
            self.end_session()
            raise
        except Exception as err:
            self.end_session()
            raise self.endpoint.failure(what, err) from err
        done = bool(result.done)
        if done:
            self.end_session()
        reward = 0.0 if result.reward is None else float(result.reward)
        info = numbers(result.observation)
        if self.schemas is not None:
            info = {"tool_calls": 0, "tool_errors": 0, "answered": True, **info}
        return self._message(result.observation), reward, done, False, info

    def _run_calls(self, items: list[Any], what: str) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """A reply with tool calls: each runs in the session (tools/call) and answers with a tool
        message; reward 0, the episode goes on (:mod:`~rlhf_lightning.envs.openenv.tools`)."""
        limit = self.settings.max_tool_calls
        if self._calls >= limit:  # told last turn that the next reply must answer
            self.end_session()
            return "", 0.0, True, False, {"tool_calls": 0, "tool_errors": 0, "answered": False}
        messages: list[dict[str, str]] = []
        ran = errors = 0
        for item in items:
            if isinstance(item, MalformedCall):
                content, failed = f"error: malformed tool call ({item.error}): {item.text}", True
            elif self._calls >= limit:
                content = f"error: not run: the limit of {limit} tool calls per episode is reached; reply with your final answer"
                failed = True
            else:
                self._calls += 1
                ran += 1
                try:
                    content, failed = call(
                        call_tool(self.client, item.name, item.arguments),
                        self.settings.timeout_s,
                        f"{what}: {item.name}",
                    )
                except OpenEnvTimeout:
                    self.end_session()
                    raise
                except Exception as err:
                    self.end_session()
                    raise self.endpoint.failure(f"{what}: MCP tools/call {item.name}", err) from err
            errors += failed
            messages.append({"role": "tool", "name": item.name, "content": content})
        return messages, 0.0, False, False, {"tool_calls": ran, "tool_errors": errors, "answered": False}

    def _message(self, obs: Any) -> str:
        text = self.codec.to_message(obs)
        if not isinstance(text, str):
            raise TypeError(
                f"env.kwargs.observation={self.settings.observation} returned {type(text).__name__}; it must "
                "return the message text (a str)"
            )
        return text

    def end_session(self) -> None:
        """Close this episode's session (without waiting for the server)."""
        if self._session is not None:
            self._session()
        self._session, self.client = None, None

    def close(self) -> None:
        """End the session, and stop the server if this env started it."""
        self.end_session()
        owner = getattr(self, "_owner", None)
        if owner is not None:
            owner()

    def __getstate__(self) -> Any:
        raise TypeError(
            "OpenEnvEnv holds a live WebSocket session, which cannot travel to a step worker process: "
            "env=openenv steps on threads (env.step_workers=thread, as conf/env/openenv.yaml sets) "
            "and bounds every call itself with env.step_timeout_s"
        )


class OpenEnvFactory:
    """Fresh :class:`OpenEnvEnv` s sharing one server and one check of the settings; the server
    stops when the factory is released or :meth:`close`\\ d (and at exit). It bounds every call
    itself (``timeout_s``), so the harness runs no step deadline of its own."""

    bounds_its_calls = True

    def __init__(self, **kwargs: Any) -> None:
        self.prototype = OpenEnvEnv(**kwargs)

    @property
    def endpoint(self) -> Endpoint:
        return self.prototype.endpoint

    def __call__(self) -> OpenEnvEnv:
        return self.prototype.sibling()

    def close(self) -> None:
        self.prototype.close()
