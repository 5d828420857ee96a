"""Offline fixtures: the embedded tiny model, composed configs shrunk for speed."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from rlhf_lightning.config import register_configs
from rlhf_lightning.losses.policy import POLICY_LOSSES
from rlhf_lightning.models.tiny import TINY_MODEL_DIR

torch.set_num_threads(1)
register_configs()

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# Small but real: 4 prompts x 4 samples, 20 eval problems.
FAST = [
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.enable_progress_bar=false",
    "env.kwargs.eval_size=20",
    "eval.batch_size=20",
    "samples.every_n_steps=1",
]


def compose_config(overrides: list[str] | None = None, output_dir: Path | None = None) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides`` (no Hydra run, no chdir)."""
    extra = [f"output_dir={output_dir}"] if output_dir is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=[*(overrides or []), *extra])


@pytest.fixture
def fast_cfg(tmp_path: Path):
    def make(*overrides: str) -> DictConfig:
        return compose_config([*FAST, *overrides], output_dir=tmp_path / "run")

    return make


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(TINY_MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from rlhf_lightning.models.build import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture
def tiny_model(tiny_path):
    from rlhf_lightning.models.build import load_model

    return load_model(tiny_path, dtype="float32", attn_implementation="eager")


def fit_steps(cfg: DictConfig, tmp_path: Path, steps: int = 1, callbacks=(), module_hook=None):
    """Build from ``cfg`` and run ``steps`` optimizer steps without loggers or checkpoints."""
    import lightning as L

    from rlhf_lightning.run import build

    L.seed_everything(cfg.seed)
    module, dm = build(cfg, tmp_path)
    if module_hook is not None:
        module_hook(module)
    trainer = L.Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=dm)
    return module, trainer


def spy_collect(module, seen: list) -> None:
    """Append every rollout result ``module.source.collect`` returns to ``seen``."""
    original = module.source.collect

    def spy(rows, sampling, group_size):
        out = original(rows, sampling, group_size)
        seen.append(out[0])
        return out

    module.source.collect = spy


def trainable_snapshot(module) -> dict:
    """Copies of the policy's trainable parameters, by name."""
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}


def fit_recording(cfg: DictConfig, tmp_path: Path, steps: int):
    """:func:`fit_steps`, keeping each step's rollout result (``module.source.collect``'s) and wall time.

    Returns (module, trainer, results, step seconds)."""
    import time

    import lightning as L

    seen: list = []
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            times.append(time.perf_counter() - self.start)

    module, trainer = fit_steps(
        cfg, tmp_path, steps=steps, callbacks=[Timer()], module_hook=lambda m: spy_collect(m, seen)
    )
    return module, trainer, seen, times


# Under `make test` (pytest -n 2 --dist loadfile) each module runs on one worker, modules handed
# out in collection order: the longest start first, so that neither worker is left alone with a
# long module at the end (the rest keep their order).
LONGEST_FIRST = (  # by their time in a full run on 2026-12-03, longest first
    "tests/test_strategies.py",
    "tests/algorithms/test_async.py",
    "tests/rollout/test_vllm_async.py",
    "tests/rollout/test_vllm_server_faults.py",
    "tests/test_resume.py",
    "tests/algorithms/test_distributed.py",
    "tests/rollout/test_vllm.py",
    "tests/algorithms/test_offline.py",
    "tests/test_export.py",
    "tests/test_config.py",
    "tests/rollout/test_vllm_server.py",
    "tests/envs/test_openenv_runs.py",
    "tests/algorithms/test_eval_ranks.py",
    "tests/population/test_side_by_side.py",
    "tests/test_bench.py",
    "tests/test_train.py",
    "tests/test_results_and_sweeps.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest modules first (:data:`LONGEST_FIRST`); ``@pytest.mark.gpu`` tests are
    skipped, with the reason shown, where CUDA is absent."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- a loss from outside the package
USER_LOSS_MODULE = "my_losses_for_test"  # a user's loss module outside the package (user_loss_module)
USER_LOSS_FILE = textwrap.dedent(
    '''
    """A user's loss: REINFORCE scaled by its own hyper-parameter, which it reports."""
    from dataclasses import dataclass

    import torch

    from rlhf_lightning.losses.policy import POLICY_LOSSES

    SEEN = []  # the scale every call received


    @dataclass(frozen=True)
    class ScaledParams:
        scale: float = 1.0


    @POLICY_LOSSES.register("scaled_pg", params=ScaledParams, uses_ratio=False)
    def scaled_pg(logp, old_logp, advantages, mask, *, scale=1.0):
        SEEN.append(scale)
        adv = advantages[:, None] if advantages.dim() == 1 else advantages
        return -scale * adv * logp, {"scale": torch.tensor(float(scale))}
    '''
)


@pytest.fixture
def user_loss_module(tmp_path, monkeypatch):
    """The user's loss module importable here (its directory: for a subprocess's PYTHONPATH)."""
    (tmp_path / f"{USER_LOSS_MODULE}.py").write_text(USER_LOSS_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(USER_LOSS_MODULE, None)
    for name in ("scaled_pg", f"{USER_LOSS_MODULE}.scaled_pg"):  # the registry is global: leave it as it was
        POLICY_LOSSES._entries.pop(name, None)
        POLICY_LOSSES._meta.pop(name, None)
