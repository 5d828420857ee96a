"""Build the embedded tiny checkpoint (``model=tiny``) from scratch, offline.

1. Train a byte-level BPE tokenizer on arithmetic word problems rendered in the chat format.
2. Build a ~1M-parameter Qwen2-style model.
3. Supervised-fine-tune it on the train split (loss on answer tokens only) and stop as soon as
   its held-out accuracy, sampled at temperature 1, is partial (``--target``), so that RL has
   room to improve it within minutes on a CPU.
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_arithmetic``.

    python scripts/build_tiny_model.py            # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch

from rlhf_lightning.envs.arithmetic import make_problem
from rlhf_lightning.models.tiny import TINY_MODEL_DIR, build_tiny_model, build_tokenizer


def render(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def sft_batch(tokenizer, rows: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer ids, attention mask, and labels (-100 outside the answer)."""
    seqs, labels = [], []
    for row in rows:
        p = make_problem(seed, row, False, 10, 99)
        prompt = tokenizer(render(tokenizer, p.question), add_special_tokens=False).input_ids
        answer = tokenizer(str(p.answer), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, lb) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)], lab[i, : len(lb)] = torch.tensor(s), torch.tensor(lb)
    return ids, (lab != -100) | (ids != tokenizer.pad_token_id), lab


@torch.no_grad()
def accuracy(model, tokenizer, seed: int, n: int, temperature: float) -> float:
    model.eval()
    problems = [make_problem(seed, i, True, 10, 99) for i in range(n)]
    enc = tokenizer([render(tokenizer, p.question) for p in problems], return_tensors="pt", padding=True)
    kwargs = (
        {"do_sample": True, "temperature": temperature, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    out = model.generate(**enc, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id, **kwargs)
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    model.train()
    return sum(t.strip() == str(p.answer) for t, p in zip(texts, problems)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.25, help="stop once sampled eval accuracy >= this")
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.set_num_threads(1)

    # 1. Tokenizer, trained on the prompts and answers it will see.
    corpus_rows = [make_problem(args.seed, i, False, 10, 99) for i in range(4000)]
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
    corpus = [render(bootstrap, p.question) + f"{p.answer}<|im_end|>\n" for p in corpus_rows]
    tokenizer = build_tokenizer(corpus, vocab_size=512)
    # 2. Model.
    model = build_tiny_model(
        len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model.config.use_cache = True
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}")
    # 3. SFT until the sampled accuracy is partial.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    t0, history = time.time(), []
    acc_greedy = acc_sampled = 0.0
    for step in range(1, args.max_steps + 1):
        rows = [random.randrange(100_000) for _ in range(args.batch_size)]
        ids, mask, labels = sft_batch(tokenizer, rows, args.seed)
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            acc_sampled = accuracy(model, tokenizer, args.seed, 200, 1.0)
            acc_greedy = accuracy(model, tokenizer, args.seed, 200, 0.0)
            history.append({"step": step, "loss": loss.item(), "greedy": acc_greedy, "sampled": acc_sampled})
            print(
                f"step {step:4d}  loss {loss.item():.3f}  eval greedy {acc_greedy:.3f}  sampled {acc_sampled:.3f}  ({time.time() - t0:.0f}s)"
            )
            if acc_sampled >= args.target:
                break
    # 4. Save.
    if args.out.exists():
        shutil.rmtree(args.out)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    info = {
        "seed": args.seed,
        "sft_steps": step,
        "eval_accuracy_greedy": acc_greedy,
        "eval_accuracy_sampled_t1": acc_sampled,
        "history": history,
    }
    (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
    print(f"saved to {args.out} after {step} steps ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
