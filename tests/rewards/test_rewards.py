"""The reward group: weighted combinations, user functions, sequence-classification reward models."""

from __future__ import annotations

import csv
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.records.trajectory import Trajectory
from rlhf_lightning.rewards import CombinedReward, Episode, FunctionReward, build_reward
from rlhf_lightning.rewards.model import ModelReward
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config


def traj(rewards: list[float], replies: list[str], info: dict | None = None) -> Trajectory:
    return Trajectory(
        token_ids=[1], action_turn=[-1], sampling_logps=[0.0], rewards=list(rewards), group_id=0,
        prompt_len=1, observation="Q?", replies=list(replies), task_info=dict(info or {}),
    )  # fmt: skip


class Const:
    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, values
        self.seen: list = []

    def score(self, episodes, device):
        self.seen = list(episodes)
        return self.values


def test_combined_reward_weights_env_turns_and_adds_components_on_the_final_turn():
    a, b = Const("a", [1.0, -2.0]), Const("b", [10.0, 20.0])
    reward = CombinedReward([a, b], {"env": 2.0, "b": 0.5}, use_env=True)
    trajs = [traj([1.0, 0.5], ["x", "y"]), traj([0.25], ["z"])]
    metrics = reward.apply(trajs)
    # episode 0: env turns x2 -> [2, 1]; final += 1*1 + 0.5*10 = 6 -> [2, 7]
    # episode 1: env x2 -> [0.5]; final += 1*(-2) + 0.5*20 = 8 -> [8.5]
    assert trajs[0].rewards == [2.0, 7.0]
    assert trajs[1].rewards == [8.5]
    assert metrics["reward/env"] == pytest.approx((1.5 + 0.25) / 2)
    assert metrics["reward/a"] == pytest.approx(-0.5)
    assert metrics["reward/b"] == pytest.approx(15.0)
    assert metrics["reward/total"] == pytest.approx((9.0 + 8.5) / 2)
    assert [e.replies for e in a.seen] == [["x", "y"], ["z"]]
    assert [e.env_return for e in a.seen] == [1.5, 0.25]


def test_without_the_env_its_rewards_are_dropped():
    trajs = [traj([1.0, 1.0], ["x", "y"])]
    CombinedReward([Const("a", [3.0])], {}, use_env=False).apply(trajs)
    assert trajs[0].rewards == [0.0, 3.0]


def test_env_alone_is_no_work_and_bad_names_are_named():
    assert build_reward(["env"]) is None
    assert isinstance(build_reward(["env"], weights={"env": 2.0}), CombinedReward)
    with pytest.raises(ConfigError, match=r"reward\.sources"):
        build_reward(["env", "critic"])
    with pytest.raises(ConfigError, match=r"reward\.fn"):
        build_reward(["function"])
    with pytest.raises(ConfigError, match=r"reward\.fn"):
        build_reward(["function"], "no_such_module.fn")
    with pytest.raises(ConfigError, match=r"reward.weights.*\['model'\]"):
        build_reward(["env"], weights={"model": 1.0})


def user_module(tmp_path: Path, monkeypatch) -> str:
    """A reward module outside the package, importable like a user's own code."""
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            CALLS = []

            def short_and_right(prompts, completions, replies, answer, **columns):
                CALLS.append((list(prompts), list(completions), list(answer)))
                return [float(c.strip() == str(a)) - 0.01 * len(c) for c, a in zip(completions, answer)]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    return "my_rewards.short_and_right"


def test_function_reward_gets_prompts_completions_and_the_env_columns(tmp_path, monkeypatch):
    fn = FunctionReward(user_module(tmp_path, monkeypatch))
    episodes = [Episode("1+1?", ["2"], {"answer": 2}), Episode("2+2?", ["x", "5"], {"answer": 4, "k": 1})]
    assert fn.name == "short_and_right"
    assert fn.score(episodes, "cpu") == pytest.approx([1.0 - 0.01, -0.01])
    import my_rewards

    assert my_rewards.CALLS == [(["1+1?", "2+2?"], ["2", "5"], [2, 4])]


def test_function_reward_that_returns_the_wrong_count_is_named(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = FunctionReward("bad_rewards.f")
    with pytest.raises(ValueError, match=r"bad_rewards\.f returned 1 scores for 2 episodes"):
        fn.score([Episode("a", ["b"]), Episode("c", ["d"])], "cpu")


def metrics_rows(run_dir: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((run_dir / "metrics.csv").open()))


@pytest.mark.slow
def test_train_with_a_user_reward_function(tmp_path, monkeypatch):
    fn = user_module(tmp_path, monkeypatch)
    cfg = compose_config(
        [
            *FAST,
            "reward=function",
            f"reward.fn={fn}",
            "reward.fn_timeout_s=null",  # in this process: the test reads the calls it recorded
            "trainer.max_steps=3",
            "checkpoint.every_n_steps=0",
        ],
        output_dir=tmp_path / "run",
    )
    run(cfg)
    import my_rewards

    assert len(my_rewards.CALLS) == 3  # once per training rollout, none for evaluation
    prompts, completions, answers = my_rewards.CALLS[0]
    assert len(prompts) == len(completions) == len(answers) == 16  # 4 prompts x 4 samples
    rows = [r for r in metrics_rows(tmp_path / "run") if r.get("reward/short_and_right")]
    assert len(rows) == 3
    for r in rows:  # without the env, the training reward is the function's score
        assert float(r["rollout/reward_mean"]) == pytest.approx(float(r["reward/short_and_right"]), abs=1e-5)
        assert float(r["reward/total"]) == pytest.approx(float(r["reward/short_and_right"]), abs=1e-5)


def char_tokenizer(with_template: bool) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: nothing like the policy's byte-level BPE."""
    chars = sorted(
        set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=?.,:;!'\n<>|_[]()#")
    )
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    if with_template:
        fast.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}[EOS]{% endfor %}"
    return fast


def build_reward_model(directory: Path, with_template: bool = False) -> Path:
    """A GPT-2 sequence classifier (num_labels=1) with a character tokenizer, saved offline."""
    torch.manual_seed(0)
    tok = char_tokenizer(with_template)
    config = GPT2Config(
        vocab_size=len(tok), n_positions=512, n_embd=32, n_layer=2, n_head=2, num_labels=1,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    GPT2ForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("with_template", [False, True])
def test_reward_model_batches_equal_one_by_one_scores(tmp_path, with_template):
    path = build_reward_model(tmp_path / "rm", with_template)
    rm = ModelReward(str(path), batch_size=3)
    episodes = [Episode("What is 2+2?", ["4"]), Episode("Hi", ["a much longer reply here", "x"]),
                Episode([{"role": "user", "content": "7-3?"}], ["4."]), Episode("q", [""])]  # fmt: skip
    scores = rm.score(episodes, "cpu")
    model = GPT2ForSequenceClassification.from_pretrained(path).eval()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    for episode, score in zip(episodes, scores):
        prompt = episode.prompt if isinstance(episode.prompt, str) else episode.prompt[0]["content"]
        reply = "\n".join(episode.replies)
        text = f"u:{prompt}[EOS]a:{reply}[EOS]" if with_template else f"{prompt}\n{reply}"
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0].item()  # one sequence: no padding at all
        assert score == pytest.approx(expected, abs=1e-5)
    # normalize=batch: score stays raw; the step's finalize standardises (tests/rewards/test_normalize.py)
    batch_rm = ModelReward(str(path), normalize="batch")
    assert batch_rm.normalize == "batch"
    assert batch_rm.score(episodes, "cpu") == pytest.approx(scores, abs=1e-6)
    trajs = [traj([0.0], e.replies) for e in episodes]
    for t, e in zip(trajs, episodes):
        t.observation = e.prompt
    reward = CombinedReward([batch_rm], {}, use_env=False)
    reward.apply(trajs)
    reward.finalize(trajs, lambda x: x)
    n = len(scores)
    mean = sum(scores) / n
    std = (sum((s - mean) ** 2 for s in scores) / (n - 1)) ** 0.5
    assert [t.rewards[-1] for t in trajs] == pytest.approx(
        [(s - mean) / (std + 1e-6) for s in scores], abs=1e-5
    )


def test_reward_model_tokenizer_without_pad_eos_or_unk_is_refused_with_the_fix(tmp_path):
    vocab = {c: i for i, c in enumerate("abc")}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    bare = PreTrainedTokenizerFast(tokenizer_object=tok)  # no pad, eos or unk token
    GPT2ForSequenceClassification(
        GPT2Config(vocab_size=3, n_embd=16, n_layer=1, n_head=2, num_labels=1)
    ).save_pretrained(tmp_path)
    bare.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"reward\.model_path=.*pad, eos or unk token.*add_special_tokens"):
        ModelReward(str(tmp_path))


def test_reward_model_with_several_outputs_is_refused(tmp_path):
    tok = char_tokenizer(False)
    GPT2ForSequenceClassification(
        GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, num_labels=2)
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="num_labels=1"):
        ModelReward(str(tmp_path))


@pytest.mark.slow
def test_train_with_a_reward_model_of_another_architecture_and_tokenizer(tmp_path):
    path = build_reward_model(tmp_path / "rm", with_template=True)
    cfg = compose_config(
        [*FAST, "reward=model", f"reward.model_path={path}", "reward.sources=[env,model]",
         "reward.weights={model:0.5}", "experiment=quick", "trainer.max_steps=3", "trainer.val_check_interval=3",
         "env.kwargs.eval_size=20"],
        output_dir=tmp_path / "run",
    )  # fmt: skip
    run(cfg)
    rows = [r for r in metrics_rows(tmp_path / "run") if r.get("reward/model")]
    assert len(rows) == 3
    for r in rows:
        expected = float(r["reward/env"]) + 0.5 * float(r["reward/model"])
        assert float(r["reward/total"]) == pytest.approx(expected, abs=1e-5)
        assert float(r["rollout/reward_mean"]) == pytest.approx(expected, abs=1e-5)
    evals = [r for r in metrics_rows(tmp_path / "run") if r.get("eval/accuracy_greedy")]
    assert evals and all(0.0 <= float(r["eval/return_greedy"]) <= 1.0 for r in evals)  # the env's own


def test_rewards_are_refused_for_offline_algorithms(tmp_path):
    from rlhf_lightning.run.validation import validate

    cfg = compose_config(["algo=sft", "reward=function", "reward.fn=math.sqrt"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"reward.sources.*sft"):
        validate(cfg)


def test_function_and_model_presets_without_their_required_value_are_named(tmp_path):
    from rlhf_lightning.run import training_reward

    with pytest.raises(ConfigError, match=r"reward\.fn=None.*dotted path"):
        training_reward(compose_config(["reward=function"], output_dir=tmp_path).reward)
    with pytest.raises(ConfigError, match=r"reward\.model_path=None"):
        training_reward(compose_config(["reward=model"], output_dir=tmp_path).reward)


def test_validation_names_the_missing_reward_value(tmp_path):
    from rlhf_lightning.run.validation import validate

    with pytest.raises(ConfigError, match=r"reward\.fn=None.*reward\.fn=my_pkg"):
        validate(compose_config(["reward=function"], output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"reward\.model_path=None.*reward\.model_path=/path"):
        validate(compose_config(["reward=model"], output_dir=tmp_path))
