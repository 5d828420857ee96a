"""A server's answers are checked before they reach the update (``rollout/servers/answers.py``,
``server_client.py``'s transport), against a fake vLLM server on 127.0.0.1 that answers wrongly:
every wrong answer ends in an error naming the server and the request, never in a raw
AttributeError, IndexError or RecursionError, and never in bad ids or log-probs in a batch; an
answer is read up to a size cap and a request is bounded as a whole; a server that does not
return processed log-probs is refused at start, naming the flag."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import pytest

from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.servers.answers import answer_limit
from rlhf_lightning.rollout.servers.client import BadAnswer, RequestPolicy, ServerError
from rlhf_lightning.rollout.servers.engine import ServerSettings, VLLMServerEngine
from tests.rollout.fake_vllm import FakeVLLM, Handler

VOCAB = 512
MAX_TOKENS = 4


@pytest.fixture
def fake():
    server = FakeVLLM(vocab=VOCAB)
    yield server
    server.close()


def engine_on(fake: FakeVLLM, timeout_s: float = 30.0, retries: int = 0) -> VLLMServerEngine:
    """A full fine-tuning engine on ``fake`` (requests name the base model), started."""
    settings = ServerSettings(
        urls=(fake.url,),
        lora=False,
        request=RequestPolicy(timeout_s, retries, backoff_s=0.01),
        vocab_size=VOCAB,
    )
    engine = VLLMServerEngine(settings)
    engine.start()
    return engine


def choice(index: int, ids: list[Any], logps: list[Any], reason: Any = "stop") -> dict[str, Any]:
    return {"index": index, "token_ids": ids, "logprobs": {"token_logprobs": logps}, "finish_reason": reason}


def body(status: int, data: bytes, kind: str = "application/json", length: bool = True):
    def answer(handler: Handler, request: dict[str, Any]) -> None:
        handler.send(status, data, kind, length)

    return answer


def answers(*choices: dict[str, Any]) -> Callable[[Handler, dict[str, Any]], None]:
    return body(200, json.dumps({"choices": list(choices)}).encode())


NESTED = b'{"choices": ' + b"[" * 20000 + b"]" * 20000 + b"}"
HUGE = b'{"choices": [], "pad": "' + b"x" * (8 << 20) + b'"}'

WRONG = {
    "a JSON list": (body(200, b"[1, 2]"), r"with a JSON list '\[1, 2\]', not a JSON object"),
    "an HTML page": (
        body(200, b"<html><body>502 Bad Gateway</body></html>", "text/html"),
        r"with text '<html><body>502 Bad Gateway",
    ),
    "no choices": (body(200, b"{}"), r"choices=None, not a list of objects"),
    "an empty list of choices": (answers(), r"0 choices, not the 1 asked"),
    "a choice that is not an object": (body(200, b'{"choices": [7]}'), r"not a list of objects"),
    "string ids": (answers(choice(0, ["7"], [-0.1])), r"token ids \['7'\] in choice 0, not integers"),
    "an id outside the vocabulary": (
        answers(choice(0, [3, VOCAB], [-0.1, -0.2])),
        rf"token ids \[{VOCAB}\] in choice 0, not integers in \[0, {VOCAB}\)",
    ),
    "a negative id": (answers(choice(0, [-1], [-0.1])), r"token ids \[-1\]"),
    "a boolean id": (answers(choice(0, [True], [-0.1])), r"token ids \[True\]"),
    "a NaN log-prob": (answers(choice(0, [3], [math.nan])), r"log-probs \[nan\] in choice 0, not finite"),
    "an infinite log-prob": (answers(choice(0, [3], [-math.inf])), r"log-probs \[-inf\]"),
    "a positive log-prob": (answers(choice(0, [3, 4], [-0.1, 0.5])), r"log-probs \[0\.5\]"),
    "a string log-prob": (answers(choice(0, [3], ["-0.1"])), r"log-probs \['-0\.1'\]"),
    "fewer log-probs than ids": (answers(choice(0, [3, 4], [-0.1])), r"without a log-prob for each"),
    "more tokens than asked": (
        answers(choice(0, [3] * (MAX_TOKENS + 1), [-0.1] * (MAX_TOKENS + 1))),
        rf"{MAX_TOKENS + 1} tokens in choice 0, more than the max_tokens={MAX_TOKENS} asked",
    ),
    "an aborted completion": (answers(choice(0, [3], [-0.1], "abort")), r"finish_reason='abort'"),
    "an index twice": (
        answers(choice(0, [3], [-0.1]), choice(0, [4], [-0.1])),
        r"2 choices, not the 1 asked",
    ),
    "JSON nested 20000 deep": (body(200, NESTED), r"with JSON it cannot parse"),
    "8 MiB with its length": (body(200, HUGE), r"with more than \d+ bytes"),
    "8 MiB without a length": (body(200, HUGE, length=False), r"with more than \d+ bytes"),
}


@pytest.mark.parametrize("case", list(WRONG), ids=list(WRONG))
def test_a_wrong_answer_is_refused_naming_the_server_and_the_request(fake, case):
    """Each wrong answer ends the call with a BadAnswer naming the server's URL, the endpoint and
    the request; it is not retried (the server is misconfigured, not busy)."""
    engine = engine_on(fake, retries=3)
    fake.wrong, pattern = WRONG[case]
    sent = fake.count("/v1/completions")
    try:
        with pytest.raises(BadAnswer, match=pattern) as err:
            engine.generate([[5, 6]], SamplingParams(MAX_TOKENS, seed=1))
    finally:
        engine.shutdown()
    assert f"the vLLM server {fake.url} answered /v1/completions" in str(err.value)
    assert fake.count("/v1/completions") == sent + 1


def test_two_samples_asked_one_answered_is_refused(fake):
    engine = engine_on(fake)
    fake.wrong = answers(choice(0, [3], [-0.1]))
    try:
        with pytest.raises(BadAnswer, match=r"for prompt 0 \(n=2, max_tokens=4\) with 1 choices, not the 2"):
            engine.generate([[5, 6]], SamplingParams(MAX_TOKENS, n=2, seed=1))
    finally:
        engine.shutdown()


def test_a_right_answer_passes_the_checks(fake):
    engine = engine_on(fake)
    try:
        (done,) = engine.generate([[5, 6]], SamplingParams(MAX_TOKENS, seed=1))
    finally:
        engine.shutdown()
    assert done.token_ids == [5, 6] and done.logprobs == [-0.5, -0.5] and done.finish_reason == "length"


def test_the_size_cap_follows_the_request():
    small = {"n": 1, "max_tokens": 4, "prompt": [1, 2]}
    large = {"n": 8, "max_tokens": 256, "prompt": [1] * 100}
    assert answer_limit(small) == (64 << 10) + 4 * 1024 + 2 * 16
    assert answer_limit(large) == (64 << 10) + 8 * (256 * 1024 + 100 * 16)


def drip(head: bool) -> Callable[[Handler, dict[str, Any]], None]:
    """An answer written a byte every 0.1 s (its status line too with ``head``): 6 s in all."""
    data = json.dumps({"choices": [choice(0, [3], [-0.1])]}).encode()
    head_bytes = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n".encode()

    def answer(handler: Handler, request: dict[str, Any]) -> None:
        out = head_bytes + data if head else data
        if not head:
            handler.send_response(200)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.flush()
        try:
            for i in range(0, len(out), max(1, len(out) // 60)):
                handler.wfile.write(out[i : i + max(1, len(out) // 60)])
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # the client gave up

    return answer


@pytest.mark.parametrize("head", [False, True], ids=["body", "status line"])
def test_a_server_that_drips_its_answer_is_cut_off_at_the_request_timeout(fake, head):
    """rollout.request_timeout_s bounds a try as a whole: an answer that arrives a byte every
    0.1 s (never 1 s without one) fails after 1 s, not after the 6 s it takes."""
    engine = engine_on(fake, timeout_s=1.0)
    fake.wrong = drip(head)
    t0 = time.monotonic()
    try:
        with pytest.raises(
            ServerError, match=r"did not answer /v1/completions after 1 tries.*no whole answer within 1 s"
        ):
            engine.generate([[5, 6]], SamplingParams(MAX_TOKENS, seed=1))
    finally:
        engine.shutdown()
    assert time.monotonic() - t0 < 3.0


# ---------------------------------------------------------------- processed log-probs at start
@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logits"])
def test_a_server_without_processed_logprobs_is_refused_at_start_naming_the_flag(mode):
    """One probe request at start (top-k 1: processed log-probs are 0): vLLM's default raw
    log-probs, or logits, are refused before any rollout, naming the flag to add."""
    fake = FakeVLLM(logprobs_mode=mode)
    engine = VLLMServerEngine(ServerSettings(urls=(fake.url,), lora=False))
    try:
        with pytest.raises(
            BadAnswer, match=rf"{fake.url} returns log-probs that ignore .*--logprobs-mode processed_logprobs"
        ):
            engine.start()
        assert not engine.clients  # nothing kept of a refused start
    finally:
        engine.shutdown()
        fake.close()


@pytest.mark.parametrize("tie", [False, True], ids=["one top token", "two tied"])
def test_a_server_with_processed_logprobs_starts(tie):
    fake = FakeVLLM()
    fake.tie = tie
    engine = VLLMServerEngine(ServerSettings(urls=(fake.url,), lora=False))
    try:
        engine.start()
        ((path, probe),) = fake.requests
        assert path == "/v1/completions" and probe["top_k"] == 1 and probe["logprobs"] == 0
        assert probe["ignore_eos"] and probe["temperature"] == 1.0
    finally:
        engine.shutdown()
        fake.close()


def test_a_probe_answered_with_no_token_is_refused(fake):
    fake.wrong = answers(choice(0, [], []))
    engine = VLLMServerEngine(ServerSettings(urls=(fake.url,), lora=False))
    try:
        with pytest.raises(BadAnswer, match=rf"{fake.url} answered a probe asking 8 tokens .* with none"):
            engine.start()
    finally:
        engine.shutdown()
