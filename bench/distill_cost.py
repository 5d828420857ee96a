"""What each distillation estimator costs: time and peak memory of one update on a batch of
student samples, the teacher's part included (``algo.distill.estimator``).

    .venv/bin/python bench/distill_cost.py                                    # the embedded model (V=~1k)
    .venv/bin/python bench/distill_cost.py --model qwen0.5b-shape --rows 4 --length 512

Arms, each in its own process so that peaks do not mix:
  none     the student's update alone (a GRPO step: log-probs, PPO-clip loss, backward)
  sampled  + a no-grad teacher pass for the sampled tokens' log-probs (once a batch), the
           per-token log-ratio folded into the advantages
  full     the exact KL over the vocabulary as a loss term: the teacher's body in the update's
           pass, both heads' logits tile by tile forward and again backward
Student and teacher have the same shape (the teacher a copy with other weights); the student
trains LoRA adapters as the default run does. Memory: peak RSS growth over the loaded models on
a CPU, ``torch.cuda.max_memory_allocated`` growth on a GPU. One markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ARMS = ("none", "sampled", "full")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def models(model: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from rlhf_lightning.models.tiny import ASSETS

    def make(seed: int):
        torch.manual_seed(seed)
        if model == "qwen0.5b-shape":
            cfg = Qwen2Config(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                              tie_word_embeddings=True, attn_implementation="sdpa")  # fmt: skip
            return Qwen2ForCausalLM(cfg)
        lm = AutoModelForCausalLM.from_pretrained(str(ASSETS / model), attn_implementation="sdpa")
        if seed:
            with torch.no_grad():
                for p in lm.parameters():
                    p.add_(torch.randn_like(p) * 0.5 * p.abs().mean())
        return lm

    return make(0), make(1)


def batch(rows: int, length: int, prompt: int, vocab: int):
    """``rows`` sequences of ``length`` tokens, the last ``length - prompt`` of them actions."""
    import torch

    from rlhf_lightning.records.trajectory import Trajectory, collate

    gen = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(rows):
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        trajs.append(
            Trajectory(ids, [-1] * prompt + [0] * (length - prompt), [0.0] * length, [0.0], i, prompt)
        )
    return collate(trajs, 0)


def run_arm(arm: str, model: str, rows: int, length: int, device: str, repeats: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from rlhf_lightning.learner.objective import MicroBatch, PolicyObjective, PolicyTerm, TeacherKLTerm
    from rlhf_lightning.learner.records import Scored
    from rlhf_lightning.learner.scoring import distilled_advantages
    from rlhf_lightning.models.policy import Policy

    student_lm, teacher_lm = models(model)
    for p in teacher_lm.parameters():
        p.requires_grad_(False)
    peft = get_peft_model(student_lm, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), "actor")
    student, teacher = Policy(peft, adapter_name="actor").to(device), Policy(teacher_lm).to(device)
    b = batch(rows, length, length // 4, teacher_lm.config.vocab_size).to(device)
    mask = b.action_mask
    task = torch.randn(rows, device=device)
    norm = {"num_tokens": mask.sum().float(), "num_seqs": torch.tensor(float(rows), device=device)}
    term = PolicyTerm("ppo_clip", {})
    objective = PolicyObjective(term, teacher_kl=TeacherKLTerm(1.0, teacher) if arm == "full" else None)

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    times = []
    for _ in range(repeats):  # the first step pays for warm-up; the table shows the fastest
        t0 = time.perf_counter()
        adv = task
        if arm == "sampled":  # the scoring pass: both models' sampled-token log-probs, no gradient
            with torch.no_grad():
                t_logp = teacher.forward_heads(b, ("logp",))["logp"]
                s_logp = student.forward_heads(b, ("logp",))["logp"]
            adv, _ = distilled_advantages(task, s_logp, t_logp, mask, 1.0)
        mb = MicroBatch.rows_of(b, Scored(adv, mask, {}), torch.arange(rows, device=device), None, None)
        loss, _ = objective(student, mb, norm, lambda part: None)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "arm": arm,
        "model": model,
        "rows": rows,
        "length": length,
        "action_tokens": int(mask.sum()),
        "vocab": int(teacher_lm.config.vocab_size),
        "step_s": min(times),
        "peak_mb": peak / 2**20,
        "threads": torch.get_num_threads(),
        "device": device,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="tiny_arithmetic", help="an embedded model's directory, or qwen0.5b-shape"
    )
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one arm, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_arm(args.one, args.model, args.rows, args.length, args.device, args.repeats)))
        return
    results = []
    for arm in args.arms:
        cmd = [sys.executable, __file__, "--one", arm, "--model", args.model, "--rows", str(args.rows)]
        cmd += ["--length", str(args.length), "--device", args.device, "--repeats", str(args.repeats)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(out))
        print(f"{arm}: {results[-1]['step_s']:.2f} s, {results[-1]['peak_mb']:.0f} MB", file=sys.stderr)
    base = results[0]
    print(f"\n{base['model']}, V={base['vocab']}, {base['rows']} rows x {base['length']} tokens "
          f"({base['action_tokens']} action tokens), {base['device']}, {base['threads']} thread(s), "
          f"fastest of {args.repeats} steps\n")  # fmt: skip
    print("| estimator | step (s) | x none | peak memory (MB) | x none |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['arm']} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | "
            f"{r['peak_mb']:.0f} | {r['peak_mb'] / max(base['peak_mb'], 1e-9):.2f} |"
        )


if __name__ == "__main__":
    main()
