"""The HF engine's KV cache across turns (``env.history=full``), measured per turn: each turn's
generate call with the previous call's cache reused against prefilling the whole conversation.

    .venv/bin/python bench/kv_reuse.py                      # GEM Sudoku on model=tiny_gem, 16 episodes
    .venv/bin/python bench/kv_reuse.py --episodes 32 --threads 2

Both arms play the same episodes (``game:Sudoku-v0-easy``, GEM's 15-turn limit, the conversation
kept whole, sampled at temperature 1 from the same seed) through the rollout harness, one
generate call per turn for all live episodes. Per turn: the prompt tokens of a call (the
conversation so far), the tokens the engine prefilled with reuse (the turn's new ones), and each
arm's wall time of the call. The arms must sample the same tokens (checked: the run fails
otherwise) with log-probs within float32 noise (the largest difference is printed).
``model=tiny_gem`` is the embedded model whose positions (2,560) hold a whole Sudoku
conversation; its moves are poor, which is beside the point here: the cost is the prompt's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def play(model: Any, tok: Any, reuse: bool, episodes: int, seed: int) -> tuple[Any, list[dict[str, float]]]:
    """The rollout, and one record per generate call: prompt tokens, prefilled tokens, seconds."""
    import torch

    from rlhf_lightning.envs.gem import GemEnv
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.engines.hf import HFEngine
    from rlhf_lightning.rollout.episodes.chat import ChatFormatter
    from rlhf_lightning.rollout.episodes.harness import RolloutHarness

    engine = HFEngine(
        lambda: model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok, reuse_turn_cache=reuse
    )
    calls: list[dict[str, float]] = []
    generate = engine.generate

    def timed(prompts: list[list[int]], params: Any, adapters: Any = None) -> Any:
        cache = engine.turn_cache
        before = cache.prefilled_tokens if cache is not None else 0
        t0 = time.perf_counter()
        out = generate(prompts, params, adapters)
        seconds = time.perf_counter() - t0
        prompt = sum(len(p) for p in prompts)
        prefilled = cache.prefilled_tokens - before if cache is not None and cache.reused_calls else prompt
        calls.append({"rows": len(prompts), "prompt": prompt, "prefilled": prefilled, "seconds": seconds})
        return out

    engine.generate = timed  # type: ignore[method-assign]
    harness = RolloutHarness(
        lambda: GemEnv(id="game:Sudoku-v0-easy"),
        tok,
        ChatFormatter(tok),
        max_turns=15,
        max_model_len=int(model.config.max_position_embeddings),
        history="full",
    )
    torch.manual_seed(seed)
    result = harness.rollout(engine, list(range(episodes)), SamplingParams(10, temperature=1.0))
    return result, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny_gem", help="an embedded model (rlhf_lightning/assets/<name>)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from rlhf_lightning.models.build import load_model, load_tokenizer
    from rlhf_lightning.models.tiny import ASSETS

    torch.set_num_threads(args.threads)
    path = str(ASSETS / args.model)
    model, tok = load_model(path, dtype="float32", attn_implementation="sdpa"), load_tokenizer(path)
    play(model, tok, True, 2, args.seed)  # warm-up: first-call allocations out of both arms
    arms = {
        name: play(model, tok, reuse, args.episodes, args.seed)
        for name, reuse in (("prefill", False), ("reuse", True))
    }
    (a, calls_a), (b, calls_b) = arms["prefill"], arms["reuse"]
    diff = 0.0
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        if x.token_ids != y.token_ids:
            raise SystemExit("the arms sampled different tokens: reuse is not exact")
        diff = max([diff, *(abs(p - q) for p, q in zip(x.sampling_logps, y.sampling_logps, strict=True))])
    print(f"GEM Sudoku-v0-easy, model={args.model}, {args.episodes} episodes, {args.threads} thread(s); "
          f"same tokens in both arms, largest log-prob difference {diff:.2e}\n")  # fmt: skip
    print(
        "| turn | episodes | prompt tokens (all episodes) | prefilled with reuse | prefill ms | reuse ms | speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for k, (ca, cb) in enumerate(zip(calls_a, calls_b, strict=True)):
        speed = ca["seconds"] / cb["seconds"]
        rows.append({"turn": k + 1, "episodes": ca["rows"], "prompt_tokens": ca["prompt"], "prefilled": cb["prefilled"],
                     "prefill_s": ca["seconds"], "reuse_s": cb["seconds"], "speedup": speed})  # fmt: skip
        print(f"| {k + 1} | {ca['rows']} | {ca['prompt']:,} | {cb['prefilled']:,} | {1e3 * ca['seconds']:.0f} | "
              f"{1e3 * cb['seconds']:.0f} | {speed:.2f}x |")  # fmt: skip
    total_a, total_b = sum(c["seconds"] for c in calls_a), sum(c["seconds"] for c in calls_b)
    print(f"\nall turns: prefill {total_a:.2f} s, reuse {total_b:.2f} s ({total_a / total_b:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "max_logp_diff": diff, "prefill_s": total_a,
                                         "reuse_s": total_b, **vars(args) | {"json": str(args.json)}}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
