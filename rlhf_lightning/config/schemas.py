"""Typed config schemas, registered in Hydra's ConfigStore; YAML under ``conf/`` holds values.

Each group's YAML starts from its schema (``defaults: [<schema name>, _self_]``), so a typo
or a wrong type in a YAML file or on the command line fails at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from rlhf_lightning.config.algo import (
    DPOConfig,
    GRPOConfig,
    OfflineConfig,
    OptimConfig,
    PPOConfig,
    RolloutAlgoConfig,
    SFTConfig,
)
from rlhf_lightning.config.choices import (
    Finetune,
    History,
    PartialVersions,
    PopulationInit,
    PopulationSchedule,
    Selection,
    StepWorkers,
)
from rlhf_lightning.config.sections import run_dir

__all__ = [  # the algorithm schemas are defined in config/algo.py and stored here
    "DPOConfig",
    "GRPOConfig",
    "OfflineConfig",
    "OptimConfig",
    "PPOConfig",
    "RolloutAlgoConfig",
    "SFTConfig",
]

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # rlhf_lightning/assets


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Any = "all-linear"


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # a local directory or a Hugging Face Hub id
    tokenizer_path: str | None = None  # default: path
    revision: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    attn_implementation: str | None = None  # eager | sdpa | flash_attention_2 | None (transformers' choice)
    trust_remote_code: bool = False
    finetune: Finetune = Finetune.lora  # lora | full
    lora: LoraSettings = field(default_factory=LoraSettings)
    gradient_checkpointing: bool = False
    adapter_path: str | None = None  # start from saved adapters (actor/, reference/, critic/): chaining
    reference_from_checkpoint: bool = False  # load adapter_path's reference/ instead of copying the actor
    pad_token: str | None = None  # set when the tokenizer has none (e.g. its eos token)
    chat_template: str | None = (
        None  # a Jinja template or a .jinja file's path (e.g. ${asset:chat_templates/tools.jinja})
    )
    # QLoRA (GPU): the frozen base quantised by bitsandbytes, LoRA on top, lm_head unquantised.
    quantization: str | None = None  # null | 4bit | 8bit
    quant_type: str = "nf4"  # 4bit: nf4 | fp4
    double_quant: bool = True  # 4bit: quantise the quantisation constants too
    compute_dtype: str = "bfloat16"  # 4bit: the matmuls' dtype
    liger_kernels: bool = False  # GPU: Liger's RoPE, RMSNorm and SwiGLU kernels patched into the model


@dataclass
class RolloutConfig:
    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 8
    max_batch_size: int | None = None  # completions per generate call; None: all at once
    # Applied identically by every engine; the model's own generation_config is never merged in.
    repetition_penalty: float = 1.0  # 1.0: off (CTRL-style: divide positive logits of seen tokens)
    min_p: float = 0.0  # 0.0: off; keep tokens with p >= min_p * max p
    stop: list[str] = field(default_factory=list)  # stop strings (the matched text stays in the reply)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides the eos token
    # How tool calls are read from a reply (env=tools): a name in rlhf_lightning.envs.tool_parsers
    tool_parser: str = "hermes"
    # sync: generate, then update, in every step. async: a producer process with its own copy of
    # the model (and the run's engine) generates the next batches while the trainer updates;
    # evaluation and dynamic-sampling refills then run on HF generate (docs/guides/async.md).
    mode: str = "sync"
    # async: batch t is generated with the weights after update t - max_staleness (0: lockstep,
    # the synchronous run's batches through the producer)
    max_staleness: int = 1
    # async, multi-turn: later turns of an episode in flight use newer weights than its first
    partial: bool = False
    # partial: newest (each turn the newest version published when it starts, never waiting) |
    # planned (turn j of batch s: min(s - K + j, s), reproducible, but waits for those weights)
    partial_versions: PartialVersions = PartialVersions.newest
    producer_threads: int | None = None  # async: the producer's torch threads; null: the trainer's
    async_timeout_s: float = (
        600.0  # async: the longest wait for the producer before the run stops with an error
    )
    # async on GPUs: the CUDA device of each rank's producer (rank r: devices[r]), devices training
    # does not use; null: the trainer's own device (colocated)
    devices: list[int] | None = None


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    """Colocated vLLM (``rollout=vllm``); see rlhf_lightning/rollout/engines/vllm.py."""

    engine: str = "vllm"
    dtype: str = "auto"  # the engine's dtype; auto: the checkpoint's
    max_model_len: int | None = None  # default: env.max_model_len
    gpu_memory_utilization: float = 0.5  # share of GPU memory for weights + KV cache (GPU)
    kv_cache_memory_bytes: int | None = None  # explicit KV-cache size; required on CPU (default 64 MiB there)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    sleep_mode: bool = True  # free the engine's GPU memory while training (no-op on CPU)
    sleep_mode_level: int = 1  # 1: keep base weights in host RAM (LoRA sync); 2: discard them (full sync)
    lora_staging_dir: str | None = None  # default: a temporary directory per rank
    seed: int | None = None  # default: the run's seed
    offload_trainer_during_rollout: bool = False  # move the policy to CPU while the engine is awake (GPU)


@dataclass
class VLLMServerRolloutConfig(RolloutConfig):
    """Rollouts on vLLM inference servers (``rollout=vllm_server``); see
    docs/guides/inference-servers.md and rlhf_lightning/rollout/servers/engine.py."""

    engine: str = "vllm_server"
    servers: list[str] | None = None  # running servers' URLs (http://host:port); null: the run starts them
    # Servers the run starts: one per entry, the entry its CUDA_VISIBLE_DEVICES ("0"; "1,2": tensor
    # parallel over two GPUs); null: one server on the trainer's own devices
    server_devices: list[str] | None = None
    server_args: list[str] = field(default_factory=list)  # more arguments for the servers the run starts
    served_model_name: str | None = None  # the base model's name on the servers; null: the one they serve
    # Where each version of the trained weights is written for the servers to read (a shared
    # filesystem when they run on other nodes); null: <run>/server_weights
    sync_dir: str | None = None
    max_concurrency: int = 32  # requests in flight per server
    request_timeout_s: float = 300.0  # each try of a request, as a whole (connecting, sending, every read)
    request_retries: int = 3  # tries after the first, with exponential backoff (a gone server: none)
    server_start_timeout_s: float = 600.0  # the longest wait for the servers' /health at start
    max_loras: int = 2  # servers the run starts: LoRA adapters one batch may hold
    # Servers the run starts, as for rollout=vllm:
    dtype: str = "auto"  # the servers' dtype; auto: the checkpoint's
    max_model_len: int | None = None  # default: env.max_model_len
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None  # explicit KV-cache size (64 MiB on a machine without CUDA)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True


@dataclass
class EnvConfig:
    _target_: str = MISSING  # the TextEnv class; env.kwargs go to its constructor
    kwargs: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    apply_chat_template: bool = True
    max_turns: int = 1
    max_model_len: int = 512
    # raise (show prompt and completion) | zero (score 0, count env/reward_errors)
    on_reward_error: str = "raise"
    concurrency: int = 1  # env steps of a turn run at once; 1: one after the other
    # a step that takes longer is stopped (its worker process killed; on_reward_error decides)
    step_timeout_s: float | None = None
    # where steps run when concurrency > 1 or step_timeout_s is set: process (worker processes;
    # envs must pickle) | thread (no step_timeout_s: a thread cannot be stopped)
    step_workers: StepWorkers = StepWorkers.process
    train_size: int | None = None  # rows per split, for envs without num_rows()
    eval_size: int | None = None
    # What a multi-turn prompt holds each turn: full (the conversation so far) | last (the
    # instructions and the latest observation: each turn its own sequence) | last_k (the
    # instructions and the last history_k turns, each a reply and the observation after it)
    history: History = History.full
    history_k: int = 2  # turns of conversation kept by history=last_k


@dataclass
class RewardConfig:
    """The training reward (``reward=env|function|model``): the env's, a user function's, a
    sequence-classification model's, or a weighted sum (``reward.sources=[env,model]``)."""

    sources: list[str] = field(default_factory=lambda: ["env"])  # env | function | model
    fn: Any = None  # function: a dotted path (or a list): fn(prompts, completions, **columns) -> scores
    # function: a call (one batch) running longer is stopped and fails the run; the function then
    # runs in a worker process (it must pickle). null: in the trainer's process, no limit
    fn_timeout_s: float | None = 300.0
    model_path: str | None = None  # model: an AutoModelForSequenceClassification directory or Hub id
    model_batch_size: int = 32
    model_max_len: int = 1024
    model_dtype: str = "float32"
    normalize: str = (
        "none"  # model scores: none | batch (standardised over each training step's global batch)
    )
    offload: bool = True  # model: on the CPU except while scoring
    weights: Any = None  # {name: weight} by component name (env, fn name, model); unset: 1.0


@dataclass
class StrategyConfig:
    """Lightning's distribution strategy (``strategy=auto|ddp|fsdp|deepspeed_zero2|deepspeed_zero3``).

    Batch sizes in ``algo`` are global: they are split across ``trainer.devices x num_nodes``.
    """

    name: str = "auto"  # auto | ddp | fsdp | deepspeed_zero2 | deepspeed_zero3
    process_group_backend: str | None = None  # None: nccl on GPUs, gloo on CPUs
    timeout_s: int = 1800  # collective timeout: a rank that never joins fails the run instead of hanging
    offload_optimizer: bool = False  # deepspeed_*: optimizer states and step on the CPU (ZeRO-Offload)


@dataclass
class LoggerConfig:
    name: str = "csv"  # csv | tensorboard | wandb
    project: str = "rlhf_lightning"
    entity: str | None = None
    group: str | None = None  # wandb: default the run's name (its experiment), per sweep in a multirun
    tags: list[str] | None = None  # wandb: default [algo, model, env]
    job_type: str | None = None  # wandb: default train, or sweep in a multirun
    log_model: bool = False  # wandb: upload checkpoints (Lightning's log_model) and the final adapters
    mode: str | None = None  # wandb: online | offline | disabled (default: WANDB_MODE or online)
    flush_every_n_steps: int = 10  # metrics.csv reaches the disk at least this often


@dataclass
class TrainerConfig:
    """Passed to ``lightning.Trainer`` as keyword arguments."""

    max_steps: int = 100
    max_epochs: int = -1
    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: Any = "32-true"
    val_check_interval: Any = 20
    check_val_every_n_epoch: int | None = None
    log_every_n_steps: int = 1
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    enable_model_summary: bool = False  # Lightning's layer table (one Policy row here); true shows it
    limit_val_batches: Any = None
    deterministic: Any = False
    benchmark: bool | None = None
    fast_dev_run: Any = False
    profiler: str | None = None


@dataclass
class EvalConfig:
    before_training: bool = True
    at_end: bool = True
    greedy: bool = True
    sampled: bool = True  # samples at the training temperature
    num_samples: int = 1  # sampled completions per problem; > 1 also logs eval/pass@k for k <= num_samples
    batch_size: int = 200  # prompts per validation batch and rank
    # numeric info keys whose per-turn mean over the eval episodes is logged as
    # eval/env_<key>_<greedy|sampled> (e.g. [valid_move] for env=gem)
    info_metrics: list[str] = field(default_factory=list)


@dataclass
class CheckpointConfig:
    every_n_steps: int = 100  # 0: only at the end
    save_last: bool = True
    export_adapters: bool = True  # a PEFT directory per adapter next to each checkpoint
    keep_last: int = 3  # step checkpoints kept (older ones and their adapters are deleted); -1: all
    monitor: str | None = "eval/accuracy_greedy"  # also keep the best by this metric (null: none)
    monitor_mode: str = "max"  # max | min


@dataclass
class GuardConfig:
    """Divergence and collapse guard (see ``rlhf_lightning/callbacks/guard.py``)."""

    max_nonfinite_steps: int = 3  # stop after this many skipped (non-finite) steps in a row; 0: never
    patience: int = 10  # steps in a row a collapse signal must hold before it fires
    empty_frac: float = 0.9  # share of empty completions that counts as collapse
    stop_on_collapse: bool = False  # false: warn


@dataclass
class SamplesConfig:
    every_n_steps: int = 10  # 0 disables the sample table
    num: int = 4


@dataclass
class TraceConfig:
    """Rollout traces: whole episodes in the run's ``traces.jsonl`` (``rlhf_lightning/traces``;
    read them with ``python -m rlhf_lightning.traces RUN``) and a ``traces`` table in W&B."""

    every_n_steps: int = 0  # trace every this many training steps; 0: off
    episodes: int = 4  # episodes traced per traced step (the step's first ones)
    max_bytes: int = 20_000_000  # bound on traces.jsonl: past it the oldest traced steps are dropped
    max_chars: int = 4000  # per text field (a turn's context, reply, ...): head and tail kept; 0: all


@dataclass
class ProgressConfig:
    """A compact progress line (step, reward, eval accuracy, elapsed, ETA) when stdout is not a
    terminal (log files, CI, SLURM); in a terminal the rich bar shows progress instead."""

    every_n_steps: int | None = None  # null: about 20 lines a run (1..100 steps apart); 0: none


@dataclass
class MultiFrequencyConfig:
    """``population.mf_pbt``: the sub-populations of ``population.schedule=mf_pbt`` (multiple-
    frequencies PBT, Doulazmi et al. 2025, arXiv 2506.03225; ``population/multi_frequency.py``)."""

    # Sub-population j evolves every intervals[j] x population.evolve_every steps (strictly
    # rising, fastest first; the paper's first is 1); one entry per sub-population.
    intervals: list[int] = field(default_factory=lambda: [1, 4])
    sizes: list[int] | None = None  # members per sub-population, slots in order; null: an even split
    # the open bracket of an evolving sub-population takes better members of the others (a
    # slower one's: weights and hyper-parameters; a faster one's: weights only); false: none
    migration: bool = True


@dataclass
class PopulationConfig:
    """Population training with evolution (``rlhf_lightning/population``); size 1 is off."""

    size: int = 1
    # Members side by side: every training step is one rollout for all members (one engine call,
    # per-row adapters) and one update of each; false: members take turns, one per training step
    # (round-robin); null: side by side unless the run needs round-robin (full fine-tuning,
    # dynamic sampling).
    batched: bool | None = None
    # Between evolutions: training steps (all members together; default 50 x size) round-robin,
    # population steps (default 50) side by side; 0: never.
    evolve_every: int | None = None
    # accuracy_sampled | accuracy_greedy | return_sampled | return_greedy. Greedy fitness on short
    # horizons selected ever smaller learning rates (docs/guides/sweeps-population.md, "Population training").
    fitness: str = "accuracy_sampled"
    eval_rows: int = 100  # held-out rows each member is scored on
    # sample: each member's first values of the mutation space drawn from its prior (log-uniform
    # for lr, uniform otherwise; seeded), as a search draws its trials | config: the config's values
    init: PopulationInit = PopulationInit.sample
    # truncation: the least fit `truncation` share replaced by clones of as many fittest ones, the
    # rest kept (population based training) | tournament: every slot a tournament's winner
    selection: Selection = Selection.truncation
    # pbt: every member evolves every evolve_every steps | mf_pbt: sub-populations at their own
    # intervals with migration between them (population.mf_pbt; selection is then MF-PBT's brackets)
    schedule: PopulationSchedule = PopulationSchedule.pbt
    mf_pbt: MultiFrequencyConfig = field(default_factory=MultiFrequencyConfig)
    truncation: float = 0.25  # share of members replaced at each evolution (at least one, at most half)
    tournament_size: int = 2
    elitism: bool = True  # tournament: the fittest member survives unchanged
    no_mutation_prob: float = 0.2  # a clone keeps its parent's hyper-parameters
    resample_prob: float = 0.25  # a clone's mutated value is drawn afresh from the prior, not scaled
    mutate_initial: bool = False  # init=config: members 1..N-1 start from one mutation of the config's values
    snapshot_every: int = 0  # write the population from a background thread every this many steps
    keep_snapshots: int = 2  # background snapshots kept on disk (the newest); >= 1
    # {name: {low, high, scale, prior}} for lr, min_lr_ratio, clip_low, clip_high, beta, temperature,
    # group_size, entropy_coef (prior: log | uniform; null: log for lr); null: {lr: {low: 1e-6, high: 1e-2, scale: 2}}
    mutate: Any = None


@dataclass
class Config:
    algo: Any = MISSING
    model: ModelConfig = MISSING
    env: EnvConfig = MISSING
    rollout: RolloutConfig = MISSING
    reward: RewardConfig = MISSING
    strategy: StrategyConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = MISSING
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    samples: SamplesConfig = field(default_factory=SamplesConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    # Extra Lightning callbacks: {name: {_target_: a Callback class, its keyword arguments}},
    # instantiated after the run's own (conf/callbacks/; add with +callbacks.<name>._target_=...).
    callbacks: dict[str, Any] = field(default_factory=dict)
    name: str = "default"  # runs land in outputs/<name>/<timestamp>
    # The algorithm's family (conf/family/, set by the algo option's defaults): the tuned settings
    # are conf/tuned/<model>/<family>.yaml, so a new option built on algo/grpo.yaml gets GRPO's.
    family: str = "none"
    tuned: str | None = None  # which tuned file applied (<model>/<family>; each file names itself)
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; None: torch's default (OMP_NUM_THREADS or all cores)
    output_dir: str | None = None  # default: Hydra's run directory
    ckpt_path: str | None = None  # resume from this Lightning checkpoint
    # resume this run: output_dir's last checkpoint, or the newest outputs/<name>/* run with the same config
    resume: bool = False
    resume_force: bool = False  # resume although the config differs from the checkpoint run's
    # start a new run in an output_dir that holds an earlier one, deleting that run's results
    overwrite: bool = False
    # What train.py returns (to a Hydra sweeper such as Optuna): any metric the run logs, its final
    # value or its best over the run (best by optimized_direction: maximize | minimize). null:
    # nothing (hparams_search=optuna sets eval/accuracy_sampled); a name is checked early.
    optimized_metric: str | None = None
    optimized_mode: str = "final"  # final | best
    optimized_direction: str = "maximize"


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore and register the ``${asset:NAME}`` resolver."""
    if not OmegaConf.has_resolver("asset"):  # ${asset:tiny_arithmetic}: a directory shipped in the package
        OmegaConf.register_new_resolver("asset", lambda name: str(ASSETS / name))
    if not OmegaConf.has_resolver("or_default"):  # hydra.run.dir follows output_dir when it is set
        OmegaConf.register_new_resolver(
            "or_default", lambda value, default: default if value in (None, "") else value
        )
    if not OmegaConf.has_resolver("run_dir"):  # hydra.run.dir: output_dir (checked) when it is set
        OmegaConf.register_new_resolver("run_dir", run_dir)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    # Schemas live outside the option groups (``/schema/<group>/<name>``), so Hydra never offers
    # them as options; each YAML starts from one.
    for group, name, node in (
        ("model", "model", ModelConfig),
        ("env", "env", EnvConfig),
        ("rollout", "rollout", RolloutConfig),
        ("rollout", "vllm", VLLMRolloutConfig),
        ("rollout", "vllm_server", VLLMServerRolloutConfig),
        ("reward", "reward", RewardConfig),
        ("strategy", "strategy", StrategyConfig),
        ("logger", "logger", LoggerConfig),
        ("trainer", "trainer", TrainerConfig),
        # The built-in algorithm families' schemas (``algo.module`` names); a family defined
        # outside the package stores its own through ``register_algorithm`` when imported. Stored
        # here so that composing a config imports neither the families nor torch.
        ("algo", "grpo", GRPOConfig),
        ("algo", "ppo", PPOConfig),
        ("algo", "sft", SFTConfig),
        ("algo", "dpo", DPOConfig),
    ):
        cs.store(group=f"schema/{group}", name=name, node=node)
