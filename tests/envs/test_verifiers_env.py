"""env=verifiers: verifiers 0.4.0 environments written in these tests (tests/envs/vf_envs/: a
single-turn one on a local file with an exact-match reward, a multi-turn one with an MCP
calculator tool) train 3 steps through ``run(cfg)``; the runner trains on the endpoint's
recorded tokens; a rollout verifiers marks failed counts in ``env/reward_errors``; held-out
tasks are never training tasks; ``.[openenv,verifiers]`` imports both."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason='needs the verifiers extra: pip install -e ".[verifiers]"')

from rlhf_lightning.config import ASSETS
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.records.sampling import Completion, SamplingParams
from tests.conftest import compose_config

VF_ENVS = Path(__file__).parent / "vf_envs"
TASKS = "examples/agent_calc/tasks.jsonl"


@pytest.fixture(scope="module", autouse=True)
def installed_envs():
    """The test environments importable by their top-level names, here and in the processes
    the run starts (its workers, verifiers' tool servers), as an installed package would be."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(VF_ENVS))
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(VF_ENVS), os.environ.get("PYTHONPATH")) if p))
        yield


def test_openenv_and_verifiers_import_in_one_process():
    import openenv.core
    import verifiers.v1 as vf

    assert openenv.core.EnvClient and vf.load_environment


def test_held_out_tasks_are_never_training_tasks(tmp_path):
    from rlhf_lightning.envs.verifiers import VerifiersEnv

    env = VerifiersEnv("vf_exact_answer", {"path": TASKS, "limit": 200})
    train = [env.task(i, False) for i in range(env.num_rows(False))]
    held = [env.task(i, True) for i in range(env.num_rows(True))]
    assert (len(train), len(held)) == (180, 20)  # eval_fraction 0.1 of the 200 tasks
    assert not {q for q, _ in train} & {q for q, _ in held}
    # the env's own eval split (eval_args): its tasks, and the training tasks with the same prompts dropped
    rows = [json.loads(line) for line in Path(TASKS).read_text().splitlines()[:30]]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[20:30]))
    env = VerifiersEnv(
        "vf_exact_answer", {"path": TASKS, "limit": 25}, eval_args={"path": str(tmp_path / "test.jsonl")}
    )
    assert [env.task(i, True)[0] for i in range(10)] == [r["question"] for r in rows[20:30]]
    assert [env.task(i, False)[0] for i in range(env.num_rows(False))] == [r["question"] for r in rows[:20]]


def test_a_missing_environment_is_refused_naming_the_field():
    from rlhf_lightning.envs.verifiers import VerifiersEnv

    with pytest.raises(ConfigError, match=r"env\.kwargs\.id.*vf_no_such_env"):
        VerifiersEnv("vf_no_such_env")


def test_a_missing_extra_is_refused_naming_it(monkeypatch):
    from rlhf_lightning.envs.verifiers import VerifiersEnv

    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name == "verifiers" else object()
    )
    with pytest.raises(ConfigError, match=r'env\.kwargs\.id.*pip install -e "\.\[verifiers\]"'):
        VerifiersEnv("vf_exact_answer", {"path": TASKS})


class ScriptedEngine:
    """Calls the calculator on the task's expression, then answers with the tool's result (or
    the answer right away when ``direct``); records every completion it returns."""

    def __init__(self, tok, direct=False):
        self.tok, self.direct, self.returned = tok, direct, []

    def generate(self, prompts, params):
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            question = re.findall(r"What is (.*?)\?", text)[-1:] or ["0"]
            if self.direct or "<tool_response>\n" in text:
                reply = text.rsplit("<tool_response>\n", 1)[-1].split("\n")[0] if not self.direct else "7"
            else:
                reply = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{question[0]}"}}}}</tool_call>'
            r = self.tok(reply, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
            self.returned.append(r)
            out.append(Completion(r, [-0.01 * (k + 1) for k in range(len(r))], "stop", i))
        return out


def test_the_runner_trains_on_the_endpoints_tokens_and_counts_failed_rollouts():
    from vf_calc_tool import PROMPT

    from rlhf_lightning.envs.verifiers import VerifiersEnv
    from rlhf_lightning.models.build import load_tokenizer
    from rlhf_lightning.rollout.agents.runner import AgentRunner
    from rlhf_lightning.rollout.episodes.chat import ChatFormatter

    question = PROMPT.format("28 * 80 - 21")
    tok = load_tokenizer(str(ASSETS / "tiny_tools"))
    env = VerifiersEnv("vf_calc_tool", {"path": TASKS, "limit": 20, "fail_on": "52 * 67 - 43"})
    rows = [i for i in range(env.num_rows(False)) if env.task(i, False)[0] in (question, "FAIL THIS ROLLOUT")]
    engine = ScriptedEngine(tok)
    runner = AgentRunner(
        env, tok, ChatFormatter(tok), max_model_len=1024, concurrency=2, on_reward_error="zero"
    )
    try:
        result = runner.rollout(engine, rows, SamplingParams(max_new_tokens=48), group_size=2)
    finally:
        runner.shutdown()
    assert result.metrics["env/reward_errors"] == 2.0  # the failing task's two episodes
    by_question = {}
    for t in result.trajectories:
        by_question.setdefault(t.observation, []).append(t)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "28 * 80 - 21"}}</tool_call>'
    first, second = (
        tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id] for text in (call, "2219")
    )
    assert sorted(by_question) == ["FAIL THIS ROLLOUT", question]
    for t in by_question[question]:
        assert t.rewards[-1] == 1.0 and t.infos[0] == {
            "correct": 1.0,
            "tool_results": 1.0,
            "agent_error": False,
        }
        # two calls, the second extending the first: one sequence whose sampled tokens are the two
        # completions the engine returned, in order, with their log-probs
        assert t.num_turns == 2 and t.segment_starts == [0]
        sampled = [i for i, turn in enumerate(t.action_turn) if turn >= 0]
        assert [t.token_ids[i] for i in sampled] == first + second
        assert [t.sampling_logps[i] for i in sampled] == pytest.approx(
            [-0.01 * (k + 1) for k in range(len(first))] + [-0.01 * (k + 1) for k in range(len(second))],
            abs=1e-6,
        )
    for t in by_question["FAIL THIS ROLLOUT"]:
        assert t.rewards[-1] == 0.0 and t.infos[0]["agent_error"] is True


def read_metrics(out: Path) -> list[dict[str, str]]:
    with (out / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


COMMON = [
    "env=verifiers",
    "algo.prompts_per_step=4",
    "algo.group_size=2",
    "rollout.max_new_tokens=48",  # a calculator call is ~29 tokens
    "env.eval_size=4",
    "eval.batch_size=4",
    "trainer.enable_progress_bar=false",
    "env.concurrency=2",
    "trainer.max_steps=3",
    "trainer.val_check_interval=3",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, env_id, checks, multi_turn",
    [
        ("tiny_chat", "vf_exact_answer", ("exact", "reply_chars"), False),
        ("tiny_tools", "vf_calc_tool", ("correct", "tool_results"), True),
    ],
)
def test_a_verifiers_environment_trains_three_steps(tmp_path, model, env_id, checks, multi_turn):
    from rlhf_lightning.run import run

    out = tmp_path / "run"
    cfg = compose_config(
        [
            *COMMON,
            f"model={model}",
            f"env.kwargs.id={env_id}",
            f"env.kwargs.args={{path: {TASKS}, limit: 64}}",
        ],
        output_dir=out,
    )
    result = run(cfg)
    assert result.exit_code == 0 and result.trainer.global_step == 3
    rows = read_metrics(out)
    train = [r for r in rows if r.get("rollout/reward_mean")]
    assert [r["step"] for r in train] == ["1", "2", "3"]
    for r in train:
        assert float(r["env/reward_errors"]) == 0.0 and float(r["agent/extended_share"]) == 1.0
        assert all(r.get(f"env/{k}") not in (None, "") for k in checks)  # the env's own rewards and metrics
    calls = [float(r["agent/calls_per_episode"]) for r in train]
    if multi_turn:  # the embedded tools model calls the calculator, reads its result, answers
        assert sum(calls) / 3 > 1.5 and sum(float(r["env/tool_results"]) for r in train) > 0
    else:
        assert calls == [1.0, 1.0, 1.0]
    assert [r for r in rows if r.get("eval/accuracy_greedy")]
    assert not result.module.harness.endpoint._thread  # the endpoint stopped with the run
