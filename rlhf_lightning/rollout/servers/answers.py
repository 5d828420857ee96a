"""What a vLLM server answers, checked before it reaches the update (``rollout=vllm_server``).

An answer's token ids index the trainer's logits and its log-probs are the ratio's behaviour
log-probs, so a server's answer is never trusted: :func:`completions_of` takes a
``/v1/completions`` answer apart and refuses one that is not a JSON object with exactly the
``n`` choices asked, each with integer token ids inside the model's vocabulary, a finite log-prob
<= 0 for each, at most ``max_tokens`` of them and a finish reason; the error names the server
and the request. :func:`answer_limit` is the most bytes such an answer can take (the client
reads no more). :func:`check_processed_logprobs` asks one probe request at start: a server
without ``--logprobs-mode processed_logprobs`` (vLLM's default is raw) would hand back log-probs
that ignore the temperature and the top-k/top-p/min-p filters.
"""

from __future__ import annotations

import math
from typing import Any

from rlhf_lightning.records.sampling import Completion
from rlhf_lightning.rollout.servers.client import BadAnswer, ServerClient

# A completion's answer: the choices' text, tokens, log-probs and offsets take well under 1 KiB
# a generated token (vLLM also returns the prompt's ids per choice: 16 bytes a prompt token).
ANSWER_BASE_BYTES = 64 << 10
ANSWER_BYTES_PER_TOKEN = 1 << 10
ANSWER_BYTES_PER_PROMPT_TOKEN = 16
PROBE_PROMPT = [0, 1, 2, 3]
PROBE_TOKENS = 8
PROBE_TOLERANCE = 1e-3


def answer_limit(body: dict[str, Any]) -> int:
    """The most bytes the answer to the ``/v1/completions`` request ``body`` can take."""
    n, tokens, prompt = int(body["n"]), int(body["max_tokens"]), len(body["prompt"])
    return ANSWER_BASE_BYTES + n * (ANSWER_BYTES_PER_TOKEN * tokens + ANSWER_BYTES_PER_PROMPT_TOKEN * prompt)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def completions_of(
    answer: Any,
    prompt_index: int,
    url: str,
    spread: bool = False,
    request: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    logprob_range: bool = True,
) -> list[Completion]:
    """The completions of one ``/v1/completions`` answer to ``request``, in choice order: all of
    prompt ``prompt_index``, or (``spread``: a run of equal prompts) choice c of prompt
    ``prompt_index + c``. Token ids must lie in ``[0, vocab_size)`` (any id >= 0 when None),
    log-probs be finite and <= 0 (numbers of any value without ``logprob_range``: the probe's)."""
    n = None if request is None else int(request["n"])
    max_tokens = None if request is None else int(request["max_tokens"])
    asked = "" if request is None else f" (n={n}, max_tokens={max_tokens})"
    what = f"the vLLM server {url} answered /v1/completions for prompt {prompt_index}{asked} with"

    def bad(problem: str) -> BadAnswer:
        return BadAnswer(f"{what} {problem}")

    if not isinstance(answer, dict):
        raise bad(f"a JSON {type(answer).__name__}, not an object")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise bad(f"choices={str(choices)[:120]}, not a list of objects")
    if n is not None and len(choices) != n:
        raise bad(f"{len(choices)} choices, not the {n} asked")
    indices = [c.get("index", 0) for c in choices]
    if not all(_is_int(i) for i in indices) or sorted(indices) != list(range(len(choices))):
        raise bad(f"choice indices {indices[:16]}, not 0..{len(choices) - 1} once each")
    out = []
    for c, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):
        ids = choice.get("token_ids")
        logprobs = choice.get("logprobs")
        logps = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
        if not isinstance(ids, list) or not isinstance(logps, list) or len(ids) != len(logps):
            raise bad(
                f"choice {c} without a log-prob for each generated token id (it needs vLLM >= 0.10, which "
                "returns token ids, and the request's logprobs=0)"
            )
        if not all(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in ids):
            bound = f"[0, {vocab_size}) (the model's vocabulary)" if vocab_size is not None else ">= 0"
            wrong = [t for t in ids if not (_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size))]
            raise bad(
                f"token ids {wrong[:8]} in choice {c}, not integers in {bound}: is it serving the run's model?"
            )
        valid = [_is_number(x) and (not logprob_range or (math.isfinite(x) and x <= 0.0)) for x in logps]
        if not all(valid):
            wrong = [x for x, ok in zip(logps, valid) if not ok]
            raise bad(f"log-probs {wrong[:8]} in choice {c}, not finite numbers <= 0")
        if max_tokens is not None and len(ids) > max_tokens:
            raise bad(f"{len(ids)} tokens in choice {c}, more than the max_tokens={max_tokens} asked")
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            raise bad(f"a completion ended with finish_reason={reason!r} (aborted?)")
        out.append(
            Completion(list(ids), [float(x) for x in logps], reason, prompt_index + (c if spread else 0))
        )
    return out


def probe_body(model: str) -> dict[str, Any]:
    """A request whose processed log-probs are known without the model: with top-k 1 the sampled
    token is the only one left (or one of m tied at the top), its processed log-prob 0 (or
    -log m); a raw log-prob is the model's own, almost never that for every token."""
    return {
        "model": model,
        "prompt": list(PROBE_PROMPT),
        "max_tokens": PROBE_TOKENS,
        "n": 1,
        "seed": 0,
        "temperature": 1.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }


def check_processed_logprobs(client: ServerClient, model: str) -> None:
    """Refuse a server whose log-probs are not processed (``--logprobs-mode processed_logprobs``):
    one probe request (:func:`probe_body`)."""
    body = probe_body(model)
    answer = client.complete(body, answer_limit(body))
    (done,) = completions_of(answer, 0, client.url, request=body, logprob_range=False)
    ties = [-math.log(m) for m in range(1, 9)]
    odd = [x for x in done.logprobs if not any(abs(x - t) <= PROBE_TOLERANCE for t in ties)]
    if not done.logprobs:
        raise BadAnswer(
            f"the vLLM server {client.url} answered a probe asking {PROBE_TOKENS} tokens (ignore_eos) "
            f"with none: is it a vLLM server? {client.where}"
        )
    if odd:
        raise BadAnswer(
            f"the vLLM server {client.url} returns log-probs that ignore the sampling settings: a probe "
            f"sampled with top_k=1 got log-probs {[round(x, 4) for x in done.logprobs]} (processed ones "
            "are 0). Start it with --logprobs-mode processed_logprobs (vLLM's default is raw_logprobs, "
            "which would make the raw log-probs the behaviour log-probs whenever the temperature is not "
            f"1 or a top-k/top-p/min-p filter is set); {client.where}"
        )
