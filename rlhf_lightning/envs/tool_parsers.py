"""Read tool calls out of a model's reply, by the format its chat template taught it.

Each parser takes the decoded reply and returns a :class:`ParsedReply`: the calls in the order
they were written, each either a :class:`ToolCall` or a :class:`MalformedCall` (the fragment as
written and what is wrong with it), and the text outside the calls. A malformed fragment is an
error message for the model (``ToolEnv`` answers it with a tool message), never an exception.
A reply with no call at all is the model's final answer.

Parsers are keyed by the names used in config (``rollout.tool_parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the
  reply, any number of them (Hermes, Qwen2.5, Qwen3; the ``tools.jinja`` template).
- ``llama3_json``: a reply that is JSON objects ``{"name": ..., "parameters": {...}}`` (Llama 3.1
  and 3.3; ``"arguments"`` is accepted too), one or more, separated by ``;`` or whitespace, with
  an optional ``<|python_tag|>`` in front.
- ``pythonic``: a reply that is a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris"), add(a=1, b=2)]`` (Llama 3.2 and 4); argument values must be
  literals (read with ``ast.literal_eval``, never evaluated).
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}``
  objects (Mistral). The harness decodes replies without special tokens, and Mistral's
  tokenizers make ``[TOOL_CALLS]`` one, so a reply that *starts* with such a JSON list counts too.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhf_lightning.runtime.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool name and its arguments (not yet checked against the schema)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A fragment that tried to be a call and is not one: ``text`` as written, ``error`` why."""

    text: str
    error: str
    name: str = ""  # the tool it named, when that much could be read


@dataclass
class ParsedReply:
    """A reply's calls in the order written (well-formed and malformed), and the other text."""

    items: list[ToolCall | MalformedCall] = field(default_factory=list)
    content: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.items if isinstance(c, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [c for c in self.items if isinstance(c, MalformedCall)]

    @property
    def has_calls(self) -> bool:
        """The reply tried to call a tool (so it is not the final answer)."""
        return bool(self.items)


ToolParser = Callable[[str], ParsedReply]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool parser")

MAX_FRAGMENT_CHARS = 200  # a malformed fragment is quoted back to the model up to this length


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name`` (``KeyError`` listing the valid names otherwise)."""
    return TOOL_PARSERS.get(name)


# What decoding a reply's JSON may raise: bad JSON, or (RecursionError) JSON nested deeper than
# Python's recursion limit, e.g. a reply caught in a repetition loop of brackets.
JSON_ERRORS = (json.JSONDecodeError, RecursionError)


def _why(err: Exception) -> str:
    if isinstance(err, RecursionError):
        return "nested too deeply"
    return str(err)


def _short(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_FRAGMENT_CHARS else text[:MAX_FRAGMENT_CHARS] + "..."


def call_from_object(obj: Any, text: str, arguments_keys: tuple[str, ...]) -> ToolCall | MalformedCall:
    """``{"name": str, <one of arguments_keys>: object}`` (arguments may be missing: none, or a
    JSON string of an object, as OpenAI-style APIs write them) as a call, else what is wrong."""
    if not isinstance(obj, dict):
        return MalformedCall(_short(text), f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(_short(text), 'no "name" string')
    key = next((k for k in arguments_keys if k in obj), None)
    args = obj.get(key, {}) if key is not None else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except JSON_ERRORS as err:
            return MalformedCall(_short(text), f'"{key}" is a string that is not JSON ({_why(err)})', name)
    if not isinstance(args, dict):
        return MalformedCall(
            _short(text), f'"{key}" must be a JSON object of arguments, got {type(args).__name__}', name
        )
    return ToolCall(name, args)


def _json_call(body: str, arguments_keys: tuple[str, ...]) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except JSON_ERRORS as err:
        return MalformedCall(_short(body), f"invalid JSON ({_why(err)})")
    return call_from_object(obj, body, arguments_keys)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


@TOOL_PARSERS.register("hermes")
def parse_hermes(reply: str) -> ParsedReply:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, in order; an opened
    block that is never closed is malformed (the reply was cut, or the tag forgotten)."""
    parsed = ParsedReply()
    content: list[str] = []
    pos = 0
    while (start := reply.find(_HERMES_OPEN, pos)) >= 0:
        content.append(reply[pos:start])
        body_start = start + len(_HERMES_OPEN)
        end = reply.find(_HERMES_CLOSE, body_start)
        if end < 0:
            parsed.items.append(MalformedCall(_short(reply[start:]), f"{_HERMES_OPEN} is never closed"))
            pos = len(reply)
            break
        parsed.items.append(_json_call(reply[body_start:end], ("arguments", "parameters")))
        pos = end + len(_HERMES_CLOSE)
    content.append(reply[pos:])
    parsed.content = "".join(content).strip()
    return parsed


def _json_values(text: str, separators: str) -> list[tuple[Any, str, str | None]]:
    """Consecutive JSON values in ``text`` separated by ``separators`` and whitespace, as
    (value, its text, None); when the rest does not parse, a last (None, rest, error)."""
    decoder = json.JSONDecoder()
    out: list[tuple[Any, str, str | None]] = []
    pos = 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return out
        try:
            value, end = decoder.raw_decode(text, pos)
        except JSON_ERRORS as err:
            out.append((None, text[pos:], f"invalid JSON ({_why(err)})"))
            return out
        out.append((value, text[pos:end], None))
        pos = end


@TOOL_PARSERS.register("llama3_json")
def parse_llama3_json(reply: str) -> ParsedReply:
    """A reply that starts with ``{`` (after an optional ``<|python_tag|>``) is one or more JSON
    call objects separated by ``;``; anything else is the final answer."""
    text = reply.strip()
    text = text.removeprefix("<|python_tag|>").lstrip()
    if not text.startswith("{"):
        return ParsedReply(content=reply.strip())
    parsed = ParsedReply()
    for value, fragment, error in _json_values(text, ";"):
        if error is not None:
            parsed.items.append(MalformedCall(_short(fragment), error))
        else:
            parsed.items.append(call_from_object(value, fragment, ("parameters", "arguments")))
    return parsed


_MISTRAL_TAG = "[TOOL_CALLS]"
_MISTRAL_BARE = re.compile(r"\[\s*\{")


@TOOL_PARSERS.register("mistral")
def parse_mistral(reply: str) -> ParsedReply:
    """``[TOOL_CALLS]`` and a JSON list of call objects (or a reply starting with such a list,
    the marker having been decoded away as a special token); text before the marker is content."""
    tag = reply.find(_MISTRAL_TAG)
    if tag >= 0:
        content, body = reply[:tag].strip(), reply[tag + len(_MISTRAL_TAG) :].strip()
    elif _MISTRAL_BARE.match(reply.lstrip()):
        content, body = "", reply.strip()
    else:
        return ParsedReply(content=reply.strip())
    parsed = ParsedReply(content=content)
    try:
        value, end = json.JSONDecoder().raw_decode(body)
    except JSON_ERRORS as err:
        parsed.items.append(MalformedCall(_short(body), f"invalid JSON ({_why(err)})"))
        return parsed
    objects = value if isinstance(value, list) else [value]
    for obj in objects:
        parsed.items.append(call_from_object(obj, json.dumps(obj), ("arguments", "parameters")))
    if not objects:
        parsed.items.append(MalformedCall(_short(body), "an empty list of calls"))
    parsed.content = " ".join(t for t in (content, body[end:].strip()) if t)
    return parsed


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


class _Segments:
    """Source text of AST nodes in O(node length): ``ast.get_source_segment`` splits the whole
    source on every call, which made a reply of n calls cost O(n x reply) (minutes for a few
    thousand calls). Line starts are found once; columns are UTF-8 byte offsets, as in the AST."""

    def __init__(self, source: str) -> None:
        self.data = source.encode()
        self.starts = [0] + [m.end() for m in re.finditer(rb"\r\n|\r|\n", self.data)]

    def __call__(self, node: ast.expr) -> str:
        if node.end_lineno is None or node.end_col_offset is None:
            return ""
        start = self.starts[node.lineno - 1] + node.col_offset
        end = self.starts[node.end_lineno - 1] + node.end_col_offset
        return self.data[start:end].decode(errors="replace")


def _pythonic_call(node: ast.expr, segment: _Segments) -> ToolCall | MalformedCall:
    text = segment(node)
    if not isinstance(node, ast.Call):
        return MalformedCall(_short(text), "expected a call such as name(arg=value)")
    name = segment(node.func)
    if not isinstance(node.func, (ast.Name, ast.Attribute)):
        return MalformedCall(_short(text), "the called thing must be a tool name")
    if node.args:
        return MalformedCall(_short(text), "arguments must be given by keyword (name=value)", name)
    arguments: dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None:
            return MalformedCall(_short(text), "**kwargs is not allowed", name)
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return MalformedCall(_short(text), f"argument {kw.arg!r} is not a literal value", name)
    return ToolCall(name, arguments)


@TOOL_PARSERS.register("pythonic")
def parse_pythonic(reply: str) -> ParsedReply:
    """A reply that starts with ``[name(`` is a Python list of keyword-argument calls (parsed,
    never run); anything else is the final answer."""
    text = reply.strip()
    if not _PYTHONIC_START.match(text):
        return ParsedReply(content=text)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as err:
        return ParsedReply([MalformedCall(_short(text), f"not a Python list of calls ({err})")])
    if not isinstance(tree.body, ast.List):
        return ParsedReply([MalformedCall(_short(text), "expected one list: [name(arg=value), ...]")])
    segment = _Segments(text)
    return ParsedReply([_pythonic_call(node, segment) for node in tree.body.elts])
