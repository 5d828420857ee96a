"""Build the embedded tiny chat checkpoint (``model=tiny_chat``) from scratch, offline, with ``algo=sft``.

1. Generate multi-turn SFT dialogues with ``make_chat_sft_data.chat_sft_mix``: guess_number and
   tool_calc episodes played by scripted policies of mixed quality, plus single-turn arithmetic.
2. Train a byte-level BPE tokenizer on the dialogues rendered in the chat format, and build a
   ~1M-parameter Qwen2-style model (random weights) of ``model=tiny``'s size next to it.
3. Supervised-fine-tune it with the package's SFT module (``algo=sft``, full fine-tuning, loss on
   assistant tokens only). Every ``--eval-every`` steps, play the eval split of every multi-turn
   env (greedy and sampled at temperature 1, ``rollout.max_new_tokens=16``) and stop once every
   env's sampled success is partial (``--target``), or at ``--max-steps`` / ``--max-minutes``:
   RL has room to improve it within minutes on a CPU.
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_chat``, with
   ``build_info.json`` (steps, seconds, success and turns per episode per env, the history).

    python scripts/build_tiny_chat_model.py       # ~10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import lightning as L
from build_tiny_model import ROOT
from hydra import compose, initialize_config_dir
from make_chat_sft_data import chat_sft_mix, success_rates, write_jsonl
from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.config import ASSETS, register_configs
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.models.tiny import build_tokenizer, save_untrained
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.engines.base import RolloutEngine
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from rlhf_lightning.run import run

CHAT_MODEL_DIR = ASSETS / "tiny_chat"
EVAL_ENVS = ("tool_calc", "guess_number")


# A build's SFT runs keep no checkpoints, exports or sample tables and show no progress bar.
QUIET_BUILD = [
    "checkpoint.every_n_steps=0",
    "checkpoint.save_last=false",
    "checkpoint.export_adapters=false",
    "checkpoint.monitor=null",
    "samples.every_n_steps=0",
    "trainer.enable_progress_bar=false",
]


def compose_config(overrides: list[str]) -> DictConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def env_harness(name: str, tokenizer: Any) -> RolloutHarness:
    """The rollout harness of ``conf/env/<name>.yaml``."""
    e = compose_config([f"env={name}"]).env
    kwargs = cast(dict[str, Any], OmegaConf.to_container(e.kwargs, resolve=True))
    return RolloutHarness(
        env_factory(e._target_, kwargs),
        tokenizer,
        ChatFormatter(tokenizer, e.system_prompt, e.apply_chat_template),
        max_turns=e.max_turns,
        max_model_len=e.max_model_len,
    )


def play_eval(harness: RolloutHarness, engine: RolloutEngine, sampling: SamplingParams, rows: int) -> dict:
    """Success and turns per episode on the first ``rows`` eval rows, greedy and sampled."""
    out = {}
    for mode, params in (("greedy", dataclasses.replace(sampling, temperature=0.0)), ("sampled", sampling)):
        trajs = harness.rollout(engine, list(range(rows)), params, evaluation=True).trajectories
        out[f"success_{mode}"] = round(sum(episode_success(t) for t in trajs) / len(trajs), 4)
        out[f"turns_{mode}"] = round(sum(t.num_turns for t in trajs) / len(trajs), 3)
    return out


class EvalEnvsAndStop(L.Callback):
    """At each validation, play every env of ``harnesses`` with the module's engine and record it
    in ``history``; stop fitting once every env's sampled success reaches ``target``, or after
    ``max_seconds``."""

    def __init__(self, harnesses: dict[str, RolloutHarness], rows: int, target: float, max_seconds: float):
        self.harnesses, self.rows, self.target, self.max_seconds = harnesses, rows, target, max_seconds
        self.history: list[dict[str, Any]] = []
        self.t0 = time.time()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        # Before the module restores the training RNG state: evaluating does not shift training.
        entry: dict[str, Any] = {"step": trainer.global_step, "seconds": round(time.time() - self.t0)}
        for name, harness in self.harnesses.items():
            entry[name] = play_eval(harness, pl_module.engine, pl_module.sampling, self.rows)
        self.history.append(entry)
        print(json.dumps(entry), flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        loss = trainer.callback_metrics.get("eval/loss")
        if loss is not None:
            self.history[-1]["eval_loss"] = round(float(loss), 4)
        partial = all(self.history[-1][n]["success_sampled"] >= self.target for n in self.harnesses)
        if trainer.state.fn == "fit" and partial:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if time.time() - self.t0 > self.max_seconds:
            trainer.should_stop = True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=CHAT_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rows", type=int, default=20_000, help="guess_number and tool_calc dialogues each")
    ap.add_argument("--arithmetic-rows", type=int, default=5_000)
    ap.add_argument("--target", type=float, default=0.2, help="stop once every env's sampled success >= this")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--max-minutes", type=float, default=10.0, help="stop (at a step end) after this long")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-rows", type=int, default=100, help="eval episodes per env and mode")
    ap.add_argument("--vocab-size", type=int, default=512)
    args = ap.parse_args()
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="tiny_chat_build_"))
    try:
        # 1. Dialogues: train rows 0.., held-out rows after them (for the SFT eval loss).
        counts = {"guess_number": args.rows, "tool_calc": args.rows, "arithmetic": args.arithmetic_rows}
        train = chat_sft_mix(counts, seed=args.seed)
        held_out = chat_sft_mix(dict.fromkeys(counts, 100), seed=args.seed, first_row=max(counts.values()))
        write_jsonl(train, work / "train.jsonl")
        write_jsonl(held_out, work / "eval.jsonl")
        # 2. Tokenizer trained on the rendered dialogues (CALC(, ANSWER:, the prompts: few tokens).
        bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
        corpus = [bootstrap.apply_chat_template(r["messages"], tokenize=False) for r in train[:8000]]
        tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
        base = work / "base"
        save_untrained(tokenizer, base)
        print(f"data success: {success_rates(train)}")
        # 3. SFT with algo=sft; the envs are played by the callback, not the module.
        cfg = compose_config(
            [
                "algo=sft",
                "model=local",
                f"model.path={base}",
                "model.finetune=full",
                "model.dtype=float32",
                "model.attn_implementation=eager",
                f"algo.data_path={work / 'train.jsonl'}",
                f"algo.eval_data_path={work / 'eval.jsonl'}",
                "algo.env_eval=false",
                f"algo.lr={args.lr}",
                "algo.warmup_steps=50",
                "algo.min_lr_ratio=1.0",
                f"algo.batch_size={args.batch_size}",
                f"trainer.max_steps={args.max_steps}",
                f"trainer.val_check_interval={args.eval_every}",
                "env=tool_calc",
                "rollout.max_new_tokens=16",
                *QUIET_BUILD,
                f"seed={args.seed}",
                "num_threads=1",
                f"output_dir={work / 'run'}",
            ]
        )
        harnesses = {name: env_harness(name, tokenizer) for name in EVAL_ENVS}
        stop = EvalEnvsAndStop(harnesses, args.eval_rows, args.target, args.max_minutes * 60)
        result = run(cfg, extra_callbacks=[stop])
        final = stop.history[-1]
        # 4. Save.
        if args.out.exists():
            shutil.rmtree(args.out)
        result.module.policy.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        info = {
            "seed": args.seed,
            "sft_steps": result.trainer.global_step,
            "seconds": round(time.time() - t0),
            "data": {"dialogues": counts, "success": success_rates(train)},
            "eval": {name: final[name] for name in EVAL_ENVS},
            "eval_rows": args.eval_rows,
            "built_with": "scripts/build_tiny_chat_model.py (algo=sft)",
            "history": stop.history,
        }
        (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
        print(f"saved to {args.out} after {info['sft_steps']} SFT steps ({info['seconds']}s): {info['eval']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
