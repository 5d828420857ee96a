"""A fake vLLM OpenAI-compatible server on 127.0.0.1, as far as ``rollout=vllm_server`` uses one:
``/health``, ``/v1/models``, ``/v1/completions`` (log-probs of the kind its ``logprobs_mode``
gives), runtime LoRA loading with vLLM's refusals (400 "already been loaded", 404 "cannot be
found"), and the development endpoints. ``lose[path] = k``: the next k requests to ``path`` do
their work and then drop the connection without an answer; ``wrong``: answers completion
requests instead (a test's misbehaving server)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    server: Any

    def do_GET(self) -> None:
        fake: FakeVLLM = self.server.fake
        if self.path == "/health":
            self.send(200, b"")
        else:
            base = [{"id": m, "parent": None} for m in fake.models]
            adapters = [{"id": a, "parent": fake.models[0]} for a in sorted(fake.loaded)]
            self.send_json(200, {"data": base + adapters})

    def do_POST(self) -> None:
        fake: FakeVLLM = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        with fake.lock:
            fake.requests.append((self.path, body))
        if self.path == "/v1/completions":
            if fake.wrong is not None:
                fake.wrong(self, body)
            else:
                self.send_json(200, fake.completion(body))
        elif self.path == "/v1/load_lora_adapter":
            name = body["lora_name"]
            if name in fake.loaded:
                self.refuse(400, f"The lora adapter '{name}' has already been loaded.")
                return
            fake.loaded.add(name)
            self.done(f"Success: LoRA adapter '{name}' added successfully.")
        elif self.path == "/v1/unload_lora_adapter":
            name = body["lora_name"]
            if name not in fake.loaded:
                self.refuse(404, f"The lora adapter '{name}' cannot be found.")
                return
            fake.loaded.discard(name)
            self.done(f"Success: LoRA adapter '{name}' removed successfully.")
        else:  # /collective_rpc, /reset_prefix_cache
            self.done("{}")

    def done(self, text: str) -> None:
        """The work is done: answer, unless this answer is to be lost."""
        fake: FakeVLLM = self.server.fake
        with fake.lock:
            lose = fake.lose.get(self.path, 0) > 0
            if lose:
                fake.lose[self.path] -= 1
        if lose:
            self.close_connection = True  # the connection drops, no status line
            return
        self.send(200, text.encode(), "text/plain")

    def refuse(self, code: int, message: str) -> None:
        self.send_json(code, {"error": {"message": message, "type": "BadRequestError", "code": code}})

    def send_json(self, status: int, body: Any) -> None:
        self.send(status, json.dumps(body).encode())

    def send(self, status: int, data: bytes, kind: str = "application/json", length: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if length:
            self.send_header("Content-Length", str(len(data)))
        else:
            self.close_connection = True  # the body ends when the connection does
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class FakeVLLM:
    """The fake server (module docstring); ``url``, ``close()``; every request in ``requests``."""

    def __init__(
        self, logprobs_mode: str = "processed_logprobs", models: tuple[str, ...] = ("m",), vocab: int = 512
    ) -> None:
        self.logprobs_mode, self.models, self.vocab = logprobs_mode, models, vocab
        self.loaded: set[str] = set()
        self.lose: dict[str, int] = {}
        self.wrong: Callable[[Handler, dict[str, Any]], None] | None = None
        self.tie = False  # processed top-k 1 log-probs of two tokens tied at the top: -log 2
        self.requests: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.httpd: Any = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.fake = self  # type: ignore[attr-defined]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def count(self, path: str) -> int:
        with self.lock:
            return sum(p == path for p, _ in self.requests)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def logprob(self, body: dict[str, Any]) -> float:
        """The sampled token's log-prob as the server's logprobs mode reports it."""
        if self.logprobs_mode.endswith("logits"):
            return 3.25  # a logit
        if self.logprobs_mode == "processed_logprobs" and body.get("top_k") == 1:
            return -0.6931471805599453 if self.tie else 0.0  # the only token left (or one of two)
        return -0.5

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """``n`` choices of up to two tokens each, ids from the prompt's first."""
        k = min(2, int(body["max_tokens"]))
        ids = [(body["prompt"][0] + j) % self.vocab for j in range(k)]
        choice = {"token_ids": ids, "logprobs": {"token_logprobs": [self.logprob(body)] * k}}
        return {"choices": [{"index": j, **choice, "finish_reason": "length"} for j in range(body["n"])]}
