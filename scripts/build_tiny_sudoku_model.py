"""Build the embedded Sudoku model (``model=tiny_sudoku``) from scratch, offline, with ``algo=sft``.

A model sized for GEM's 4x4 Sudoku (``game:Sudoku-v0-easy``) as ``env.history=last`` shows it:
each turn's prompt is GEM's instructions and the latest feedback and board, so the model plays
from the board alone (the Markov view) and a turn costs O(board) tokens.

1. Play Sudoku through ``env=gem`` itself with the scripted player of ``make_gem_sft_data.py``:
   the solver's move (a cell with a single candidate) with probability ``--quality``, else a
   mistake: a legal-looking wrong digit, a digit in a filled cell (an earlier move's cell
   repeated, or a clue), or a malformed reply. ``--episodes`` games on train rows 0.., cut
   into one SFT example per turn: the turn's prompt as the harness renders it with
   ``env.history=last`` (:func:`~rlhf_lightning.rollout.episodes.chat.latest_view`) and the move.
2. Train a byte-level BPE tokenizer on those examples rendered in the chat format, with every
   board cell one token (:data:`CELL_TOKENS`), and build a Qwen2-style model (random weights,
   ``--layers`` x ``--hidden``).
3. SFT (``algo=sft``, full fine-tuning at lr ``--lr``, loss on the moves, examples packed), in
   two stages. (a) A warm-up of ``--warmup-steps`` on the same kind of games played at
   ``--warmup-quality`` (the solver's moves by default) with short prompts, the board alone:
   with GEM's ~330 tokens of instructions in front of every board a fresh model stayed at
   uniform guessing (0.48 nats a token, valid moves 0.12) for 800 steps, while from the board
   alone it starts reading it within ~300 steps. (b) The ``env.history=last`` turns above; the
   instructions every example starts with run once per micro-batch. Every ``--eval-every`` steps
   play ``--eval-rows`` held-out boards (GEM seeds after the train ones whose boards no train seed
   has: ``env.kwargs.eval_unseen``), greedy and sampled at temperature 1, and stop once the
   sampled solve rate reaches ``--target`` after ``--min-steps``: RL has room to improve it. Or
   stop at ``--max-steps`` / ``--max-minutes``.
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_sudoku`` with
   ``build_info.json`` (the recipe, the data's own solve and valid-move rates, the eval history).

    OMP_NUM_THREADS=1 python scripts/build_tiny_sudoku_model.py    # the shipped model: see build_info.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from build_tiny_chat_model import QUIET_BUILD, compose_config
from build_tiny_gem_model import EvalAndStop
from make_chat_sft_data import write_jsonl
from make_gem_sft_data import SUDOKU_ID, gem_dialogues, summary

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.gem import GemEnv
from rlhf_lightning.models.tiny import build_tiny_model, build_tokenizer
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, latest_view
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.run import run

MODEL_DIR = ASSETS / "tiny_sudoku"
TRAIN_SIZE = 5000  # conf/experiment/gem_sudoku.yaml's env.kwargs.train_size: the train seeds
MAX_TURNS = 15  # game:Sudoku-v0-easy's own limit
MAX_MODEL_LEN = 640  # a turn's sequence: ~330 tokens of instructions, ~100 of board, the move
# GEM draws a board row as "R1  .  2 |  3  ." and a byte-level BPE cuts a filled cell into more
# tokens than an empty one, so cells of one column sit at different distances row to row. Each
# cell as one token ("  ." or "  <digit>"): every row has the same tokens, a column's cells are
# one row's length apart, and the model finds a cell's row, column and box by position.
CELL_TOKENS = ["  .", "  1", "  2", "  3", "  4"]


def turn_examples(dialogue: dict[str, Any], instructions: str) -> list[dict[str, Any]]:
    """One SFT example per turn of a GEM dialogue, as ``env.history=last`` prompts it: the first
    turn's prompt is GEM's first observation, a later turn's the instructions and that turn's
    observation (GEM's feedback and the new board)."""
    messages = dialogue["messages"]
    out = []
    for k in range(0, len(messages), 2):
        obs = messages[k]["content"]
        prompt = obs if k == 0 else latest_view(instructions, obs)
        out.append(
            {"messages": [{"role": "user", "content": prompt}, messages[k + 1]], "row": dialogue["row"]}
        )
    return out


def sudoku_harness(tokenizer: Any, eval_rows: int) -> RolloutHarness:
    """``experiment=gem_sudoku``'s env: GEM's Sudoku with ``env.history=last``, held-out boards unseen."""
    return RolloutHarness(
        lambda: GemEnv(id=SUDOKU_ID, train_size=TRAIN_SIZE, eval_size=eval_rows, eval_unseen=True),
        tokenizer,
        ChatFormatter(tokenizer),
        max_turns=MAX_TURNS,
        max_model_len=MAX_MODEL_LEN,
        history="last",
    )


def save_untrained(tokenizer: Any, directory: Path, layers: int, hidden: int) -> int:
    """A random Qwen2-style model sized to ``tokenizer``, saved with it like any local model;
    returns its parameter count."""
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_heads=hidden // 32,
        num_kv_heads=max(hidden // 64, 1),
        max_position_embeddings=MAX_MODEL_LEN,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def board_examples(dialogue: dict[str, Any]) -> list[dict[str, Any]]:
    """One warm-up example per turn of a GEM dialogue: the board GEM showed (from its "Here is
    the current board layout:" on) and the move."""
    messages = dialogue["messages"]
    out = []
    for k in range(0, len(messages), 2):
        obs = messages[k]["content"]
        board = obs[obs.rfind("Here is the current board layout:") :]
        out.append(
            {"messages": [{"role": "user", "content": board}, messages[k + 1]], "row": dialogue["row"]}
        )
    return out


def sft_config(
    args: argparse.Namespace, model: Path, data: Path, held: Path | None, steps: int, every: int, out: Path
) -> Any:
    """``algo=sft`` on ``data`` (full fine-tuning of the model at ``model``, packed examples)."""
    return compose_config(
        [
            "algo=sft",
            "model=local",
            f"model.path={model}",
            "model.finetune=full",
            "model.dtype=float32",
            "model.attn_implementation=sdpa",
            f"algo.data_path={data}",
            f"algo.eval_data_path={held}" if held is not None else "algo.eval_fraction=0.01",
            f"algo.max_len={4 * MAX_MODEL_LEN}",
            "algo.packing=true",
            "algo.env_eval=false",
            f"algo.lr={args.lr}",
            "algo.warmup_steps=50",
            "algo.min_lr_ratio=1.0",
            f"algo.batch_size={args.batch_size}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={every or steps + 1}",
            "env=gem",
            f"env.max_model_len={MAX_MODEL_LEN}",
            "rollout.max_new_tokens=10",
            *QUIET_BUILD,
            f"eval.before_training={bool(every)}",
            f"seed={args.seed}",
            f"num_threads={args.threads}",
            f"output_dir={out}",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=3000, help="scripted games on train rows 0..")
    ap.add_argument("--quality", type=float, default=0.7, help="the scripted player's good-move probability")
    ap.add_argument("--target", type=float, default=0.15, help="stop once the sampled solve rate >= this")
    ap.add_argument("--min-steps", type=int, default=150, help="never stop before this many steps")
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="stop (at a step end) after this long")
    ap.add_argument("--batch-size", type=int, default=64, help="examples (turns) per step")
    ap.add_argument("--lr", type=float, default=7e-4, help="2e-3 stayed at uniform guessing for 400 steps")
    ap.add_argument("--eval-every", type=int, default=75)
    ap.add_argument("--eval-rows", type=int, default=50, help="held-out boards per evaluation and mode")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=1500, help="board-only SFT steps first (0: none)")
    ap.add_argument(
        "--warmup-quality", type=float, default=1.0, help="the warm-up games' good-move probability"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.episodes > TRAIN_SIZE:
        ap.error(
            f"--episodes must be at most {TRAIN_SIZE} (the train seeds; eval boards are checked against them)"
        )
    t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="tiny_sudoku_build_"))
    try:
        # 1. Scripted games on train rows; one example per turn, shuffled (deterministic).
        games = gem_dialogues("sudoku", args.episodes, args.quality, seed=args.seed, first_row=0)
        instructions = GemEnv(id=SUDOKU_ID).reset(row_index=0)[1]["instructions"]
        examples = [e for g in games for e in turn_examples(g, instructions)]
        random.Random(f"sudoku-sft:{args.seed}").shuffle(examples)
        held = examples[:500]  # the eval loss: turns of train games the steps never see
        train = examples[500:]
        write_jsonl(train, work / "train.jsonl")
        write_jsonl(held, work / "eval.jsonl")
        data = {"episodes": args.episodes, "examples": len(train), **summary(games)}
        print(f"data: {data}; {time.time() - t0:.0f}s", flush=True)
        # 2. Tokenizer on the rendered examples, a random model beside it.
        bootstrap = build_tokenizer(["x"], vocab_size=300)  # only to render the chat template
        corpus = [bootstrap.apply_chat_template(e["messages"], tokenize=False) for e in train[:8000]]
        tokenizer = build_tokenizer(corpus, vocab_size=args.vocab_size)
        tokenizer.add_tokens(CELL_TOKENS)  # every cell one token: a board row always has the same length
        base = work / "base"
        params = save_untrained(tokenizer, base, args.layers, args.hidden)
        print(f"vocab {len(tokenizer)}, parameters {params:,}", flush=True)
        # 3a. Warm-up: the solver's moves from the board alone (the prompt's last part), short
        # prompts that teach the model to read a board before the instructions are in front of it.
        warm_games = gem_dialogues(
            "sudoku", args.episodes, args.warmup_quality, seed=args.seed + 1, first_row=0
        )
        warm = [e for g in warm_games for e in board_examples(g)]
        random.Random(f"sudoku-warmup:{args.seed}").shuffle(warm)
        write_jsonl(warm, work / "warmup.jsonl")
        start = base
        if args.warmup_steps:
            stage = run(
                sft_config(args, base, work / "warmup.jsonl", None, args.warmup_steps, 0, work / "warmup_run")
            )
            start = work / "warm"
            stage.module.policy.model.save_pretrained(start)
            tokenizer.save_pretrained(start)
            print(f"warm-up: {args.warmup_steps} steps; {time.time() - t0:.0f}s", flush=True)
        # 3b. SFT on the env.history=last turns (mixed quality); held-out boards played every
        # --eval-every steps.
        cfg = sft_config(
            args,
            start,
            work / "train.jsonl",
            work / "eval.jsonl",
            args.max_steps,
            args.eval_every,
            work / "run",
        )
        stop = EvalAndStop(
            sudoku_harness(tokenizer, args.eval_rows),
            args.eval_rows,
            args.target,
            args.min_steps,
            args.max_minutes * 60,
        )
        result = run(cfg, extra_callbacks=[stop])
        module = result.module
        # 4. Save.
        if args.out.exists():
            shutil.rmtree(args.out)
        module.policy.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        info = {
            "seed": args.seed,
            "parameters": params,
            "warmup_steps": args.warmup_steps,
            "sft_steps": result.trainer.global_step,
            "seconds": round(time.time() - t0),
            "data": data,
            "eval": {k: v for k, v in stop.history[-1].items() if k not in ("step", "seconds")},
            "eval_rows": args.eval_rows,
            "built_with": "scripts/build_tiny_sudoku_model.py (algo=sft)",
            "args": {k: str(v) for k, v in vars(args).items()},
            "history": stop.history,
        }
        (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
        print(f"saved to {args.out} after {info['sft_steps']} SFT steps ({info['seconds']}s): {info['eval']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
