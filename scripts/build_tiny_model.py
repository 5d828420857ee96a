"""Build the embedded tiny checkpoint (``model=tiny``) from scratch, offline, with ``algo=sft``.

1. Train a byte-level BPE tokenizer on arithmetic word problems rendered in the chat format.
2. Build a ~1M-parameter Qwen2-style model (random weights) next to it.
3. Supervised-fine-tune it with the package's SFT module (``algo=sft``, full fine-tuning, loss on
   answer tokens only) on problems from the arithmetic train split, evaluating the env's
   held-out split every 10 steps, and stop as soon as the accuracy sampled at temperature 1 is
   partial (``--target``), so that RL has room to improve it within minutes on a CPU.
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_arithmetic``.

    python scripts/build_tiny_model.py            # ~5-10 minutes on 2 CPU cores

``--noise p`` replaces a share ``p`` of the SFT answers by the answer with one digit wrong, so
that a model can know more than it samples at temperature 1 (stop it with
``--target-metric greedy``); ``--init DIR`` continues from a built checkpoint. The shipped
checkpoint uses neither (see docs/models.md, "The tiny model").
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import lightning as L
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlhf_lightning.config import register_configs
from rlhf_lightning.envs.arithmetic import make_problem
from rlhf_lightning.models.tiny import TINY_MODEL_DIR, build_tokenizer, save_untrained
from rlhf_lightning.run import run

ROOT = Path(__file__).resolve().parent.parent


class StopAtAccuracy(L.Callback):
    """Stop fitting once ``eval/accuracy_<metric>`` (sampled or greedy) reaches ``target``."""

    def __init__(self, target: float, metric: str = "sampled") -> None:
        self.target, self.key = target, f"eval/accuracy_{metric}"

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        acc = trainer.callback_metrics.get(self.key)
        if trainer.state.fn == "fit" and acc is not None and float(acc) >= self.target:
            trainer.should_stop = True


def careless(answer: int, rng: random.Random) -> int:
    """``answer`` with one digit replaced by a different random digit (a careless slip)."""
    digits = list(str(abs(answer)))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    value = int("".join(digits))
    return -value if answer < 0 else value


def write_jsonl(path: Path, seed: int, rows: range, noise: float = 0.0) -> None:
    """SFT rows from the train split; a ``noise`` share of the answers has one digit wrong."""
    rng = random.Random(f"{seed}:noise")
    with path.open("w") as f:
        for i in rows:
            p = make_problem(seed, i, False, 10, 99)
            answer = careless(p.answer, rng) if rng.random() < noise else p.answer
            f.write(json.dumps({"prompt": p.question, "completion": str(answer)}) + "\n")


def untrained(seed: int, out: Path) -> tuple[PreTrainedTokenizerBase, Path]:
    """1. A tokenizer trained on the prompts and answers it will see; 2. the random model next to
    it, saved like any local model."""
    bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
    corpus = []
    for i in range(4000):
        p = make_problem(seed, i, False, 10, 99)
        msgs = [{"role": "user", "content": p.question}]
        corpus.append(
            bootstrap.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            + f"{p.answer}<|im_end|>\n"
        )
    tokenizer = build_tokenizer(corpus, vocab_size=512)
    save_untrained(tokenizer, out)
    return tokenizer, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=TINY_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.25, help="stop once the eval accuracy >= this")
    ap.add_argument("--target-metric", choices=["sampled", "greedy"], default="sampled")
    ap.add_argument("--noise", type=float, default=0.0, help="share of SFT answers with one digit wrong")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--train-rows", type=int, default=100_000)
    ap.add_argument("--init", type=Path, default=None, help="continue SFT from this checkpoint")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="tiny_build_"))
    try:
        if args.init is not None:  # continue from a built checkpoint (its tokenizer and weights)
            tokenizer, base = AutoTokenizer.from_pretrained(args.init), args.init
        else:
            tokenizer, base = untrained(args.seed, work / "base")
        # 3. SFT with algo=sft until the accuracy is partial.
        write_jsonl(work / "train.jsonl", args.seed, range(args.train_rows), args.noise)
        write_jsonl(work / "eval.jsonl", args.seed + 1, range(200))
        register_configs()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            cfg = compose(
                config_name="config",
                overrides=[
                    "algo=sft",
                    "model=local",
                    f"model.path={base}",
                    "model.finetune=full",
                    "model.dtype=float32",
                    "model.attn_implementation=eager",
                    f"algo.data_path={work / 'train.jsonl'}",
                    f"algo.eval_data_path={work / 'eval.jsonl'}",
                    f"algo.lr={args.lr}",
                    f"algo.warmup_steps={args.warmup}",
                    "algo.min_lr_ratio=1.0",
                    f"algo.batch_size={args.batch_size}",
                    f"trainer.max_steps={args.max_steps}",
                    f"trainer.val_check_interval={args.eval_every}",
                    "env=arithmetic",
                    "env.kwargs.eval_size=200",
                    "rollout.max_new_tokens=6",
                    "eval.batch_size=200",
                    "eval.at_end=false",
                    "checkpoint.every_n_steps=0",
                    "checkpoint.save_last=false",
                    "checkpoint.export_adapters=false",
                    "samples.every_n_steps=0",
                    "trainer.enable_progress_bar=false",
                    f"seed={args.seed}",
                    f"num_threads={args.threads}",
                    f"output_dir={work / 'run'}",
                ],
            )
        result = run(cfg, extra_callbacks=[StopAtAccuracy(args.target, args.target_metric)])
        history = [
            {
                "step": int(r["step"]),
                "eval_loss": float(r["eval/loss"]),
                "greedy": float(r["eval/accuracy_greedy"]),
                "sampled": float(r["eval/accuracy_sampled"]),
            }
            for r in csv.DictReader((work / "run" / "metrics.csv").open())
            if r.get("eval/accuracy_sampled")
        ]
        # 4. Save.
        if args.out.exists():
            shutil.rmtree(args.out)
        result.module.policy.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        info = {
            "seed": args.seed,
            "sft_steps": result.trainer.global_step,
            "eval_accuracy_greedy": history[-1]["greedy"],
            "eval_accuracy_sampled_t1": history[-1]["sampled"],
            "built_with": "scripts/build_tiny_model.py (algo=sft)",
            "history": history,
        }
        (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
        print(
            f"saved to {args.out} after {result.trainer.global_step} SFT steps ({time.time() - t0:.0f}s): "
            f"eval greedy {info['eval_accuracy_greedy']:.3f}, sampled {info['eval_accuracy_sampled_t1']:.3f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
