"""env=openenv: the adapter against a real OpenEnv server (examples/openenv_guess, served once
for the module on 127.0.0.1): rewards and done are the server's, each episode its own session,
turns token-exact through the harness, seeds split, every call under its deadline, and the
start-up refusals naming the field before any model loads."""

from __future__ import annotations

import gc
import pickle
import random
import sys
import time

import pytest

pytest.importorskip("openenv.core", reason="the openenv extra is not installed: pip install -e '.[openenv]'")

from examples.openenv_guess.models import GuessAction
from examples.openenv_guess.server import GuessEnvironment
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.base import TextEnv
from rlhf_lightning.envs.factory import env_factory
from rlhf_lightning.envs.openenv import OpenEnvEnv, OpenEnvFactory, OpenEnvTimeout
from rlhf_lightning.envs.openenv.settings import default_message, text_field
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.episodes.harness import ChatFormatter, RolloutHarness
from rlhf_lightning.runtime.local_server import free_port
from tests.envs.test_multiturn import RandomEngine, replay

TARGET = "rlhf_lightning.envs.openenv.OpenEnvEnv"
GUESS = {"client": "examples.openenv_guess.client:GuessEnv", "app": "examples.openenv_guess.server:app"}


@pytest.fixture(scope="module")
def guess(tmp_path_factory) -> OpenEnvFactory:
    """One server of the guessing game for the module (the run's factory: env_factory's)."""
    factory = env_factory(TARGET, {**GUESS, "eval_size": 5, "run_dir": str(tmp_path_factory.mktemp("run"))})
    assert isinstance(factory, OpenEnvFactory)
    yield factory
    factory.close()


def play_alone(seed: int, replies: list[str]) -> list[tuple[str, float, bool]]:
    """The game played in this process, without server or client: (text, reward, done) per reply."""
    game = GuessEnvironment()
    game.reset(seed=seed)
    out = []
    for reply in replies:
        obs = game.step(GuessAction(text=reply))
        out.append((obs.text, obs.reward, obs.done))
        if obs.done:
            break
    return out


def test_rewards_done_and_messages_are_the_servers_and_numbers_are_logged(guess):
    env = guess()
    assert isinstance(env, TextEnv)
    obs, info = env.reset(row_index=7)
    assert obs == GuessEnvironment().reset(seed=7).text and info["openenv_seed"] == 7
    replies = ["no idea", "8", "4", "12", "2"]
    expected = play_alone(7, replies)
    got = []
    for reply in replies[: len(expected)]:
        text, reward, terminated, truncated, step_info = env.step(reply)
        got.append((text, reward, terminated))
        assert not truncated and set(step_info) == {"guesses", "distance", "solved"}
        assert step_info["guesses"] == len(got)
    assert got == expected
    with pytest.raises(RuntimeError, match="before reset"):  # the episode ended: its session closed
        env.step("3")


def test_each_episode_plays_its_own_session(guess):
    """Interleaved episodes (one session each) play as they do alone; HTTP /step would not."""
    envs = [guess() for _ in range(3)]
    seeds = [3, 11, 3]
    for env, s in zip(envs, seeds):
        env.reset(row_index=s)
    replies = {i: ["5", "9", "13", "1"] for i in range(3)}
    got: dict[int, list] = {i: [] for i in range(3)}
    for turn in range(4):
        for i, env in enumerate(envs):
            if env.client is not None:
                text, reward, done, *_ = env.step(replies[i][turn])
                got[i].append((text, reward, done))
    for i, s in enumerate(seeds):
        assert got[i] == play_alone(s, replies[i])


@pytest.mark.parametrize("seed", [0, 1])
def test_episodes_through_the_harness_are_token_exact(guess, tiny_tokenizer, seed):
    """Every trajectory's ids are the prompt, each reply and each observation's ids, rewards the
    server's turn by turn (replayed on fresh sessions), on threads (env.concurrency=4)."""
    tok = tiny_tokenizer
    engine = RandomEngine(tok, seed=seed)
    formatter = ChatFormatter(tok)
    harness = RolloutHarness(
        guess, tok, formatter, max_turns=4, max_model_len=512, concurrency=4, step_workers="thread"
    )
    rows = [2, 9]
    result = harness.rollout(engine, rows, SamplingParams(max_new_tokens=6), group_size=2)
    harness.close()
    b = result.batch
    for i, traj in enumerate(result.trajectories):
        gens = [
            [t for t, k in zip(traj.token_ids, traj.action_turn) if k == turn]
            for turn in range(traj.num_turns)
        ]
        texts = [(tok.decode(g, skip_special_tokens=True), g) for g in gens]
        ids, turns, rewards = replay(guess, rows[i // 2], texts, formatter, tok)
        n = len(ids)
        assert b.input_ids[i, :n].tolist() == ids
        assert b.attention_mask[i].sum().item() == n
        assert b.turn_ids[i, : n - 1].tolist() == turns[1:]
        assert traj.rewards == pytest.approx(rewards)
        assert all(r in (-0.1, 0.0, 1.0) for r in traj.rewards)


@pytest.mark.parametrize("history", ["last", "last_k"])
def test_other_history_modes_play_the_same_rewards(guess, tiny_tokenizer, history):
    tok = tiny_tokenizer
    harness = RolloutHarness(guess, tok, ChatFormatter(tok), max_turns=4, max_model_len=512, history=history)
    result = harness.rollout(RandomEngine(tok, seed=3), [4], SamplingParams(max_new_tokens=6), group_size=2)
    for traj in result.trajectories:
        replies = [r for r in traj.replies]
        assert [r for _, r, _ in play_alone(4, replies)][: len(traj.rewards)] == pytest.approx(traj.rewards)


def test_train_and_eval_seeds_never_meet(guess):
    env = guess()
    assert env.num_rows(False) == 100_000 and env.num_rows(True) == 5
    assert env.settings.eval_seeds == (100_000, 100_001, 100_002, 100_003, 100_004)
    _, info = env.reset(row_index=6, evaluation=True)
    assert info["openenv_seed"] == 100_001
    env.end_session()
    with pytest.raises(ConfigError, match=r"env.kwargs.eval_seeds.*\[5, 99\] are training seeds"):
        OpenEnvEnv(**GUESS, url=None, eval_seeds=[5, 200_000, 99], train_size=100)


def test_a_session_is_closed_when_its_env_is_dropped(guess):
    """An episode the harness cut (max_turns) ends its session when its env is dropped."""
    env = guess()
    env.reset(row_index=1)
    client = env.client
    del env
    gc.collect()
    end = time.monotonic() + 5
    while client._ws is not None and time.monotonic() < end:
        time.sleep(0.05)
    assert client._ws is None


def test_the_env_refuses_to_be_pickled_naming_the_setting(guess):
    with pytest.raises(TypeError, match=r"env\.step_workers=thread.*env\.step_timeout_s"):
        pickle.dumps(guess())


def test_a_step_that_never_returns_is_stopped_at_the_deadline(tmp_path, tiny_tokenizer):
    """The server's step hangs: the call ends at env.step_timeout_s (the adapter's timeout_s) with OpenEnvTimeout naming
    the call; through the harness the episode is scored as a step error (on_reward_error=zero)."""
    factory = env_factory(
        TARGET,
        {
            "client": GUESS["client"],
            "app": "tests.envs.openenv_hang:app",
            "timeout_s": 1.5,
            "run_dir": str(tmp_path),
        },
    )
    try:
        env = factory()
        env.reset(row_index=0)  # reset answers; step never does
        start = time.monotonic()
        with pytest.raises(
            OpenEnvTimeout, match=r"OpenEnvEnv.step \(turn 1\) of .*GuessEnv did not return within 1.5 s"
        ):
            env.step("8")
        assert 1.4 < time.monotonic() - start < 4.0
        tok = tiny_tokenizer
        harness = RolloutHarness(
            factory, tok, ChatFormatter(tok), max_turns=3, max_model_len=512, on_reward_error="zero",
            concurrency=4, step_workers="thread",
        )  # fmt: skip
        start = time.monotonic()
        result = harness.rollout(
            RandomEngine(tok, seed=0, cut_prob=0), [0], SamplingParams(max_new_tokens=4), group_size=4
        )
        harness.close()
        assert time.monotonic() - start < 6.0  # the four steps timed out at once, on threads
        assert result.metrics["env/reward_errors"] == 4.0
        assert [t.rewards for t in result.trajectories] == [[0.0]] * 4
    finally:
        factory.endpoint.server.stop(grace_s=0.5)  # its hung step would hold a clean stop for 5 s
        factory.close()


def test_the_action_default_needs_exactly_one_string_field():
    from openenv.core.env_server.types import Action

    class Two(Action):
        a: str
        b: str

    assert text_field(GuessAction, "x") == "text"
    with pytest.raises(ConfigError, match=r"env.kwargs.action.*2 string fields \['a', 'b'\]"):
        text_field(Two, "my.client:C")


def test_the_default_message_is_the_text_field_else_the_json():
    assert default_message({"text": "hi", "n": 1}) == "hi"
    assert default_message({"board": [1, 2], "n": 1, "reward": 3}) == '{"board": [1, 2], "n": 1}'


# ----------------------------------------------------------------- start-up refusals, before any model
@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusals must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the env was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def run_refused(fast_cfg, *overrides: str) -> ConfigError:
    from rlhf_lightning.run import run

    cfg = fast_cfg("env=openenv", "model=tiny_chat", *overrides)
    with pytest.raises(ConfigError) as err:
        run(cfg)
    return err.value


def test_a_bad_client_path_fails_before_the_model_loads(fast_cfg, no_model):
    err = run_refused(fast_cfg, "env.kwargs.client=examples.openenv_guess.client:NoSuchEnv")
    assert "env.kwargs.client" in str(err) and "has no NoSuchEnv" in str(err)
    err = run_refused(fast_cfg, "env.kwargs.client=examples.openenv_guess.models:GuessAction")
    assert "an EnvClient subclass" in str(err)


def test_a_missing_extra_fails_before_the_model_loads_naming_it(fast_cfg, no_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # import openenv.core raises ImportError
    err = run_refused(fast_cfg)
    assert "env.kwargs.client" in str(err) and 'pip install -e ".[openenv]"' in str(err)


def test_an_unreachable_url_fails_before_the_model_loads(fast_cfg, no_model):
    port = free_port()  # nothing listens there
    err = run_refused(fast_cfg, "env.kwargs.app=null", f"env.kwargs.url=http://127.0.0.1:{port}")
    assert f"env.kwargs.url='http://127.0.0.1:{port}'" in str(err) and "GET /health failed" in str(err)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["env.kwargs.app=null"], "env.kwargs.url"),  # neither
        (["env.kwargs.url=http://127.0.0.1:1"], "env.kwargs.url"),  # both
        (["env.step_timeout_s=null"], "env.step_timeout_s"),
        (["env.kwargs.timeout_s=5"], "env.kwargs.timeout_s"),
        (["env.step_workers=process"], "env.step_workers"),
        (["env.kwargs.app=examples.openenv_guess.nowhere:app"], "env.kwargs.app"),
    ],
)
def test_settings_that_cannot_work_are_refused_early(fast_cfg, overrides, field):
    from rlhf_lightning.run.validation import validate

    cfg = fast_cfg("env=openenv", "model=tiny_chat", *overrides)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg)
        env_factory(TARGET, dict(cfg.env.kwargs))  # what the run builds next (the app's module)
    assert time.monotonic() - started < 5.0


def test_random_row_seeds_are_rows(guess):
    env = guess()
    for row in random.Random(0).sample(range(100_000), 3):
        assert env.settings.episode_seed(row, evaluation=False) == row
