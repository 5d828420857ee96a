"""The policy behind an OpenAI-compatible endpoint, recording every call.

:class:`PolicyEndpoint` serves ``/v1/chat/completions`` and ``/v1/completions`` (and
``/v1/models``) on 127.0.0.1 (or ``host``) from a thread of its own. Each episode has its own
address, ``<url>/episodes/<id>/v1``, so concurrent episodes never mix: every call served there is
recorded under the episode (:class:`~rlhf_lightning.rollout.agents.assembly.Call`: prompt ids,
completion ids, the engine's log-probs, finish reason, policy version).

Generation does not happen on the server's thread: a request waits in a queue until the thread
that owns the rollout engine (the trainer's, or the async producer's) calls :meth:`serve`, which
takes every request that arrives within ``gather_s`` of the first (up to ``max_batch``) and
generates them in one engine call per kind of request (same ``max_tokens``, stop strings and
``n``). 32 agents waiting on their next turn cost about one batched generate, not 32.

Prompts are rendered with the run's chat template (``tokenizer.apply_chat_template`` with the
request's ``tools``), replies decoded without special tokens and read for tool calls with the
run's parser (``rollout.tool_parser``). Sampling is the run's (``rollout.temperature``,
``top_p``, ``top_k``): a request's own temperature or top_p would make the recorded log-probs
those of another distribution than the one the trainer scores, so they are served with the run's
and counted (``agent/sampling_overridden``). ``max_tokens`` is capped at ``rollout.max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf_lightning.envs.tool_parsers import ParsedReply, get_tool_parser
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.agents import openai_api as api
from rlhf_lightning.rollout.agents.assembly import Call

log = logging.getLogger(__name__)

GATHER_S = 0.01  # requests arriving this soon after the first join its engine call
MAX_BATCH = 256


@dataclass
class Pending:
    """A request waiting for the engine: ``prompt_ids`` and the episode it was sent under."""

    episode: str
    prompt_ids: list[int]
    ask: api.Ask
    main_key: str  # the conversation's first message (another purpose's calls differ)
    seq: int = 0  # arrival order (ties within one episode's round)
    done: concurrent.futures.Future[list[tuple[Completion, str]]] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass
class EpisodeRecord:
    """Every call served under one episode's address, in the order served."""

    calls: list[Call] = field(default_factory=list)
    first_key: str | None = None
    refused: int = 0  # requests answered 400 (too long, malformed)


class PolicyEndpoint:
    """The run's policy over HTTP (see the module's docstring).

    Args:
        tokenizer: renders prompts (its chat template) and decodes replies.
        max_model_len: a prompt plus its ``max_tokens`` beyond it is refused (``400``).
        parser: the tool-call parser's name (``rollout.tool_parser``).
        host: the interface to listen on (127.0.0.1 unless asked).
        model: the name ``/v1/models`` lists (any name is accepted in requests).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int,
        parser: str = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "policy",
        gather_s: float = GATHER_S,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self.tokenizer, self.max_model_len, self.model = tokenizer, max_model_len, model
        self.parse: Callable[[str], ParsedReply] = get_tool_parser(parser)
        self.host, self.port = host, port
        self.gather_s, self.max_batch = gather_s, max_batch
        self.pending: queue.Queue[Pending] = queue.Queue()
        self.episodes: dict[str, EpisodeRecord] = {}
        self.engine_calls = 0  # batched engine calls made (tests count them)
        self.overridden = 0  # requests whose temperature/top_p differed from the run's
        self._held: list[Pending] = []  # requests of the round being gathered (``live``)
        self._order: dict[str, int] = {}  # each open episode's place, in the order opened
        self._seq = itertools.count()
        self._arrivals = itertools.count()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode: str) -> str:
        """The address an episode's client uses (``openai.AsyncOpenAI(base_url=...)``)."""
        return f"{self.url}/episodes/{episode}/v1"

    def start(self) -> PolicyEndpoint:
        """Listen (once); returns self."""
        if self._thread is not None:
            return self
        ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run_server, args=(ready,), name="policy-endpoint", daemon=True
        )
        self._thread.start()
        self.port = ready.result(timeout=30)
        return self

    def _run_server(self, ready: concurrent.futures.Future[int]) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_post("/episodes/{episode}/v1/completions", self._completions)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        runner = web.AppRunner(app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self._runner = runner
            ready.set_result(int(runner.addresses[0][1]))
        except BaseException as err:  # the port taken, say: the caller hears it
            ready.set_exception(err)
            return
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def close(self) -> None:
        """Stop listening; requests still waiting are answered ``503``."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._thread = self._loop = None
        self._fail_pending(ConnectionAbortedError("the policy endpoint closed"))

    # ---------------------------------------------------------------- episodes
    def open_episode(self, episode: str) -> str:
        """Start recording under ``episode``; its base URL."""
        with self._lock:
            self.episodes[episode] = EpisodeRecord()
            self._order[episode] = next(self._seq)
        return self.base_url(episode)

    def close_episode(self, episode: str) -> EpisodeRecord:
        """Stop serving ``episode`` (later calls are ``404``); its record."""
        with self._lock:
            self._order.pop(episode, None)
            return self.episodes.pop(episode, EpisodeRecord())

    # ---------------------------------------------------------------- the engine's side
    def serve(
        self,
        engine: Any,
        params: SamplingParams,
        version: Callable[[], int],
        wait_s: float = 0.05,
        live: int | None = None,
    ) -> int:
        """Generate what is waiting, one engine call per kind of request. Returns the requests
        served (0 when nothing was ready within ``wait_s``). Call from the thread that owns
        ``engine``.

        ``live=None`` (``window``): the requests that arrive within ``gather_s`` of the first.
        ``live=n`` (``rounds``): only once ``n`` episodes have a request waiting (the episodes still
        running, which the caller counts), all of them, in the order the episodes were opened, so
        the engine sees the same batches in the same order whatever the timing: a run repeats
        exactly, and lockstep asynchronous rollouts sample what the synchronous run samples."""
        batch = self._gather(wait_s) if live is None else self._round(wait_s, live)
        if not batch:
            return 0
        kinds: dict[tuple[int, tuple[str, ...], int], list[Pending]] = {}
        for p in batch:
            cap = min(p.ask.max_tokens or params.max_new_tokens, params.max_new_tokens)
            kinds.setdefault((cap, p.ask.stop, p.ask.n), []).append(p)
        for (cap, stop, n), group in kinds.items():
            asked = replace(params, max_new_tokens=cap, stop=tuple(params.stop) + stop, n=n, seed=None)
            try:
                out = engine.generate([p.prompt_ids for p in group], asked)
            except BaseException as err:
                for p in group:
                    p.done.set_exception(err)
                raise
            self.engine_calls += 1
            v = version()
            for i, p in enumerate(group):
                mine = list(out[i * n : (i + 1) * n])  # prompt-major
                texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in mine]
                self._record(p, mine, texts, v)
                p.done.set_result(list(zip(mine, texts)))
        return len(batch)

    def _gather(self, wait_s: float) -> list[Pending]:
        try:
            first = self.pending.get(timeout=wait_s)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + self.gather_s
        while len(batch) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                batch.append(
                    self.pending.get(timeout=max(left, 0.0)) if left > 0 else self.pending.get_nowait()
                )
            except queue.Empty:
                break
        return batch

    def _round(self, wait_s: float, live: int) -> list[Pending]:
        deadline = time.monotonic() + wait_s
        while True:
            waiting = {p.episode for p in self._held}
            if self._held and len(waiting) >= live:
                batch = sorted(self._held, key=lambda p: (self._order.get(p.episode, -1), p.seq))
                self._held = []
                return batch
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            try:
                self._held.append(self.pending.get(timeout=left))
            except queue.Empty:
                return []

    def _record(self, p: Pending, completions: list[Completion], texts: list[str], version: int) -> None:
        with self._lock:
            record = self.episodes.get(p.episode)
            if record is None:  # the episode ended (its deadline) while the call waited
                return
            if record.first_key is None:
                record.first_key = p.main_key
            for c, text in zip(completions, texts):
                record.calls.append(
                    Call(
                        prompt_ids=list(p.prompt_ids),
                        completion_ids=list(c.token_ids),
                        logprobs=list(c.logprobs),
                        finish_reason=c.finish_reason,
                        version=version,
                        text=text,
                        main=p.main_key == record.first_key,
                    )
                )

    def drop_pending(self) -> None:
        """Answer what still waits (a call of an episode past its deadline) with ``503``."""
        self._fail_pending(ConnectionAbortedError("its episode ended"))

    def _fail_pending(self, err: BaseException) -> None:
        held, self._held = self._held, []
        for p in held:
            p.done.set_exception(err)
        while True:
            try:
                p = self.pending.get_nowait()
            except queue.Empty:
                return
            p.done.set_exception(err)

    # ---------------------------------------------------------------- HTTP
    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"status": "ok"})

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "rlhf_lightning"}],
            }
        )

    async def _body(self, request: Any) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise api.BadRequest(f"the body is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise api.BadRequest("the body must be a JSON object")
        return body

    def _known(self, episode: str) -> bool:
        with self._lock:
            return episode in self.episodes

    async def _answer(self, request: Any, chat: bool) -> Any:
        from aiohttp import web

        episode = request.match_info["episode"]
        if not self._known(episode):
            return web.json_response(
                {
                    "error": {
                        "message": f"no episode {episode!r} is running here (it ended or never began)",
                        "type": "not_found_error",
                    }
                },
                status=404,
            )
        try:
            body = await self._body(request)
            ask = api.parse_ask(body, chat)
            if chat:
                messages = api.normalise_messages(body.get("messages"))
                tools = api.check_tools(body.get("tools"))
                text = self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False
                )
                prompt_ids = self.tokenizer(text, add_special_tokens=False).input_ids
                main_key = json.dumps(messages[0], sort_keys=True)
            else:
                tools, prompt_ids, main_key = None, self._completion_prompt(body.get("prompt")), "completions"
            if len(prompt_ids) + (ask.max_tokens or 1) > self.max_model_len:
                raise api.BadRequest(
                    f"this model's maximum context length is {self.max_model_len} tokens (env.max_model_len); the "
                    f"prompt has {len(prompt_ids)} and max_tokens asks {ask.max_tokens or 1} more",
                    "messages" if chat else "prompt",
                )
        except api.BadRequest as err:
            with self._lock:
                if episode in self.episodes:
                    self.episodes[episode].refused += 1
            return web.json_response(err.body(), status=400)
        if ask.temperature is not None or ask.top_p is not None:
            self.overridden += 1
        pending = Pending(episode, prompt_ids, ask, main_key, next(self._arrivals))
        self.pending.put(pending)
        try:
            completions = await asyncio.wrap_future(pending.done)
        except Exception as err:
            return web.json_response(
                {"error": {"message": f"generation failed: {err}", "type": "server_error"}}, status=503
            )
        choices = [self._choice(c, text, ask.logprobs) for c, text in completions]
        model = str(body.get("model") or self.model)
        if chat:
            parsed = [self.parse(c.text) if tools else None for c in choices]
            if ask.stream:
                return await self._stream(
                    request, api.chat_chunks(model, len(prompt_ids), choices, parsed, ask)
                )
            return web.json_response(api.chat_response(model, len(prompt_ids), choices, parsed, ask))
        if ask.stream:
            events = [
                {**api.completion_response(model, len(prompt_ids), [c], ask), "object": "text_completion"}
                for c in choices
            ]
            return await self._stream(request, events)
        return web.json_response(api.completion_response(model, len(prompt_ids), choices, ask))

    def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return list(prompt)
        raise api.BadRequest(
            "prompt must be one string or one list of token ids (one prompt per request)", "prompt"
        )

    def _choice(self, c: Completion, text: str, logprobs: bool) -> api.Choice:
        """A served completion as a response choice (each token's own text only when the request
        asked for log-probs: it is what they are shown against)."""
        return api.Choice(
            text=text,
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            finish_reason=c.finish_reason,
            tokens=[self.tokenizer.decode([t]) for t in c.token_ids] if logprobs else [],
        )

    async def _stream(self, request: Any, events: list[dict[str, Any]]) -> Any:
        from aiohttp import web

        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(api.sse(events))
        await response.write_eof()
        return response

    async def _chat(self, request: Any) -> Any:
        return await self._answer(request, chat=True)

    async def _completions(self, request: Any) -> Any:
        return await self._answer(request, chat=False)
