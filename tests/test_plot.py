"""Plotting run directories: sparse Lightning CSVs read exactly, panels chosen by the rules,
PNGs written by the API and the CLI, and a one-line error for a dir without metrics.csv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_lightning.plot import (
    panels,
    plot_runs,
    read_metrics,
    run_label,
    trailing_mean,
    unique_labels,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Like Lightning's CSV logger: one row per logging call, empty cells where a key was not logged;
# the eval row at step 0 comes before any training row. actor/kl_clamp_frac is not a KL.
GRPO_CSV = """\
actor/clipfrac,actor/kl,actor/kl_clamp_frac,eval/accuracy_greedy,eval/accuracy_sampled,rollout/reward_mean,step,train/loss
,,,0.25,0.125,,0,
0.5,0.01,0.0,,,0.25,1,1.5
0.25,0.02,0.0,,,0.5,2,-0.5
,,,0.5,0.375,,2,
0.0,0.03,0.0,,,0.75,3,0.25
"""
# No KL column at all; an epoch column as Lightning writes it.
NO_KL_CSV = """\
actor/clipfrac,epoch,eval/accuracy_sampled,rollout/reward_mean,step
,0,0.5,,0
0.125,0,,1.0,1
0.375,0,,0.0,2
"""
SFT_CSV = """\
epoch,eval/loss,step,train/loss
0,2.0,0,
0,,1,1.75
0,1.5,2,1.25
"""


def make_run(root: Path, name: str, csv_text: str, config: str | None = None) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(csv_text)
    if config is not None:
        (run / "config.yaml").write_text(config)
    return run


@pytest.fixture
def grpo_run(tmp_path: Path) -> Path:
    return make_run(tmp_path, "grpo_seed0", GRPO_CSV, "algo:\n  name: grpo\nname: gsm\nseed: 0\n")


@pytest.fixture
def no_kl_run(tmp_path: Path) -> Path:
    return make_run(tmp_path, "cispo_seed1", NO_KL_CSV)


def plot_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rlhf_lightning.plot", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > len(PNG_MAGIC) and path.read_bytes()[:8] == PNG_MAGIC


def test_read_metrics_keeps_logged_cells_only(grpo_run: Path, no_kl_run: Path) -> None:
    assert read_metrics(grpo_run) == {
        "actor/clipfrac": [(1, 0.5), (2, 0.25), (3, 0.0)],
        "actor/kl": [(1, 0.01), (2, 0.02), (3, 0.03)],
        "actor/kl_clamp_frac": [(1, 0.0), (2, 0.0), (3, 0.0)],
        "eval/accuracy_greedy": [(0, 0.25), (2, 0.5)],
        "eval/accuracy_sampled": [(0, 0.125), (2, 0.375)],
        "rollout/reward_mean": [(1, 0.25), (2, 0.5), (3, 0.75)],
        "train/loss": [(1, 1.5), (2, -0.5), (3, 0.25)],
    }
    no_kl = read_metrics(no_kl_run)
    assert "epoch" not in no_kl and "step" not in no_kl
    assert no_kl["rollout/reward_mean"] == [(1, 1.0), (2, 0.0)]
    assert no_kl["eval/accuracy_sampled"] == [(0, 0.5)]


def test_read_metrics_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"must contain metrics\.csv"):
        read_metrics(tmp_path)
    make_run(tmp_path, "nostep", "a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        read_metrics(tmp_path / "nostep")
    make_run(tmp_path, "text", "step,a\n0,oops\n")
    with pytest.raises(ValueError, match="line 2: a='oops'"):
        read_metrics(tmp_path / "text")


def test_panels_order_and_selection(grpo_run: Path, no_kl_run: Path, tmp_path: Path) -> None:
    grpo, no_kl = read_metrics(grpo_run), read_metrics(no_kl_run)
    sft = read_metrics(make_run(tmp_path, "sft", SFT_CSV))
    # Online runs: their train/loss is not a panel; a run with no KL gets no KL panel.
    assert panels([grpo]) == ["rollout/reward_mean", "eval/accuracy_sampled", "actor/kl", "actor/clipfrac"]
    assert panels([no_kl]) == ["rollout/reward_mean", "eval/accuracy_sampled", "actor/clipfrac"]
    # One run with data is enough for a panel.
    assert panels([no_kl, grpo]) == panels([grpo])
    # Offline runs get their losses; next to an online run they fill the panels left.
    assert panels([sft]) == ["eval/loss", "train/loss"]
    assert panels([no_kl, sft]) == [
        "rollout/reward_mean",
        "eval/accuracy_sampled",
        "actor/clipfrac",
        "eval/loss",
    ]
    assert panels([grpo, sft]) == panels([grpo])  # at most 4


def test_panels_rules_on_columns() -> None:
    p = [(0, 1.0)]
    # Entropy is preferred to clip fraction; greedy alone keys the accuracy panel.
    assert panels([{"actor/entropy": p, "actor/clipfrac": p, "eval/accuracy_greedy": p}]) == [
        "eval/accuracy_greedy",
        "actor/entropy",
    ]
    # KL: actor/kl first, then kl/*, then other actor/kl*; a *_frac column is never the KL.
    assert panels([{"kl/ref": p, "actor/kl": p}]) == ["actor/kl"]
    assert panels([{"actor/kl_k3": p, "kl/ref": p}]) == ["kl/ref"]
    assert panels([{"actor/kl_clamp_frac": p}]) == []
    # A column in the header but never logged does not count.
    assert panels([{"rollout/reward_mean": [], "actor/clipfrac": p}]) == ["actor/clipfrac"]
    assert panels([]) == []


def test_trailing_mean() -> None:
    assert trailing_mean([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert trailing_mean([1.0, 3.0], 10) == [1.0, 2.0]
    assert trailing_mean([1.0, 3.0, -2.0], 1) == [1.0, 3.0, -2.0]
    assert trailing_mean([], 5) == []


def test_run_labels(grpo_run: Path, no_kl_run: Path, tmp_path: Path) -> None:
    assert run_label(grpo_run) == "gsm (grpo, seed 0)"
    assert run_label(no_kl_run) == "cispo_seed1"  # no config.yaml
    other = make_run(tmp_path / "other", "grpo_seed0", GRPO_CSV, (grpo_run / "config.yaml").read_text())
    labels = unique_labels([run_label(grpo_run), run_label(other)], [grpo_run, other])
    assert labels[0] != labels[1]
    assert labels[1].endswith("[other/grpo_seed0]")
    assert unique_labels(["a", "b"], [grpo_run, other]) == ["a", "b"]


def test_plot_runs_writes_png(grpo_run: Path, no_kl_run: Path, tmp_path: Path) -> None:
    one = plot_runs([grpo_run], tmp_path / "figs" / "nested" / "one.png", title="one run", smooth=2)
    assert one == tmp_path / "figs" / "nested" / "one.png"
    assert is_png(one)
    two = plot_runs([grpo_run, no_kl_run], tmp_path / "two.png")
    assert is_png(two)


def test_plot_runs_errors(grpo_run: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"must contain metrics\.csv") as err:
        plot_runs([grpo_run, empty], tmp_path / "x.png")
    assert str(empty) in str(err.value)
    perf = make_run(tmp_path, "perf_only", "perf/step_s,step\n0.5,1\n")
    with pytest.raises(ValueError, match=r"columns found: \['perf/step_s'\]"):
        plot_runs([perf], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_cli_one_run_default_out(grpo_run: Path, tmp_path: Path) -> None:
    proc = plot_cli(str(grpo_run), "--smooth", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(grpo_run / "plots.png")
    assert is_png(grpo_run / "plots.png")


def test_cli_compare_with_out(grpo_run: Path, no_kl_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp" / "runs.png"
    proc = plot_cli(
        str(grpo_run), str(no_kl_run), "--out", str(out), "--title", "GRPO vs CISPO", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert is_png(out)
    assert not (grpo_run / "plots.png").exists() and not (tmp_path / "compare.png").exists()


def test_cli_default_compare_png(grpo_run: Path, no_kl_run: Path, tmp_path: Path) -> None:
    proc = plot_cli(str(grpo_run), str(no_kl_run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert is_png(tmp_path / "compare.png")


def test_cli_error_without_metrics(grpo_run: Path, tmp_path: Path) -> None:
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    proc = plot_cli(str(grpo_run), str(empty), cwd=tmp_path)
    assert proc.returncode != 0
    assert str(empty) in proc.stderr
    assert proc.stderr.startswith("error: ") and "must contain metrics.csv" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "compare.png").exists()


def test_plotting_leaves_the_matplotlib_backend_alone(tmp_path):
    """A run inside a notebook draws plots.png without switching the notebook off its inline backend."""
    import matplotlib

    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.csv").write_text("step,rollout/reward_mean\n1,0.1\n2,0.3\n")
    before = matplotlib.get_backend()
    matplotlib.use("svg")  # any non-Agg backend stands in for a notebook's
    try:
        plot_runs([run], tmp_path / "p.png")
        assert matplotlib.get_backend().lower() == "svg"
    finally:
        matplotlib.use(before)
