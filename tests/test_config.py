"""Every YAML composes; every invalid value fails at start-up with field, value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.models.build import load_tokenizer
from rlhf_lightning.models.tiny import build_tokenizer
from rlhf_lightning.run.validation import validate
from tests.conftest import CONF, compose_config

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def group_options():
    for group in GROUPS:
        for yaml in sorted((CONF / group).glob("*.yaml")):
            yield group, yaml.stem


@pytest.mark.parametrize(("group", "option"), list(group_options()))
def test_every_yaml_composes_and_resolves(group, option, tiny_path):
    overrides = [f"{group}={option}"]
    if group == "family" and option != "none":  # a family agrees with the algorithm's module
        overrides.append(f"algo={option}")
    if (group, option) == ("model", "local"):
        overrides.append(f"model.path={tiny_path}")
    if (group, option) == ("env", "custom"):  # its one required value
        overrides.append("env._target_=rlhf_lightning.envs.arithmetic.ArithmeticEnv")
    if (group, option) == ("env", "dataset"):  # its one required value
        overrides.append("env.kwargs.path=openai/gsm8k")
    if (group, option) == ("env", "agent"):  # its two required values
        overrides += ["env.kwargs.agent=examples.agent_calc.agent:solve", "env.kwargs.data.path=tasks.jsonl"]
    if (group, option) == ("env", "verifiers"):  # its one required value
        overrides.append("env.kwargs.id=my_env")
    if (group, option) == ("algo", "distill"):  # its one required value
        overrides.append("algo.teacher.path=/models/teacher")
    if (group, option) == ("reward", "function"):
        overrides.append("reward.fn=math.sqrt")
    if (group, option) == ("reward", "model"):
        overrides.append(f"reward.model_path={tiny_path}")
    cfg = compose_config(overrides, output_dir=Path("/tmp/unused"))
    container = OmegaConf.to_container(cfg, resolve=True)
    assert container["algo"]["name"] and container["model"]["path"]
    if group == "model" and option.startswith("qwen"):
        assert container["model"]["path"].startswith("Qwen/")
    zero3 = (group, option) == ("strategy", "deepspeed_zero3")
    unusable = zero3 or (group == "strategy" and option.startswith("deepspeed_") and not deepspeed_usable())
    refusal = r"DeepSpeed needs CUDA|pip install 'deepspeed|deepspeed_zero2, or"
    if unusable:  # composes anywhere; refused at start-up (ZeRO-3 anywhere, ZeRO-2 without CUDA/deepspeed)
        with pytest.raises(ConfigError, match=refusal):
            validate(cfg)
    elif group not in ("model", "experiment"):  # Hub models are validated when reachable
        validate(cfg)


def deepspeed_usable() -> bool:
    from rlhf_lightning.runtime.deepspeed import deepspeed_missing

    return torch.cuda.is_available() and deepspeed_missing() is None


def test_default_model_is_the_embedded_checkpoint(tiny_path):
    cfg = compose_config()
    assert (
        cfg.model.path == tiny_path and cfg.algo.name == "grpo" and cfg.env._target_.endswith("ArithmeticEnv")
    )


TUNED = sorted((p.parent.name, p.stem) for p in (CONF / "tuned").glob("*/*.yaml"))


@pytest.mark.parametrize(("model", "family"), TUNED)
def test_every_tuned_config_composes_for_its_model_and_family(model, family):
    """conf/tuned/<model>/<family>.yaml applies exactly when both are chosen (the family's base
    option, algo=<family>, sets it)."""
    assert (CONF / "family" / f"{family}.yaml").is_file() and (CONF / "model" / f"{model}.yaml").is_file()
    cfg = compose_config([f"model={model}", f"algo={family}"], output_dir=Path("/tmp/unused"))
    validate(cfg)
    assert (cfg.family, cfg.tuned, cfg.model.name) == (family, f"{model}/{family}", model)


def test_the_tiny_models_settings_do_not_leak_into_real_models():
    """The embedded models' measured settings live in conf/tuned/; a real model gets the
    algorithm's own defaults, and the command line still wins over both."""
    tiny, real = compose_config(), compose_config(["model=qwen0.5b"])
    assert (tiny.algo.lr, tiny.algo.prompts_per_step, tiny.trainer.max_steps) == (1e-3, 16, 900)
    assert (real.algo.lr, real.algo.prompts_per_step, real.trainer.max_steps) == (1e-5, 32, 600)
    assert compose_config(["algo.lr=3e-4"]).algo.lr == 3e-4
    ppo = compose_config(["algo=ppo", "model=qwen0.5b"])
    assert (ppo.algo.lr, ppo.algo.lr_critic) == (1e-5, None)
    assert (
        compose_config(["algo=sft"]).algo.lr == 1e-3
        and compose_config(["algo=sft", "model=qwen0.5b"]).algo.lr == 1e-4
    )
    chat = compose_config(["experiment=guess_number", "algo=ppo"])
    assert (chat.algo.lr, chat.algo.lr_critic, chat.algo.prompts_per_step) == (2e-3, 2e-3, 8)


def test_cispo_is_the_grpo_module_with_the_cispo_loss():
    cfg = compose_config(["algo=cispo"])
    validate(cfg)  # clip bounds left at auto become the cispo loss's own
    assert (cfg.algo.module, cfg.algo.loss.name, cfg.algo.clip_low, cfg.algo.clip_high) == (
        "grpo",
        "cispo",
        None,
        4.0,
    )
    assert cfg.algo.group_size == compose_config().algo.group_size


def test_unknown_group_option_lists_choices():
    with pytest.raises(MissingConfigException, match=r"(?s)Available options.*cispo.*grpo"):
        compose_config(["algo=grpoo"])


def test_typos_and_wrong_types_fail_at_composition():
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["algo.grup_size=4"])
    assert "Key 'grup_size' not in 'GRPOConfig'" in str(err.value.__cause__)
    with pytest.raises(ConfigError, match=r"algo.grup_size=4: not a field of algo; valid: .*group_size"):
        validate(compose_config(["+algo.grup_size=4"]))
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(["algo.group_size=many"])
    assert isinstance(err.value.__cause__, ValidationError)


BAD = [
    ("algo.group_size=1", "algo.group_size=1", "at least 2"),
    (
        "algo.prompts_per_step=4 algo.group_size=4 algo.mini_batch_size=5",
        "algo.mini_batch_size=5",
        "divisor of the rollout batch",
    ),
    (
        "algo.mini_batch_size=8 algo.micro_batch_size=3",
        "algo.micro_batch_size=3",
        "divisor of the mini-batch",
    ),
    ("algo.lr=0", "algo.lr=0.0", "learning rate > 0"),
    ("algo.lr=-1e-5", "algo.lr=-1e-05", "learning rate > 0"),
    ("algo.clip_low=1.5", "algo.clip_low=1.5", "[0, 1)"),
    ("algo.clip_high=-0.1", "algo.clip_high=-0.1", "offset > 0"),
    ("algo.clip_ratio_c=0.5", "algo.clip_ratio_c=0.5", "> 1"),
    ("algo.update_epochs=0", "algo.update_epochs=0", "at least 1"),
    ("algo.chunk_rows=0", "algo.chunk_rows=0", "positive int"),
    (
        "algo.loss=ppo",
        "algo.loss='ppo'",
        "one of cispo, dppo_kl, dppo_tv, gmpo, gspo, kl_cov, ppo_clip, reinforce, sapo",
    ),
    ("algo.beta=-0.1", "algo.beta=-0.1", ">= 0"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0", "positive number of tokens"),
    ("rollout.temperature=0", "rollout.temperature=0.0", "> 0"),
    ("rollout.top_p=1.5", "rollout.top_p=1.5", "(0, 1]"),
    ("model.path=/no/such/model", "model.path='/no/such/model'", "no such directory"),
    ("model.dtype=fp8", "model.dtype='fp8'", "one of auto"),
    ("env.max_model_len=4", "env.max_model_len=4", "more than rollout.max_new_tokens"),
    # accepted and then ignored, or crashing mid-run, before start-up checks existed (issue 11)
    ("algo.advantage=gae", "algo.advantage='gae'", "gae needs a critic: use algo=ppo"),
    ("algo.loss=reinforce algo.update_epochs=2", "algo.update_epochs=2", "no importance ratio"),
    (
        "algo=rloo algo.mini_batch_size=64",
        "algo.mini_batch_size=64",
        "off-policy without an importance ratio",
    ),
    ("trainer.max_steps=-1", "trainer.max_steps=-1", "a run needs an end"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0", "a positive number of training steps"),
    ("trainer.val_check_interval=1.5", "trainer.val_check_interval=1.5", "a fraction of an epoch in (0, 1]"),
    ("model.lora.dropout=0.1", "model.lora.dropout=0.1", "LoRA dropout applies to SFT and DPO only"),
    ("algo.use_liger_loss=true algo.mask_truncated=true", "algo.use_liger_loss=True", "mask_truncated"),
    (
        "algo.use_liger_loss=true algo.offpolicy_seq_threshold=1.0",
        "algo.use_liger_loss=True",
        "off-policy masks",
    ),
    ("algo=ppo algo.use_liger_loss=true", "algo.use_liger_loss=True", "no critic or entropy term"),
    ("rollout.repetition_penalty=0", "rollout.repetition_penalty=0.0", "> 0"),
    ("rollout.min_p=1.0", "rollout.min_p=1.0", "in [0, 1)"),
]


@pytest.mark.parametrize(("overrides", "field", "allowed"), BAD)
def test_invalid_values_name_field_value_and_allowed(overrides, field, allowed):
    cfg = compose_config(overrides.split())
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert f"invalid config: {field}:" in str(err.value)
    assert allowed in str(err.value)


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        ("model.finetune=qlora", "model.finetune", "[lora, full]"),
        ("algo=ppo algo.turn_value_reduction=max", "algo.turn_value_reduction", "[state, mean, final_value]"),
        (
            "algo=ppo algo.importance_sampling_level=row",
            "algo.importance_sampling_level",
            "[token, turn, trajectory, auto]",
        ),
        ("algo.is_level=token", "algo.is_level", "[sequence, turn]"),
        ("algo.loss_agg_mode=sum", "algo.loss_agg_mode", "[token_mean, seq_mean_token_mean,"),
        ("rollout.partial_versions=latest", "rollout.partial_versions", "[newest, planned]"),
        ("env.step_workers=pool", "env.step_workers", "[process, thread]"),
        ("algo=dpo algo.loss_type=hinge", "algo.loss_type", "[sigmoid, ipo]"),
    ],
)
def test_a_closed_choice_is_checked_when_the_config_is_composed(overrides, key, allowed):
    """Closed choices are enums of the schema: a bad value fails in composition, naming the
    field, the value and the allowed ones."""
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(overrides.split())
    bad = overrides.split()[-1].split("=")[1]
    message = f"{err.value} {err.value.__cause__}"
    assert key in message and f"Invalid value '{bad}'" in message and allowed in message, message


def test_closed_choices_compare_as_their_strings_and_log_as_them():
    from omegaconf import OmegaConf

    cfg = compose_config(["algo=ppo"])
    hp = OmegaConf.to_object(cfg.algo)
    assert hp.kl_mode == "loss" and f"{hp.turn_value_reduction}" == "state"
    logged = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    assert type(logged["algo"]["kl_mode"]) is str and type(logged["model"]["finetune"]) is str


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algo=ppo", "algo.loss=cispo"], "loss"),  # PPO's objective is PPO-clip (or GSPO's pooled ratio)
        (["algo=ppo", "algo.dynamic_sampling=true"], "dynamic_sampling"),
        (["algo=ppo", "algo.skip_zero_advantage=true"], "skip_zero_advantage"),
        (["algo=sft", "algo.group_size=4"], "group_size"),
    ],
)
def test_fields_another_family_owns_are_not_accepted(overrides, key):
    with pytest.raises(ConfigCompositionException) as err:
        compose_config(overrides)
    assert f"Key '{key}' not in" in str(err.value.__cause__)


def test_schemas_are_not_offered_as_options():
    from hydra.errors import MissingConfigException

    for group, schema in (("algo", "grpo_schema"), ("model", "model_schema"), ("rollout", "vllm_schema")):
        with pytest.raises(MissingConfigException):
            compose_config([f"{group}={schema}"])


def test_lora_dropout_is_active_for_offline_training(tiny_model):
    from rlhf_lightning.models.build import build_policy

    policy = build_policy(tiny_model, lora_dropout=0.5)
    policy.train()
    with torch.no_grad():  # LoRA's B starts at 0: give the adapter an effect dropout can change
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(3, 200, (2, 12))
    attn, action = torch.ones_like(ids), torch.ones(2, 11, dtype=torch.bool)
    torch.manual_seed(0)
    a, _ = policy.token_logprobs(ids, attn, action)
    b, _ = policy.token_logprobs(ids, attn, action)
    assert not torch.equal(a, b)  # LoRA dropout is on in training mode
    ref1, _ = policy.token_logprobs(ids, attn, action, reference=True)
    ref2, _ = policy.token_logprobs(ids, attn, action, reference=True)
    assert torch.equal(ref1, ref2)  # the base's own dropout stays off


def test_model_dir_without_config_json(tmp_path):
    cfg = compose_config([f"model.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"no config\.json"):
        validate(cfg)


def test_run_rejects_bad_values_before_loading_anything(tmp_path):
    from rlhf_lightning.run import run

    cfg = compose_config(["algo.group_size=1", "model.path=/no/such/model"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"model\.path"):  # the first invalid field, before any load
        run(cfg)
    assert not (tmp_path / "metrics.csv").exists()


def test_tokenizer_without_pad_token_or_chat_template(tmp_path):
    tok = build_tokenizer(["hello world 123"], vocab_size=300)
    tok.pad_token = None
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"model.pad_token=None: .*has no pad token; set model.pad_token"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"no chat template; set model.chat_template.*env.apply_chat_template=false"
    ):
        load_tokenizer(str(tmp_path), pad_token="<|endoftext|>")
    assert (
        load_tokenizer(str(tmp_path), pad_token="<|endoftext|>", need_chat_template=False).pad_token_id == 0
    )


def test_hub_id_is_not_treated_as_a_missing_directory():
    cfg = compose_config(["model=qwen0.5b"])
    validate(cfg)  # a Hub id passes validation; loading it needs the Hub or a local copy


def test_model_dir_without_tokenizer_files_names_the_directory(tmp_path, tiny_path):
    (tmp_path / "config.json").write_text((Path(tiny_path) / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"model\.path=.*no tokenizer files.*model\.tokenizer_path="):
        load_tokenizer(str(tmp_path))
    # a config alone makes transformers build a 1-token tokenizer (generate then hits an IndexError)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2Tokenizer"}')
    with pytest.raises(ConfigError, match=r"only 1 tokens for a model with 393 embeddings.*tokenizer_path="):
        load_tokenizer(str(tmp_path))


def test_ckpt_path_must_be_a_readable_lightning_checkpoint(tmp_path):
    good = tmp_path / "step_000002.ckpt"
    torch.save({"pytorch-lightning_version": "2.5.0", "state_dict": {"w": torch.ones(64)}}, good)
    validate(compose_config([f"ckpt_path={good}"]))
    truncated = tmp_path / "last.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    resume_good = re.escape(f"ckpt_path={good}")
    with pytest.raises(ConfigError, match=rf"last\.ckpt': not a zip archive.*truncated.*{resume_good}"):
        validate(compose_config([f"ckpt_path={truncated}"]))
    tensor_file = tmp_path / "weights.ckpt"
    torch.save({"w": torch.ones(2)}, tensor_file)  # torch.load would advise weights_only=False
    with pytest.raises(ConfigError, match=r"not a Lightning checkpoint"):
        validate(compose_config([f"ckpt_path={tensor_file}"]))
    good.unlink()
    with pytest.raises(ConfigError, match=r"no readable \.ckpt next to it"):
        validate(compose_config([f"ckpt_path={truncated}"]))


def test_env_target_is_checked_to_be_an_env_class_before_it_is_called(monkeypatch):
    import os

    from rlhf_lightning.envs.factory import env_factory

    calls = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    with pytest.raises(ConfigError, match=r"env\._target_='os\.system': the dotted path of a TextEnv class"):
        validate(compose_config(["env=custom", "env._target_=os.system"]))
    with pytest.raises(ConfigError, match=r"env\._target_='os\.system'"):
        env_factory("os.system", {"command": "true"})
    assert calls == []
    with pytest.raises(ConfigError, match=r"OrderedDict lacks reset and step"):
        env_factory("collections.OrderedDict", {})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=local"], "model.path='???': required and not set: pass model.path=/path/to/model"),
        (["env=custom"], "env._target_='???': required and not set: pass env._target_=my_pkg.envs.MyEnv"),
    ],
)
def test_required_fields_left_unset_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides))
    assert str(err.value) == f"invalid config: {message} on the command line"
