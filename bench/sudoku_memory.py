"""Peak memory and time of one training step on a batch of GEM Sudoku episodes: the whole
conversation (``env.history=full``) against each turn on its own (``last``), with the chunked
log-probs on and off.

    .venv/bin/python bench/sudoku_memory.py                          # the embedded model=tiny_sudoku
    .venv/bin/python bench/sudoku_memory.py --model qwen0.5b-shape    # Qwen2.5-0.5B's shape, random weights

The batch: ``--episodes`` games of ``game:Sudoku-v0-easy`` (``env=gem``, GEM's 15-turn limit)
played by the scripted player of ``scripts/make_gem_sft_data.py`` (right moves half the time,
else plausible mistakes) through the rollout harness, so both history modes hold the same games,
move for move, token-exact as training sees them. One training step: LoRA r=16 on every linear
layer, forward and backward of CISPO's loss on every move token, its log-probs as training
computes them (each sequence through the body once, what every sequence starts with shared, the
move tokens through chunked lm-head tiles) or the naive way (each sequence through the body, its
``(positions, V)`` logits, ``log_softmax``, gather), as one micro-batch. Memory: peak RSS growth of the process over the step's inputs (each variant in its
own process, so peaks do not mix); ``--device cuda``: ``torch.cuda.max_memory_allocated`` growth.
``qwen0.5b-shape`` builds Qwen2.5-0.5B's architecture (vocabulary 151,936, 24 layers) with random
weights, offline: the numbers are its memory, not its play.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

VARIANTS = [(h, c) for h in ("full", "last") for c in ("chunked", "naive")]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ScriptedPlayer:
    """An engine that plays the last board of each prompt with ``make_gem_sft_data``'s scripted
    player (its own RNG per episode order, so both history modes get the same moves)."""

    def __init__(self, tokenizer, quality: float, seed: int) -> None:
        from make_gem_sft_data import sudoku_policy

        self.tok, self.policy, self.rng = tokenizer, sudoku_policy(quality), random.Random(seed)

    def generate(self, prompts, params):
        from rlhf_lightning.records.sampling import Completion

        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids, skip_special_tokens=True)
            reply = self.policy([{"role": "user", "content": text}], self.rng)
            reply_ids = [*self.tok(reply, add_special_tokens=False).input_ids, self.tok.eos_token_id]
            out.append(Completion(reply_ids, [-1.0] * len(reply_ids), "stop", i))
        return out


def sudoku_batch(tokenizer, history: str, episodes: int, seed: int):
    """``episodes`` scripted games, rows 0.., as the harness builds them with ``history``."""
    from rlhf_lightning.envs.gem import GemEnv
    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.episodes.chat import ChatFormatter
    from rlhf_lightning.rollout.episodes.harness import RolloutHarness

    harness = RolloutHarness(
        lambda: GemEnv(id="game:Sudoku-v0-easy"),
        tokenizer,
        ChatFormatter(tokenizer),
        max_turns=15,
        max_model_len=4096,
        history=history,
    )
    result = harness.rollout(ScriptedPlayer(tokenizer, 0.5, seed), list(range(episodes)), SamplingParams(12))
    return result.batch


def sequences(b):
    """The batch's sequences one per row (a packed row's turns cut apart), right-padded, and
    where its move tokens' predictions sit: (ids (S, M), mask (S, M), acts (S, M-1))."""
    import torch

    from rlhf_lightning.models.packing import sequence_layout

    if b.position_ids is None:
        return b.input_ids, b.attention_mask, b.action_mask
    real, seq, pos, count, longest = sequence_layout(b.position_ids, b.attention_mask)
    ids = torch.zeros((count, longest), dtype=b.input_ids.dtype)
    mask = torch.zeros((count, longest), dtype=b.attention_mask.dtype)
    ids[seq, pos], mask[seq, pos] = b.input_ids[real], 1
    seq_at = torch.full(b.input_ids.shape, -1)
    pos_at = torch.full(b.input_ids.shape, -1)
    seq_at[real], pos_at[real] = seq, pos
    rows, cols = b.action_mask.nonzero(as_tuple=True)
    acts = torch.zeros((count, longest - 1), dtype=torch.bool)
    acts[seq_at[rows, cols + 1], pos_at[rows, cols + 1] - 1] = True
    return ids, mask, acts


def load(model: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlhf_lightning.models.tiny import ASSETS

    tok = AutoTokenizer.from_pretrained(str(ASSETS / (model if (ASSETS / model).is_dir() else "tiny_sudoku")))
    if model == "qwen0.5b-shape":
        cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
        torch.manual_seed(0)
        return tok, Qwen2ForCausalLM(cfg)
    return tok, AutoModelForCausalLM.from_pretrained(str(ASSETS / model), attn_implementation="sdpa")


def run_variant(model: str, history: str, logprobs: str, episodes: int, device: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from rlhf_lightning.losses import aggregate, get_policy_loss
    from rlhf_lightning.models.policy import Policy

    torch.manual_seed(0)
    tok, lm = load(model)
    batch = sudoku_batch(tok, history, episodes, seed=0)
    peft = get_peft_model(
        lm, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), adapter_name="actor"
    )
    policy = Policy(peft, adapter_name="actor").to(device)
    b = batch.to(device)
    adv = torch.randn(len(b), device=device)[:, None].expand_as(b.action_mask)  # episode advantages

    def logp() -> torch.Tensor:
        """The move tokens' log-probs (B, T): the policy's path, or the naive one."""
        if logprobs == "chunked":
            return policy.forward_heads(b, ("logp",))["logp"]
        ids, mask, acts = sequences(b)  # every sequence on its own, no sharing
        logits = policy.causal_lm(input_ids=ids, attention_mask=mask).logits  # (S, M, V)
        all_lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        out = torch.zeros(b.action_mask.shape, dtype=all_lp.dtype, device=all_lp.device)
        return out.masked_scatter(b.action_mask, all_lp[acts])

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    t0 = time.perf_counter()
    lp = logp()
    per_token, _ = get_policy_loss("cispo")(lp, lp.detach(), adv, b.action_mask)
    aggregate(per_token, b.action_mask, "token_mean").backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    lens = b.attention_mask.sum(-1).float()
    return {
        "model": model,
        "history": history,
        "logprobs": logprobs,
        "episodes": len(b),
        "tokens_per_episode": float(lens.mean()),
        "row_width": int(b.input_ids.shape[1]),
        "turns_per_episode": float(b.num_turns.float().mean()),
        "peak_mb": peak / 2**20,
        "step_s": seconds,
        "threads": torch.get_num_threads(),
        "device": device,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="tiny_sudoku", help="an embedded model (tiny_sudoku) or qwen0.5b-shape"
    )
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_variant(a.model, a.child[0], a.child[1], a.episodes, a.device)))
        return
    results = []
    for history, logprobs in VARIANTS:
        cmd = [sys.executable, __file__, "--model", a.model, "--episodes", str(a.episodes), "--device", a.device,
               "--child", history, logprobs]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            print(
                f"{history}/{logprobs} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}",
                file=sys.stderr,
            )
            results.append({"history": history, "logprobs": logprobs, "failed": True})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{history}/{logprobs}: done", file=sys.stderr, flush=True)
    ok = [r for r in results if not r.get("failed")]
    base = next((r for r in ok if r["history"] == "full" and r["logprobs"] == "naive"), None)
    print(
        f"\n{a.model}, {a.episodes} scripted Sudoku episodes, device {a.device}, "
        f"threads {ok[0]['threads'] if ok else '?'}; one step: forward + backward of CISPO's loss, LoRA r=16\n"
    )
    print(
        "| env.history | log-probs | tokens / episode | turns / episode | peak memory (MB) | x full+naive | step (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        if r.get("failed"):
            print(f"| {r['history']} | {r['logprobs']} | failed | | | | |")
            continue
        ratio = r["peak_mb"] / base["peak_mb"] if base else float("nan")
        print(f"| {r['history']} | {r['logprobs']} | {r['tokens_per_episode']:.0f} | {r['turns_per_episode']:.1f} | "
              f"{r['peak_mb']:.0f} | {ratio:.3f} | {r['step_s']:.2f} |")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
