"""The import-layer contract of ``pyproject.toml`` (``[tool.importlinter]``, run by ``make lint``):
kept by the package, and broken by a deliberately added upward import or cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(), reason="import-linter not installed (make install-dev)"
)


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` with the project's contract."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def package_copy(tmp_path: Path) -> Path:
    """The package's Python files and ``pyproject.toml`` under ``tmp_path`` (no assets)."""
    shutil.copytree(
        ROOT / "rlhf_lightning",
        tmp_path / "rlhf_lightning",
        ignore=shutil.ignore_patterns("assets", "__pycache__"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_package_keeps_its_layers():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 kept, 0 broken" in out.stdout  # the layers, rollout's folders, the families, no cycles


@pytest.mark.parametrize(
    ("module", "line", "named"),
    [
        # the cycle this round removed: the schemas importing the algorithm families
        (
            "config/schemas.py",
            "import rlhf_lightning.algorithms\n",
            "rlhf_lightning.config.schemas -> rlhf_lightning.algorithms",
        ),
        # a leaf reaching up to the run
        (
            "config/errors.py",
            "from rlhf_lightning import run\n",
            "rlhf_lightning.config.errors -> rlhf_lightning.run",
        ),
        # a lazy import inside a function counts too (the old rewards <-> harness cycle)
        (
            "rewards/__init__.py",
            "def _late():\n    from rlhf_lightning.rollout.episodes.harness import RolloutHarness\n",
            "rlhf_lightning.rewards -> rlhf_lightning.rollout.episodes.harness",
        ),
        # envs are a leaf under the rollout layer that drives them
        (
            "envs/base.py",
            "def _late():\n    from rlhf_lightning.rollout.episodes.harness import RolloutHarness\n",
            "rlhf_lightning.envs.base -> rlhf_lightning.rollout.episodes.harness",
        ),
        # the records every layer shares sit below them all
        (
            "records/trajectory.py",
            "def _late():\n    from rlhf_lightning.models.policy import Policy\n",
            "rlhf_lightning.records.trajectory -> rlhf_lightning.models.policy",
        ),
        # a type-only import counts too (the old models.policy -> rollout.trajectory one)
        (
            "models/policy.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlhf_lightning.rollout.episodes.harness import RolloutHarness\n",
            "rlhf_lightning.models.policy -> rlhf_lightning.rollout.episodes.harness",
        ),
        # the learner and the rollout layer are siblings: rollouts reach the learner as records
        (
            "learner/learner.py",
            "def _late():\n    from rlhf_lightning.rollout.episodes.harness import RolloutHarness\n",
            "rlhf_lightning.learner.learner -> rlhf_lightning.rollout.episodes.harness",
        ),
        # inside rollout/: an engine reaching up to the episode driver that calls it
        (
            "rollout/engines/hf.py",
            "def _late():\n    from rlhf_lightning.rollout.episodes.harness import RolloutHarness\n",
            "rlhf_lightning.rollout.engines.hf -> rlhf_lightning.rollout.episodes.harness",
        ),
        # the async transports do not know the source that owns their driver
        (
            "rollout/asynchronous/driver.py",
            "def _late():\n    from rlhf_lightning.rollout.source import RolloutSource\n",
            "rlhf_lightning.rollout.asynchronous.driver -> rlhf_lightning.rollout.source",
        ),
        # one algorithm family importing another
        (
            "algorithms/ppo.py",
            "def _late():\n    from rlhf_lightning.algorithms.grpo import GRPOModule\n",
            "rlhf_lightning.algorithms.ppo -> rlhf_lightning.algorithms.grpo",
        ),
        # a cycle inside one package (the old population checks <-> generations one)
        (
            "population/checks.py",
            "def _late():\n    from rlhf_lightning.population.generations import Generations\n",
            "No cycles are allowed in rlhf_lightning.population",
        ),
    ],
)
def test_an_added_upward_import_breaks_the_contract(tmp_path, module, line, named):
    root = package_copy(tmp_path)
    assert lint_imports(root).returncode == 0  # the copy keeps it before the edit
    with open(root / "rlhf_lightning" / module, "a") as f:
        f.write("\n" + line)
    out = lint_imports(root)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and named in out.stdout, out.stdout
