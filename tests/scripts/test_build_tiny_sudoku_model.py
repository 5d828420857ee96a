"""The Sudoku model build (scripts/build_tiny_sudoku_model.py): the solver's targets on played
turns are moves GEM accepts, the early stop waits for both the solve and the valid-move rate, and
the shipped model starts RL inside the band its build aimed at."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("gem", reason="env=gem needs the gem extra: pip install 'rlhf_lightning[gem]'")

from rlhf_lightning.config import ASSETS
from rlhf_lightning.envs.gem import GemEnv
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location(
    "build_tiny_sudoku_model", ROOT / "scripts" / "build_tiny_sudoku_model.py"
)
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

SUDOKU = "game:Sudoku-v0-easy"


def test_relabelled_turns_keep_the_played_prompt_and_gem_accepts_their_move():
    games = build.gem_dialogues("sudoku", 12, 0.5, seed=3)
    instructions = GemEnv(id=SUDOKU).reset(row_index=0)[1]["instructions"]
    rng = random.Random(0)
    checked = changed = 0
    for game in games:
        turns = build.turn_examples(game, instructions)
        replies = [m["content"] for m in game["messages"][1::2]]
        for k, turn in enumerate(turns):
            new = build.relabel(turn, 1.0, rng)
            assert new["messages"][0] == turn["messages"][0] and new["row"] == turn["row"]
            changed += new["messages"][1] != turn["messages"][1]
            # Replay the game's first k moves, then play the new target: GEM calls it correct.
            env = GemEnv(id=SUDOKU)
            env.reset(row_index=game["row"])
            for reply in replies[:k]:
                env.step(reply)
            _, reward, *_ = env.step(new["messages"][1]["content"])
            assert reward > 0, (k, new["messages"][1]["content"])
            checked += 1
    assert checked > 100 and changed > checked // 4  # half the played moves were mistakes


def test_relabel_at_quality_zero_keeps_every_move_as_played():
    game = build.gem_dialogues("sudoku", 1, 0.5, seed=4)[0]
    turns = build.turn_examples(game, GemEnv(id=SUDOKU).reset(row_index=0)[1]["instructions"])
    rng = random.Random(0)
    assert [build.relabel(t, 0.0, rng) for t in turns] == turns


def _stop_after(history: list[dict], step: int, target: float = 0.1, min_valid: float = 0.4) -> bool:
    stop = build.StopInBand(None, 50, target, 50, 3600.0, min_valid=min_valid)
    stop.history = history
    trainer = SimpleNamespace(
        global_step=step, callback_metrics={}, should_stop=False, state=SimpleNamespace(fn="fit")
    )
    stop.on_validation_end(trainer, None)
    assert stop.target == target  # restored whatever the decision
    return trainer.should_stop


@pytest.mark.parametrize(
    ("solved", "valid", "step", "stops"),
    [
        (0.12, 0.45, 100, True),
        (0.10, 0.40, 50, True),  # both thresholds are inclusive
        (0.12, 0.38, 100, False),  # solves enough but too few legal moves
        (0.08, 0.55, 100, False),  # legal moves but too few solved
        (0.12, 0.45, 49, False),  # before min_steps
    ],
)
def test_stop_in_band_waits_for_the_solve_rate_and_the_valid_move_rate(solved, valid, step, stops):
    entry = {"step": step, "solved_sampled": solved, "valid_move_sampled": valid}
    assert _stop_after([entry], step) is stops


def test_the_shipped_model_starts_rl_in_the_band_it_was_built_for():
    info = json.loads((ASSETS / "tiny_sudoku" / "build_info.json").read_text())
    args, last = info["args"], info["eval"]
    assert last["solved_sampled"] >= float(args["target"]) and 0.05 <= last["solved_sampled"] <= 0.2
    assert last["valid_move_sampled"] >= float(args["min_valid"]) >= 0.4
    assert info["data"]["targets_as_played"] < 1.0  # the solver relabelled the played mistakes


def test_own_play_turns_are_the_prompts_the_model_was_shown_with_the_solvers_move():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_lightning.records.sampling import SamplingParams
    from rlhf_lightning.rollout.engines.hf import HFEngine

    path = ASSETS / "tiny_sudoku"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    instructions = GemEnv(id=SUDOKU).reset(row_index=0)[1]["instructions"]
    torch.manual_seed(0)
    examples, valid = build.own_play_examples(model, tok, [0, 1, 2], instructions, random.Random(0))
    # The same games again, straight from the harness: each turn's prompt is its own sequence.
    torch.manual_seed(0)
    engine = HFEngine(lambda: model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    trajs = build.sudoku_harness(tok, 1).rollout(engine, [0, 1, 2], params).trajectories
    shown, accepted = [], 0
    for t in trajs:
        ends = [*t.segment_starts[1:], len(t.token_ids)]
        for a, b in zip(t.segment_starts, ends):
            text = tok.decode(t.token_ids[a:b])
            shown.append(text[len("<|im_start|>user\n") : text.index("<|im_end|>\n<|im_start|>assistant\n")])
        accepted += sum(bool(i.get("valid_move")) for i in t.infos)
    assert [e["messages"][0]["content"] for e in examples] == shown
    assert valid == pytest.approx(accepted / len(shown))
    for e in examples:  # every target is a cell with one candidate and its digit
        board = build.parse_board(e["messages"][0]["content"])
        r, c, v = (int(x) for x in e["messages"][1]["content"][len("\\boxed{") : -1].split())
        assert board[r - 1][c - 1] == 0 and build.solve(board)[r - 1][c - 1] == v
        assert (r - 1, c - 1) in build.singles(board)
