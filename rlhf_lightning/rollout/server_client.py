"""One vLLM OpenAI-compatible server over HTTP (the standard library's ``urllib``): every request
under a timeout, retried with exponential backoff when the server does not answer or answers
with a server error, never retried when it refuses the request (4xx: the message is shown).

Endpoints used: ``/health``, ``/v1/models``, ``/v1/completions`` (token-id prompts, the sampled
tokens' ids and log-probs back), ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(runtime LoRA loading: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on the server), and with
``VLLM_SERVER_DEV_MODE=1`` ``/collective_rpc`` (``reload_weights`` from a directory) and
``/reset_prefix_cache``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ServerError(RuntimeError):
    """A vLLM server refused a request, did not answer within its retries, or is gone."""


class ServerRefused(ServerError):
    """A vLLM server answered a request with a client error (4xx): retrying cannot help."""


@dataclass(frozen=True)
class RequestPolicy:
    """``rollout.request_timeout_s`` (each try; a socket read never waits longer),
    ``rollout.request_retries`` (tries after the first) and the first backoff (doubling)."""

    timeout_s: float = 300.0
    retries: int = 3
    backoff_s: float = 0.5

    def longest_s(self) -> float:
        """The longest one request can take, every try and backoff included."""
        tries = self.retries + 1
        return tries * self.timeout_s + sum(self.backoff_s * 2**i for i in range(self.retries)) + 1.0


def _gone_never() -> str | None:
    return None


class ServerClient:
    """Requests to the server at ``url``.

    Args:
        policy: timeouts and retries.
        gone: how the server ended (``was killed by SIGKILL``) or None while it runs (a server
            this run started); a request to a gone server fails at once instead of retrying.
        where: where to look when it fails (``its log: <path>``), for the error messages.
    """

    def __init__(
        self,
        url: str,
        policy: RequestPolicy = RequestPolicy(),
        gone: Callable[[], str | None] = _gone_never,
        where: str = "a server started outside this run",
    ) -> None:
        self.url, self.policy, self.gone, self.where = url.rstrip("/"), policy, gone, where

    # ---------------------------------------------------------------- transport
    def _once(self, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
        text = raw.decode() if raw else ""
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text  # the LoRA endpoints answer with plain text

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        retries: int | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """GET (``body`` None) or POST ``path``; the decoded JSON (or text) answer. ``retries`` and
        ``timeout_s`` (each try) default to the policy's."""
        tries = (self.policy.retries if retries is None else retries) + 1
        last: BaseException | None = None
        for attempt in range(tries):
            try:
                return self._once(path, body, self.policy.timeout_s if timeout_s is None else timeout_s)
            except urllib.error.HTTPError as err:
                if err.code < 500:
                    raise ServerRefused(
                        f"the vLLM server {self.url} refused {path}: {_message(err)}"
                    ) from None
                last = err
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                last = err  # refused, reset, timed out
            ended = self.gone()
            if ended is not None:
                raise ServerError(self.died(ended, path)) from last
            if attempt + 1 < tries:
                time.sleep(self.policy.backoff_s * 2**attempt)
        raise ServerError(
            f"the vLLM server {self.url} did not answer {path} after {tries} tries "
            f"(rollout.request_timeout_s={self.policy.timeout_s:g}, rollout.request_retries="
            f"{self.policy.retries}): {last}; {self.where}"
        ) from last

    def died(self, how: str, path: str) -> str:
        return (
            f"the vLLM server {self.url} {how} (while the trainer waited for {path}); {self.where}. "
            "The last checkpoint resumes the run (resume=true), with new servers if the run starts them"
        )

    # ---------------------------------------------------------------- the endpoints
    def healthy(self) -> bool:
        """Whether ``/health`` answers now (one short try)."""
        try:
            self._once("/health", None, 2.0)
            return True
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until ``/health`` answers; a clear error naming the URL after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            ended = self.gone()
            if ended is not None:
                raise ServerError(self.died(ended, "/health"))
            if time.monotonic() > deadline:
                raise ServerError(
                    f"no vLLM server answered {self.url}/health within {timeout_s:g} s "
                    f"(rollout.server_start_timeout_s); {self.where}. Start it first, or check the URL "
                    "(docs/guides/inference-servers.md)"
                )
            time.sleep(0.5)

    def base_models(self) -> list[str]:
        """The names of the models the server serves that are not LoRA adapters."""
        listed = self.call("/v1/models") or {}
        return [m["id"] for m in listed.get("data", []) if not m.get("parent")]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.call("/v1/completions", body))

    def load_lora(self, name: str, path: str) -> None:
        try:
            self.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except ServerRefused as err:
            raise ServerRefused(
                f"{err}\nA run that trains a LoRA adapter loads each version at run time: start the "
                "server with --enable-lora --max-lora-rank <r or more> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            ) from None

    def unload_lora(self, name: str) -> None:
        self.call("/v1/unload_lora_adapter", {"lora_name": name})

    def reload_weights(self, path: str) -> None:
        """Every weight from the model directory ``path`` (in place), then an empty prefix cache."""
        try:
            self.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            self.call("/reset_prefix_cache", {})
        except ServerRefused as err:
            raise ServerRefused(
                f"{err}\nFull fine-tuning reloads the server's weights through its development "
                "endpoints: start the server with VLLM_SERVER_DEV_MODE=1"
            ) from None


def _message(err: urllib.error.HTTPError) -> str:
    """The server's error message (its JSON ``error.message`` or ``detail``), or the status."""
    try:
        body = err.read().decode(errors="replace")
    except OSError:
        body = ""
    try:
        parsed = json.loads(body)
        error = parsed.get("error", parsed)
        text = error.get("message") or error.get("detail") or body
    except (json.JSONDecodeError, AttributeError):
        text = body
    return f"HTTP {err.code}: {str(text)[:500]}"
