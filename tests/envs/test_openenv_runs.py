"""env=openenv end to end: ``run(cfg)`` trains 3 steps on examples/openenv_guess, once with the
server the run starts (env.kwargs.app) and once given by URL (a server the test starts); a killed
env server ends the run naming it and its log, and resume=true continues from the checkpoint;
kill -9 of the trainer leaves no env server behind."""

from __future__ import annotations

import csv
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason="the openenv extra is not installed: pip install -e '.[openenv]'")

from examples.openenv_guess.models import GuessAction
from examples.openenv_guess.server import GuessEnvironment
from rlhf_lightning.envs.openenv import stop_servers
from rlhf_lightning.run import checkpoint_step
from rlhf_lightning.runtime.group_guard import group_members
from rlhf_lightning.runtime.local_server import LocalServer, free_port
from tests.conftest import FAST, compose_config
from tests.runtime.test_workers import alive, children_of, cmdline
from tests.test_resume import run_here, start, wait_for

pytestmark = pytest.mark.slow

OPENENV = ["env=openenv", "model=tiny_chat", "env.kwargs.eval_size=8", "eval.batch_size=8"]
GUESS_APP = "examples.openenv_guess.server:app"


def train_rows(run: Path) -> list[dict[str, str]]:
    with (run / "metrics.csv").open() as f:
        return [r for r in csv.DictReader(f) if r.get("rollout/reward_mean")]


def replayed(trajectories) -> None:
    """Every episode's rewards are the game's own for its seed and replies (played here alone)."""
    for t in trajectories:
        game = GuessEnvironment()
        game.reset(seed=t.task_info["openenv_seed"])
        rewards = [game.step(GuessAction(text=r)).reward for r in t.replies]
        assert rewards == pytest.approx(t.rewards), t.replies


def train_three_steps(out: Path, *overrides: str):
    """``run(cfg)`` for 3 steps, keeping every training rollout's trajectories."""
    import lightning as L

    from rlhf_lightning.run import run

    seen: list = []

    class Spy(L.Callback):
        def on_fit_start(self, trainer, module) -> None:
            source = getattr(module, "source", module)  # the rollout source (or the module itself)
            original = source.collect

            def collect(*args, **kwargs):
                got = original(*args, **kwargs)
                seen.append(got[0] if isinstance(got, tuple) else got)
                return got

            source.collect = collect

    cfg = compose_config([*FAST, *OPENENV, "trainer.max_steps=3", *overrides], output_dir=out)
    result = run(cfg, extra_callbacks=[Spy()])
    return result, seen


def guards_of(pid: int) -> list[int]:
    return [c for c in children_of(pid) if "rlhf_lightning.runtime.group_guard" in cmdline(c)]


def test_three_steps_with_the_server_the_run_starts(tmp_path):
    """env.kwargs.app: the run serves the app on 127.0.0.1 (its log in <run>/servers/), trains 3
    steps on the game's own rewards and logs its numeric observation fields."""
    out = tmp_path / "run"
    result, seen = train_three_steps(out)
    try:
        assert result.exit_code == 0 and len(seen) == 3
        for rollout in seen:
            assert len(rollout.trajectories) == 16
            replayed(rollout.trajectories)
        rows = train_rows(out)
        assert [r["step"] for r in rows] == ["1", "2", "3"]
        assert all(r["env/guesses"] and r["env/distance"] and r["env/solved"] for r in rows)
        log = (out / "servers" / "openenv-0.log").read_text()
        assert re.search(rf"uvicorn {re.escape(GUESS_APP)} --host 127\.0\.0\.1 --port \d+", log)
        assert not guards_of(os.getpid())  # stopped with the run (run(cfg) in-process)
        assert result.module.harness.env_factory.endpoint.server.death() is not None
    finally:
        stop_servers()
    assert not guards_of(os.getpid())


def test_the_command_line_run_stops_its_server_at_its_end(tmp_path):
    run = tmp_path / "A"
    proc = start(tmp_path, *OPENENV, "trainer.max_steps=1", f"output_dir={run}")
    wait_for(run / "servers" / "openenv-0.log", proc)
    end = time.monotonic() + 60
    while not guards_of(proc.pid) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    group = [p for g in guards_of(proc.pid) for p in group_members(g)]
    assert group
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    end = time.monotonic() + 10
    while any(alive(p) for p in group) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [cmdline(p) for p in group if alive(p)]


def test_three_steps_with_a_server_given_by_url(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", GUESS_APP, "--host", "127.0.0.1", "--port", str(port)]
    server = LocalServer("the test's OpenEnv server", command, port, tmp_path / "server.log")
    try:
        server.wait_ready(time.monotonic() + 60, "the test")
        out = tmp_path / "run"
        result, seen = train_three_steps(out, "env.kwargs.app=null", f"env.kwargs.url={server.url}")
        assert result.exit_code == 0 and len(seen) == 3
        for rollout in seen:
            replayed(rollout.trajectories)
        assert not (out / "servers").exists()  # the run started none
        assert server.death() is None  # and leaves the one it was given running
    finally:
        server.stop(grace_s=2)


def test_async_rollouts_train_with_a_server_of_the_producers_own(tmp_path):
    out = tmp_path / "run"
    result, _ = train_three_steps(out, "rollout.mode=async", "trainer.max_steps=2")
    try:
        assert result.exit_code == 0
        assert [r["step"] for r in train_rows(out)] == ["1", "2"]
        logs = sorted(p.name for p in (out / "servers").iterdir())
        assert logs == ["openenv-0.log", "openenv-1.log"]  # the trainer's and the producer's
    finally:
        stop_servers()


def test_a_run_with_an_mcp_envs_tools(tmp_path):
    """env.kwargs.tools=true through the real config: the tools reach the template (checked at
    start-up) and the run trains (the tiny model rarely calls them: its replies are answers)."""
    out = tmp_path / "run"
    tools = [
        "env.kwargs.app=tests.envs.openenv_tools:app",
        "env.kwargs.tools=true",
        "model.chat_template=${asset:chat_templates/tools.jinja}",
        "env.max_model_len=1024",
        "trainer.max_steps=2",
    ]
    result, seen = train_three_steps(out, *tools)
    try:
        assert result.exit_code == 0 and len(seen) == 2
        rows = train_rows(out)
        assert all(r["env/answered"] != "" for r in rows)
        assert all(t.infos[-1]["answered"] in (True, False) for r in seen for t in r.trajectories)
    finally:
        stop_servers()


def test_a_killed_env_server_ends_the_run_naming_it_and_the_checkpoint_resumes(tmp_path):
    """SIGKILL of the env server after the step-2 checkpoint: the trainer exits non-zero within
    seconds naming the server, how it ended and its log; resume=true starts a new server and
    trains to the end."""
    run = tmp_path / "B"
    overrides = [*OPENENV, "checkpoint.every_n_steps=1", "trainer.max_steps=6"]
    proc = start(tmp_path, *overrides, f"output_dir={run}")
    wait_for(run / "checkpoints" / "step_000002.ckpt", proc)
    (guard,) = guards_of(proc.pid)
    (server,) = children_of(guard)
    port = re.search(r"--port (\d+)", cmdline(server)).group(1)  # type: ignore[union-attr]
    os.kill(server, signal.SIGKILL)
    killed_at = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    waited = time.monotonic() - killed_at
    assert proc.returncode != 0 and waited < 30, (proc.returncode, waited, out[-3000:])
    assert (
        f"the OpenEnv server {GUESS_APP} (env.kwargs.app) at http://127.0.0.1:{port} was killed by SIGKILL"
        in out
    ), out[-3000:]
    assert f"its log: {run / 'servers' / 'openenv-0.log'}" in out
    assert "Resume with resume=true" in out
    assert not alive(guard)
    step = checkpoint_step(run / "checkpoints" / "last.ckpt")
    assert 2 <= step < 6
    run_here(*overrides, f"output_dir={run}", "resume=true")
    assert [int(r["step"]) for r in train_rows(run)][-1] == 6
    assert (run / "servers" / "openenv-1.log").is_file()  # the resumed run's own server


def test_kill_9_of_the_trainer_leaves_no_env_server(tmp_path):
    run = tmp_path / "C"
    proc = start(
        tmp_path, *OPENENV, "checkpoint.every_n_steps=1", "trainer.max_steps=1000", f"output_dir={run}"
    )
    wait_for(run / "checkpoints" / "step_000001.ckpt", proc)
    (guard,) = guards_of(proc.pid)
    group = group_members(guard)
    assert any("uvicorn" in cmdline(p) for p in group), [cmdline(p) for p in group]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    end = time.monotonic() + 10
    while any(alive(p) for p in group) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [cmdline(p) for p in group if alive(p)]
