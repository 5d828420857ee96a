"""The closed choices of the config: each a ``StrEnum`` whose names are its values, so a YAML
value or a command-line override is checked by OmegaConf when the config is composed (a bad one
is named with the allowed ones), and code compares them with plain strings."""

from __future__ import annotations

from enum import StrEnum


class AggMode(StrEnum):
    """``algo.loss_agg_mode``: how token losses become a batch loss (``losses/aggregate.py``)."""

    token_mean = "token_mean"
    seq_mean_token_mean = "seq_mean_token_mean"
    seq_mean_token_sum = "seq_mean_token_sum"
    seq_mean_token_sum_norm = "seq_mean_token_sum_norm"


class Pooling(StrEnum):
    """``algo.is_pooling``: a sequence or turn ratio from its tokens' (mean: geometric mean)."""

    mean = "mean"
    sum = "sum"


class KLEstimator(StrEnum):
    """``algo.kl_estimator``: Schulman's k1, k2, k3."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class KLMode(StrEnum):
    """``algo.kl_mode``: where the KL to the reference goes."""

    loss = "loss"
    reward = "reward"
    advantage = "advantage"


class LogprobSource(StrEnum):
    """``algo.old_logprobs_source``: the behaviour log-probs of the ratio."""

    trainer = "trainer"
    rollout = "rollout"


class PooledLevel(StrEnum):
    """``algo.is_level``: what GSPO's ratio is pooled over."""

    sequence = "sequence"
    turn = "turn"


class RatioLevel(StrEnum):
    """``algo.importance_sampling_level`` (PPO): per token, pooled per turn or trajectory, or
    auto (per turn when the batch is multi-turn)."""

    token = "token"
    turn = "turn"
    trajectory = "trajectory"
    auto = "auto"


class Granularity(StrEnum):
    """``algo.advantage_granularity`` (PPO): the steps GAE runs over."""

    auto = "auto"
    turn = "turn"
    token = "token"


class TurnValue(StrEnum):
    """``algo.turn_value_reduction`` (PPO): a turn's state value from its tokens' values."""

    state = "state"
    mean = "mean"
    final_value = "final_value"


class PreferenceLoss(StrEnum):
    """``algo.loss_type`` (DPO): sigmoid (DPO) | ipo."""

    sigmoid = "sigmoid"
    ipo = "ipo"


class PartialVersions(StrEnum):
    """``rollout.partial_versions``: which weights a later turn of an episode in flight uses."""

    newest = "newest"
    planned = "planned"


class StepWorkers(StrEnum):
    """``env.step_workers``: where env steps run when they run at once or under a time limit."""

    process = "process"
    thread = "thread"


class Finetune(StrEnum):
    """``model.finetune``: LoRA adapters on a frozen base, or every weight."""

    lora = "lora"
    full = "full"


class History(StrEnum):
    """``env.history``: what a multi-turn episode's prompt holds at each turn.

    ``full``: the whole conversation so far (one growing sequence). ``last``: the instructions
    and the latest observation (a fresh prompt each turn, the Markov view). ``last_k``: the
    instructions and the last ``env.history_k`` turns (each a reply and the observation after
    it). With ``last`` and ``last_k`` each turn is its own sequence in the update.
    """

    full = "full"
    last = "last"
    last_k = "last_k"


class PopulationInit(StrEnum):
    """``population.init``: where members' first hyper-parameters come from: drawn from the
    mutation space's prior (as a search draws its trials), or the config's values."""

    sample = "sample"
    config = "config"


class Selection(StrEnum):
    """``population.selection``: truncation (the least fit replaced by clones of the fittest,
    the rest kept) or tournament (every slot a tournament's winner, the fittest kept)."""

    truncation = "truncation"
    tournament = "tournament"


class PopulationSchedule(StrEnum):
    """``population.schedule``: when members evolve. ``pbt``: all of them every
    ``population.evolve_every`` steps (population based training); ``mf_pbt``: sub-populations,
    each at its own interval, with migration between them (multiple-frequencies PBT,
    ``population.mf_pbt``)."""

    pbt = "pbt"
    mf_pbt = "mf_pbt"
