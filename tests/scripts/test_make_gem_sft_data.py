"""GEM SFT dialogues: played through env=gem (GEM's own games), replayed exactly, a quality knob that
moves the solve rate, and the board parser and solver the scripted Sudoku player relies on."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

pytest.importorskip("gem", reason="env=gem needs the gem extra: pip install 'rlhf_lightning[gem]'")

from rlhf_lightning.data.offline import SFTDataset, encode_conversation
from rlhf_lightning.envs.files import read_rows
from rlhf_lightning.envs.gem import GemEnv
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
spec = importlib.util.spec_from_file_location("make_gem_sft_data", ROOT / "scripts" / "make_gem_sft_data.py")
gemsft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gemsft)

IDS = {"sudoku": "game:Sudoku-v0-easy", "guess_the_number": "game:GuessTheNumber-v0-easy"}
TURNS = {"sudoku": 15, "guess_the_number": 4}  # GEM's own limits


@pytest.mark.parametrize("game", sorted(IDS))
def test_replaying_the_replies_through_gem_gives_the_same_turns_rewards_and_valid_moves(game):
    rows = gemsft.gem_dialogues(game, 40, 0.5, seed=1)
    for d in rows:
        env = GemEnv(id=IDS[game])
        obs, _ = env.reset(row_index=d["row"])
        msgs = d["messages"]
        assert msgs[0] == {"role": "user", "content": obs}
        replies = msgs[1::2]
        total, valid = 0.0, 0
        for k, reply in enumerate(replies):
            assert reply["role"] == "assistant"
            obs, reward, terminated, truncated, info = env.step(reply["content"])
            total += reward
            valid += info["valid_move"]
            last = k == len(replies) - 1
            assert (terminated or truncated or k + 1 == TURNS[game]) == last
            if not last:
                assert msgs[2 * k + 2] == {"role": "user", "content": obs}
        assert total == pytest.approx(d["return"], abs=1e-6)
        assert (valid, len(replies), info["solved"]) == (d["valid_moves"], d["turns"], d["success"])


def test_good_sudoku_moves_are_always_right_and_solve_in_as_many_turns_as_empty_cells():
    for d in gemsft.gem_dialogues("sudoku", 30, 1.0):
        board = gemsft.parse_board(d["messages"][0]["content"])
        empty = sum(v == 0 for row in board for v in row)
        assert d["success"] and d["turns"] == d["valid_moves"] == empty
        assert d["return"] == pytest.approx(1.0)  # GEM: 1/#empty per right move


def test_sudoku_mistakes_are_gems_illegal_moves_and_rare_malformed_replies():
    rows = gemsft.gem_dialogues("sudoku", 60, 0.0)
    feedback = [m["content"] for d in rows for m in d["messages"][2::2]]
    assert not any(d["success"] for d in rows) and sum(d["valid_moves"] for d in rows) == 0
    assert any("violates Sudoku rules" in f for f in feedback)
    assert any("already filled" in f for f in feedback)
    ended = [d for d in rows if d["turns"] < 15]  # a malformed reply: -0.1 and the game ends
    # 5% of mistakes are malformed: an episode of 15 mistakes ends early with 1 - 0.95**15 = 0.54
    assert 0.3 < len(ended) / len(rows) < 0.75
    assert all(d["return"] == pytest.approx(-0.1) for d in ended)


def test_guess_mistakes_and_good_guesses():
    good = gemsft.gem_dialogues("guess_the_number", 100, 1.0)
    assert all(d["valid_moves"] == d["turns"] for d in good)  # never refused
    assert 0.5 < sum(d["success"] for d in good) / 100 < 1.0  # uniform, not bisection
    for d in good:  # every guess inside the interval the hints allow
        msgs = d["messages"]
        for i in range(1, len(msgs), 2):
            _, _, lo, hi, seen = gemsft.guess_state(msgs[:i])
            g = int(msgs[i]["content"][len("\\boxed{") : -1])
            assert lo <= g <= hi and g not in seen


@pytest.mark.parametrize("game", sorted(IDS))
def test_quality_raises_the_solve_and_valid_move_rates(game):
    n = 60 if game == "sudoku" else 300
    stats = [gemsft.summary(gemsft.gem_dialogues(game, n, q)) for q in (0.2, 0.6, 1.0)]
    assert stats[0]["solved"] < stats[1]["solved"] < stats[2]["solved"], stats
    assert stats[0]["valid_move_rate"] < stats[1]["valid_move_rate"] < stats[2]["valid_move_rate"] == 1.0


def test_parse_board_reads_gems_rendering_and_solve_finds_its_solution():
    env = GemEnv(id=IDS["sudoku"])
    for row in range(20):
        obs, _ = env.reset(row_index=row)
        board = gemsft.parse_board(obs)
        assert board == env.env.board
        assert gemsft.solve(board) == env.env.full_grid
        for r, c in gemsft.singles(board):
            assert gemsft.candidates(board, r, c) == {env.env.full_grid[r][c]}
    with pytest.raises(ValueError, match="no 'Here is the current board layout:'"):
        gemsft.parse_board("At turn 1, you did not provide a valid guess.")


def test_same_seed_same_dialogues_other_seed_others():
    a = gemsft.gem_dialogues("sudoku", 10, 0.5, seed=3)
    assert a == gemsft.gem_dialogues("sudoku", 10, 0.5, seed=3)
    assert a != gemsft.gem_dialogues("sudoku", 10, 0.5, seed=4)
    with pytest.raises(ValueError, match="unknown game"):
        gemsft.gem_dialogues("chess", 1, 0.5)


def test_dialogues_are_token_exact_harness_rollouts(tiny_tokenizer):
    """SFT on a dialogue trains on exactly the ids the harness builds when the model replies so."""
    tok = tiny_tokenizer
    formatter = ChatFormatter(tok)

    class Scripted:
        def __init__(self, replies: list[str]) -> None:
            self.replies = iter(replies)

        def generate(self, prompts, params):
            ids = [*tok(next(self.replies), add_special_tokens=False).input_ids, tok.eos_token_id]
            return [Completion(ids, [0.0] * len(ids), "stop", 0)]

    for game in sorted(IDS):
        for d in gemsft.gem_dialogues(game, 3, 0.5):
            replies = [m["content"] for m in d["messages"][1::2]]
            harness = RolloutHarness(
                lambda g=game: GemEnv(id=IDS[g]), tok, formatter, max_turns=TURNS[game], max_model_len=8192
            )
            result = harness.rollout(Scripted(replies), [d["row"]], SamplingParams(max_new_tokens=40))
            traj = result.trajectories[0]
            want = encode_conversation(d["messages"], formatter)
            assert traj.token_ids == want.token_ids and traj.action_turn == want.action_turn
            assert sum(traj.rewards) == pytest.approx(d["return"], abs=1e-6)  # rounded to 6 places
            assert result.metrics["env/valid_move"] == pytest.approx(d["valid_moves"] / d["turns"])


def test_cli_writes_rows_the_sft_dataset_reads(tmp_path, monkeypatch, tiny_tokenizer):
    out = tmp_path / "gem.jsonl"
    argv = ["x", "--out", str(out), "--game", "guess_the_number", "--rows", "6", "--quality", "0.5"]
    monkeypatch.setattr(sys, "argv", argv)
    gemsft.main()
    rows = read_rows(out)
    assert len(rows) == 6 and rows == [json.loads(line) for line in out.read_text().splitlines()]
    data = SFTDataset(rows, ChatFormatter(tiny_tokenizer), {"messages": "messages"})
    for i, row in enumerate(rows):
        assert data[i][0].num_turns == row["turns"]


def test_gem_env_marks_the_moves_gem_accepted():
    """``info["valid_move"]`` (rlhf_lightning/envs/gem.py): Sudoku fills a cell only for the
    solution's digit; GuessTheNumber refuses repeated and out-of-range guesses."""
    env = GemEnv(id=IDS["sudoku"])
    obs, _ = env.reset(row_index=0)
    board, solution = gemsft.parse_board(obs), env.env.full_grid
    (r, c), (fr, fc) = (
        gemsft.singles(board)[0],
        next((i, j) for i in range(4) for j in range(4) if board[i][j]),
    )
    wrong = next(v for v in range(1, 5) if v != solution[r][c])
    moves = [
        (gemsft.move(r, c, wrong), False),
        (gemsft.move(fr, fc, 1), False),
        (gemsft.move(r, c, solution[r][c]), True),
    ]
    for reply, valid in moves:
        _, reward, _, _, info = env.step(reply)
        assert info["valid_move"] is valid and (reward > 0) is valid
    guess = GemEnv(id=IDS["guess_the_number"])
    guess.reset(row_index=0)
    target = guess.env.game_number
    other = 1 if target != 1 else 2
    for reply, valid in (
        (f"\\boxed{{{other}}}", True),
        (f"\\boxed{{{other}}}", False),
        ("\\boxed{11}", False),
    ):
        assert guess.step(reply)[4]["valid_move"] is valid
    mines = GemEnv(id="game:Minesweeper-v0-easy")
    mines.reset(row_index=0)
    assert "valid_move" not in mines.step("\\boxed{reveal 1 1}")[4]  # no counter for this game
