"""Typed schemas of the ``algo`` config group: the optimiser fields every family shares, the
rollout families' (GRPO and its losses, PPO) and the offline ones' (SFT, DPO).

``rlhf_lightning.config`` stores them in Hydra's ConfigStore with the other groups' schemas;
per-loss defaults (``clip_low``/``clip_high: auto``) are resolved from the loss's own
parameters at start-up (``algorithms/checks.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omegaconf import MISSING

from rlhf_lightning.config.choices import (
    AggMode,
    Granularity,
    KLEstimator,
    KLMode,
    LogprobSource,
    PooledLevel,
    Pooling,
    PreferenceLoss,
    RatioLevel,
    TurnValue,
)
from rlhf_lightning.config.distill import DistillConfig, TeacherConfig

# The built-in names of the registries the rollout families choose from, listed here so the
# start-up checks can name a bad one before torch is imported (``config/early.py``);
# ``tests/test_startup.py`` checks that they equal the registries' own.
BUILTIN_POLICY_LOSSES = (
    "cispo",
    "dppo_kl",
    "dppo_tv",
    "gmpo",
    "gspo",
    "kl_cov",
    "ppo_clip",
    "reinforce",
    "sapo",
)
BUILTIN_OUTCOME_ADVANTAGES = ("dr_grpo", "gdpo", "gigpo", "grpo", "mean_only", "rebn", "reinforce_pp", "rloo")
BUILTIN_AGGREGATION_MODES = tuple(m.value for m in AggMode)
BUILTIN_KL_ESTIMATORS = tuple(m.value for m in KLEstimator)


@dataclass
class OptimConfig:
    """Optimiser and log-prob settings every algorithm shares."""

    name: str = MISSING
    module: str = MISSING
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float | None = 1.0
    # Examples (trajectories, pairs) per forward/backward; None: the whole (mini-)batch.
    micro_batch_size: int | None = None
    chunk_rows: int | None = None  # log-prob tile rows; None: auto (~256 MB fp32 logits)
    # Reference policy: the base with adapters disabled (free), or its own frozen LoRA adapter,
    # copied from the actor every ref_update_interval optimizer steps.
    use_separate_reference_adapter: bool = False
    ref_update_interval: int | None = None


@dataclass
class RolloutAlgoConfig(OptimConfig):
    """What every rollout algorithm shares: clipping, KL, corrections, batch geometry."""

    # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm (losses/aggregate.py)
    loss_agg_mode: AggMode = AggMode.token_mean
    # Clipped surrogate bounds (the ratio is clipped to [1 - clip_low, 1 + clip_high]).
    # auto: the loss's own (ppo_clip 0.2 / 0.2, cispo none / 4.0, gspo 3e-4 / 4e-4; see
    # algorithms/checks.py resolve_clip_defaults); a number; or null for no bound.
    clip_low: Any = "auto"
    clip_high: Any = "auto"
    clip_ratio_c: float | None = None
    is_pooling: Pooling = (
        Pooling.mean
    )  # sequence/turn ratios: mean (geometric mean) | sum (product of token ratios)
    max_len_norm: int | None = None  # seq_mean_token_sum_norm's constant; default rollout.max_new_tokens
    whiten_advantages: bool = False
    # DAPO's soft overlong penalty (arXiv 2503.14476), applied to each turn from its own length.
    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = (
        False  # episodes with no terminal state, or a reply cut at max_new_tokens, carry no loss
    )
    # KL to the reference policy.
    beta: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_clamp: float | None = 10.0  # per-token clamp
    kl_mode: KLMode = KLMode.loss  # loss | reward (in the return) | advantage (per-token shaping)
    kl_importance_weighted: bool = False  # weight the KL term by pi/pi_old: unbiased KL gradient
    # Off-policy corrections (rollout engine vs trainer).
    old_logprobs_source: LogprobSource = (
        LogprobSource.trainer
    )  # trainer (recompute) | rollout (engine's sampling log-probs)
    tis_cap: float | None = 2.0  # truncated importance sampling cap; null disables
    # Keep tokens whose trainer/engine ratio lies inside [low, high]; drop sequences whose mean
    # engine-trainer log-ratio exceeds the threshold.
    offpolicy_token_bounds: list[float] | None = None
    offpolicy_seq_threshold: float | None = None
    # Batch geometry, in trajectories (prompts_per_step x group_size per rollout step).
    group_size: int = 8
    prompts_per_step: int = 16
    mini_batch_size: int | None = None  # per optimizer step; None: the whole rollout batch
    # Micro-batches by token budget instead of micro_batch_size rows: consecutive rows packed while
    # rows x the longest row's length stays within this many tokens (per rank); a longer row alone.
    micro_batch_tokens: int | None = None
    update_epochs: int = 1
    use_liger_loss: bool = False  # Liger's fused linear loss on GPU, for the combinations it covers
    # on-policy distillation: a teacher scores every generated token (config/distill.py)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class GRPOConfig(RolloutAlgoConfig):
    """The GRPO family (GRPO, CISPO, DAPO, Dr.GRPO, GSPO, RLOO, REINFORCE++): one module."""

    name: str = "grpo"
    module: str = "grpo"
    # Objective: {name: <a name in rlhf_lightning.losses.POLICY_LOSSES or a dotted path>, <fields
    # of its params class>}. A field the flat config also has (clip_low, clip_high, clip_ratio_c,
    # is_pooling) is moved there at start-up; the others (a loss from outside the package) stay
    # in the node. Aliases: algo.loss=<name>; algo.loss_kwargs.<field> (the older spelling).
    loss: Any = field(default_factory=lambda: {"name": "ppo_clip"})
    # The loss's params as keyword arguments (the older spelling of the node's params; joins it).
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    is_level: PooledLevel = PooledLevel.sequence  # gspo: pool the ratio per sequence | turn
    # Advantages: {name: <a group estimator in rlhf_lightning.losses.ADVANTAGE_ESTIMATORS>, <its
    # keyword parameters>}; a parameter with a flat advantage_<param> field (scale) is moved
    # there at start-up. Alias: algo.advantage=<name>.
    advantage: Any = field(default_factory=lambda: {"name": "grpo"})
    advantage_scale: str = "group"  # grpo: divide by the group | batch std, or none
    advantage_clip: float | None = None  # clip advantages to [-c, c]
    # DAPO extras (arXiv 2503.14476).
    dynamic_sampling: bool = False  # drop groups with equal rewards, refill with new prompts
    max_resample_rounds: int = 3  # refill rounds per step (0: only drop)
    # Skip rows whose advantage is 0 in forward/backward (the same gradient without a KL loss term).
    skip_zero_advantage: bool = True


@dataclass
class PPOConfig(RolloutAlgoConfig):
    """LLM-PPO: a critic adapter with a value head, turn-level GAE (each generated turn is one action)."""

    name: str = "ppo"
    module: str = "ppo"
    gamma: float = 1.0  # discount across turns (or tokens at token granularity)
    gae_lambda: float = 0.95
    advantage_granularity: Granularity = (
        Granularity.auto
    )  # turn | token | auto (token when every episode is single-turn)
    # A turn's state value from its tokens' values: state (the value before its first action
    # token: V(s_k)) | mean | final_value (AgileRL's choices; both have seen part of the action)
    turn_value_reduction: TurnValue = TurnValue.state
    importance_sampling_level: RatioLevel = (
        RatioLevel.token
    )  # token | turn | trajectory | auto (turn when multi-turn)
    vf_coef: float = 0.5
    value_clip: float | None = 0.2
    lr_critic: float | None = None  # default: lr
    share_grad_clip: bool = True  # clip actor and critic by their combined norm (else each separately)
    critic_warmup_steps: int = 0  # first learn steps update the critic only, on Monte-Carlo returns
    # A reply cut at max_new_tokens ends its episode in a terminal state (value 0), even when a
    # multi-turn env had not ended it; true: bootstrap from the critic's value there, as for an
    # episode stopped by max_turns, max_model_len or the env's own truncation (those always do)
    bootstrap_cut_replies: bool = False
    entropy_coef: float = 0.0
    # One backward for actor and critic losses of a micro-batch; false: two (less activation memory).
    fuse_actor_critic_pass: bool = True


@dataclass
class OfflineConfig(OptimConfig):
    """Supervised and preference training on a local file."""

    data_path: str | None = None  # .jsonl / .json / .parquet; default: the shipped arithmetic sample
    eval_data_path: str | None = None  # default: the last eval_fraction of data_path
    eval_fraction: float = 0.1
    prompt_key: str = "prompt"
    batch_size: int = 64  # examples (pairs for DPO) per optimizer step
    max_len: int = 512  # longer examples are dropped and counted
    env_eval: bool = True  # also evaluate greedy/sampled accuracy on the env's eval split


@dataclass
class SFTConfig(OfflineConfig):
    name: str = "sft"
    module: str = "sft"
    messages_key: str = "messages"  # chat rows; else prompt_key / completion_key
    completion_key: str = "completion"
    packing: bool = False  # several examples per row of up to max_len tokens (attention kept per example)


@dataclass
class DPOConfig(OfflineConfig):
    name: str = "dpo"
    module: str = "dpo"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    beta: float = 0.1
    loss_type: PreferenceLoss = PreferenceLoss.sigmoid  # sigmoid (DPO) | ipo
    label_smoothing: float = 0.0


# ---------------------------------------------------------------- registered functions' nodes
def registered_name(value: Any) -> str:
    """The registered name of an ``algo.loss`` / ``algo.advantage`` value: the node's ``name``,
    or the value itself (the flat alias ``algo.loss=cispo``)."""
    if isinstance(value, Mapping):
        return str(value.get("name"))
    return str(value)


def node_params(value: Any) -> dict[str, Any]:
    """The parameters an ``algo.loss`` / ``algo.advantage`` node sets (every key but ``name``)."""
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items() if k != "name"}
    return {}


HP = TypeVar("HP")
NODES = ("loss", "advantage")  # a member's ``loss.<p>`` / ``advantage.<p>`` values go into these


def with_hparams(hp: HP, values: Mapping[str, Any]) -> HP:
    """A copy of the algorithm config ``hp`` with a population member's ``values``: a name that
    is a field of ``hp`` sets it, ``loss.<p>`` / ``advantage.<p>`` set ``<p>`` in that node;
    anything else (``temperature``, the sampler's) is left to its owner. The one function that
    applies hyper-parameters to a member, side by side and round-robin."""
    names = {f.name for f in dataclasses.fields(hp)}  # type: ignore[arg-type]
    flat = {k: v for k, v in values.items() if k in names}
    for node in NODES:
        own = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(f"{node}.")}
        if own and node in names:
            current = getattr(hp, node)
            base = dict(current) if isinstance(current, Mapping) else {"name": current}
            flat[node] = {**base, **own}
    return dataclasses.replace(hp, **flat)  # type: ignore[type-var]
