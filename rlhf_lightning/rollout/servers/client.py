"""One vLLM OpenAI-compatible server over HTTP (the standard library's ``http.client``): every
try of a request bounded as a whole (connecting, sending and every read: a server that drips its
answer a byte at a time is cut off at ``rollout.request_timeout_s``), its answer read up to a size
cap, retried with exponential backoff when the server does not answer or answers with a server
error, never retried when it refuses the request (4xx: the message is shown) or answers with
something the trainer cannot use (:class:`BadAnswer`, naming the server and the request).

Endpoints used: ``/health``, ``/v1/models``, ``/v1/completions`` (token-id prompts, the sampled
tokens' ids and log-probs back), ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(runtime LoRA loading: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` on the server), and with
``VLLM_SERVER_DEV_MODE=1`` ``/collective_rpc`` (``reload_weights`` from a directory) and
``/reset_prefix_cache``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.runtime.local_server import resume_hint

SMALL_ANSWER_BYTES = 1 << 20  # every answer but a completion's (those: answer_limit)


class ServerError(RuntimeError):
    """A vLLM server refused a request, did not answer within its retries, or is gone."""


class ServerRefused(ServerError):
    """A vLLM server answered a request with a client error (4xx): retrying cannot help."""


class BadAnswer(ServerError):
    """A vLLM server answered with something the trainer cannot use (not JSON, the wrong shape,
    too large, ids outside the vocabulary, ...): not retried, the server is misconfigured."""


@dataclass(frozen=True)
class RequestPolicy:
    """``rollout.request_timeout_s`` (each try, as a whole: connecting, sending, every read),
    ``rollout.request_retries`` (tries after the first) and the first backoff (doubling)."""

    timeout_s: float = 300.0
    retries: int = 3
    backoff_s: float = 0.5

    def longest_s(self) -> float:
        """The longest one request can take, every try and backoff included."""
        tries = self.retries + 1
        return tries * self.timeout_s + sum(self.backoff_s * 2**i for i in range(self.retries)) + 1.0


class _Status(Exception):
    """The server answered with an error status: its code and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code, self.message = code, message


def _gone_never() -> str | None:
    return None


class ServerClient:
    """Requests to the server at ``url``.

    Args:
        policy: timeouts and retries.
        gone: how the server ended (``was killed by SIGKILL``) or None while it runs (a server
            this run started); a request to a gone server fails at once instead of retrying.
        where: where to look when it fails (``its log: <path>``), for the error messages.
        resume: what the run can resume from (:func:`resume_hint`), for a gone server's message.
    """

    def __init__(
        self,
        url: str,
        policy: RequestPolicy = RequestPolicy(),
        gone: Callable[[], str | None] = _gone_never,
        where: str = "a server started outside this run",
        resume: Callable[[], str] = lambda: resume_hint(None),
    ) -> None:
        self.url, self.policy, self.gone, self.where = url.rstrip("/"), policy, gone, where
        self.resume = resume

    # ---------------------------------------------------------------- transport
    def _once(self, path: str, body: dict[str, Any] | None, timeout_s: float, limit: int) -> Any:
        """One try: connecting, sending and every read within ``timeout_s`` together (a timer
        shuts the socket at the deadline), at most ``limit`` bytes of answer; the decoded JSON
        (or text)."""
        parts = urllib.parse.urlsplit(self.url + path)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = kind(parts.hostname or "", parts.port, timeout=timeout_s)
        expired = threading.Event()

        sockets: list[socket.socket] = []

        def expire() -> None:
            expired.set()
            for sock in sockets:  # (the connection hands its socket to a response that closes it)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a read blocked on it

        deadline = time.monotonic() + timeout_s
        timer: threading.Timer | None = None
        try:
            conn.connect()  # (bounded by the socket timeout)
            sockets.append(conn.sock)
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), expire)
            timer.daemon = True
            timer.start()
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            data = None if body is None else json.dumps(body).encode()
            conn.request(
                "GET" if body is None else "POST", target, data, {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            raw = self._read(response, path, limit)
        except (OSError, http.client.HTTPException) as err:
            if expired.is_set():
                raise TimeoutError(f"no whole answer within {timeout_s:g} s") from err
            raise
        finally:
            if timer is not None:
                timer.cancel()
            conn.close()
        if expired.is_set():  # an answer cut at the deadline can look complete
            raise TimeoutError(f"no whole answer within {timeout_s:g} s")
        if response.status >= 400:
            raise _Status(response.status, _message(raw))
        return self._decode(raw, path)

    def _read(self, response: http.client.HTTPResponse, path: str, limit: int) -> bytes:
        """The answer's body, refused past ``limit`` bytes (never buffered whole)."""
        length = response.getheader("Content-Length")
        too_large = BadAnswer(
            f"the vLLM server {self.url} answered {path} with more than {limit} bytes (the most this "
            f"request's answer can take); {self.where}"
        )
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        while chunk := response.read(min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise too_large
        return b"".join(chunks)

    def _decode(self, raw: bytes, path: str) -> Any:
        """JSON, or the text of an answer that is not JSON (the LoRA endpoints answer text)."""
        if not raw:
            return None
        try:
            text = raw.decode()
            return json.loads(text)
        except UnicodeDecodeError:
            raise BadAnswer(
                f"the vLLM server {self.url} answered {path} with bytes that are not UTF-8"
            ) from None
        except json.JSONDecodeError:
            return text
        except (RecursionError, ValueError) as err:  # nested too deep, an integer too long
            raise BadAnswer(
                f"the vLLM server {self.url} answered {path} with JSON it cannot parse: {str(err)[:200]}"
            ) from None

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        retries: int | None = None,
        timeout_s: float | None = None,
        limit: int = SMALL_ANSWER_BYTES,
        done_if: Callable[[int, str], bool] | None = None,
    ) -> Any:
        """GET (``body`` None) or POST ``path``; the decoded JSON (or text) answer. ``retries`` and
        ``timeout_s`` (each try) default to the policy's; ``limit``: the answer's most bytes.
        ``done_if(code, message)``: a refusal that means a retry found the work done by a try
        whose answer was lost (success, None returned); only after such a try."""
        tries = (self.policy.retries if retries is None else retries) + 1
        last: BaseException | None = None
        lost = False  # a try reached the server and its answer never came
        for attempt in range(tries):
            try:
                return self._once(
                    path, body, self.policy.timeout_s if timeout_s is None else timeout_s, limit
                )
            except _Status as err:
                if err.code < 500:
                    if lost and done_if is not None and done_if(err.code, err.message):
                        return None
                    raise ServerRefused(f"the vLLM server {self.url} refused {path}: {err}") from None
                last = err
            except (OSError, http.client.HTTPException) as err:
                last = err  # refused, reset, timed out
                lost = lost or not isinstance(err, ConnectionRefusedError)
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
            f"{self.resume()} (with new servers if the run starts them)"
        )

    # ---------------------------------------------------------------- the endpoints
    def healthy(self) -> bool:
        """Whether ``/health`` answers now (one short try)."""
        try:
            self._once("/health", None, 2.0, SMALL_ANSWER_BYTES)
            return True
        except (OSError, http.client.HTTPException, _Status, ServerError):
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
        listed = self.call("/v1/models")
        data = listed.get("data") if isinstance(listed, dict) else None
        if not isinstance(data, list) or not all(
            isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
        ):
            raise BadAnswer(
                f"the vLLM server {self.url} answered /v1/models with {_show(listed)}, not "
                f'{{"data": [{{"id": <name>, ...}}, ...]}}: is it a vLLM server? {self.where}'
            )
        return [m["id"] for m in data if not m.get("parent")]

    def complete(self, body: dict[str, Any], limit: int = SMALL_ANSWER_BYTES) -> dict[str, Any]:
        """A ``/v1/completions`` answer, a JSON object (its content is checked by the caller)."""
        answer = self.call("/v1/completions", body, limit=limit)
        if not isinstance(answer, dict):
            raise BadAnswer(
                f"the vLLM server {self.url} answered /v1/completions with {_show(answer)}, not a "
                f"JSON object; {self.where}"
            )
        return answer

    def load_lora(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path``. A retry after a lost answer that finds it loaded
        (vLLM: 400 "... has already been loaded") is success."""
        try:
            self.call(
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": path},
                done_if=lambda code, message: code == 400 and "already been loaded" in message.lower(),
            )
        except ServerRefused as err:
            raise ServerRefused(
                f"{err}\nA run that trains a LoRA adapter loads each version at run time: start the "
                "server with --enable-lora --max-lora-rank <r or more> and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            ) from None

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``. A retry after a lost answer that finds it gone (vLLM: 404
        "... cannot be found") is success."""
        self.call(
            "/v1/unload_lora_adapter",
            {"lora_name": name},
            done_if=lambda code, message: code == 404 and "cannot be found" in message.lower(),
        )

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


def _show(value: Any) -> str:
    """A short description of an answer that is not what was asked (its kind and start)."""
    kind = "text" if isinstance(value, str) else f"a JSON {type(value).__name__}"
    return f"{kind} {str(value)[:120]!r}" if value is not None else "nothing"


def _message(raw: bytes) -> str:
    """The server's error message (its JSON ``error.message``, ``message`` or ``detail``), or the body."""
    body = raw.decode(errors="replace")
    try:
        parsed = json.loads(body)
        error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
        text = (error.get("message") or error.get("detail") or body) if isinstance(error, dict) else body
    except (ValueError, RecursionError):
        text = body
    return str(text)[:500]
