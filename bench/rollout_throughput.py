"""Rollout throughput: HF generate vs colocated vLLM vs a vLLM server, and the harness's overhead
over the raw engine.

    .venv/bin/python bench/rollout_throughput.py                  # 64 prompts x group 8, tiny model
    .venv/bin/python bench/rollout_throughput.py --engines hf     # without vLLM
    .venv/bin/python bench/rollout_throughput.py --engines vllm server --concurrency 32 128

``server`` is ``rollout=vllm_server``: one vLLM OpenAI-compatible server the bench starts on this
machine (as a run with ``rollout.servers=null`` does), the same model, dtype and LoRA adapter as
the colocated engine, one HTTP request per completion, ``--concurrency`` requests in flight (one
row per value).

For each engine: ``raw`` = one ``engine.generate`` call on the 512 pre-tokenised prompts;
``harness`` = ``RolloutHarness.rollout`` for the same 64 env rows x 8 (env resets, chat
templating, tokenisation, decoding, scoring, padding into the training batch). Both use the
same sampling parameters; the median of ``--repeats`` timed runs (after one warm-up) is kept.
Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm", "server"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[32], help="server: requests in flight")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from rlhf_lightning.envs.arithmetic import ArithmeticEnv
    from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
    from rlhf_lightning.models.tiny import TINY_MODEL_DIR
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.engines.hf import HFEngine
    from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness

    path = str(TINY_MODEL_DIR)
    tok = load_tokenizer(path)
    policy = build_policy(load_model(path, dtype="float32", attn_implementation="eager"), finetune="lora")
    formatter = ChatFormatter(tok)
    harness = RolloutHarness(ArithmeticEnv, tok, formatter, max_turns=1, max_model_len=512)
    rows = list(range(a.prompts))
    prompt_ids = [formatter.prompt_ids(ArithmeticEnv().reset(row_index=r, seed=r)[0]) for r in rows]
    flat = [ids for ids in prompt_ids for _ in range(a.group)]
    params = SamplingParams(a.max_new_tokens, temperature=1.0)

    def timed(fn) -> tuple[float, object]:
        fn()  # warm-up
        times, out = [], None
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times), out

    def engines():
        """(row name, engine) for each engine asked for (a server: one row per concurrency)."""
        for name in a.engines:
            if name == "hf":
                yield "hf", HFEngine(policy.generation_model, tok.pad_token_id, [tok.eos_token_id])
            elif name == "vllm":
                try:
                    from rlhf_lightning.rollout.engines.vllm import VLLMEngine
                except ImportError as err:
                    print(f"skipping vllm: {err}", file=sys.stderr)
                    continue
                engine = VLLMEngine(path, dtype="float32", lora_rank=16)
                engine.sync_weights(policy)
                yield "vllm (colocated)", engine
            else:
                yield from server_engines(path, policy, a.concurrency)

    results = []
    for name, engine in engines():
        raw_s, comps = timed(lambda engine=engine: engine.generate(flat, params))
        tokens = sum(len(c.token_ids) for c in comps)
        harness_s, result = timed(
            lambda engine=engine: harness.rollout(engine, rows, params, group_size=a.group)
        )
        h_tokens = int(result.batch.action_mask.sum())
        results.append((name, raw_s, len(comps), tokens, harness_s, h_tokens))
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    print(
        f"\n{a.prompts} prompts x {a.group} samples, max_new_tokens={a.max_new_tokens}, threads={torch.get_num_threads()}, "
        f"median of {a.repeats}\n"
    )
    print("| engine | raw generate (s) | completions/s | tokens/s | harness rollout (s) | harness overhead |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, raw_s, n, tokens, harness_s, _ in results:
        print(
            f"| {name} | {raw_s:.3f} | {n / raw_s:.0f} | {tokens / raw_s:.0f} | {harness_s:.3f} | {100 * (harness_s / raw_s - 1):+.1f}% |"
        )


def server_engines(path: str, policy, concurrencies: list[int]):
    """One vLLM server started here (LoRA, fp32), then driven by URL with each concurrency."""
    from rlhf_lightning.rollout.servers.engine import ServerSettings, VLLMServerEngine
    from rlhf_lightning.rollout.servers.process import LaunchSpec

    launch = LaunchSpec(path, dtype="float32", lora_rank=16)
    owner = VLLMServerEngine(ServerSettings(launch=launch, log_dir=os.environ.get("BENCH_SERVER_LOGS")))
    try:
        owner.start()
        urls = tuple(p.url for p in owner.processes)
        for c in concurrencies:
            engine = VLLMServerEngine(ServerSettings(urls=urls, max_concurrency=c))
            engine.sync_weights(policy)
            yield f"vllm server, {c} in flight", engine
    finally:
        owner.shutdown()


if __name__ == "__main__":
    main()
