"""Values the start-up checks used to miss, each of which crashed late with a raw traceback (or,
for ``guard.patience=0``, declared a collapse on a healthy run): every one now fails in the
early checks, in-process and before any model loads, with one message naming the field and
what to set instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_lightning.config.early import early_checks
from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.config.sections import check_chat_template, kv_bytes_per_token, output_dir_problem
from rlhf_lightning.models.tiny import TINY_MODEL_DIR
from rlhf_lightning.run.validation import validate
from tests.conftest import ROOT, compose_config

ASSETS = Path(TINY_MODEL_DIR).parent
# The embedded tiny model: 4 layers, 2 KV heads of 128 / 4 = 32 dims, float32, 512 positions.
TINY_KV_PER_TOKEN = 2 * 4 * 2 * 32 * 4

BAD = [
    ("algo.adam_betas=[1.5,0.999]", "algo.adam_betas=[1.5, 0.999]", "each in [0, 1)"),
    ("algo.adam_betas=[0.9,1.0]", "algo.adam_betas=[0.9, 1.0]", "each in [0, 1)"),
    ("algo.adam_eps=-1", "algo.adam_eps=-1.0", "> 0"),
    ("algo.adam_eps=0", "algo.adam_eps=0.0", "> 0"),
    ("logger.flush_every_n_steps=0", "logger.flush_every_n_steps=0", ">= 1"),
    ("checkpoint.monitor_mode=median", "checkpoint.monitor_mode='median'", "max or min"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0", "or -1 (keep all)"),
    ("checkpoint.keep_last=-2", "checkpoint.keep_last=-2", "or -1 (keep all)"),
    ("trainer.precision=bogus", "trainer.precision='bogus'", "bf16-mixed, 32-true"),
    ("model.chat_template='{%if%}'", "model.chat_template='{%if%}'", "does not compile"),
    ("guard.patience=0", "guard.patience=0", ">= 1 steps in a row"),
    ("guard.patience=-3", "guard.patience=-3", ">= 1 steps in a row"),
    ("guard.empty_frac=5", "guard.empty_frac=5.0", "a share in (0, 1]"),
    ("guard.max_nonfinite_steps=-1", "guard.max_nonfinite_steps=-1", ">= 0"),
    ("samples.num=-1", "samples.num=-1", ">= 0"),
    ("samples.every_n_steps=-1", "samples.every_n_steps=-1", ">= 0"),
    ("reward.normalize=bogus", "reward.normalize='bogus'", "one of none, batch"),
    ("algo.warmup_steps=900", "algo.warmup_steps=900", "fewer than trainer.max_steps=900"),
    ("rollout.stop_token_ids=[-1]", "rollout.stop_token_ids=[-1]", "token ids >= 0"),
    ("rollout.stop_token_ids=[393]", "rollout.stop_token_ids=[393]", "below the model's vocab_size=393"),
    ("rollout=vllm rollout.max_model_len=100", "rollout.max_model_len=100", ">= env.max_model_len=512"),
    ("rollout=vllm env.max_model_len=1000", "env.max_model_len=1000", "<= the model's 512 positions"),
    (
        "rollout=vllm rollout.kv_cache_memory_bytes=4096",
        "rollout.kv_cache_memory_bytes=4096",
        f">= {TINY_KV_PER_TOKEN * 512} bytes: one sequence of 512 tokens needs {TINY_KV_PER_TOKEN} bytes",
    ),
    ("output_dir=/proc/rlhf/run", "output_dir='/proc/rlhf/run'", "virtual filesystem"),
]


@pytest.mark.parametrize(("overrides", "field", "allowed"), BAD)
def test_a_bad_value_fails_in_the_early_checks_naming_the_field(overrides, field, allowed):
    cfg = compose_config(overrides.split())
    started = time.process_time()
    with pytest.raises(ConfigError) as err:
        early_checks(cfg)  # what train.py runs before torch, Lightning and transformers
    assert time.process_time() - started < 2.0
    assert f"invalid config: {field}:" in str(err.value) and allowed in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match=f"invalid config: {field.split('=')[0]}="):
        validate(cfg)  # the API's run(cfg) runs them too


@pytest.mark.parametrize(
    "overrides",
    [
        "checkpoint.keep_last=-1",
        "trainer.precision=16",
        "trainer.precision=null",  # Lightning's own default (32-true)
        "trainer.precision=bf16-mixed",
        "algo.warmup_steps=899",
        "rollout=vllm rollout.kv_cache_memory_bytes=1048576",
        "rollout=vllm rollout.max_model_len=512",
        "rollout.stop_token_ids=[392]",
        "env=gem",  # beyond the tiny model's positions, on HF with rotary positions: a warning only
        'model.chat_template="{%for m in messages%}{%generation%}{{m.content}}{%endgeneration%}{%endfor%}"',
    ],
)
def test_good_values_pass(overrides):
    split = [overrides] if overrides.startswith("model.chat_template") else overrides.split()
    validate(compose_config(split))


def test_env_kwargs_of_the_wrong_type_name_the_key_and_the_env():
    with pytest.raises(
        ConfigError,
        match=r"env\.kwargs\.eval_size='abc': an integer \(ArithmeticEnv\.__init__ takes eval_size: int\)",
    ):
        validate(compose_config(["env.kwargs.eval_size=abc"]))
    validate(compose_config(["env.kwargs.eval_size=20"]))
    with pytest.raises(
        ConfigError,
        match=r"env\.kwargs\.exact=3: true or false \(ArithmeticEnv\.__init__ takes exact: bool\)",
    ):
        validate(compose_config(["env.kwargs.exact=3"]))
    with pytest.raises(ConfigError, match=r"env\.kwargs\.path=123: a string \(a number in quotes"):
        validate(compose_config(["env=dataset", "env.kwargs.path=123"]))


def test_a_broken_chat_template_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }}\n")  # no endfor
    with pytest.raises(ConfigError, match=rf"model\.chat_template=.*{bad}.* does not compile: .*endfor"):
        early_checks(compose_config([f"model.chat_template={bad}"]))


def test_the_shipped_chat_templates_compile():
    for template in sorted((ASSETS / "chat_templates").glob("*.jinja")):
        check_chat_template(str(template))
    for tokenizer_config in sorted(ASSETS.glob("*/chat_template.jinja")):
        check_chat_template(tokenizer_config.read_text())


def test_output_dir_creatability_is_checked_without_creating_anything(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert output_dir_problem(str(blocker / "run")) == (
        f"{blocker} is a file, not a directory, so {blocker / 'run'} cannot be created under it"
    )
    assert output_dir_problem(str(blocker)) == f"{blocker} is a file, not a directory"
    fresh = tmp_path / "not" / "yet" / "there"
    assert output_dir_problem(str(fresh)) is None
    early_checks(compose_config([f"output_dir={fresh}"]))
    assert not (tmp_path / "not").exists()  # checked, not created (the run claims it later)
    with pytest.raises(ConfigError, match=r"output_dir=.*a_file.*is a file, not a directory"):
        early_checks(compose_config([f"output_dir={blocker / 'run'}"]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_an_unwritable_output_dir_parent_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert output_dir_problem(str(locked / "run")) == f"{locked} is not writable"
    finally:
        locked.chmod(0o700)


def test_train_py_names_an_output_dir_hydra_could_not_create(tmp_path):
    """Hydra creates ``hydra.run.dir`` before train.py's own checks run: its resolver checks
    ``output_dir`` first, so the command ends with the one-line error, not Hydra's traceback."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = subprocess.run(
        [sys.executable, "train.py", f"output_dir={blocker}/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: invalid config: output_dir='{blocker}/run': {blocker} is a file, not a directory, so "
        f"{blocker}/run cannot be created under it; give a directory that can be created and written"
    )
    assert "Traceback" not in proc.stderr and blocker.read_text() == "x"


def test_kv_bytes_per_token_from_a_config():
    """2 (keys and values) x layers x KV heads x head dim x bytes of the dtype."""
    qwen_like = {
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_size": 896,
    }
    assert kv_bytes_per_token({**qwen_like, "torch_dtype": "bfloat16"}, "auto") == 2 * 24 * 2 * 64 * 2
    assert kv_bytes_per_token({**qwen_like, "head_dim": 128}, "float32") == 2 * 24 * 2 * 128 * 4
    assert kv_bytes_per_token(qwen_like, "auto") is None  # dtype unknown: nothing is checked


@pytest.mark.parametrize(
    ("overrides", "ok"),
    [
        ("checkpoint.monitor=eval/bogus", False),
        ("checkpoint.monitor=eval/pass@4", False),  # one sample per problem: no pass@k
        ("checkpoint.monitor=eval/pass@4 eval.num_samples=6", True),
        ("checkpoint.monitor=eval/pass@6 eval.num_samples=6", True),
        ("checkpoint.monitor=eval/pass@3 eval.num_samples=6", False),
        ("checkpoint.monitor=eval/env_valid_move_sampled eval.info_metrics=[valid_move]", True),
        ("checkpoint.monitor=eval/return_sampled", True),
        ("checkpoint.monitor=rollout/reward_mean", True),  # a training metric: known only at run time
        ("algo=sft checkpoint.monitor=eval/loss", True),  # another family's eval metrics
    ],
)
def test_a_checkpoint_monitor_the_rollout_evaluation_never_logs_is_refused(overrides, ok):
    cfg = compose_config(overrides.split())
    if ok:
        early_checks(cfg)
        return
    with pytest.raises(
        ConfigError,
        match=r"checkpoint\.monitor='eval/.*': a metric this run logs: one of eval/accuracy_greedy",
    ):
        early_checks(cfg)


DROP = object()  # a change that removes the key


def model_dir(tmp_path: Path, **changes: object) -> str:
    """A model directory whose config.json is the tiny model's (4 layers, 2 KV heads of 32 dims,
    float32, 512 positions, rotary, every layer full attention) with ``changes``."""
    config = json.loads((Path(TINY_MODEL_DIR) / "config.json").read_text())
    assert config["max_position_embeddings"] == 512 and config["sliding_window"] is None
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not DROP}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


ROPE_SCALED = [  # (rope fields of config.json, the longest env.max_model_len vLLM accepts)
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}, 2048),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}, 1024),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, 1024),
    ({"rope_scaling": {"rope_type": "linear", "factor": 3}}, 1536),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}, 1024),  # transformers 5
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 512),  # its positions already extended
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, 512),  # not a number: not scaled
    ({"rope_scaling": None}, 512),
]


@pytest.mark.parametrize(("rope", "longest"), ROPE_SCALED)
def test_rope_scaling_extends_the_positions_a_vllm_length_is_checked_against(tmp_path, rope, longest):
    path = model_dir(tmp_path, **rope)
    early_checks(compose_config(["rollout=vllm", f"model.path={path}", f"env.max_model_len={longest}"]))
    with pytest.raises(
        ConfigError, match=rf"env\.max_model_len={longest + 1}: <= the model's {longest} positions"
    ):
        early_checks(
            compose_config(["rollout=vllm", f"model.path={path}", f"env.max_model_len={longest + 1}"])
        )


def test_a_scaled_length_is_explained_in_the_error(tmp_path):
    path = model_dir(
        tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    )
    with pytest.raises(ConfigError) as err:
        early_checks(compose_config(["rollout=vllm", f"model.path={path}", "env.max_model_len=1025"]))
    assert str(err.value) == (
        f"invalid config: env.max_model_len=1025: <= the model's 1024 positions (original_max_position_embeddings"
        f"=256 x rope factor 4.0 in {path}/config.json) with rollout.engine=vllm; lower it"
    )


@pytest.mark.parametrize(
    ("attention", "checked"),
    [
        ({}, True),  # the tiny model: every layer full attention (layer_types all full_attention)
        ({"sliding_window": 128, "use_sliding_window": False}, True),  # Qwen2's window, switched off
        ({"sliding_window": 128, "use_sliding_window": DROP}, False),  # Mistral-style: 128 positions kept
        ({"sliding_window": 128, "use_sliding_window": True}, False),
        ({"layer_types": ["sliding_attention", "full_attention"] * 2}, False),  # hybrid (Gemma-style)
        ({"layer_types": ["linear_attention", "full_attention"] * 2}, False),  # hybrid (Qwen3-Next-style)
        ({"kv_lora_rank": 512}, False),  # multi-head latent attention (DeepSeek-style)
    ],
)
def test_the_kv_cache_size_is_checked_only_for_full_attention_in_every_layer(tmp_path, attention, checked):
    """Keys and values of every layer for every KV head is what a full-attention model caches;
    a sliding-window, hybrid or latent-attention model caches less, and vLLM checks it itself."""
    path = model_dir(tmp_path, **attention)
    cfg = compose_config(["rollout=vllm", f"model.path={path}", "rollout.kv_cache_memory_bytes=4096"])
    if not checked:
        early_checks(cfg)
        return
    with pytest.raises(
        ConfigError, match=rf"rollout\.kv_cache_memory_bytes=4096: >= {TINY_KV_PER_TOKEN * 512} bytes"
    ):
        early_checks(cfg)
