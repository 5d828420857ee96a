"""SFT and DPO on the shipped data; references; chaining SFT -> DPO -> GRPO through adapters."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.data.offline import encode_conversation
from rlhf_lightning.rollout.episodes.harness import ChatFormatter
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config, fit_steps

QUICK = [o for o in FAST if not o.startswith("algo.")]


def test_sft_loss_only_on_assistant_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    fmt = ChatFormatter(tok, system_prompt="Answer with a number.")
    msgs = [
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 plus 3?"},
        {"role": "assistant", "content": "6"},
    ]
    t = encode_conversation(msgs, fmt)
    action = [i for i, k in enumerate(t.action_turn) if k >= 0]
    four = tok("4", add_special_tokens=False).input_ids + [tok.eos_token_id]
    six = tok("6", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert [t.token_ids[i] for i in action] == four + six
    assert [t.action_turn[i] for i in action] == [0] * len(four) + [1] * len(six)
    # the ids are exactly the chat template's rendering of the conversation
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Answer with a number."}, *msgs], tokenize=False
    )
    assert tok.decode(t.token_ids) + "\n" == rendered


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_sft_lowers_the_loss_on_the_shipped_data(tmp_path, tiny_tokenizer, packing):
    # From a freshly initialised tiny model: the shipped checkpoint was already SFT-ed on this task.
    from rlhf_lightning.models.tiny import build_tiny_model

    torch.manual_seed(0)
    fresh = tmp_path / "fresh"
    build_tiny_model(len(tiny_tokenizer)).save_pretrained(fresh)
    tiny_tokenizer.save_pretrained(fresh)
    cfg = compose_config(
        [
            *QUICK,
            "algo=sft",
            "model=local",
            f"model.path={fresh}",
            "model.finetune=full",
            f"algo.packing={packing}",
            "algo.batch_size=8",
            "algo.lr=3e-3",
            "trainer.max_steps=12",
            "trainer.val_check_interval=12",
            "algo.env_eval=false",
        ],
        output_dir=tmp_path / "run",
    )
    result = run(cfg)
    import csv

    losses = [
        float(r["eval/loss"])
        for r in csv.DictReader((result.output_dir / "metrics.csv").open())
        if r.get("eval/loss")
    ]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.02


@pytest.mark.slow
def test_dpo_learns_the_shipped_preferences(tmp_path):
    cfg = compose_config(
        [
            *QUICK,
            "algo=dpo",
            "algo.batch_size=32",
            "trainer.max_steps=150",
            "trainer.val_check_interval=150",
            "algo.env_eval=false",
        ],
        output_dir=tmp_path / "run",
    )
    result = run(cfg)
    import csv

    rows = list(csv.DictReader((result.output_dir / "metrics.csv").open()))
    train = [r for r in rows if r.get("rewards/accuracy")]
    late = train[-25:]
    # rewards/accuracy on the training pairs (the criterion), over the last 25 updates
    assert sum(float(r["rewards/accuracy"]) for r in late) / len(late) > 0.8
    early = train[:25]
    margin = [sum(float(r["rewards/margin"]) for r in rs) / len(rs) for rs in (early, late)]
    assert margin[1] > margin[0] + 0.3
    # held-out pairs: the tiny model's arithmetic limits generalisation (~0.8 after 150-300 updates)
    evals = [r for r in rows if r.get("eval/rewards_accuracy")]
    first, last = evals[0], evals[-1]
    assert float(last["eval/rewards_accuracy"]) > 0.7
    assert float(last["eval/rewards_margin"]) > float(first["eval/rewards_margin"]) + 0.3


def adapters_equal(policy, a: str, b: str) -> bool:
    params = dict(policy.named_parameters())
    pairs = [(p, params[n.replace(f".{a}.", f".{b}.")]) for n, p in params.items() if f".{a}." in n]
    return bool(pairs) and all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.slow
def test_chaining_sft_dpo_grpo_through_adapter_path(tmp_path):
    stages = [
        ("sft", ["algo=sft", "algo.batch_size=8", "algo.env_eval=false", "algo.lr=3e-3"]),
        ("dpo", ["algo=dpo", "algo.batch_size=8", "algo.env_eval=false", "algo.lr=3e-3"]),
        ("grpo", ["algo=grpo", "algo.prompts_per_step=4", "algo.group_size=4", "algo.lr=1e-2"]),
    ]
    previous = None
    for name, extra in stages:
        overrides = [
            *QUICK,
            *extra,
            "trainer.max_steps=2",
            "checkpoint.every_n_steps=2",
            "eval.before_training=false",
        ]
        if previous is not None:
            overrides.append(f"model.adapter_path={previous}")
        cfg = compose_config(overrides, output_dir=tmp_path / name)
        starts = []

        def check_start(module, starts=starts, previous=previous):
            pol = module.policy
            if previous is None:
                starts.append(pol.reference_adapter is None)
                return
            # the actor is the saved one, and the reference is a copy of it
            saved = load_file(str(previous / "actor" / "adapter_model.safetensors"))
            params = dict(pol.named_parameters())
            for key, value in saved.items():
                name = "model." + key.replace(".weight", ".actor.weight")
                starts.append(torch.equal(params[name].detach(), value))
            starts.append(len(saved) > 0 and adapters_equal(pol, "actor", "reference"))

        fit_steps(cfg, tmp_path, steps=1, module_hook=check_start)
        assert all(starts), name
        result = run(cfg)
        previous = result.output_dir / "checkpoints" / "adapters" / "last"
        assert (previous / "actor" / "adapter_config.json").is_file()
        if name != "sft":
            assert (previous / "reference" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_lora_config_mismatch_shows_both(tmp_path):
    cfg = compose_config(
        [
            *QUICK,
            "algo=sft",
            "algo.batch_size=8",
            "algo.env_eval=false",
            "trainer.max_steps=1",
            "eval.before_training=false",
            "eval.at_end=false",
            "checkpoint.every_n_steps=1",
        ],
        output_dir=tmp_path / "sft",
    )
    saved = run(cfg).output_dir / "checkpoints" / "adapters" / "last"
    bad = compose_config(
        [*QUICK, "algo=grpo", f"model.adapter_path={saved}", "model.lora.r=4"], output_dir=tmp_path / "g"
    )
    with pytest.raises(ConfigError, match=r"model\.lora=.*r=4.*trained with r=16"):
        fit_steps(bad, tmp_path, steps=1)
