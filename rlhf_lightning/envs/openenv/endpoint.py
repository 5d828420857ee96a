"""Where an OpenEnv server is, and every call to it under a deadline.

An :class:`Endpoint` is either a server someone started (``env.kwargs.url``: checked to answer
``/health`` at start-up) or one this process starts (``env.kwargs.app``: uvicorn on 127.0.0.1
and a free port, under :class:`~rlhf_lightning.runtime.local_server.LocalServer`, its log in
``<run>/servers/openenv-<i>.log``). Client calls run on one event loop thread per process
(:func:`call`), each under ``env.step_timeout_s``: past it the call is cancelled (nothing of it
keeps running here) and :class:`OpenEnvTimeout` is raised. A call that fails because the server
is gone raises :class:`EnvServerGone` naming the server, its log and what the run can resume from.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.openenv.settings import Settings
from rlhf_lightning.runtime.local_server import (
    LocalServer,
    ServerStartError,
    free_port,
    next_log_path,
    resume_hint,
)
from rlhf_lightning.runtime.workers import CallTimeout

log = logging.getLogger(__name__)

_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[Endpoint] = weakref.WeakSet()  # stopped at exit (kill -9: the guard)


class OpenEnvTimeout(CallTimeout):
    """A call to the env server did not return within ``env.step_timeout_s`` (it was cancelled
    and the episode's session closed). The harness treats it as a step timeout
    (``env.on_reward_error``)."""


class EnvServerGone(RuntimeError):
    """The env server the run uses is gone (killed, crashed, or not answering any more)."""


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's client loop, on a daemon thread of its own (started on first use)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openenv-client-loop", daemon=True).start()
            _LOOP = loop
        return _LOOP


def call(coro: Coroutine[Any, Any, Any], timeout_s: float, what: str) -> Any:
    """Run ``coro`` on the client loop within ``timeout_s``; past it the coroutine is cancelled
    and :class:`OpenEnvTimeout` raised (``what`` names the call in its message)."""
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout_s), event_loop())
    try:
        return future.result(timeout_s + 5.0)  # wait_for ends it at timeout_s; this is a backstop
    except (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
        future.cancel()
        raise OpenEnvTimeout(f"{what} did not return within {timeout_s:g} s (env.step_timeout_s)") from None


def fire_and_forget(coro: Coroutine[Any, Any, Any]) -> None:
    """Schedule ``coro`` on the client loop without waiting (closing a session from a finalizer)."""
    loop = _LOOP
    if loop is None or loop.is_closed() or not loop.is_running():
        coro.close()
        return
    with contextlib.suppress(RuntimeError):
        asyncio.run_coroutine_threadsafe(coro, loop)


def probe_health(url: str, timeout_s: float) -> str | None:
    """None when ``url``/health answers 200, else why not."""
    http = "http" + url[2:] if url.startswith("ws") else url
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=timeout_s) as r:
            return None if r.status == 200 else f"GET /health answered {r.status}"
    except urllib.error.HTTPError as err:
        return f"GET /health answered {err.code}"
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"GET /health failed: {getattr(err, 'reason', err)}"


def run_dir_for(s: Settings) -> Path:
    """The run directory (``output_dir``; else Hydra's job directory; else a fresh temporary one)."""
    if s.run_dir:
        return Path(s.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        return Path(tempfile.mkdtemp(prefix="openenv-"))


def server_env() -> dict[str, str]:
    """The server's environment: the trainer's, with the trainer's ``sys.path`` first on
    ``PYTHONPATH`` (the app imports as it does here)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class Endpoint:
    """The env server of a run (see the module docstring)."""

    def __init__(self, s: Settings) -> None:
        self.settings = s
        self.server: LocalServer | None = None
        self.checkpoints: Path | None = None
        if s.url is not None:
            self.url = s.url
            why = probe_health(self.url, min(10.0, s.timeout_s))
            if why is not None:
                raise ConfigError(
                    "env.kwargs.url",
                    s.url,
                    f"the URL of a running OpenEnv server ({why}); start it first, or let the run "
                    "start one with env.kwargs.app=module:app (and env.kwargs.url=null)",
                )
            self.name = f"the OpenEnv server {self.url} (env.kwargs.url)"
        else:
            run_dir = run_dir_for(s)
            self.checkpoints = run_dir / "checkpoints"
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "uvicorn",
                str(s.app),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ]
            command += ["--log-level", "warning"]
            self.name = f"the OpenEnv server {s.app} (env.kwargs.app)"
            self.server = LocalServer(
                self.name, command, port, next_log_path(run_dir / "servers", "openenv"), env=server_env()
            )
            self.url = self.server.url
            try:
                self.server.wait_ready(time.monotonic() + s.start_timeout_s, "env.kwargs.start_timeout_s")
            except ServerStartError as err:
                self.server.stop(grace_s=2.0)
                raise ConfigError("env.kwargs.app", s.app, f"an app that serves: {err}") from None
            log.info("%s serves at %s; %s", self.name, self.url, self.server.where())
        _LIVE.add(self)

    def gone(self) -> str | None:
        """How a server this run started ended, or None while it runs (or for a URL)."""
        return self.server.death() if self.server is not None else None

    def failure(self, what: str, err: BaseException) -> Exception:
        """The error for a call (``what``) that failed with ``err``: :class:`EnvServerGone` when
        the server is gone (or, given by URL, no longer answers /health), else a RuntimeError
        naming the server and the call."""
        cause = f"{type(err).__name__}: {err}"
        death = self.gone()
        if self.server is not None and death is None and not self.server.healthy():
            time.sleep(0.5)  # a killed server's guard exits a moment after the server
            death = self.gone()
        if death is not None and self.server is not None:
            return EnvServerGone(
                f"{self.name} at {self.url} {death} (during {what}); {self.server.where()}:\n"
                f"{self.server.log_tail()}\n{resume_hint(self.checkpoints)}"
            )
        if self.server is None and probe_health(self.url, 5.0) is not None:
            return EnvServerGone(
                f"{self.name} no longer answers (during {what}: {cause}). Restart it, then resume the run "
                "from its last checkpoint with resume=true output_dir=<the run directory>"
            )
        hint = ""
        if "capacity" in cause.lower() or "CAPACITY" in cause:
            hint = (
                " (every episode of a batch holds a session from reset to its end: the server's "
                "max_concurrent_envs must be at least prompts_per_step x group_size and eval.batch_size)"
            )
        return RuntimeError(f"{what} failed on {self.name} at {self.url}: {cause}{hint}")

    def close(self) -> None:
        """Stop the server this run started (nothing for a URL)."""
        _LIVE.discard(self)
        if self.server is not None:
            self.server.stop(grace_s=5.0)


@atexit.register
def stop_servers() -> None:
    """Stop every env server this process started (at exit; a script that runs ``run(cfg)``
    more than once may call it between runs)."""
    for endpoint in list(_LIVE):
        with contextlib.suppress(Exception):
            endpoint.close()
