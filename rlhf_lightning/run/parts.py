"""The parts a run and its rollout producer both build from the config: the tokenizer, the env's
rollout harness, the model and policy, the rollout engine, the training reward; and
:class:`ProducerBuild`, which builds the producer's parts in its own process.

Nothing here imports Lightning (nor the algorithm modules): a producer process (``rollout.mode=
async``), which unpickles :class:`ProducerBuild` and so imports this module, starts without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from rlhf_lightning.envs.agent import AgentEnv
from rlhf_lightning.envs.factory import env_factory, split_sizes
from rlhf_lightning.models.build import build_policy, load_model, load_tokenizer
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rewards import CombinedReward, build_reward
from rlhf_lightning.rollout.agents.runner import AgentRunner
from rlhf_lightning.rollout.asynchronous.plan import Placement
from rlhf_lightning.rollout.engines.hf import HFEngine
from rlhf_lightning.rollout.episodes.chat import ChatFormatter, check_template, env_tools
from rlhf_lightning.rollout.episodes.harness import RolloutHarness
from rlhf_lightning.run.server_factory import server_engine


# ---------------------------------------------------------------- model, env, engine
def tokenizer_from(m: DictConfig, e: DictConfig) -> Any:
    """The ``model`` node's tokenizer, with the chat template the ``env`` needs."""
    return load_tokenizer(
        m.tokenizer_path or m.path,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        pad_token=m.pad_token,
        chat_template=m.chat_template,
        need_chat_template=e.apply_chat_template,
        field="model.tokenizer_path" if m.tokenizer_path else "model.path",
    )


def harness_from(cfg: DictConfig, tokenizer: Any, online: bool) -> tuple[RolloutHarness, int, int]:
    """The ``env`` node's rollout harness (the ``reward`` group when the family trains ``online``
    on rollouts), and the sizes of its train and eval splits."""
    e = cfg.env
    factory = env_factory(e._target_, cast(dict[str, Any], OmegaConf.to_container(e.kwargs, resolve=True)))
    if isinstance(factory, AgentEnv):  # env=agent: the agents drive the episodes
        runner = AgentRunner(
            factory,
            tokenizer,
            ChatFormatter(tokenizer, e.system_prompt, e.apply_chat_template),
            max_model_len=e.max_model_len,
            concurrency=e.concurrency,
            step_timeout_s=e.step_timeout_s,
            on_reward_error=e.on_reward_error,
            parser=cfg.rollout.tool_parser,
            reward=training_reward(cfg.reward) if online else None,
        )
        return cast(RolloutHarness, runner), *split_sizes(factory, e.train_size, e.eval_size)
    check_members = getattr(factory, "check_harness", None)  # env=mix: its members' nodes against env's
    if callable(check_members):
        check_members(e)
    train_rows, eval_rows = split_sizes(factory, e.train_size, e.eval_size)
    formatter = ChatFormatter(tokenizer, e.system_prompt, e.apply_chat_template, tools=env_tools(factory))
    check_template(formatter, multi_turn=e.max_turns > 1, history=e.history)
    harness = RolloutHarness(
        factory,
        tokenizer,
        formatter,
        max_turns=e.max_turns,
        max_model_len=e.max_model_len,
        on_reward_error=e.on_reward_error,
        reward=training_reward(cfg.reward) if online else None,
        concurrency=e.concurrency,
        # an env that bounds its own calls (env=openenv) needs no step deadline of the harness's
        step_timeout_s=None if getattr(factory, "bounds_its_calls", False) else e.step_timeout_s,
        step_workers=e.step_workers,
        history=e.history,
        history_k=e.history_k,
    )
    return harness, train_rows, eval_rows


def model_from(m: DictConfig) -> Any:
    """The ``model`` node's causal LM (quantized, with Liger's kernels, as it asks)."""
    return load_model(
        m.path,
        dtype=m.dtype,
        attn_implementation=m.attn_implementation,
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        quantization=m.quantization,
        quant_type=m.quant_type,
        double_quant=m.double_quant,
        compute_dtype=m.compute_dtype,
        liger_kernels=m.liger_kernels,
    )


def policy_from(
    model: Any,
    m: DictConfig,
    a: DictConfig,
    *,
    need_reference: bool = False,
    with_critic: bool = False,
    actor_only: bool = False,
) -> Policy:
    """The trainable policy on ``model``: the adapters (or full model), and the reference and
    critic the algorithm family needs; ``actor_only``: the actor alone (the async rollout
    producer's copy)."""
    return build_policy(
        model,
        finetune=m.finetune,
        lora_r=m.lora.r,
        lora_alpha=m.lora.alpha,
        lora_dropout=m.lora.dropout,
        lora_target_modules=m.lora.target_modules,
        need_reference=need_reference and not actor_only,
        gradient_checkpointing=m.gradient_checkpointing and not actor_only,
        adapter_path=m.adapter_path,
        reference_from_checkpoint=m.reference_from_checkpoint and not actor_only,
        separate_reference=a.use_separate_reference_adapter and not actor_only,
        with_critic=with_critic and not actor_only,
    )


def sampling_from(r: DictConfig) -> SamplingParams:
    """The ``rollout`` node's training sampling parameters."""
    return SamplingParams(
        r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop_token_ids=tuple(r.stop_token_ids),
        stop=tuple(r.stop),
        repetition_penalty=r.repetition_penalty,
        min_p=r.min_p,
    )


def build_engine(
    cfg: DictConfig, policy: Any, tokenizer: Any, kind: str | None = None, output_dir: Path | None = None
) -> Any:
    """The rollout engine ``kind`` (default: ``rollout.engine``): HF ``generate`` on the policy
    itself, a colocated vLLM (started lazily), or vLLM servers (logs and weights in ``output_dir``)."""
    r = cfg.rollout
    if (kind or r.engine) == "vllm_server":
        return server_engine(cfg, output_dir)
    if (kind or r.engine) == "hf":
        return HFEngine(
            policy.generation_model,
            tokenizer.pad_token_id,
            [tokenizer.eos_token_id],
            r.max_batch_size,
            tokenizer=tokenizer,
        )
    from rlhf_lightning.rollout.engines.vllm import VLLMEngine

    m = cfg.model
    dtype = r.dtype if r.dtype != "auto" else m.dtype
    return VLLMEngine(
        m.path,
        m.tokenizer_path,
        dtype=dtype,
        max_model_len=r.max_model_len or cfg.env.max_model_len,
        lora_rank=m.lora.r if m.finetune == "lora" else None,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        enforce_eager=r.enforce_eager,
        sleep_mode=r.sleep_mode,
        sleep_mode_level=r.sleep_mode_level,
        lora_staging_dir=r.lora_staging_dir,
        seed=r.seed if r.seed is not None else cfg.seed,  # + the rank, once the trainer knows it
        enable_prefix_caching=r.enable_prefix_caching,
    )


def training_reward(rw: DictConfig) -> CombinedReward | None:
    """The ``reward`` group as a :class:`CombinedReward` (None: the env's rewards as they are)."""
    fns = OmegaConf.to_container(rw.fn) if isinstance(rw.fn, ListConfig) else rw.fn
    weights = OmegaConf.to_container(rw.weights) if isinstance(rw.weights, DictConfig) else rw.weights
    model_kwargs = {
        "path": rw.model_path,
        "batch_size": rw.model_batch_size,
        "max_len": rw.model_max_len,
        "normalize": rw.normalize,
        "offload": rw.offload,
        "dtype": rw.model_dtype,
    }
    return build_reward(list(rw.sources), fns, weights, model_kwargs, rw.fn_timeout_s)


@dataclass(frozen=True)
class ProducerBuild:
    """Builds the rollout producer's parts in its own process (``rollout.mode=async``): the
    harness, the engine and a policy of the same structure as the trainer's actor (no reference,
    no critic), from the run's resolved config (YAML, so it pickles)."""

    config_yaml: str

    def __call__(self, place: Placement) -> tuple[RolloutHarness, Any, Policy]:
        """The parts on ``place``: the HF engine's policy on its device; a vLLM engine bound to
        its rank and CUDA device (its policy stays on the CPU: it only exports the weights)."""
        cfg = cast(DictConfig, OmegaConf.create(self.config_yaml))
        m, a = cfg.model, cfg.algo
        tokenizer = tokenizer_from(m, cfg.env)
        harness, _, _ = harness_from(cfg, tokenizer, online=True)
        policy = policy_from(model_from(m), m, a, actor_only=True)
        engine = build_engine(cfg, policy, tokenizer)
        if cfg.rollout.engine == "hf":
            policy.to(place.device)
        else:
            engine.bind_rank(place.rank, place.world_size, place.cuda_index or 0)
        return harness, engine, policy
