"""``strategy=deepspeed_zero2|deepspeed_zero3``: composing anywhere, refusing at start-up what
cannot run (no CUDA, no deepspeed, ZeRO-3, several processes, a population, ...), and the parts
of the strategy that run without a GPU. deepspeed is not installed here (nor needed)."""

from __future__ import annotations

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.deepspeed_checks import process_count, validate_deepspeed
from rlhf_lightning.run.validation import validate
from rlhf_lightning.runtime.deepspeed import before_backward, deepspeed_config, deepspeed_missing
from rlhf_lightning.runtime.strategies import build_strategy
from tests.conftest import compose_config

ZERO = ["deepspeed_zero2", "deepspeed_zero3"]


@pytest.mark.parametrize("name", ZERO)
def test_deepspeed_strategies_compose_on_any_machine(name):
    cfg = compose_config([f"strategy={name}", "strategy.offload_optimizer=true"])
    assert (cfg.strategy.name, cfg.strategy.offload_optimizer, cfg.strategy.timeout_s) == (name, True, 1800)


def test_deepspeed_config_keeps_the_projects_optimizer_accumulation_and_clipping():
    two = deepspeed_config(2, grad_clip=0.5, offload_optimizer=False)
    assert two["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in two["zero_optimization"]
    # the learner runs several backward passes per step: DeepSpeed must not count them itself
    assert two["managed_gradient_accumulation"] is False
    # Lightning's DeepSpeedStrategy refuses a config that sets it (it sets it from the trainer)
    assert "gradient_accumulation_steps" not in two
    assert two["gradient_clipping"] == 0.5 and two["zero_allow_untested_optimizer"] is True
    three = deepspeed_config(3, grad_clip=None, offload_optimizer=True)
    assert three["zero_optimization"]["stage"] == 3 and three["gradient_clipping"] == 0.0
    assert three["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert three["zero_force_ds_cpu_optimizer"] is False  # torch's AdamW steps on the CPU


def test_no_cuda_is_refused_at_start_up_naming_why(monkeypatch):
    monkeypatch.setattr("rlhf_lightning.run.deepspeed_checks.cuda_devices", lambda: 0)
    with pytest.raises(
        ConfigError, match=r"strategy.name='deepspeed_zero2'.*DeepSpeed needs CUDA.*strategy=ddp"
    ):
        validate(compose_config(["strategy=deepspeed_zero2"]))
    with pytest.raises(ConfigError, match=r"trainer.accelerator='cpu'.*DeepSpeed runs on CUDA only"):
        validate(compose_config(["strategy=deepspeed_zero2", "trainer.accelerator=cpu"]))


@pytest.mark.parametrize("cuda", [0, 1])
def test_zero3_is_refused_on_any_machine_naming_why(cuda, monkeypatch):
    """Under ZeRO-3 the policy reads weights outside a module's forward (the lm head, adapter
    exports), where DeepSpeed has released them: seen on the CPU, the exports came out empty."""
    monkeypatch.setattr("rlhf_lightning.run.deepspeed_checks.cuda_devices", lambda: cuda)
    with pytest.raises(
        ConfigError, match=r"strategy.name='deepspeed_zero3': deepspeed_zero2, or strategy=fsdp.*released"
    ):
        validate(compose_config(["strategy=deepspeed_zero3"]))


def test_the_refusal_comes_before_any_model_loads(tmp_path, monkeypatch):
    import rlhf_lightning.run.fit as fit

    monkeypatch.setattr("rlhf_lightning.run.deepspeed_checks.cuda_devices", lambda: 0)

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the strategy was refused")

    monkeypatch.setattr(fit, "build", no_build)
    cfg = compose_config(["strategy=deepspeed_zero2"], output_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="DeepSpeed needs CUDA"):
        fit.run(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run directory was claimed


def test_a_cuda_machine_without_deepspeed_is_told_to_install_it(monkeypatch):
    import importlib.metadata

    version = importlib.metadata.version

    def without_deepspeed(name: str) -> str:  # deepspeed absent, whether or not it is installed
        if name == "deepspeed":
            raise importlib.metadata.PackageNotFoundError(name)
        return version(name)

    monkeypatch.setattr(importlib.metadata, "version", without_deepspeed)
    assert deepspeed_missing() is not None
    monkeypatch.setattr("rlhf_lightning.run.deepspeed_checks.cuda_devices", lambda: 1)
    with pytest.raises(
        ConfigError, match=r"strategy.name='deepspeed_zero2'.*pip install 'deepspeed>=0.19.8'"
    ):
        validate(compose_config(["strategy=deepspeed_zero2"]))
    with pytest.raises(ConfigError, match=r"strategy.name='deepspeed_zero2'.*pip install 'deepspeed"):
        build_strategy(compose_config(["strategy=deepspeed_zero2"]).strategy, grad_clip=1.0)


def test_deepspeed_versions():
    assert "not installed" in str(deepspeed_missing(None))
    assert "0.18.2 is too old" in str(deepspeed_missing("0.18.2"))
    assert deepspeed_missing("0.19.8") is None and deepspeed_missing("0.20.1+cu128") is None


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["population.size=2"], r"population.size=2: 1 with strategy=deepspeed_zero2: a population trains "
         r"one optimizer per member, and DeepSpeed takes exactly one optimizer"),
        (["algo=ppo", "algo.share_grad_clip=false"], r"algo.share_grad_clip=False: true with .*one global norm"),
        (["trainer.devices=2"], r"trainer.devices=2: 1 \(and trainer.num_nodes=1\)"),
        (["trainer.num_nodes=2", "trainer.devices=1"], r"trainer.devices=1: 1 .*2 processes"),
        (["model.finetune=full"], r"model.finetune='full': lora with strategy=deepspeed_zero2"),
        (["model.quantization=4bit"], r"model.quantization='4bit': null with strategy=deepspeed_zero2"),
        (["rollout=vllm"], r"rollout.engine='vllm': hf with strategy=deepspeed_zero2"),
        (["trainer.precision=16-mixed"], r"trainer.precision='16-mixed': 32-true, bf16-mixed or bf16-true"),
        (["ckpt_path=/tmp/x.ckpt"], r"ckpt_path='/tmp/x.ckpt': unset with .*model.adapter_path="),
        (["resume=true"], r"resume=True: unset with strategy=deepspeed_zero2"),
    ],
)  # fmt: skip
def test_what_deepspeed_cannot_do_is_refused_at_start_up(overrides, refused):
    cfg = compose_config(["strategy=deepspeed_zero2", *overrides])
    with pytest.raises(ConfigError, match=refused):
        validate_deepspeed(cfg, visible=1, missing=None)


def test_zero2_keeps_the_fused_liger_loss():
    cfg = compose_config(["strategy=deepspeed_zero2", "algo.use_liger_loss=true"])
    validate_deepspeed(cfg, visible=1, missing=None)


@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo"])
def test_one_cuda_process_with_lora_passes(algo):
    """PPO's critic is a second parameter group of the one AdamW, not a second optimizer."""
    validate_deepspeed(compose_config(["strategy=deepspeed_zero2", f"algo={algo}"]), visible=1, missing=None)
    cfg = compose_config(["strategy=deepspeed_zero2", "trainer.devices=[3]"])
    validate_deepspeed(cfg, visible=4, missing=None)


def test_process_count_reads_trainer_devices():
    cfg = compose_config([])
    assert process_count(cfg.trainer, visible=4) == 4  # devices=auto: every visible device
    assert process_count(compose_config(["trainer.devices=[0,2]"]).trainer, visible=4) == 2
    assert process_count(compose_config(["trainer.devices=1", "trainer.num_nodes=3"]).trainer, visible=8) == 3


def test_each_backward_pass_is_announced_to_zero_as_engine_forward_would():
    """The learner runs the policy, not the engine: the flag engine.forward() clears before each
    pass is cleared before each backward instead (ZeRO counts micro-steps by it)."""
    calls = []
    engine = type("Engine", (), {})()
    engine.optimizer = type("Opt", (), {"clear_backward_seen_flag": lambda self: calls.append(1)})()
    before_backward(engine)
    before_backward(type("NoZero", (), {"optimizer": None})())  # an engine without ZeRO's optimizer
    assert calls == [1]
