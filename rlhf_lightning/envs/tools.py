"""Agentic tool calling through the model's chat template: ``ToolEnv``.

Tools are plain typed Python functions with Google-style docstrings; their JSON schemas come from
``transformers.utils.get_json_schema`` and reach the chat template as ``apply_chat_template(
tools=...)`` (``ToolEnv.tool_schemas``, read by ``rollout.episodes.chat.env_tools``). A named parser
(``envs.tool_parsers``) reads the calls out of each reply; each call runs with a time limit and
its result goes back as a ``{"role": "tool", ...}`` message, which the chat template renders in
its own tool-role format, so trajectories stay token-exact at assistant -> tool -> assistant
boundaries.
"""

from __future__ import annotations

import copy
import functools
import json
import pickle
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import Message, Observation
from rlhf_lightning.envs.tool_parsers import TOOL_PARSERS, MalformedCall, ToolCall, get_tool_parser
from rlhf_lightning.runtime.workers import Outcome, call_inline, in_worker, shared_pool

LIMIT_NOTE = "(that was the last tool call allowed in this episode: reply with your final answer)"


def run_tool(
    fn: Callable[..., Any], arguments: dict[str, Any], timeout_s: float | None, workers: int
) -> Outcome:
    """``fn(**arguments)`` stopped at ``timeout_s``: in a worker process of this process's tool
    pool (``workers`` processes; a call past its limit kills its worker, so nothing keeps
    running), or, when the env itself is stepped inside a worker (``env.step_timeout_s``), in
    that worker under a signal timer. Without a limit: a plain call."""
    if timeout_s is None:
        return call_inline(lambda: fn(**arguments), None)
    if in_worker():
        return call_inline(lambda: fn(**arguments), timeout_s)
    return shared_pool("tools", workers).call(fn, kwargs=arguments, timeout_s=timeout_s)


def resolve_tool(tool: Any) -> Callable[..., Any]:
    """A tool given as a callable or as the dotted path of one (``my_pkg.tools.lookup``)."""
    if isinstance(tool, str):
        from hydra.utils import get_object

        try:
            tool = get_object(tool)
        except Exception as err:
            raise ConfigError(
                "env.kwargs.tools", tool, f"the dotted path of an importable function ({err})"
            ) from None
    if not callable(tool) or isinstance(tool, type):
        raise ConfigError("env.kwargs.tools", tool, "a function, or the dotted path of one")
    return tool


def check_picklable(fn: Callable[..., Any]) -> None:
    """A tool with a time limit runs in a worker process, which gets it pickled (by name): a
    ConfigError with the fix for one that cannot be (a lambda, a function defined in a function)."""
    try:
        pickle.dumps(fn)
    except Exception as err:
        raise ConfigError(
            "env.kwargs.tools",
            getattr(fn, "__qualname__", repr(fn)),
            "a module-level function: tools with a time limit run in worker processes, which import "
            f"them by name ({err}); or set env.kwargs.tool_timeout_s=null to run them in the env's "
            "own process without a limit",
        ) from None


@functools.lru_cache(maxsize=256)
def _cached_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException, ...
        raise ConfigError(
            "env.kwargs.tools",
            getattr(fn, "__qualname__", repr(fn)),
            "a function with type hints on every argument and a Google-style docstring that "
            f"describes each one under Args: (transformers.utils.get_json_schema said: {err})",
        ) from None


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s JSON schema (``{"type": "function", "function": {...}}``); ``ConfigError`` naming
    ``env.kwargs.tools`` and what get_json_schema said when ``fn`` has no proper docstring or
    type hints."""
    try:
        return copy.deepcopy(_cached_schema(fn))
    except TypeError:  # an unhashable callable: no cache
        return _cached_schema.__wrapped__(fn)


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def value_problem(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """What is wrong with ``value`` against ``schema`` (the subset get_json_schema writes:
    ``type`` (one or a list), ``nullable``, ``enum``, ``items``, ``prefixItems``,
    ``additionalProperties``), or None when it fits."""
    if value is None and schema.get("nullable"):
        return None
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in allowed):
            shown = json.dumps(value)[:40]
            return f"{where} must be {' or '.join(allowed)}, got {_json_type(value)} {shown}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)[:40]}"
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        if prefix is not None:
            if len(value) != len(prefix):
                return f"{where} must have {len(prefix)} items, got {len(value)}"
            pairs = list(zip(value, prefix))
        else:
            items = schema.get("items")
            pairs = [(v, items) for v in value] if isinstance(items, dict) else []
        for i, (v, s) in enumerate(pairs):
            if (problem := value_problem(v, s, f"{where}[{i}]")) is not None:
                return problem
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in value.items():
            if (problem := value_problem(v, schema["additionalProperties"], f"{where}[{k!r}]")) is not None:
                return problem
    return None


def argument_problems(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Every way ``arguments`` misses the tool's ``parameters`` schema: missing required
    arguments, unknown ones, wrongly typed ones (empty when they fit)."""
    props: dict[str, Any] = parameters.get("properties", {})
    problems = [f"missing {name!r}" for name in parameters.get("required", []) if name not in arguments]
    problems += [f"{name!r} is not an argument" for name in arguments if name not in props]
    for name, value in arguments.items():
        if name in props and (problem := value_problem(value, props[name], repr(name))) is not None:
            problems.append(problem)
    return problems


def result_text(value: Any, max_chars: int) -> str:
    """A tool's return value as the tool message's content: a string as is, else JSON (or
    ``str``), cut to ``max_chars`` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [cut to {max_chars} characters]"
    return text


class CallResult(NamedTuple):
    """One tool call's message content and what happened."""

    content: str
    valid: bool  # a known tool with arguments that fit: it ran
    failed: bool = False  # it raised or ran over its limit
    timed_out: bool = False


class ToolEnv:
    """A task the model may solve with tools: subclasses pose it and score the final answer.

    Episode semantics:

    - A reply with tool calls (as ``parser`` reads them; malformed ones count) gets one tool
      message per call, in the order written: ``{"role": "tool", "name": <tool>, "content": <str>}``,
      together the next observation (the chat template renders them). Each call's arguments are
      checked against the tool's schema first; an unknown tool, missing, unknown or wrongly
      typed arguments, or a malformed call (e.g. invalid JSON) is not run and its message says
      what was wrong (``error: ...``). A valid call runs with a time limit (``tool_timeout_s``)
      in a worker process (:func:`run_tool`; ``tool_workers`` of them, shared by every env of
      the process): one that runs over is stopped (its worker killed, a new one started), so
      nothing of it keeps running. Its return value (a string as is, anything else as JSON, cut
      to ``max_result_chars``, as are error texts) is the content, or, when it raises or runs over,
      ``error: <tool> raised <Type>: <message>`` / ``error: <tool> did not return within <t> s``.
      The episode goes on. Tools must therefore be picklable (module-level functions).
    - ``max_tool_calls`` calls (every call counts, malformed ones too) per episode. Calls beyond
      it in a reply are not run (``error: not run: ...``), and the message of the reply that
      reaches the limit ends with a note that the next reply must be the final answer. A reply
      with tool calls after that (with ``max_tool_calls=0``: any) ends the episode unanswered:
      terminated, reward 0, ``info["correct"] = False``, ``info["answered"] = False``.
    - A reply with no tool call is the final answer: ``score_answer(reply)`` is the turn's
      reward and the episode terminates; ``info["correct"] = is_correct(reply, score)``.

    Reward of a tool turn (shaping, default 0): ``call_reward`` per valid call (it named a
    known tool with arguments that fit, whether it then returned, raised or ran over) minus
    ``error_penalty`` per invalid one (malformed, unknown tool, bad arguments); refused calls
    beyond the limit score nothing. The episode's return is the answer's score plus this shaping.
    ``info`` each turn: ``tool_calls``, ``tool_errors`` (in this reply; errors: invalid calls,
    raised, timed out) and ``tool_timeouts`` (calls stopped at their limit), ``correct`` (False
    until a correct final answer) and ``answered``.

    Subclasses implement :meth:`new_task` and :meth:`score_answer`.

    Args:
        tools: typed functions with docstrings, or their dotted paths.
        parser: a name in ``envs.tool_parsers.TOOL_PARSERS`` (config: ``rollout.tool_parser``).
        max_tool_calls: calls allowed per episode.
        tool_timeout_s: a call that takes longer is stopped (None: no limit; then it runs in the
            env's own process).
        call_reward: reward per valid call.
        error_penalty: penalty per invalid call.
        max_result_chars: a longer tool result is cut.
        tool_workers: worker processes for tool calls (the process's pool has the most asked).
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | str],
        parser: str = "hermes",
        max_tool_calls: int = 4,
        tool_timeout_s: float | None = 10.0,
        call_reward: float = 0.0,
        error_penalty: float = 0.0,
        max_result_chars: int = 2000,
        tool_workers: int = 2,
    ) -> None:
        if parser not in TOOL_PARSERS:
            raise ConfigError(
                "env.kwargs.parser",
                parser,
                f"one of {', '.join(TOOL_PARSERS.names())} (env=tools sets it from rollout.tool_parser)",
            )
        if max_tool_calls < 0:
            raise ConfigError("env.kwargs.max_tool_calls", max_tool_calls, ">= 0")
        if tool_timeout_s is not None and tool_timeout_s <= 0:
            raise ConfigError("env.kwargs.tool_timeout_s", tool_timeout_s, "> 0 seconds, or null (no limit)")
        if max_result_chars < 1:
            raise ConfigError("env.kwargs.max_result_chars", max_result_chars, ">= 1")
        if tool_workers < 1:
            raise ConfigError("env.kwargs.tool_workers", tool_workers, ">= 1 worker process")
        fns = [resolve_tool(t) for t in tools]
        if not fns:
            raise ConfigError("env.kwargs.tools", list(tools), "at least one tool")
        if tool_timeout_s is not None:
            for fn in fns:
                check_picklable(fn)
        self.schemas = [tool_schema(fn) for fn in fns]
        names = [s["function"]["name"] for s in self.schemas]
        if len(set(names)) != len(names):
            raise ConfigError("env.kwargs.tools", names, "tools with distinct names")
        self.tools: dict[str, Callable[..., Any]] = dict(zip(names, fns))
        self._parameters = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.schemas}
        self.parse = get_tool_parser(parser)
        self.max_tool_calls, self.tool_timeout_s = max_tool_calls, tool_timeout_s
        self.call_reward, self.error_penalty = call_reward, error_penalty
        self.max_result_chars, self.tool_workers = max_result_chars, tool_workers
        self.calls = 0
        self._ready = False

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``apply_chat_template(tools=...)``."""
        return copy.deepcopy(self.schemas)

    # -- what a subclass provides -------------------------------------------------------------

    def new_task(
        self, seed: int | None, row_index: int | None, evaluation: bool
    ) -> tuple[Observation, dict[str, Any]]:
        """Pick the task of this row (or seed) and return the first observation and its info."""
        raise NotImplementedError(f"{type(self).__name__} must implement new_task")

    def score_answer(self, reply: str) -> float:
        """The reward of the final answer ``reply`` (a reply with no tool call)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_answer")

    def is_correct(self, reply: str, score: float) -> bool:
        """Whether the final answer is correct (``info["correct"]``, the eval accuracy)."""
        return score > 0

    # -- the episode ----------------------------------------------------------------------------

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[Observation, dict[str, Any]]:
        self.calls = 0
        self._ready = True
        return self.new_task(seed, row_index, evaluation)

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if not self._ready:
            raise RuntimeError(f"{type(self).__name__}.step called before reset")
        parsed = self.parse(action)
        if not parsed.has_calls:
            score = float(self.score_answer(action))
            info = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "answered": True}
            return "", score, True, False, {**info, "correct": self.is_correct(action, score)}
        if self.calls >= self.max_tool_calls:  # told last turn that the next reply must answer
            info = {
                "tool_calls": 0,
                "tool_errors": 0,
                "tool_timeouts": 0,
                "answered": False,
                "correct": False,
            }
            return "", 0.0, True, False, info
        messages: list[Message] = []
        valid = invalid = errors = refused = timeouts = 0
        for item in parsed.items:
            if self.calls >= self.max_tool_calls:
                refused += 1
                content = (
                    f"error: not run: the limit of {self.max_tool_calls} tool calls per episode is "
                    "reached; reply with your final answer"
                )
                messages.append({"role": "tool", "name": item.name, "content": content})
                continue
            self.calls += 1
            result = self.run_call(item)
            valid += result.valid
            invalid += not result.valid
            errors += result.failed or not result.valid
            timeouts += result.timed_out
            messages.append({"role": "tool", "name": item.name, "content": result.content})
        if self.calls >= self.max_tool_calls and not refused:
            messages[-1]["content"] += f"\n{LIMIT_NOTE}"
        reward = self.call_reward * valid - self.error_penalty * invalid
        info = {
            "tool_calls": valid + invalid,
            "tool_errors": errors,
            "tool_timeouts": timeouts,
            "answered": False,
            "correct": False,
        }
        return messages, reward, False, False, info

    def run_call(self, item: ToolCall | MalformedCall) -> CallResult:
        """One call's tool-message content, whether the call was valid (a known tool, arguments
        that fit: it ran), whether running it failed (raised or timed out) and whether it timed out."""
        cut = self.max_result_chars  # error texts too: a huge message or a traceback
        if isinstance(item, MalformedCall):
            return CallResult(
                result_text(f"error: malformed tool call ({item.error}): {item.text}", cut), False
            )
        if item.name not in self.tools:
            known = ", ".join(self.tools)
            return CallResult(f"error: unknown tool {item.name!r}; the tools are: {known}", False)
        problems = argument_problems(self._parameters[item.name], item.arguments)
        if problems:
            return CallResult(f"error: invalid arguments for {item.name}: {'; '.join(problems)}", False)
        outcome = run_tool(self.tools[item.name], item.arguments, self.tool_timeout_s, self.tool_workers)
        if outcome.timed_out:
            return CallResult(
                f"error: {item.name} did not return within {self.tool_timeout_s:g} s", True, True, True
            )
        if outcome.error is not None:
            err = outcome.error
            return CallResult(
                result_text(f"error: {item.name} raised {type(err).__name__}: {err}", cut), True, True
            )
        return CallResult(result_text(outcome.output, self.max_result_chars), True)
