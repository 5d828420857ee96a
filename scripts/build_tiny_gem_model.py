"""Build the embedded GEM chat model (``model=tiny_gem``) from scratch, offline, with ``algo=sft``.

1. Play GEM's own games through ``env=gem`` with the scripted players of
   ``make_gem_sft_data.py`` (good moves with probability ``--guess-quality`` /
   ``--sudoku-quality``, else plausible mistakes): ``--guess-rows`` GuessTheNumber-v0-easy
   episodes (~250 tokens each) and ``--sudoku-rows`` Sudoku-v0-easy ones (~1,800 tokens: GEM
   re-sends the board every turn), train rows 0.., held-out rows after them.
2. Train a byte-level BPE tokenizer on the dialogues rendered in the chat format (GEM's long
   instructions become a few hundred tokens, a Sudoku turn's feedback and board about 100) and
   build a ~1M-parameter Qwen2-style model (random weights) whose ``max_position_embeddings``
   (``--max-positions``, 2560) holds a whole 15-turn Sudoku episode (at most ~2,300 tokens).
3. Supervised-fine-tune it with the package's SFT module (``algo=sft``, full fine-tuning, loss on
   the replies only, examples packed into rows of up to 2560 tokens). Every ``--eval-every`` steps
   play the eval split of ``--stop-game`` (greedy and sampled at temperature 1) and stop once its
   sampled solve rate reaches ``--target`` after ``--min-steps`` (room to improve by RL), or at
   ``--max-steps`` / ``--max-minutes``. The other game is played once, at the end (Sudoku's 200
   eval episodes take ~9 minutes on 2 shared cores).
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_gem`` with
   ``build_info.json`` (steps, seconds, data and eval solve rate, valid-move rate and turns per
   episode per game, the history).

    OMP_NUM_THREADS=1 python scripts/build_tiny_gem_model.py --min-steps 200 --max-minutes 15
    # the shipped model: 140 SFT steps in 15 minutes, 1,525 s in all (2 cores shared with 2 jobs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
from build_tiny_chat_model import QUIET_BUILD, compose_config
from make_chat_sft_data import write_jsonl
from make_gem_sft_data import GAMES, gem_dialogues, summary

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.gem import GemEnv
from rlhf_lightning.models.tiny import build_tiny_model, build_tokenizer
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.engines.base import RolloutEngine
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from rlhf_lightning.run import run

GEM_MODEL_DIR = ASSETS / "tiny_gem"
MAX_MODEL_LEN = 2560  # conf/experiment/gem_sudoku.yaml's env.max_model_len


def gem_harness(game: str, tokenizer: Any, eval_size: int) -> RolloutHarness:
    """``env=gem`` on ``game`` (a key of ``make_gem_sft_data.GAMES``) with the game's own turn
    limit, as conf/experiment/gem_*.yaml set it up."""
    env_id, max_turns, _ = GAMES[game]
    return RolloutHarness(
        lambda: GemEnv(id=env_id, eval_size=eval_size),
        tokenizer,
        ChatFormatter(tokenizer),
        max_turns=max_turns,
        max_model_len=MAX_MODEL_LEN,
    )


def valid_move_rate(trajs: list[Any]) -> float:
    """Turns whose move GEM accepted (``info["valid_move"]``) over all turns played."""
    turns = sum(len(t.infos) for t in trajs)
    return sum(bool(i.get("valid_move")) for t in trajs for i in t.infos) / max(turns, 1)


def play_eval(harness: RolloutHarness, engine: RolloutEngine, sampling: SamplingParams, rows: int) -> dict:
    """Solve rate, valid-move rate and turns per episode on eval rows ``0..rows-1``, greedy and sampled."""
    out = {}
    for mode, params in (("greedy", dataclasses.replace(sampling, temperature=0.0)), ("sampled", sampling)):
        trajs = harness.rollout(engine, list(range(rows)), params, evaluation=True).trajectories
        out[f"solved_{mode}"] = round(sum(episode_success(t) for t in trajs) / len(trajs), 4)
        out[f"valid_move_{mode}"] = round(valid_move_rate(trajs), 4)
        out[f"turns_{mode}"] = round(sum(t.num_turns for t in trajs) / len(trajs), 3)
    return out


class EvalAndStop(L.Callback):
    """At each validation play ``harness``'s eval rows and record them in ``history``; stop once
    the sampled solve rate reaches ``target`` (after ``min_steps``), or after ``max_seconds``."""

    def __init__(self, harness: RolloutHarness, rows: int, target: float, min_steps: int, max_seconds: float):
        self.harness, self.rows, self.target, self.min_steps = harness, rows, target, min_steps
        self.max_seconds = max_seconds
        self.history: list[dict[str, Any]] = []
        self.t0 = time.time()

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        entry: dict[str, Any] = {"step": trainer.global_step, "seconds": round(time.time() - self.t0)}
        entry |= play_eval(self.harness, pl_module.engine, pl_module.sampling, self.rows)
        self.history.append(entry)
        print(json.dumps(entry), flush=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        loss = trainer.callback_metrics.get("eval/loss")
        if loss is not None:
            self.history[-1]["eval_loss"] = round(float(loss), 4)
        reached = self.history[-1]["solved_sampled"] >= self.target and trainer.global_step >= self.min_steps
        if trainer.state.fn == "fit" and reached:
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if time.time() - self.t0 > self.max_seconds:
            trainer.should_stop = True


def save_untrained(tokenizer: Any, directory: Path, max_positions: int, layers: int) -> None:
    """A random Qwen2-style model sized to ``tokenizer``, saved with it like any local model."""
    model = build_tiny_model(
        len(tokenizer),
        num_layers=layers,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"vocab {len(tokenizer)}, parameters {sum(p.numel() for p in model.parameters()):,}", flush=True)


def dialogues(games: dict[str, int], quality: dict[str, float], seed: int, first_row: int) -> list[dict]:
    """The scripted dialogues of every game, shuffled together (deterministic in ``seed``)."""
    rows = [
        r
        for g, n in games.items()
        if n
        for r in gem_dialogues(g, n, quality[g], seed=seed, first_row=first_row)
    ]
    random.Random(f"gem-sft-shuffle:{seed}").shuffle(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=GEM_MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--guess-rows", type=int, default=20_000, help="GuessTheNumber train dialogues")
    ap.add_argument("--sudoku-rows", type=int, default=2_000, help="Sudoku train dialogues")
    ap.add_argument(
        "--guess-quality", type=float, default=0.5, help="the scripted player's good-move probability"
    )
    ap.add_argument("--sudoku-quality", type=float, default=0.6)
    ap.add_argument(
        "--stop-game", choices=sorted(GAMES), default="guess_the_number", help="the game --target is on"
    )
    ap.add_argument("--target", type=float, default=0.2, help="stop once its sampled solve rate >= this")
    ap.add_argument("--min-steps", type=int, default=0, help="never stop before this many steps")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--max-minutes", type=float, default=15.0, help="stop (at a step end) after this long")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-rows", type=int, default=100, help="eval episodes per game and mode")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-positions", type=int, default=MAX_MODEL_LEN)
    args = ap.parse_args()
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="tiny_gem_build_"))
    games = {"guess_the_number": args.guess_rows, "sudoku": args.sudoku_rows}
    quality = {"guess_the_number": args.guess_quality, "sudoku": args.sudoku_quality}
    try:
        # 1. Dialogues: train rows 0.., held-out rows after them (for the SFT eval loss).
        train = dialogues(games, quality, args.seed, 0)
        held_out = dialogues({g: 100 for g, n in games.items() if n}, quality, args.seed, max(games.values()))
        write_jsonl(train, work / "train.jsonl")
        write_jsonl(held_out, work / "eval.jsonl")
        data = {g: summary([r for r in train if r["env"] == g]) for g, n in games.items() if n}
        print(f"data: {data}; {time.time() - t0:.0f}s", flush=True)
        # 2. Tokenizer trained on the rendered dialogues, a random model beside it.
        bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
        corpus = [bootstrap.apply_chat_template(r["messages"], tokenize=False) for r in train[:6000]]
        tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
        base = work / "base"
        save_untrained(tokenizer, base, args.max_positions, args.layers)
        # 3. SFT (packed rows: a Sudoku episode is ~1,800 tokens, a GuessTheNumber one ~250).
        cfg = compose_config(
            [
                "algo=sft",
                "model=local",
                f"model.path={base}",
                "model.finetune=full",
                "model.dtype=float32",
                "model.attn_implementation=sdpa",
                f"algo.data_path={work / 'train.jsonl'}",
                f"algo.eval_data_path={work / 'eval.jsonl'}",
                f"algo.max_len={args.max_positions}",
                "algo.packing=true",
                "algo.env_eval=false",
                f"algo.lr={args.lr}",
                "algo.warmup_steps=50",
                "algo.min_lr_ratio=1.0",
                f"algo.batch_size={args.batch_size}",
                f"trainer.max_steps={args.max_steps}",
                f"trainer.val_check_interval={args.eval_every}",
                "env=gem",
                f"env.max_model_len={MAX_MODEL_LEN}",
                "rollout.max_new_tokens=10",
                *QUIET_BUILD,
                f"seed={args.seed}",
                "num_threads=1",
                f"output_dir={work / 'run'}",
            ]
        )
        harnesses = {g: gem_harness(g, tokenizer, args.eval_rows) for g in GAMES}
        stop = EvalAndStop(
            harnesses[args.stop_game], args.eval_rows, args.target, args.min_steps, args.max_minutes * 60
        )
        result = run(cfg, extra_callbacks=[stop])
        module = result.module
        final = {args.stop_game: {k: v for k, v in stop.history[-1].items() if k not in ("step", "seconds")}}
        for game in sorted(set(GAMES) - {args.stop_game}):  # the other game: once, at the end
            final[game] = play_eval(harnesses[game], module.engine, module.sampling, args.eval_rows)
            print(f"{game}: {final[game]}", flush=True)
        # 4. Save.
        if args.out.exists():
            shutil.rmtree(args.out)
        module.policy.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        info = {
            "seed": args.seed,
            "sft_steps": result.trainer.global_step,
            "seconds": round(time.time() - t0),
            "data": {"dialogues": games, "quality": quality, **data},
            "eval": final,
            "eval_rows": args.eval_rows,
            "built_with": "scripts/build_tiny_gem_model.py (algo=sft)",
            "args": {k: str(v) for k, v in vars(args).items()},
            "history": stop.history,
        }
        (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
        print(f"saved to {args.out} after {info['sft_steps']} SFT steps ({info['seconds']}s): {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
