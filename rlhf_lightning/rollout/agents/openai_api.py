"""The OpenAI wire format the policy endpoint speaks: request checks, message normalisation, and
response bodies (whole and as server-sent events). Pure functions of plain data: no server, no
engine.

Requests are checked field by field; a bad one is answered ``400`` with an OpenAI-style error
naming the field (:class:`BadRequest`), never a crash of the endpoint.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlhf_lightning.envs.tool_parsers import ParsedReply


class BadRequest(ValueError):
    """A request the endpoint refuses (``400``), naming the field (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": "invalid_request_error",
                "param": self.param,
                "code": None,
            }
        }


@dataclass(frozen=True)
class Ask:
    """What a request asks of the engine, beyond its prompt.

    ``max_tokens``: the request's cap (None: the run's ``rollout.max_new_tokens``); ``stop``:
    stop strings; ``n``: completions; ``logprobs``: return them (chat: ``top_logprobs`` is
    always 0); ``stream``: answer as server-sent events; ``usage_in_stream``:
    ``stream_options.include_usage``; ``temperature``/``top_p``: what the request asked (the
    run's sampling decides in training; see the agents guide)."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: bool = False
    stream: bool = False
    usage_in_stream: bool = False
    temperature: float | None = None
    top_p: float | None = None


def _number(body: dict[str, Any], key: str, kind: type, low: float, high: float | None = None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not isinstance(value, int))
    ):
        raise BadRequest(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
    if value < low or (high is not None and value > high):
        raise BadRequest(f"{key}={value} is out of range [{low}, {high if high is not None else 'inf'}]", key)
    return kind(value)


def parse_ask(body: dict[str, Any], chat: bool) -> Ask:
    """The request's sampling fields, checked (``chat``: ``/v1/chat/completions``'s names)."""
    max_tokens = _number(body, "max_completion_tokens", int, 1) if chat else None
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int, 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(stop)
    else:
        raise BadRequest(f"stop must be a string or a list of up to 4 strings, got {stop!r}", "stop")
    n = _number(body, "n", int, 1, 128) or 1
    if chat:
        logprobs = body.get("logprobs") is True
        top = body.get("top_logprobs")
        if top not in (None, 0):
            raise BadRequest(
                f"top_logprobs={top!r}: only 0 is served (the sampled token's log-prob)", "top_logprobs"
            )
    else:
        lp = body.get("logprobs")
        if lp not in (None, 0, 1) and not (isinstance(lp, int) and lp >= 0):
            raise BadRequest(f"logprobs must be an integer >= 0, got {lp!r}", "logprobs")
        logprobs = lp is not None
    stream = body.get("stream") is True
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, got {options!r}", "stream_options")
    return Ask(
        max_tokens=max_tokens,
        stop=stops,
        n=n,
        logprobs=logprobs,
        stream=stream,
        usage_in_stream=stream and options.get("include_usage") is True,
        temperature=_number(body, "temperature", float, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 0.0, 1.0),
    )


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise BadRequest(f"{where}.content: only text parts are served, got {part!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}", "messages"
    )


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as the chat template takes them: text content, and an assistant's
    ``tool_calls`` with their ``arguments`` as objects (templates render them with ``tojson``)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise BadRequest(
                f"{where} needs a role of system, user, assistant or tool, got {m!r}"[:300], "messages"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise BadRequest(
                        f"{where}.tool_calls: each needs function.name, got {call!r}"[:300], "messages"
                    )
                args = fn.get("arguments", "{}")
                try:
                    parsed = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    parsed = args  # the template writes it as given
                calls.append(
                    {
                        "id": call.get("id"),
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": parsed},
                    }
                )
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's ``tools`` (function schemas), or None."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        for t in tools
    ):
        raise BadRequest("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    return tools


def tool_calls(parsed: ParsedReply) -> list[dict[str, Any]]:
    """A reply's well-formed calls as the ``openai`` client reads them."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in parsed.calls
    ]


@dataclass
class Choice:
    """One generated choice, decoded: ``text`` (the reply without special tokens), ``token_ids``,
    ``logprobs``, ``finish_reason`` (``stop`` | ``length``), ``tokens`` (each id's text)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    tokens: list[str]


def _chat_logprobs(c: Choice) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(c.tokens, c.logprobs)
        ]
    }


def chat_message(c: Choice, parsed: ParsedReply | None) -> tuple[dict[str, Any], str]:
    """The assistant message of a choice and its finish reason (``tool_calls`` when it called)."""
    calls = tool_calls(parsed) if parsed is not None else []
    if calls:
        content = parsed.content if parsed is not None and parsed.content.strip() else None
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": c.text}, c.finish_reason


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_response(
    model: str, prompt_tokens: int, choices: list[Choice], parsed: list[ParsedReply | None], ask: Ask
) -> dict[str, Any]:
    """A whole ``chat.completion`` body."""
    out = []
    for i, (c, p) in enumerate(zip(choices, parsed)):
        message, reason = chat_message(c, p)
        out.append(
            {
                "index": i,
                "message": message,
                "finish_reason": reason,
                "logprobs": _chat_logprobs(c) if ask.logprobs else None,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_tokens, choices),
    }


def chat_chunks(
    model: str, prompt_tokens: int, choices: list[Choice], parsed: list[ParsedReply | None], ask: Ask
) -> list[dict[str, Any]]:
    """The same answer as ``chat.completion.chunk`` events: per choice its role, its content (one
    delta) or its tool calls, then its finish reason; the usage last when asked for."""
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    chunks: list[dict[str, Any]] = []
    for i, (c, p) in enumerate(zip(choices, parsed)):
        message, reason = chat_message(c, p)
        chunks.append(
            {
                **base,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                ],
            }
        )
        delta: dict[str, Any] = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        if delta:
            chunks.append(
                {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "delta": delta,
                            "finish_reason": None,
                            "logprobs": _chat_logprobs(c) if ask.logprobs else None,
                        }
                    ],
                }
            )
        chunks.append({**base, "choices": [{"index": i, "delta": {}, "finish_reason": reason}]})
    if ask.usage_in_stream:
        chunks.append({**base, "choices": [], "usage": usage(prompt_tokens, choices)})
    return chunks


def completion_response(model: str, prompt_tokens: int, choices: list[Choice], ask: Ask) -> dict[str, Any]:
    """A whole ``text_completion`` body."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": {
                    "tokens": c.tokens,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": None,
                    "text_offset": None,
                }
                if ask.logprobs
                else None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, choices),
    }


def sse(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events: one ``data:`` line per event, then ``data: [DONE]``."""
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()
