"""ToolEnv through the harness: token-exact round trips, error tool messages, argument checks,
the call limit, shaping rewards, results, and construction. The template, the tool tasks and
``env=tools`` training: test_tool_template.py and test_tool_tasks.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
from transformers.utils import get_json_schema

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.tool_parsers import ToolCall, parse_hermes
from rlhf_lightning.envs.tool_tasks import TABLE, AddLookupToolEnv, add, lookup
from rlhf_lightning.envs.tools import LIMIT_NOTE, ToolEnv
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, check_template, env_tools
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from tests.envs.slow_things import boom, sleepy, spin
from tests.envs.tool_helpers import call, tools_tokenizer


@pytest.fixture(scope="module")
def tok():
    """The embedded chat model's tokenizer with the tools template."""
    return tools_tokenizer()


class TurnEngine:
    """Turn k's reply is ``turns[k]`` (token ids) for every live episode."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.calls = turns, 0

    def generate(self, prompt_token_ids, params):
        ids = self.turns[self.calls]
        self.calls += 1
        return [Completion(list(ids), [-0.5] * len(ids), "stop", i) for i in range(len(prompt_token_ids))]

    def sleep(self):
        pass

    def wake(self):
        pass

    def sync_weights(self, model):
        pass


def play(tok, factory, replies: list[str], system_prompt: str | None = None):
    """One episode of row 0 with scripted replies; returns (trajectory, formatter)."""
    formatter = ChatFormatter(tok, system_prompt, tools=env_tools(factory))
    check_template(formatter, multi_turn=True)  # what run/fit.py does for multi-turn runs with tools
    engine = TurnEngine([tok(r, add_special_tokens=False).input_ids + [tok.eos_token_id] for r in replies])
    harness = RolloutHarness(factory, tok, formatter, max_turns=len(replies) + 1, max_model_len=4096)
    result = harness.rollout(engine, [0], SamplingParams(max_new_tokens=512))
    return result.trajectories[0]


def rerender(tok, traj, schemas, system_prompt: str | None = None) -> list[int]:
    """The whole conversation rendered at once by the template, then tokenized."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": traj.observation})
    for k, reply in enumerate(traj.replies):
        messages.append({"role": "assistant", "content": reply})
        if k < len(traj.observations):
            messages += traj.observations[k]
    text = tok.apply_chat_template(messages, tools=schemas, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


# -- round trips through the harness ------------------------------------------------------------


@pytest.mark.parametrize("system_prompt", [None, "Use the tools."])
def test_two_calls_then_answer_is_token_exact(tok, system_prompt):
    env = AddLookupToolEnv()
    question, info = env.reset(row_index=0)
    key, n = info["key"], info["n"]
    first = f"{call('lookup', key=key)}\n{call('add', a=TABLE[key], b=n)}"
    answer = str(TABLE[key] + n)
    traj = play(tok, AddLookupToolEnv, [first, answer], system_prompt)

    assert parse_hermes(traj.replies[0]).calls == [
        ToolCall("lookup", {"key": key}),
        ToolCall("add", {"a": TABLE[key], "b": n}),
    ]
    assert traj.replies == [first, answer] and traj.observation == question
    assert traj.observations == [
        [
            {"role": "tool", "name": "lookup", "content": str(TABLE[key])},
            {"role": "tool", "name": "add", "content": str(TABLE[key] + n)},
        ]
    ]
    assert traj.rewards == [0.0, 1.0] and traj.infos[-1]["correct"] is True and not traj.truncated
    schemas = [get_json_schema(add), get_json_schema(lookup)]
    full = rerender(tok, traj, schemas, system_prompt)
    newline = tok("\n", add_special_tokens=False).input_ids
    # The whole conversation rendered at once is the trajectory plus the newline that closes the
    # last turn (never generated): token for token, boundaries included.
    assert full == traj.token_ids + newline
    eos = tok.eos_token_id
    end_of_call_turn = traj.token_ids.index(eos, traj.prompt_len)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    after = end_of_call_turn + 1
    assert traj.token_ids[after : after + len(newline) + 1] == [*newline, im_start]
    # Only the replies are actions.
    generated = [t for t, k in zip(traj.token_ids, traj.action_turn) if k >= 0]
    assert generated == [
        t for r in (first, answer) for t in tok(r, add_special_tokens=False).input_ids + [eos]
    ]


def failing_env(**kwargs) -> ToolEnv:
    return AddLookupToolEnv(tools=[add, lookup, boom, sleepy], tool_timeout_s=0.3, **kwargs)


def test_errors_become_tool_messages_and_the_episode_goes_on(tok):
    env = AddLookupToolEnv()
    env.reset(row_index=0)
    replies = [
        '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>'
        + call("mul", a=2, b=3)
        + call("boom", x=7)
        + call("sleepy", seconds=5.0),
        str(env.answer),
    ]
    start = time.monotonic()
    traj = play(tok, failing_env, replies)
    assert time.monotonic() - start < 3.0  # the sleeper was stopped after 0.3 s
    contents = [m["content"] for m in traj.observations[0]]
    assert contents[0].startswith("error: malformed tool call (invalid JSON (")
    assert contents[0].endswith('): {"name": "add", "arguments": {"a": 1,')
    assert contents[1:] == [
        "error: unknown tool 'mul'; the tools are: add, lookup, boom, sleepy",
        "error: boom raised RuntimeError: boom 7",
        f"error: sleepy did not return within 0.3 s\n{LIMIT_NOTE}",  # 4 calls: the default limit
    ]
    assert [m["name"] for m in traj.observations[0]] == ["", "mul", "boom", "sleepy"]
    assert traj.rewards == [0.0, 1.0] and traj.infos[-1]["correct"] is True
    assert traj.infos[0] == {
        "tool_calls": 4,
        "tool_errors": 4,
        "tool_timeouts": 1,
        "answered": False,
        "correct": False,
    }
    schemas = [get_json_schema(f) for f in (add, lookup, boom, sleepy)]
    assert rerender(tok, traj, schemas) == traj.token_ids + tok("\n", add_special_tokens=False).input_ids


def spin_env(**kwargs) -> ToolEnv:
    return AddLookupToolEnv(tools=[add, spin], tool_timeout_s=0.2, **kwargs)


def test_a_tool_that_loops_for_ever_is_stopped_every_time_and_leaves_nothing_behind(tok, monkeypatch):
    """5 episodes x 4 calls of a tool that never returns, each stopped at 0.2 s: this process's
    own Python work does not slow down, no worker process or thread is left once the harness and
    the pools close, and the trajectories equal a run whose tool call times out at once."""
    from rlhf_lightning.envs import tools as tools_module
    from rlhf_lightning.runtime.workers import CallTimeout, Outcome, close_shared_pools, shared_pool
    from tests.runtime.test_workers import assert_no_children, note_children, python_rate, rate_after

    first = "".join(call("spin", n=i) for i in range(4))
    replies = [tok(r, add_special_tokens=False).input_ids + [tok.eos_token_id] for r in (first, "7")]
    formatter = ChatFormatter(tok, None, tools=env_tools(spin_env))

    def rollout():
        harness = RolloutHarness(
            spin_env, tok, formatter, max_turns=3, max_model_len=4096, concurrency=4, step_workers="thread"
        )
        try:
            return harness.rollout(TurnEngine(replies), list(range(5)), SamplingParams(max_new_tokens=512))
        finally:
            harness.close()

    close_shared_pools()  # an earlier test's tool workers
    note_children()
    threads = set(threading.enumerate())
    before = max(python_rate() for _ in range(3))
    stopped = rollout()
    shared_pool("tools", 2).call(sleepy, (0.0,))  # the last replacement worker has booted
    after = rate_after(before)
    assert sum(info.get("tool_timeouts", 0) for t in stopped.trajectories for info in t.infos) == 20
    assert after / before > 0.7, (before, after)  # 20 abandoned threads made it ~7x slower
    close_shared_pools()
    assert_no_children()
    # the one thread that starts children for the process (runtime.children.popen) may stay
    assert {t.name for t in set(threading.enumerate()) - threads} <= {"child-starter"}

    def times_out_at_once(fn, arguments, timeout_s, workers):
        return Outcome(error=CallTimeout(f"did not return within {timeout_s:g} s"))

    monkeypatch.setattr(tools_module, "run_tool", times_out_at_once)
    at_once = rollout()
    for a, b in zip(stopped.trajectories, at_once.trajectories, strict=True):
        assert (a.token_ids, a.rewards, a.infos, a.observations) == (
            b.token_ids,
            b.rewards,
            b.infos,
            b.observations,
        )
    assert stopped.batch.input_ids.equal(at_once.batch.input_ids)
    contents = {m["content"] for m in stopped.trajectories[0].observations[0]}
    assert contents == {
        "error: spin did not return within 0.2 s",
        f"error: spin did not return within 0.2 s\n{LIMIT_NOTE}",
    }


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"a": 1}, "missing 'b'"),
        ({"a": 1, "b": 2, "c": 3}, "'c' is not an argument"),
        ({"a": "1", "b": 2}, "'a' must be integer, got string \"1\""),
        ({"a": True, "b": 2.5}, "'a' must be integer, got boolean true; 'b' must be integer, got number 2.5"),
        ({"b": None}, "missing 'a'; 'b' must be integer, got null null"),
    ],
)
def test_arguments_are_checked_against_the_schema(arguments, message):
    env = AddLookupToolEnv()
    env.reset(row_index=0)
    obs, reward, terminated, truncated, info = env.step(call("add", **arguments))
    assert obs == [{"role": "tool", "name": "add", "content": f"error: invalid arguments for add: {message}"}]
    assert (reward, terminated, truncated) == (0.0, False, False) and info["tool_errors"] == 1


def test_a_tool_with_a_time_limit_must_be_importable_by_name():
    def local(x: int) -> int:
        """Doubles.

        Args:
            x: a number
        """
        return 2 * x

    with pytest.raises(
        ConfigError, match=r"env\.kwargs\.tools=.*local.*a module-level function.*tool_timeout_s=null"
    ):
        AddLookupToolEnv(tools=[local])
    env = AddLookupToolEnv(tools=[local], tool_timeout_s=None)
    env.reset(row_index=0)
    assert env.step(call("local", x=4))[0][0]["content"] == "8"


def test_nested_schema_types_are_checked():
    def pick(items: list[int], pair: tuple[int, str], table: dict[str, int], mode: str | None = None) -> str:
        """Picks.

        Args:
            items: numbers
            pair: a number and a name
            table: counts
            mode: how (choices: ["a", "b"])
        """
        return "ok"

    env = AddLookupToolEnv(tools=[pick], tool_timeout_s=None)  # no limit: a local function may run here
    env.reset(row_index=0)
    cases = {
        call("pick", items=[1, 2], pair=[1, "x"], table={"k": 1}): "ok",
        call("pick", items=[1, "2"], pair=[1, "x"], table={}): "'items'[1] must be integer, got string \"2\"",
        call("pick", items=[], pair=[1], table={}): "'pair' must have 2 items, got 1",
        call(
            "pick", items=[], pair=[1, "x"], table={"k": 1.5}
        ): "'table'['k'] must be integer, got number 1.5",
        call(
            "pick", items=[], pair=[1, "x"], table={}, mode="c"
        ): '\'mode\' must be one of ["a", "b"], got "c"',
        call("pick", items=[], pair=[1, "x"], table={}, mode=None): "ok",
    }
    for reply, expected in cases.items():
        env.calls = 0
        content = env.step(reply)[0][0]["content"]
        assert content == (expected if expected == "ok" else f"error: invalid arguments for pick: {expected}")


def test_call_limit_then_unanswered(tok):
    env = AddLookupToolEnv(max_tool_calls=2)
    env.reset(row_index=0)
    obs, *_ = env.step(call("add", a=1, b=2) + call("add", a=3, b=4) + call("add", a=5, b=6))
    assert [m["content"] for m in obs] == [
        "3",
        "7",
        "error: not run: the limit of 2 tool calls per episode is reached; reply with your final answer",
    ]
    assert env.step(call("add", a=1, b=1)) == (
        "",
        0.0,
        True,
        False,
        {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "answered": False, "correct": False},
    )
    # Reaching the limit exactly: the last result carries the note; the next reply may answer.
    env.reset(row_index=0)
    obs, *_ = env.step(call("add", a=1, b=2) + call("add", a=3, b=4))
    assert [m["content"] for m in obs] == ["3", f"7\n{LIMIT_NOTE}"]
    _, reward, terminated, _, info = env.step(str(env.answer))
    assert (reward, terminated, info["correct"]) == (1.0, True, True)
    # Through the harness: a third reply with a call ends the episode, with no further turn.
    traj = play(
        tok, lambda: AddLookupToolEnv(max_tool_calls=1), [call("add", a=1, b=2), call("add", a=1, b=2)]
    )
    assert traj.num_turns == 2 and traj.rewards == [0.0, 0.0] and not traj.truncated
    assert traj.infos[-1]["answered"] is False and traj.infos[-1]["correct"] is False


def test_shaping_rewards_valid_and_invalid_calls():
    env = AddLookupToolEnv(tools=[add, boom], call_reward=0.1, error_penalty=0.5)
    env.reset(row_index=0)
    reply = call("add", a=1, b=2) + call("boom", x=1) + call("nope") + "<tool_call>{</tool_call>"
    _, reward, *_ = env.step(reply)
    assert reward == pytest.approx(2 * 0.1 - 2 * 0.5, abs=1e-12)  # boom ran (and raised): valid
    _, reward, terminated, _, _ = env.step("no idea")
    assert (reward, terminated) == (0.0, True)


def test_results_are_json_and_cut():
    def table(n: int) -> dict:
        """A table.

        Args:
            n: its size
        """
        return {"rows": list(range(n))}

    env = AddLookupToolEnv(tools=[table], max_result_chars=20, tool_timeout_s=None)
    env.reset(row_index=0)
    assert env.step(call("table", n=2))[0][0]["content"] == '{"rows": [0, 1]}'
    env.calls = 0
    content = env.step(call("table", n=50))[0][0]["content"]
    assert content == json.dumps({"rows": list(range(50))})[:20] + "... [cut to 20 characters]"


# -- construction -------------------------------------------------------------------------------


def no_doc(a: int) -> int:
    return a


def no_hints(a):
    """Returns a.

    Args:
        a: a value
    """
    return a


def test_tools_need_docstrings_and_type_hints():
    with pytest.raises(
        ConfigError, match=r"env\.kwargs\.tools=.*no_doc.*get_json_schema said: .*no docstring"
    ):
        AddLookupToolEnv(tools=[no_doc])
    with pytest.raises(ConfigError, match=r"env\.kwargs\.tools=.*no_hints.*missing a type hint"):
        AddLookupToolEnv(tools=[no_hints])
    with pytest.raises(ConfigError, match=r"env\.kwargs\.tools='my_pkg\.nope'.*importable"):
        AddLookupToolEnv(tools=["my_pkg.nope"])
    with pytest.raises(ConfigError, match="distinct names"):
        AddLookupToolEnv(tools=[add, "rlhf_lightning.envs.tool_tasks.add"])
    with pytest.raises(
        ConfigError, match=r"env\.kwargs\.parser='qwen'.*hermes, llama3_json, mistral, pythonic"
    ):
        AddLookupToolEnv(parser="qwen")
    env = AddLookupToolEnv(tools=["rlhf_lightning.envs.tool_tasks.add", lookup])
    assert env.tool_schemas() == [get_json_schema(add), get_json_schema(lookup)]


def test_other_parsers_drive_the_env():
    env = AddLookupToolEnv(parser="pythonic")
    env.reset(row_index=0)
    obs, *_ = env.step('[add(a=2, b=3), lookup(key="fig")]')
    assert obs == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "lookup", "content": str(TABLE["fig"])},
    ]
    env = AddLookupToolEnv(parser="llama3_json")
    env.reset(row_index=0)
    assert env.step('{"name": "add", "parameters": {"a": 2, "b": 3}}')[0][0]["content"] == "5"
