"""The policy endpoint with the official ``openai`` client: what it answers (text, tool calls,
log-probs, streaming), what it records (the engine's own ids and log-probs, byte for byte), that
concurrent episodes share batched engine calls, and the requests it refuses."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from rlhf_lightning.config import ASSETS
from rlhf_lightning.models.build import load_tokenizer
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.agents.endpoint import PolicyEndpoint

PARAMS = SamplingParams(max_new_tokens=32, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(ASSETS / "tiny_tools"))


class ScriptedEngine:
    """Replies with ``reply(prompt_text)`` as token ids (with the end-of-turn token) and
    log-probs -0.1 * (i + 1); records every generate call."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.calls = tok, reply, []

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        out = []
        for i, ids in enumerate(prompts):
            for _ in range(params.n):
                r = self.tok(self.reply(self.tok.decode(ids)), add_special_tokens=False).input_ids
                r = r[: params.max_new_tokens - 1] + [self.tok.eos_token_id]
                out.append(Completion(r, [-0.1 * (k + 1) for k in range(len(r))], "stop", i))
        return out


def serve_while(endpoint, engine, coro_factory):
    """Run ``coro_factory()`` on a client thread while this thread serves the engine."""
    result = {}

    def client():
        result["value"] = asyncio.run(coro_factory())

    t = threading.Thread(target=client)
    t.start()
    while t.is_alive():
        endpoint.serve(engine, PARAMS, lambda: 7, wait_s=0.02)
    return result["value"]


@pytest.fixture
def endpoint(tok):
    e = PolicyEndpoint(tok, max_model_len=1024).start()
    yield e
    e.close()


def client_for(endpoint, episode):
    return openai.AsyncOpenAI(base_url=endpoint.open_episode(episode), api_key="x", max_retries=0)


def test_a_chat_call_is_answered_and_recorded_token_for_token(endpoint, tok):
    engine = ScriptedEngine(tok, lambda _: "four")

    async def go():
        c = client_for(endpoint, "e1")
        r = await c.chat.completions.create(
            model="whatever", messages=[{"role": "user", "content": "2+2?"}], logprobs=True
        )
        await c.close()
        return r

    r = serve_while(endpoint, engine, go)
    assert r.choices[0].message.content == "four" and r.choices[0].finish_reason == "stop"
    record = endpoint.close_episode("e1")
    (call,) = record.calls
    expected_prompt = tok(
        tok.apply_chat_template(
            [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
        ),
        add_special_tokens=False,
    ).input_ids
    reply_ids = tok("four", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert call.prompt_ids == expected_prompt and call.completion_ids == reply_ids
    assert call.logprobs == [-0.1 * (k + 1) for k in range(len(reply_ids))] and call.version == 7
    assert [x.logprob for x in r.choices[0].logprobs.content] == pytest.approx(call.logprobs)
    assert [x.token for x in r.choices[0].logprobs.content] == [tok.decode([t]) for t in reply_ids]
    assert r.usage.prompt_tokens == len(expected_prompt) and r.usage.completion_tokens == len(reply_ids)


def test_tool_calls_reach_the_client_parsed_and_the_next_prompt_extends_the_last(endpoint, tok):
    tool = {
        "type": "function",
        "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}},
    }
    replies = iter(
        ['<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>', "It is 4."]
    )
    engine = ScriptedEngine(tok, lambda _: next(replies))

    async def go():
        c = client_for(endpoint, "e2")
        msgs = [{"role": "user", "content": "2+2?"}]
        r1 = await c.chat.completions.create(model="m", messages=msgs, tools=[tool])
        m = r1.choices[0].message
        msgs += [
            m.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "4"},
        ]
        r2 = await c.chat.completions.create(model="m", messages=msgs, tools=[tool])
        await c.close()
        return r1, r2

    r1, r2 = serve_while(endpoint, engine, go)
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+2"}
    assert r2.choices[0].message.content == "It is 4."
    first, second = endpoint.close_episode("e2").calls
    assert (
        second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)]
        == first.prompt_ids + first.completion_ids
    )


def test_streaming_gives_the_same_text_as_server_sent_events(endpoint, tok):
    engine = ScriptedEngine(tok, lambda _: "streamed reply")

    async def go():
        c = client_for(endpoint, "e3")
        stream = await c.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await c.close()
        return chunks

    chunks = serve_while(endpoint, engine, go)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "streamed reply"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(endpoint.close_episode("e3").calls[0].completion_ids)


def test_sixteen_concurrent_agents_share_batched_engine_calls(endpoint, tok):
    engine = ScriptedEngine(tok, lambda p: "ok")

    async def agent(i):
        c = client_for(endpoint, f"a{i}")
        msgs = [{"role": "user", "content": f"task {i}"}]
        for _ in range(2):
            r = await c.chat.completions.create(model="m", messages=msgs)
            msgs += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
        await c.close()

    async def go():
        await asyncio.gather(*(agent(i) for i in range(16)))

    serve_while(endpoint, engine, go)
    served = sum(n for n, _ in engine.calls)
    assert served == 32 and len(engine.calls) <= 6, [n for n, _ in engine.calls]
    for i in range(16):
        first, second = endpoint.close_episode(f"a{i}").calls
        assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids


def test_max_tokens_is_capped_at_the_runs_and_sampling_stays_the_runs(endpoint, tok):
    engine = ScriptedEngine(tok, lambda _: "x")

    async def go():
        c = client_for(endpoint, "e4")
        await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}], max_tokens=500, temperature=0.2
        )
        await c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a"}], max_tokens=5, stop=["\n"]
        )
        await c.close()

    serve_while(endpoint, engine, go)
    (_, p1), (_, p2) = engine.calls
    assert p1.max_new_tokens == 32 and p1.temperature == 1.0 and p2.max_new_tokens == 5 and p2.stop == ("\n",)
    assert endpoint.overridden == 1


def test_completions_take_a_prompt_of_token_ids(endpoint, tok):
    engine = ScriptedEngine(tok, lambda _: "done")

    async def go():
        c = client_for(endpoint, "e5")
        r = await c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=8, logprobs=0)
        await c.close()
        return r

    r = serve_while(endpoint, engine, go)
    assert r.choices[0].text == "done"
    assert endpoint.close_episode("e5").calls[0].prompt_ids == [5, 6, 7]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 5}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x " * 2000}]}, "messages"),  # longer than max_model_len
    ],
)
def test_bad_requests_are_refused_naming_the_field(endpoint, body, field):
    import urllib.error
    import urllib.request

    url = endpoint.open_episode("bad") + "/chat/completions"
    req = urllib.request.Request(
        url, json.dumps({"model": "m", **body}).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == field
    assert endpoint.close_episode("bad").refused == 1


def test_an_unknown_episode_is_404(endpoint):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        endpoint.base_url("nobody") + "/chat/completions", b"{}", {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 404
