"""Peak memory and time of token log-probs + a GRPO loss, forward and backward, at real LM sizes.

    .venv/bin/python bench/logprob_memory.py                 # Qwen2.5-0.5B head: V=151,936, H=896, 8 x 1024 tokens
    .venv/bin/python bench/logprob_memory.py --rows 2048     # smaller, faster

Variants, each in its own process so that peaks do not mix:
  naive    full (N, V) logits -> log_softmax -> gather, autograd saves everything
  chunked  rlhf_lightning.ops.chunked_logprobs (auto chunk_rows), backward recomputes tiles
  liger    Liger's fused linear GRPO loss (when liger-kernel is installed; on a CPU its
           PyTorch chunked path, uncompiled)
Each computes the same PPO-clip loss (token mean) on the log-probs and back-propagates into
the hidden states and the lm-head weight. Memory: peak RSS growth over the inputs on a CPU,
``torch.cuda.max_memory_allocated`` growth on a GPU. Prints one markdown table with ratios to naive.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("naive", "chunked", "liger")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_variant(variant: str, rows: int, vocab: int, hidden: int, device: str, repeats: int) -> dict:
    import torch

    from rlhf_lightning.losses import aggregate, get_policy_loss
    from rlhf_lightning.ops import chunked_logprobs, resolve_chunk_rows

    torch.manual_seed(0)
    dev = torch.device(device)
    h = (torch.randn(rows, hidden, device=dev) * 0.5).requires_grad_(True)
    w = (torch.randn(vocab, hidden, device=dev) * 0.02).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), device=dev)
    adv = torch.randn(1, device=dev)
    mask = torch.ones(1, rows, dtype=torch.bool, device=dev)

    def step() -> None:
        if variant == "liger":
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            fn = LigerFusedLinearGRPOLoss(
                beta=0.0, compiled=dev.type == "cuda", use_ref_model=False, loss_type="dapo"
            )
            loss, _ = fn(h[None], w, targets[None], mask.long(), adv)
        else:
            if variant == "naive":
                logp = (h @ w.t()).float().log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
            else:
                logp = chunked_logprobs(h, w, targets)
            per_token, _ = get_policy_loss("ppo_clip")(logp[None], logp[None].detach(), adv, mask)
            loss = aggregate(per_token, mask, "token_mean")
        loss.backward()
        h.grad = None
        w.grad = None

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda" else peak_rss_bytes()) - base
    return {
        "variant": variant,
        "peak_mb": peak / 2**20,
        "time_s": min(times),
        "chunk_rows": resolve_chunk_rows(None, vocab) if variant == "chunked" else None,
        "threads": torch.get_num_threads(),
        "device": device,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8 * 1024, help="B x T tokens")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--repeats", type=int, default=2, help="timed repetitions per variant (the best is kept)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run_variant(a.child, a.rows, a.vocab, a.hidden, a.device, a.repeats)))
        return
    import torch

    from rlhf_lightning.ops.liger import liger_available

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for variant in a.variants:
        if variant == "liger" and not liger_available():
            print(
                f"skipping liger: liger-kernel is not installed ({sys.executable} -m pip install liger-kernel)",
                file=sys.stderr,
            )
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            variant,
            "--rows",
            str(a.rows),
            "--vocab",
            str(a.vocab),
            "--hidden",
            str(a.hidden),
            "--repeats",
            str(a.repeats),
            "--device",
            device,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{variant} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            results.append(
                {"variant": variant, "peak_mb": float("nan"), "time_s": float("nan"), "failed": True}
            )
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{variant}: done", file=sys.stderr, flush=True)
    naive = next((r for r in results if r["variant"] == "naive" and not r.get("failed")), None)
    print(
        f"\nN = {a.rows} tokens, V = {a.vocab}, H = {a.hidden}, device = {device}, "
        f"threads = {results[0].get('threads') if results else '?'}; forward + backward of a PPO-clip loss\n"
    )
    print("| variant | peak memory (MB) | x naive | time (s) | x naive |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        mem_ratio = r["peak_mb"] / naive["peak_mb"] if naive else float("nan")
        time_ratio = r["time_s"] / naive["time_s"] if naive else float("nan")
        name = r["variant"] + (f" (chunk_rows={r['chunk_rows']})" if r.get("chunk_rows") else "")
        print(f"| {name} | {r['peak_mb']:.0f} | {mem_ratio:.3f} | {r['time_s']:.2f} | {time_ratio:.2f} |")


if __name__ == "__main__":
    main()
