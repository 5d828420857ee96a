"""env=gem: GEM's own observations, rewards and termination, our seeds; replayed through GEM itself."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("gem", reason="env=gem needs the gem extra: pip install 'rlhf_lightning[gem]'")

import gem
from gem.wrappers.observation_wrapper import ObservationWrapper

from rlhf_lightning.algorithms.evaluation import episode_success
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.envs.gem import GemEnv, gem_seed
from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from tests.conftest import fit_recording

SUDOKU, GUESS, MINES, G2048 = (
    "game:Sudoku-v0-easy",
    "game:GuessTheNumber-v0-easy",
    "game:Minesweeper-v0-easy",
    "game:Game2048-v0-easy",
)


def moves(env_id: str, rng: random.Random, no_move: float = 0.1) -> str:
    """A random reply in the game's move format (``no_move`` of them none: GEM then ends the episode)."""
    if rng.random() < no_move:
        return "I am not sure."
    if env_id == SUDOKU:
        return f"My move: \\boxed{{{rng.randint(1, 4)} {rng.randint(1, 4)} {rng.randint(1, 4)}}}"
    if env_id == GUESS:
        return f"\\boxed{{{rng.randint(1, 10)}}}"
    if env_id == MINES:
        return f"\\boxed{{reveal {rng.randint(0, 4)} {rng.randint(0, 4)}}}"
    return f"\\boxed{{{rng.choice(['up', 'down', 'left', 'right'])}}}"


class MoveEngine:
    """Replies with random moves of one game (token ids of the text, then eos)."""

    def __init__(self, tokenizer, env_id: str, seed: int = 0) -> None:
        self.tok, self.env_id, self.rng = tokenizer, env_id, random.Random(seed)

    def generate(self, prompt_token_ids, params):
        out = []
        for i, _ in enumerate(prompt_token_ids):
            ids = self.tok(moves(self.env_id, self.rng), add_special_tokens=False).input_ids
            out.append(Completion([*ids, self.tok.eos_token_id], [-0.5] * (len(ids) + 1), "stop", i))
        return out


def own_line(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def replay(env_id: str, seed: int, replies: list[str]) -> list[tuple[float, bool, bool]]:
    """GEM alone: ``gem.make`` + ``reset(seed)`` + one ``step`` per reply, until it ends."""
    env = gem.make(env_id)
    env.reset(seed=seed)
    out = []
    for reply in replies:
        _, reward, terminated, truncated, _ = env.step(reply)
        out.append((float(reward), bool(terminated), bool(truncated)))
        if terminated or truncated:
            break
    return out


def assert_replays(env_id: str, trajectories) -> None:
    """Our rewards are GEM's, reply by reply, and our episodes end where GEM's end."""
    for t in trajectories:
        gem_turns = replay(env_id, t.task_info["gem_seed"], t.replies)
        assert [r for r, _, _ in gem_turns] == t.rewards, t.replies
        assert len(gem_turns) == t.num_turns
        _, terminated, truncated = gem_turns[-1]
        if terminated or truncated:  # GEM ended it: terminal unless GEM only truncated it
            assert t.truncated == (truncated and not terminated)
        else:  # the harness stopped it first (max_turns, max_model_len, a cut reply)
            assert t.truncated


@pytest.mark.parametrize("env_id", [SUDOKU, GUESS])
def test_observations_are_gems_instructions_feedback_and_board(env_id):
    """The first turn is what GEM's concat wrapper shows at reset; each later turn is the part its
    wrapper adds after a move (the harness keeps the history as chat turns)."""
    ours = GemEnv(id=env_id)
    assert isinstance(ours, TextEnv)
    obs, info = ours.reset(row_index=4)
    wrapped = ObservationWrapper(gem.make(env_id), include_action=False, include_chat_template=False)
    raw = gem.make(env_id)
    raw_obs, raw_info = raw.reset(seed=info["gem_seed"])
    assert obs == own_line(raw_obs) + raw_info["suffix"] == wrapped.reset(seed=info["gem_seed"])[0]
    reply = "\\boxed{1 1 1}" if env_id == SUDOKU else "\\boxed{5}"
    step_obs, *_ = ours.step(reply)
    feedback, _, _, _, gem_info = raw.step(reply)
    assert step_obs == own_line(feedback) + gem_info["suffix"]
    assert wrapped.step(reply)[0] == own_line(raw_obs) + step_obs  # GEM's: the history, then our turn


@pytest.mark.parametrize("env_id", [SUDOKU, GUESS, MINES, G2048])
def test_harness_rewards_and_ends_are_gems(tiny_tokenizer, env_id):
    """Random moves through the harness (episodes interleaved in one batch), replayed through GEM
    alone: the same rewards, turn by turn, and the same ends; GEM's suffix string is not logged."""
    tok = tiny_tokenizer
    factory = env_factory("rlhf_lightning.envs.gem.GemEnv", {"id": env_id})
    harness = RolloutHarness(factory, tok, ChatFormatter(tok), max_turns=6, max_model_len=4096)
    result = harness.rollout(
        MoveEngine(tok, env_id), [0, 1, 2, 3], SamplingParams(max_new_tokens=32), group_size=3
    )
    trajs = result.trajectories
    assert len(trajs) == 12 and max(t.num_turns for t in trajs) > 1
    assert_replays(env_id, trajs)
    assert "env/solved" in result.metrics and not any("suffix" in k for k in result.metrics)
    if env_id in (SUDOKU, MINES, G2048):  # some moves score (a right digit, revealed cells, merges)
        assert any(r > 0 for t in trajs for r in t.rewards)


def test_episodes_in_threads_play_as_alone_and_leave_global_rngs_alone():
    """GEM draws from the global RNGs while it plays (2048's new tiles, Minesweeper's mines):
    each env swaps in its own states, so the process's RNGs are untouched and episodes stepped
    together in threads equal the same episodes played alone."""
    rng = random.Random(1)
    random.seed(123)
    np.random.seed(123)
    before = (random.getstate(), np.random.get_state()[1].copy())
    played = []
    for env_id in (G2048, MINES):
        envs = [GemEnv(id=env_id) for _ in range(8)]
        for row, env in enumerate(envs):
            env.reset(row_index=row)
        replies = [[moves(env_id, rng, no_move=0.0) for _ in range(5)] for _ in envs]
        rewards: list[list[float]] = [[] for _ in envs]
        with ThreadPoolExecutor(4) as pool:
            for turn in range(5):
                outs = pool.map(lambda env, text: env.step(text), envs, [r[turn] for r in replies])
                for i, out in enumerate(outs):
                    rewards[i].append(out[1])
        played.append((env_id, replies, rewards))
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    for env_id, replies, rewards in played:
        for row in range(8):
            alone = replay(env_id, gem_seed(row, False, 0, 100_000, 200), replies[row])
            assert [r for r, _, _ in alone] == rewards[row][: len(alone)]


def test_gem_steps_in_worker_processes_run_in_parallel_and_time_out_alone(tiny_tokenizer):
    """env.concurrency=4 with a step limit: each GEM step runs in its own worker process, so one
    step past the limit (row 1 sleeps 3 s) is stopped alone while the other episodes play on, and
    the trainer's global RNGs are never touched (each env's RNG state travels with it)."""
    from tests.envs.slow_gem import SlowGem

    tok = tiny_tokenizer
    factory = env_factory("tests.envs.slow_gem.SlowGem", {"id": G2048})
    harness = RolloutHarness(
        factory,
        tok,
        ChatFormatter(tok),
        max_turns=4,
        max_model_len=4096,
        concurrency=4,
        step_timeout_s=1.0,
        on_reward_error="zero",
    )
    params = SamplingParams(max_new_tokens=32)
    try:
        harness.rollout(MoveEngine(tok, G2048), [0, 2, 3, 4], params)  # the four workers are up
        random.seed(5)
        np.random.seed(5)
        before = (random.getstate(), np.random.get_state()[1].copy())
        result = harness.rollout(MoveEngine(tok, G2048, seed=3), [0, 1, 2, 3], params)
    finally:
        harness.close()
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    slow, *others = [result.trajectories[1], *(result.trajectories[i] for i in (0, 2, 3))]
    assert slow.rewards == [0.0] and slow.num_turns == 1  # its first step was stopped
    assert result.metrics["env/step_timeouts"] == 1.0
    assert all(t.num_turns > 1 for t in others)  # not stopped with it
    assert_replays(G2048, others)
    assert isinstance(factory(), SlowGem)


def test_train_and_eval_seeds_never_meet():
    env = GemEnv(id=GUESS, train_size=1000, eval_size=200, seed=7)
    train = {env.reset(row_index=i)[1]["gem_seed"] for i in range(1000)}
    evals = {env.reset(row_index=j, evaluation=True)[1]["gem_seed"] for j in range(200)}
    assert train == set(range(7, 1007)) and evals == set(range(1007, 1207))
    assert env.reset(row_index=1003)[1]["gem_seed"] == 10  # rows wrap within their split
    assert env.reset(row_index=205, evaluation=True)[1]["gem_seed"] == 1012
    assert env.num_rows(False) == 1000 and env.num_rows(True) == 200
    with pytest.raises(ConfigError, match=r"env.kwargs.seed.*2\*\*32"):
        GemEnv(seed=2**32 - 100)


def test_solved_is_gems_win_message():
    """Filling GEM's own solution wins (Congratulations!): solved on the last turn, rewards
    1/#empty each, 1 in all; a reply without a move ends it unsolved at -0.1."""
    env = GemEnv(id=SUDOKU)
    obs, _ = env.reset(row_index=2)
    board, solution = env.env.board, env.env.full_grid  # GEM's own state
    empty = [(r, c) for r in range(4) for c in range(4) if board[r][c] == 0]
    infos, rewards = [], []
    for r, c in empty:
        _, reward, terminated, truncated, info = env.step(f"\\boxed{{{r + 1} {c + 1} {solution[r][c]}}}")
        rewards.append(reward)
        infos.append(info)
    assert terminated and not truncated and infos[-1]["solved"] and not any(i["solved"] for i in infos[:-1])
    assert rewards == pytest.approx([1 / len(empty)] * len(empty)) and sum(rewards) == pytest.approx(1.0)
    env.reset(row_index=2)
    _, reward, terminated, _, info = env.step("no move")
    assert reward == -0.1 and terminated and not info["solved"]
    guess = GemEnv(id=GUESS)
    guess.reset(row_index=0)
    low, high = 1, 10
    while True:  # binary search on GEM's hints
        mid = (low + high) // 2
        obs, reward, terminated, _, info = guess.step(f"\\boxed{{{mid}}}")
        if terminated:
            break
        low, high = (mid + 1, high) if "higher" in obs else (low, mid - 1)
    assert info["solved"] and reward == 1.0 and obs.startswith("Congratulations!")
    assert episode_success(SimpleNamespace(infos=[info], rewards=[reward])) == 1.0


def test_a_partial_reward_at_the_turn_limit_is_not_a_win():
    """GuessTheNumber pays 1 - distance/range when its turns run out: a positive return, but not
    solved, so evaluation's accuracy (which reads ``solved``) does not count it."""
    env = GemEnv(id=GUESS)
    env.reset(row_index=0)
    target = env.env.game_number
    wrong = [n for n in range(1, 11) if n != target][:4]  # 4 turns: game:GuessTheNumber-v0-easy's limit
    rewards = []
    for n in wrong:
        _, reward, terminated, truncated, info = env.step(f"\\boxed{{{n}}}")
        rewards.append(reward)
    assert terminated and truncated and rewards[-1] == pytest.approx(1 - abs(wrong[-1] - target) / 9)
    assert sum(rewards) > 0 and not info["solved"]
    assert episode_success(SimpleNamespace(infos=[info], rewards=rewards)) == 0.0


def test_start_up_errors_name_the_fix(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"env.kwargs.id='game:GuessTheNumber-v0'.*game:GuessTheNumber-v0-easy"
    ):
        env_factory("rlhf_lightning.envs.gem.GemEnv", {"id": "game:GuessTheNumber-v0"})
    with pytest.raises(
        ConfigError,
        match=r"env.kwargs.kwargs=\{'max_turn': 3\}.*\['max_turn'\] are not among \['clues', 'max_turns', 'scale'\]",
    ):
        GemEnv(kwargs={"max_turn": 3})
    with pytest.raises(
        ConfigError, match=r"env.kwargs.id='game:FifteenPuzzle-v0-random': an id gem.make builds.*TypeError"
    ):
        GemEnv(id="game:FifteenPuzzle-v0-random")  # a GEM bug: its random variant does not build
    with pytest.raises(ConfigError, match=r"env.kwargs.train_size=0"):
        GemEnv(train_size=0)
    monkeypatch.setitem(sys.modules, "gem", None)  # as if gem-llm were not installed
    with pytest.raises(
        ConfigError, match=r"env.kwargs.id='game:Sudoku-v0-hard'.*pip install 'rlhf_lightning\[gem\]'"
    ):
        GemEnv(id="game:Sudoku-v0-hard", kwargs={"max_turns": 3})


def test_importing_gem_leaves_the_root_logger_alone():
    """gem/__init__ calls logging.basicConfig(level=INFO); through GemEnv it configures nothing."""
    code = (
        "import logging; from rlhf_lightning.envs.gem import GemEnv; GemEnv(); "
        "root = logging.getLogger(); print(len(root.handlers), root.level)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", str(logging.WARNING)]


def test_ids_that_need_the_network_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError, match=r"env.kwargs.id='qa:HotpotQA'.*Hugging Face dataset 'axon-rl/HotpotQA'"
    ):
        GemEnv(id="qa:HotpotQA")
    nltk = pytest.importorskip("nltk")
    try:
        nltk.data.find("corpora/words")
        pytest.skip("NLTK's words corpus is installed here: Wordle builds")
    except LookupError:
        pass
    with pytest.raises(ConfigError, match=r"env.kwargs.id='game:Wordle-v0-easy'.*NLTK's 'words' corpus"):
        GemEnv(id="game:Wordle-v0-easy")


@pytest.mark.slow
@pytest.mark.parametrize("env_id", [SUDOKU, GUESS])
def test_three_training_steps_with_tiny_chat_replay_through_gem(fast_cfg, tmp_path, env_id):
    """env=gem through the real config: 3 GRPO steps of tiny_chat; every reply it generated,
    replayed through GEM directly, gets the reward we trained on."""
    cfg = fast_cfg("env=gem", f"env.kwargs.id={env_id}", "model=tiny_chat", "trainer.max_steps=3")
    _, _, seen, times = fit_recording(cfg, tmp_path, steps=3)
    assert len(seen) == 3 and len(times) == 3
    for result in seen:
        assert len(result.trajectories) == 16
        assert_replays(env_id, result.trajectories)
    print(f"{env_id}: step times {[round(t, 2) for t in times]} s")


def test_eval_unseen_plays_only_boards_no_train_seed_starts_with():
    from rlhf_lightning.envs.gem import unseen_eval_seeds

    env = GemEnv(id=SUDOKU, train_size=300, eval_size=40, eval_unseen=True)
    train = {GemEnv(id=SUDOKU, train_size=300).reset(row_index=i)[0] for i in range(300)}
    evals = [env.reset(row_index=j, evaluation=True) for j in range(40)]
    seeds = [info["gem_seed"] for _, info in evals]
    assert len(set(seeds)) == 40 and min(seeds) >= 300  # after the train seeds
    assert not {obs for obs, _ in evals} & train  # no held-out board is a train board
    assert seeds == list(unseen_eval_seeds(SUDOKU, "{}", 0, 300, 40))  # the same every time
    # a seed skipped is one whose board a train seed has
    skipped = sorted(set(range(300, seeds[-1])) - set(seeds))
    for s in skipped:
        raw = GemEnv(id=SUDOKU, train_size=1, eval_size=1)
        raw.env.reset(seed=s)
        assert any(raw.env.board == b for b in [parse_board_of(o) for o in train])


def parse_board_of(obs: str) -> list[list[int]]:
    rows = [line.split()[1:] for line in obs.splitlines() if line.startswith("R")]
    return [[0 if c == "." else int(c) for c in r if c != "|"] for r in rows]


def test_eval_unseen_refuses_a_game_whose_start_hides_its_puzzle(monkeypatch):
    import rlhf_lightning.envs.gem as gem_env

    class SameStart:  # a game whose first observation is the same whatever the seed
        def reset(self, seed=None):
            return "Guess my number.", {}

    gem_env.unseen_eval_seeds.cache_clear()
    monkeypatch.setattr(gem_env, "prototype", lambda env_id, kwargs: SameStart())
    with pytest.raises(ConfigError, match=r"env\.kwargs\.eval_unseen.*0 unseen starts in 500 seeds"):
        gem_env.unseen_eval_seeds("game:Same-v0", "{}", 0, 10, 5)
    gem_env.unseen_eval_seeds.cache_clear()
