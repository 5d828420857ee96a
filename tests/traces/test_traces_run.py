"""Rollout traces end to end: a 3-step default run with trace.every_n_steps=1 writes
traces.jsonl that matches the step's trajectories and metrics.csv, the CLI prints and filters it
and writes a valid, escaped HTML page; a multi-turn env gets one record per turn with the env's
rewards; the W&B logger gets a table (a stand-in logger: wandb is not installed in tests)."""

from __future__ import annotations

import copy
import csv
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from lightning.pytorch.loggers import WandbLogger

from rlhf_lightning.callbacks.traces import COLUMNS, RolloutTraces
from rlhf_lightning.run.fit import run
from rlhf_lightning.traces.__main__ import main
from rlhf_lightning.traces.html import render_html
from rlhf_lightning.traces.writer import read_traces
from tests.conftest import FAST, ROOT, compose_config

pytestmark = pytest.mark.slow
QUICK = ["eval.before_training=false", "eval.at_end=false", "trainer.val_check_interval=100", "num_threads=1"]


class KeepTrajectories(L.Callback):
    """A copy of each step's trajectories and the version they were sampled with."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[list, int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps[trainer.global_step] = (
            copy.deepcopy(pl_module.last_trajectories),
            pl_module.last_rollout_version,
        )


def traced_run(out: Path, *overrides: str) -> tuple[Path, KeepTrajectories]:
    kept = KeepTrajectories()
    cfg = compose_config(
        [*FAST, *QUICK, "trainer.max_steps=3", "trace.every_n_steps=1", *overrides], output_dir=out
    )
    run(cfg, extra_callbacks=[kept])
    return out, kept


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, KeepTrajectories]:
    return traced_run(tmp_path_factory.mktemp("traces") / "run")


def test_each_step_traces_its_first_episodes_as_they_were(default_run, tiny_tokenizer):
    out, kept = default_run
    records = read_traces(out / "traces.jsonl")
    assert [(r["step"], r["episode"]) for r in records] == [(s, i) for s in (1, 2, 3) for i in range(4)]
    metrics = {
        int(r["step"]): r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("perf/step_s")
    }
    for r in records:
        trajs, version = kept.steps[r["step"]]
        t = trajs[r["episode"]]
        assert version == r["step"] - 1  # sampled by the weights before this step's update
        assert r["group"] == t.group_id and r["return"] == pytest.approx(sum(t.rewards), abs=1e-12)
        [turn] = r["turns"]  # arithmetic: one turn
        assert turn["reply"] == t.replies[0] and turn["reward"] == t.rewards[0]
        assert turn["version"] == version and turn["finish_reason"] == t.finish_reasons[0]
        assert turn["tokens"] == len(t.token_ids) - t.prompt_len
        # the context is the chat template over the prompt, as the model was given it
        chat = [{"role": "user", "content": t.observation}]
        assert turn["context"] == tiny_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False
        )
        # the step's timings are the ones metrics.csv has for that step
        assert r["timings"]["perf/step_s"] == pytest.approx(
            float(metrics[r["step"]]["perf/step_s"]), rel=1e-6
        )


def test_the_cli_prints_and_filters_by_step(default_run, capsys):
    out, kept = default_run
    assert main([str(out), "--step", "2"]) == 0
    text = capsys.readouterr().out
    assert re.findall(r"=== step (\d+) · episode (\d+)", text) == [("2", str(i)) for i in range(4)]
    for t in kept.steps[2][0][:4]:
        assert f"[reply]\n    {t.replies[0]}\n" in text
    assert main([str(out), "--step", "9"]) == 1
    assert "traced steps: [1, 2, 3]" in capsys.readouterr().err
    # as a module, on the traces file itself: every step
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf_lightning.traces", str(out / "traces.jsonl"), "--no-context"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(re.findall(r"^=== step \d", proc.stdout, flags=re.M)) == 12 and "[context]" not in proc.stdout


class StrictPage(HTMLParser):
    """Every tag closed in order (void tags aside); the text the page shows."""

    VOID = frozenset({"meta", "br", "hr", "img", "input", "link"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag) -> None:
        assert self.open and self.open[-1] == tag, f"</{tag}> closes {self.open[-1:]}"
        self.open.pop()

    def handle_data(self, data) -> None:
        self.text.append(data)


def parsed(page: str) -> StrictPage:
    p = StrictPage()
    p.feed(page)
    p.close()
    assert p.open == [], f"unclosed: {p.open}"
    return p


def test_the_html_page_is_valid_and_escapes_everything(default_run, tmp_path):
    out, _ = default_run
    page_path = tmp_path / "page" / "traces.html"
    assert main([str(out), "--step", "3", "--html", str(page_path)]) == 0
    p = parsed(page_path.read_text())
    assert p.tags.count("section") == 4 and p.tags.count("details") == 4  # one block per episode
    assert p.tags[:2] == ["html", "head"] and "script" not in p.tags
    records = read_traces(out / "traces.jsonl")
    hostile = copy.deepcopy(records[0])
    hostile["turns"][0]["reply"] = "<script>alert('x')</script> & </pre></section>"
    hostile["prompt"] = hostile["turns"][0]["context"] = '<img src=x onerror="y">'
    page = render_html([hostile], title="<b>run</b>")
    p = parsed(page)
    assert "script" not in p.tags and "img" not in p.tags and "b" not in p.tags
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp;" in page
    shown = "".join(p.text)
    assert "<script>alert('x')</script> & </pre></section>" in shown and "<b>run</b>" in shown


def test_a_multi_turn_env_has_one_record_per_turn_with_its_rewards(tmp_path):
    out, kept = traced_run(tmp_path / "run", "env=guess_number", "trace.episodes=16")
    records = read_traces(out / "traces.jsonl")
    assert len(records) == 3 * 16
    multi = 0
    for r in records:
        t = kept.steps[r["step"]][0][r["episode"]]
        assert [x["turn"] for x in r["turns"]] == list(range(len(t.rewards)))
        assert [x["reward"] for x in r["turns"]] == t.rewards
        multi += len(r["turns"]) > 1
        for k, turn in enumerate(r["turns"]):
            # guess_number's rule, from the reply: the last integer, valid in [1, 20]
            found = re.findall(r"-?\d+", turn["reply"].replace(",", ""))
            guess = int(found[-1]) if found else None
            valid = guess is not None and 1 <= guess <= 20
            solved = turn["info"]["solved"]
            expected = 1.0 - 0.1 * k if solved else (0.0 if valid else -0.1)
            assert turn["reward"] == pytest.approx(expected, abs=1e-9)
            if k + 1 < len(r["turns"]):  # the env's answer, then the next turn sees it all
                assert turn["observation"] == (
                    "Higher." if valid else "Reply with one number between 1 and 20."
                ) or (valid and turn["observation"] == "Lower.")
                nxt = r["turns"][k + 1]["context"]
                assert nxt.startswith(turn["context"]) and turn["observation"] in nxt[len(turn["context"]) :]
                assert turn["reply"] in nxt[len(turn["context"]) :]
    assert multi >= 3, multi  # the check above met several multi-turn episodes


class FakeWandb(WandbLogger):
    """A WandbLogger that only records ``log_table`` calls (no wandb import, no network)."""

    def __init__(self) -> None:  # WandbLogger.__init__ needs wandb installed
        self.tables: list[tuple] = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        self.tables.append((key, columns, data, step))


def test_the_wandb_logger_gets_a_table_of_the_episodes(default_run, tmp_path):
    _, kept = default_run
    trajs, version = kept.steps[2]
    module = SimpleNamespace(
        last_trajectories=trajs,
        last_rollout_version=version,
        harness=SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids, **kw: f"<{len(ids)} ids>")),
    )
    wandb = FakeWandb()
    trainer = SimpleNamespace(loggers=[wandb], is_global_zero=True, global_step=2, callback_metrics={})
    cb = RolloutTraces(1, tmp_path, episodes=3, max_bytes=10**6, max_chars=100)
    cb.on_train_batch_end(trainer, module, None, None, 0)
    [(key, columns, rows, step)] = wandb.tables
    assert (key, columns, step) == ("traces", COLUMNS, 2) and len(rows) == 3
    for i, row in enumerate(rows):
        t = trajs[i]
        assert row[:5] == [2, i, t.group_id, pytest.approx(sum(t.rewards)), len(t.rewards)]
        assert row[5] == str(t.rewards) and t.replies[0] in row[7]
    # not rank 0: nothing written, nothing logged
    trainer.is_global_zero, trainer.global_step = False, 3
    cb.on_train_batch_end(trainer, module, None, None, 1)
    assert len(wandb.tables) == 1 and {r["step"] for r in read_traces(tmp_path / "traces.jsonl")} == {2}


def test_traces_are_off_by_default_and_checked(tmp_path):
    from rlhf_lightning.config.errors import ConfigError
    from rlhf_lightning.run.factories import run_callbacks

    def traced(*overrides: str) -> list:
        cfg = compose_config([*FAST, *overrides], output_dir=tmp_path)
        return [c for c in run_callbacks(cfg, tmp_path, []).all if isinstance(c, RolloutTraces)]

    assert compose_config().trace.every_n_steps == 0 and traced() == []
    [cb] = traced("trace.every_n_steps=5", "trace.episodes=2", "trace.max_bytes=4096")
    assert (cb.every_n_steps, cb.episodes, cb.writer.max_bytes) == (5, 2, 4096)
    with pytest.raises(ConfigError, match=r"trace\.episodes=0"):
        traced("trace.every_n_steps=1", "trace.episodes=0")
