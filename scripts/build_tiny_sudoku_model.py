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
   three stages. (a) A warm-up of ``--warmup-steps`` on the same kind of games played at
   ``--warmup-quality`` (the solver's moves by default) with short prompts, the board alone:
   with GEM's ~330 tokens of instructions in front of every board a fresh model stayed at
   uniform guessing (0.48 nats a token, valid moves 0.12) for 800 steps, while from the board
   alone it starts reading it within ~300 steps. (b) The ``env.history=last`` turns above, each
   target relabelled with the solver's move with probability ``--label-quality`` (:func:`relabel`):
   the prompts keep the played mistakes and GEM's feedback on them, the targets do not (with the
   played moves as targets, 30% of them mistakes, the model learned to make mistakes 30% of the
   time and started RL at 0.22 valid moves). The instructions every example starts with run once
   per micro-batch. (c) Up to ``--dagger-rounds`` rounds of the model's own play (DAgger): it plays
   ``--dagger-episodes`` train boards as RL does (sampled, ``env.history=last``), every turn is
   relabelled with the solver's move (:func:`own_play_examples`: the boards it gets stuck on,
   after its own mistakes), and ``--dagger-steps`` of SFT run on those turns mixed with as many
   of stage (b)'s. Every ``--eval-every`` steps of (b) and (c) play ``--eval-rows`` held-out
   boards (GEM seeds after the train ones whose boards no train seed has:
   ``env.kwargs.eval_unseen``), greedy and sampled at temperature 1, and stop once the sampled
   solve rate reaches ``--target`` and the sampled valid-move rate ``--min-valid`` after
   ``--min-steps`` (:class:`StopInBand`): RL has room to improve it. Or stop at ``--max-steps`` /
   ``--dagger-steps`` / ``--max-minutes`` (per stage).
   ``--init DIR`` extends a built model instead (its tokenizer, no warm-up): stages (b) and (c).
4. Save model, tokenizer and chat template to ``rlhf_lightning/assets/tiny_sudoku`` with
   ``build_info.json`` (the recipe, the data's own solve and valid-move rates, the own-play
   rounds, the eval history of every stage).

The shipped model extends the first build (the script's defaults before stage (c) and the
relabelling: 1,500 warm-up steps, then 600 steps on the played turns); see build_info.json's
``args`` and docs/models.md:

    OMP_NUM_THREADS=1 python scripts/build_tiny_sudoku_model.py --quality 0.7 --label-quality 0 \
        --dagger-rounds 0 --max-steps 600 --eval-every 75 --target 0.15 --min-valid 0 --min-steps 150 \
        --out /tmp/first                                         # the first build (~33 minutes)
    OMP_NUM_THREADS=1 python scripts/build_tiny_sudoku_model.py --init /tmp/first \
        --max-steps 250 --eval-every 125 --dagger-episodes 800 --dagger-steps 250 --max-minutes 20
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

import lightning as L
from build_tiny_chat_model import QUIET_BUILD, compose_config
from build_tiny_gem_model import EvalAndStop
from make_chat_sft_data import write_jsonl
from make_gem_sft_data import SUDOKU_ID, gem_dialogues, move, parse_board, singles, solve, summary
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.gem import GemEnv
from rlhf_lightning.models.tiny import build_tiny_model, build_tokenizer
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.engines.hf import HFEngine
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


def relabel(example: dict[str, Any], quality: float, rng: random.Random) -> dict[str, Any]:
    """``example`` whose move is, with probability ``quality``, the solver's: a cell with a single
    candidate (at random among them) and its digit; the prompt (the board and GEM's feedback on
    the move before, right or wrong) stays as played."""
    if rng.random() >= quality:
        return example
    prompt = example["messages"][0]["content"]
    board = parse_board(prompt)
    solution = solve(board)
    if solution is None:
        raise ValueError(f"the board has no solution: {board}")
    r, c = rng.choice(
        singles(board) or [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if not v]
    )
    reply = {"role": "assistant", "content": move(r, c, solution[r][c])}
    return {**example, "messages": [example["messages"][0], reply]}


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


class StopInBand(EvalAndStop):
    """:class:`EvalAndStop` that also wants the sampled valid-move rate at ``min_valid``: stop at
    the first evaluation (after ``min_steps``) whose sampled solve rate reaches ``target`` and
    whose valid-move rate reaches ``min_valid``, so that RL starts from a model that solves a
    few boards and plays mostly legal moves."""

    def __init__(self, *args: Any, min_valid: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.min_valid = min_valid

    def in_band(self) -> bool:
        """The last evaluation reached both ``target`` and ``min_valid``."""
        last = self.history[-1] if self.history else {}
        return (
            bool(last)
            and last["solved_sampled"] >= self.target
            and last["valid_move_sampled"] >= self.min_valid
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        valid = self.history[-1]["valid_move_sampled"] >= self.min_valid
        target, self.target = self.target, self.target if valid else float("inf")
        try:
            super().on_validation_end(trainer, pl_module)
        finally:
            self.target = target


def own_play_examples(
    model: Any, tokenizer: Any, rows: list[int], instructions: str, rng: random.Random
) -> tuple[list[dict[str, Any]], float]:
    """The model's own games on train ``rows`` (sampled at temperature 1, ``env.history=last``,
    as RL plays them), one example per turn with the solver's move as its target (DAgger): the
    boards it gets stuck on, after its own mistakes, with what it should have played. Returns the
    examples and the share of the model's moves GEM accepted."""
    harness = sudoku_harness(tokenizer, 1)
    engine = HFEngine(lambda: model, tokenizer.pad_token_id, [tokenizer.eos_token_id], tokenizer=tokenizer)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    was_training = model.training
    model.eval()
    out, valid, turns = [], 0, 0
    for start in range(0, len(rows), 100):
        for traj in harness.rollout(engine, rows[start : start + 100], params).trajectories:
            observations = [traj.observation, *traj.observations][: traj.num_turns]
            messages = [
                m for obs, reply in zip(observations, traj.replies) for m in (user(obs), assistant(reply))
            ]
            turn_list = turn_examples(
                {"messages": messages, "row": traj.task_info.get("row", -1)}, instructions
            )
            out += [relabel(e, 1.0, rng) for e in turn_list]
            valid += sum(bool(i.get("valid_move")) for i in traj.infos)
            turns += traj.num_turns
    model.train(was_training)
    return out, valid / max(turns, 1)


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


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
            f"algo.min_lr_ratio={args.min_lr_ratio}",
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


def warm_model(
    args: argparse.Namespace, train: list[dict[str, Any]], work: Path, t0: float
) -> tuple[Any, Path, int]:
    """Stages 2 and 3a: a tokenizer on ``train`` rendered in the chat format, a random model,
    and its board-only warm-up; returns (tokenizer, the warm model's directory, parameters)."""
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
    warm_games = gem_dialogues("sudoku", args.episodes, args.warmup_quality, seed=args.seed + 1, first_row=0)
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
    return tokenizer, start, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=MODEL_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=3000, help="scripted games on train rows 0..")
    ap.add_argument("--quality", type=float, default=0.7, help="the scripted player's good-move probability")
    ap.add_argument(
        "--label-quality",
        type=float,
        default=1.0,
        help="stage (b): a turn's target is the solver's move with this probability, else the move played",
    )
    ap.add_argument("--target", type=float, default=0.1, help="stop once the sampled solve rate >= this")
    ap.add_argument(
        "--min-valid", type=float, default=0.4, help="... and the sampled valid-move rate >= this"
    )
    ap.add_argument("--min-steps", type=int, default=50, help="never stop before this many steps")
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--max-minutes", type=float, default=60.0, help="stop (at a step end) after this long")
    ap.add_argument("--batch-size", type=int, default=64, help="examples (turns) per step")
    ap.add_argument("--lr", type=float, default=7e-4, help="2e-3 stayed at uniform guessing for 400 steps")
    ap.add_argument(
        "--min-lr-ratio",
        type=float,
        default=1.0,
        help="cosine decay of each stage's lr to lr x this (1: constant)",
    )
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-rows", type=int, default=50, help="held-out boards per evaluation and mode")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=1500, help="board-only SFT steps first (0: none)")
    ap.add_argument(
        "--warmup-quality", type=float, default=1.0, help="the warm-up games' good-move probability"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dagger-rounds", type=int, default=2, help="stage (c) rounds at most (0: none)")
    ap.add_argument("--dagger-episodes", type=int, default=1000, help="own games per stage (c) round")
    ap.add_argument("--dagger-steps", type=int, default=300, help="SFT steps per stage (c) round")
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="extend this model (its tokenizer too): stage (b) only, no new tokenizer or warm-up",
    )
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
        played = examples[500:]  # the tokenizer's corpus: the turns as played
        label_rng = random.Random(f"sudoku-labels:{args.seed}")
        examples = [relabel(e, args.label_quality, label_rng) for e in examples]
        held = examples[:500]  # the eval loss: turns of train games the steps never see
        train = examples[500:]
        write_jsonl(train, work / "train.jsonl")
        write_jsonl(held, work / "eval.jsonl")
        solver = sum(
            e["messages"][1]["content"] == p["messages"][1]["content"] for e, p in zip(train, played)
        )
        data = {
            "episodes": args.episodes,
            "examples": len(train),
            **summary(games),
            "targets_as_played": round(solver / len(train), 4),
        }
        print(f"data: {data}; {time.time() - t0:.0f}s", flush=True)
        if args.init is not None:  # extend a built model: its tokenizer, no warm-up
            tokenizer = AutoTokenizer.from_pretrained(args.init)
            start = args.init
            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(args.init).parameters())
        else:
            tokenizer, start, params = warm_model(args, played, work, t0)
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
        stop = StopInBand(
            sudoku_harness(tokenizer, args.eval_rows),
            args.eval_rows,
            args.target,
            args.min_steps,
            args.max_minutes * 60,
            min_valid=args.min_valid,
        )
        result = run(cfg, extra_callbacks=[stop])
        module = result.module
        history = [{"stage": "b", **e} for e in stop.history]
        steps, own_play = result.trainer.global_step, []
        # 3c. DAgger rounds until the evaluation is in the band: the model's own games on train
        # boards, every turn relabelled with the solver's move, mixed with as many stage (b)
        # turns (what the model saw so far), SFT from the current weights.
        label_rng = random.Random(f"sudoku-own-play:{args.seed}")
        for k in range(args.dagger_rounds):
            if stop.in_band():
                break
            first = (k * args.dagger_episodes) % TRAIN_SIZE
            rows = [(first + i) % TRAIN_SIZE for i in range(args.dagger_episodes)]
            own, own_valid = own_play_examples(module.policy.model, tokenizer, rows, instructions, label_rng)
            mixed = own + random.Random(f"sudoku-mix:{args.seed}:{k}").sample(
                train, min(len(own), len(train))
            )
            random.Random(f"sudoku-mix-order:{args.seed}:{k}").shuffle(mixed)
            write_jsonl(mixed, work / f"own{k}.jsonl")
            current = work / f"own{k}_start"
            module.policy.model.save_pretrained(current)
            tokenizer.save_pretrained(current)
            own_play.append(
                {
                    "round": k,
                    "rows": [rows[0], rows[-1]],
                    "turns": len(own),
                    "valid_move": round(own_valid, 4),
                }
            )
            print(f"own play {k}: {own_play[-1]}; {time.time() - t0:.0f}s", flush=True)
            cfg = sft_config(
                args,
                current,
                work / f"own{k}.jsonl",
                work / "eval.jsonl",
                args.dagger_steps,
                args.eval_every,
                work / f"run{k}",
            )
            stop = StopInBand(
                sudoku_harness(tokenizer, args.eval_rows),
                args.eval_rows,
                args.target,
                args.min_steps,
                args.max_minutes * 60,
                min_valid=args.min_valid,
            )
            result = run(cfg, extra_callbacks=[stop])
            module = result.module
            history += [{"stage": f"c{k}", **e} for e in stop.history]
            steps += result.trainer.global_step
        # 4. Save.
        if args.out.exists():
            shutil.rmtree(args.out)
        module.policy.model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)
        if args.init is not None:  # the extended model's tokenizer files as they were (a reload
            # through AutoTokenizer re-saves them as a Qwen2Tokenizer; the ids are the same)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                shutil.copy(args.init / name, args.out / name)
        info = {
            "seed": args.seed,
            "parameters": params,
            "warmup_steps": 0 if args.init is not None else args.warmup_steps,
            "extends": str(args.init) if args.init is not None else None,
            "sft_steps": steps,
            "own_play": own_play,
            "seconds": round(time.time() - t0),
            "data": data,
            "eval": {k: v for k, v in history[-1].items() if k not in ("stage", "step", "seconds")},
            "eval_rows": args.eval_rows,
            "built_with": "scripts/build_tiny_sudoku_model.py (algo=sft)",
            "args": {k: str(v) for k, v in vars(args).items()},
            "history": history,
        }
        (args.out / "build_info.json").write_text(json.dumps(info, indent=1))
        print(f"saved to {args.out} after {info['sft_steps']} SFT steps ({info['seconds']}s): {info['eval']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
