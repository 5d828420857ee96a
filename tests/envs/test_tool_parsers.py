"""Tool-call parsers: each format written by hand, several calls per reply, malformed fragments."""

from __future__ import annotations

import pytest

from rlhf_lightning.envs.tool_parsers import (
    TOOL_PARSERS,
    MalformedCall,
    ParsedReply,
    ToolCall,
    get_tool_parser,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_pythonic,
)


def test_registry_names_duplicates_and_misses():
    assert TOOL_PARSERS.names() == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert get_tool_parser("hermes") is parse_hermes
    with pytest.raises(
        KeyError, match="unknown tool parser 'qwen'; valid names: hermes, llama3_json, mistral, pythonic"
    ):
        get_tool_parser("qwen")
    with pytest.raises(ValueError, match="tool parser 'hermes' is already registered"):
        TOOL_PARSERS.register("hermes")(parse_pythonic)


def test_hermes_several_calls_in_order_and_content():
    reply = (
        "Let me look.\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "apple"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": -2}}</tool_call> done'
    )
    parsed = parse_hermes(reply)
    assert parsed.items == [ToolCall("lookup", {"key": "apple"}), ToolCall("add", {"a": 1, "b": -2})]
    assert parsed.malformed == [] and parsed.has_calls
    assert parsed.content == "Let me look.\n\n done"


def test_hermes_argument_forms():
    # OpenAI-style arguments as a JSON string, "parameters", and no arguments at all.
    reply = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
        '<tool_call>{"name": "add", "parameters": {"a": 3}}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
    )
    assert parse_hermes(reply).calls == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("add", {"a": 3}),
        ToolCall("now", {}),
    ]


def test_hermes_malformed_fragments_keep_their_place():
    reply = (
        '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>["add", 1]</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 5}'
    )
    items = parse_hermes(reply).items
    assert [type(i) for i in items] == [
        MalformedCall,
        ToolCall,
        MalformedCall,
        MalformedCall,
        MalformedCall,
        MalformedCall,
    ]
    bad_json, _, not_object, no_name, list_args, unclosed = items
    assert isinstance(bad_json, MalformedCall) and bad_json.error.startswith("invalid JSON (")
    assert bad_json.text == '{"name": "add", "arguments": {"a": 1,'
    assert isinstance(not_object, MalformedCall) and not_object.error == "expected a JSON object, got list"
    assert isinstance(no_name, MalformedCall) and no_name.error == 'no "name" string'
    assert isinstance(list_args, MalformedCall) and list_args.name == "add"
    assert list_args.error == '"arguments" must be a JSON object of arguments, got list'
    assert isinstance(unclosed, MalformedCall) and unclosed.error == "<tool_call> is never closed"
    assert unclosed.text == '<tool_call>{"name": "add", "arguments": {"a": 5}'


def test_hermes_plain_answer_has_no_calls():
    parsed = parse_hermes("The answer is 42.")
    assert parsed == ParsedReply([], "The answer is 42.") and not parsed.has_calls


def test_llama3_json_one_or_several_objects():
    assert parse_llama3_json('{"name": "add", "parameters": {"a": 1, "b": 2}}').items == [
        ToolCall("add", {"a": 1, "b": 2})
    ]
    reply = '<|python_tag|>{"name": "lookup", "parameters": {"key": "fig"}}; {"name": "add", "arguments": {"a": 2}}'
    assert parse_llama3_json(reply).items == [ToolCall("lookup", {"key": "fig"}), ToolCall("add", {"a": 2})]


def test_llama3_json_malformed_and_plain():
    items = parse_llama3_json('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": ').items
    assert items[0] == ToolCall("add", {"a": 1})
    assert isinstance(items[1], MalformedCall) and items[1].error.startswith("invalid JSON (")
    assert items[1].text == '{"name": "add", "parameters":'
    assert parse_llama3_json('{"parameters": {}}').malformed[0].error == 'no "name" string'
    plain = parse_llama3_json("It is 7 {roughly}.")
    assert not plain.has_calls and plain.content == "It is 7 {roughly}."


def test_mistral_with_and_without_marker():
    calls = [ToolCall("add", {"a": 1, "b": 2}), ToolCall("lookup", {"key": "kiwi"})]
    body = (
        '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "lookup", "arguments": {"key": "kiwi"}}]'
    )
    with_tag = parse_mistral(f"Sure.[TOOL_CALLS]{body}")
    assert with_tag.items == calls and with_tag.content == "Sure."
    assert parse_mistral(body).items == calls  # [TOOL_CALLS] decoded away as a special token
    bad = parse_mistral('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}')
    assert len(bad.items) == 1 and isinstance(bad.items[0], MalformedCall)
    assert bad.items[0].error.startswith("invalid JSON (")
    mixed = parse_mistral('[TOOL_CALLS][{"name": "add", "arguments": {}}, {"name": 3}]').items
    assert mixed[0] == ToolCall("add", {}) and isinstance(mixed[1], MalformedCall)
    assert not parse_mistral("[1, 2] are the numbers").has_calls


def test_pythonic_calls_with_literal_keyword_arguments():
    parsed = parse_pythonic('[lookup(key="plum"), add(a=1, b=-2), search(q=["x", 1], opts={"k": None})]')
    assert parsed.items == [
        ToolCall("lookup", {"key": "plum"}),
        ToolCall("add", {"a": 1, "b": -2}),
        ToolCall("search", {"q": ["x", 1], "opts": {"k": None}}),
    ]


def test_pythonic_malformed_calls_are_not_run():
    items = parse_pythonic('[add(1, 2), add(a=__import__("os").system("true")), add(**kw), add(a=1)]').items
    assert [type(i) for i in items] == [MalformedCall, MalformedCall, MalformedCall, ToolCall]
    positional, code, star, ok = items
    assert isinstance(positional, MalformedCall)
    assert positional.error == "arguments must be given by keyword (name=value)"
    assert positional.name == "add" and positional.text == "add(1, 2)"
    assert isinstance(code, MalformedCall) and code.error == "argument 'a' is not a literal value"
    assert isinstance(star, MalformedCall) and star.error == "**kwargs is not allowed"
    assert ok == ToolCall("add", {"a": 1})
    broken = parse_pythonic("[add(a=1), lookup(key=")
    assert len(broken.items) == 1 and isinstance(broken.items[0], MalformedCall)
    assert broken.items[0].error.startswith("not a Python list of calls (")
    assert not parse_pythonic("[1, 2, 3]").has_calls
    assert not parse_pythonic("The result is 12.").has_calls


def test_pythonic_fragments_are_cut_from_the_source_without_rescanning_it(monkeypatch):
    """Names and fragments over several lines (\\n, \\r\\n) and non-ASCII text equal Python's own
    source segments, found from line starts computed once: ``ast.get_source_segment`` splits the
    whole reply on every call (a reply of 8,000 calls took 6 minutes) and is never called."""
    import ast

    reply = '[add(a=1),\r\n  café.lookup(clé="ü"),\n  add(1,\n 2), é(x=1), 3]'
    tree = ast.parse(reply, mode="eval")
    assert isinstance(tree.body, ast.List)
    own = [ast.get_source_segment(reply, e) for e in tree.body.elts]
    monkeypatch.setattr(ast, "get_source_segment", None)  # any call would raise
    items = parse_pythonic(reply).items
    assert items[0] == ToolCall("add", {"a": 1}) and items[1] == ToolCall("café.lookup", {"clé": "ü"})
    assert items[3] == ToolCall("é", {"x": 1})
    assert isinstance(items[2], MalformedCall) and items[2].text == own[2] == "add(1,\n 2)"
    assert items[2].name == "add"
    assert isinstance(items[4], MalformedCall) and items[4].text == own[4] == "3"


DEEP = 5000  # far past Python's recursion limit (1000): what a repetition loop of brackets writes
NESTED = "[" * DEEP + "]" * DEEP


@pytest.mark.parametrize(
    ("parser", "reply"),
    [
        (parse_hermes, f"<tool_call>{NESTED}</tool_call>"),
        (parse_hermes, '<tool_call>{"name": "add", "arguments": ' + NESTED + "}</tool_call>"),
        (parse_hermes, '<tool_call>{"name": "add", "arguments": "' + NESTED + '"}</tool_call>'),  # a string
        (parse_llama3_json, '{"name": "add", "parameters": ' + NESTED + "}"),
        (parse_llama3_json, '{"name": "add", "parameters": {}}; {"a": ' + NESTED + "}"),
        (parse_mistral, f"[TOOL_CALLS]{NESTED}"),
        (parse_mistral, '[{"name": "add", "arguments": ' + NESTED + "}]"),
    ],
)
def test_json_nested_too_deeply_is_a_malformed_call_not_an_error(parser, reply):
    parsed = parser(reply)  # raised RecursionError, which ended the run under on_reward_error=raise
    assert parsed.has_calls
    assert any(isinstance(i, MalformedCall) and "nested too deeply" in i.error for i in parsed.items)
