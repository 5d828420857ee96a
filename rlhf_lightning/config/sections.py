"""Start-up checks of the run's own sections (``guard``, ``checkpoint``, ``samples``, ``logger``,
``reward.normalize``, ``output_dir``), of ``model.chat_template`` (compiled here) and of the
lengths and token ids that must fit the model (read from its ``config.json``, never loaded).

Like ``config/early.py`` they need the composed config alone (no torch, Lightning or
transformers import), so ``early_checks`` runs them before the heavy imports and a bad value
fails in well under a second, naming the field and the fix, instead of crashing mid-run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lightning.config.errors import ConfigError, check, is_hub_id

# Lightning's ``Trainer(precision=...)`` values (lightning.fabric.connector's _PRECISION_INPUT),
# listed here so a typo fails before Lightning is imported.
PRECISIONS = (
    "transformer-engine",
    "transformer-engine-float16",
    "16-true",
    "16-mixed",
    "bf16-true",
    "bf16-mixed",
    "32-true",
    "64-true",
    "64",
    "32",
    "16",
    "bf16",
)
log = logging.getLogger(__name__)

NORMALIZE = ("none", "batch")  # reward.normalize (rlhf_lightning.rewards.NORMALIZE)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def check_sections(cfg: DictConfig) -> None:
    """The checks of this module, in the order a reader meets the fields."""
    validate_guard(cfg.guard)
    validate_checkpoint(cfg.checkpoint)
    s = cfg.samples
    for name in ("every_n_steps", "num"):
        check(s[name] >= 0, f"samples.{name}", s[name], ">= 0 (samples.every_n_steps=0 turns the table off)")
    check(
        cfg.logger.flush_every_n_steps >= 1,
        "logger.flush_every_n_steps",
        cfg.logger.flush_every_n_steps,
        ">= 1 (metrics.csv is written at least every this many steps)",
    )
    normalize = cfg.reward.normalize
    check(normalize in NORMALIZE, "reward.normalize", normalize, f"one of {', '.join(NORMALIZE)}")
    warmup, steps = cfg.algo.get("warmup_steps"), cfg.trainer.max_steps
    check(
        warmup is None or steps <= 0 or warmup < steps,
        "algo.warmup_steps",
        warmup,
        f"fewer than trainer.max_steps={steps} (the learning rate would never finish warming up); "
        "lower algo.warmup_steps",
    )
    if cfg.output_dir:
        err = output_dir_error(str(cfg.output_dir))
        if err is not None:
            raise err
    if cfg.model.chat_template is not None:
        check_chat_template(str(cfg.model.chat_template))
    check_model_fit(cfg)
    check_monitor(cfg)
    check_openenv(cfg.env)
    check_agent(cfg)


AGENT_TARGETS = ("rlhf_lightning.envs.agent.AgentEnv", "rlhf_lightning.envs.verifiers.VerifiersEnv")


def check_agent(cfg: DictConfig) -> None:
    """``env=agent`` (and ``env=verifiers``, played the same way): what it does not support yet is
    refused before the model loads."""
    if cfg.env.get("_target_") not in AGENT_TARGETS:
        return
    population = cfg.get("population") or {}
    check(
        int(population.get("size", 1) or 1) <= 1 or not population.get("batched", False),
        "population.batched",
        population.get("batched"),
        "false with env=agent (its members are not sampled side by side in one engine call)",
    )


OPENENV_TARGET = "rlhf_lightning.envs.openenv.OpenEnvEnv"


def check_openenv(e: DictConfig) -> None:
    """``env=openenv``: exactly one of ``env.kwargs.url`` and ``env.kwargs.app``, and steps on
    threads (a live WebSocket session cannot travel to a step worker process; the adapter bounds
    every call itself with ``env.step_timeout_s``). The rest is checked when the env is built,
    before the model loads (``envs/openenv``)."""
    if e.get("_target_") != OPENENV_TARGET:
        return
    kwargs = e.get("kwargs") or {}
    url, app = kwargs.get("url"), kwargs.get("app")
    check(
        (url is None) != (app is None),
        "env.kwargs.url",
        url,
        "exactly one of env.kwargs.url (a server someone started) and env.kwargs.app (module:app, a "
        f"server the run starts); {'both are' if url is not None else 'neither is'} set",
    )
    check(
        isinstance(e.step_timeout_s, (int, float)) and e.step_timeout_s > 0,
        "env.step_timeout_s",
        e.step_timeout_s,
        "a number of seconds > 0 with env=openenv: every call to the env server (connect + reset, "
        "step) ends by then",
    )
    check(
        kwargs.get("timeout_s", e.step_timeout_s) == e.step_timeout_s,
        "env.kwargs.timeout_s",
        kwargs.get("timeout_s"),
        f"unset: env=openenv's deadline is env.step_timeout_s (={e.step_timeout_s}); set that instead",
    )
    check(
        e.step_workers == "thread" or e.concurrency == 1,
        "env.step_workers",
        e.step_workers,
        "thread with env=openenv and env.concurrency > 1 (its sessions cannot be pickled into worker processes)",
    )


def validate_guard(g: DictConfig) -> None:
    check(
        g.patience >= 1,
        "guard.patience",
        g.patience,
        ">= 1 steps in a row (with 0 every healthy step would count as a collapse)",
    )
    check(0.0 < g.empty_frac <= 1.0, "guard.empty_frac", g.empty_frac, "a share in (0, 1]")
    check(
        g.max_nonfinite_steps >= 0,
        "guard.max_nonfinite_steps",
        g.max_nonfinite_steps,
        ">= 0 (0: never stop on non-finite steps)",
    )


def validate_checkpoint(c: DictConfig) -> None:
    check(
        c.keep_last >= 1 or c.keep_last == -1,
        "checkpoint.keep_last",
        c.keep_last,
        ">= 1 step checkpoints kept, or -1 (keep all)",
    )
    check(c.monitor_mode in ("max", "min"), "checkpoint.monitor_mode", c.monitor_mode, "max or min")


def pass_ks(n: int) -> list[int]:
    """The k of the ``eval/pass@k`` metrics from ``n`` samples per problem: 1, 2, 4, ... up to
    n, and n itself (``algorithms/evaluation.py`` computes them; listed here, torch-free, for
    :func:`rollout_eval_metrics` too)."""
    ks = [k for k in (2**i for i in range(n.bit_length())) if k <= n]
    return sorted({*ks, n})


def rollout_eval_metrics(ev: DictConfig) -> list[str]:
    """Every ``eval/`` metric the built-in rollout families can log with these ``eval`` settings
    (``algorithms/evaluation.py``), whichever of greedy and sampled is on: accuracy and return per
    mode, ``env_<key>_<mode>`` per ``eval.info_metrics`` key, ``pass@k`` (k in :func:`pass_ks`
    of ``eval.num_samples``) with several samples."""
    names = [f"{m}_{mode}" for m in ("accuracy", "return") for mode in ("greedy", "sampled")]
    names += [f"env_{k}_{mode}" for k in ev.info_metrics for mode in ("greedy", "sampled")]
    n = ev.num_samples
    if n > 1:
        names += [f"pass@{k}" for k in pass_ks(n)]
    return [f"eval/{name}" for name in names]


def check_monitor(cfg: DictConfig) -> None:
    """``checkpoint.monitor`` under ``eval/`` is a metric a built-in rollout family logs (other
    names, and other families' metrics, are not known before the run: BestCheckpoint warns when
    one never comes)."""
    monitor = cfg.checkpoint.monitor
    if not monitor or not str(monitor).startswith("eval/") or cfg.algo.get("module") not in ("grpo", "ppo"):
        return
    known = rollout_eval_metrics(cfg.eval)
    check(
        monitor in known,
        "checkpoint.monitor",
        monitor,
        f"a metric this run logs: one of {', '.join(known)} (or a training metric, or null for no best.ckpt)",
    )


def validate_precision(precision: Any) -> None:
    """``trainer.precision``: one of Lightning's values (an int such as 32 as its string), or
    null (Lightning's own default, 32-true)."""
    check(
        precision is None or str(precision) in PRECISIONS,
        "trainer.precision",
        precision,
        f"one of {', '.join(PRECISIONS[2:8])} (Lightning's precision values), or null (32-true)",
    )


def output_dir_error(path: str) -> ConfigError | None:
    """The error for an ``output_dir`` that cannot be created (:func:`output_dir_problem`), or None."""
    problem = output_dir_problem(path)
    if problem is None:
        return None
    return ConfigError("output_dir", path, f"{problem}; give a directory that can be created and written")


def run_dir(output_dir: Any, default: str) -> str:
    """``hydra.run.dir``'s resolver: ``output_dir`` when it is set, else ``default``. Hydra creates
    that directory before ``train.py``'s checks run, so an ``output_dir`` that cannot be created
    ends the command here with the same one-line error (not Hydra's traceback)."""
    if output_dir in (None, ""):
        return default
    err = output_dir_error(str(output_dir))
    if err is not None:
        raise SystemExit(f"error: {err}")  # not an Exception: omegaconf and Hydra pass it through
    return str(output_dir)


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be created (or written) as the run directory, or None. Nothing is
    created: the nearest existing ancestor must be a writable directory on a filesystem that
    stores files (not read-only, not /proc or /sys)."""
    p = Path(path).expanduser().absolute()
    for existing in (p, *p.parents):
        if not existing.exists():
            if existing.is_symlink():
                return f"{existing} is a broken symbolic link"
            continue
        if not existing.is_dir():
            return f"{existing} is a file, not a directory" + (
                "" if existing == p else f", so {p} cannot be created under it"
            )
        stats = os.statvfs(existing)
        if stats.f_blocks == 0:  # /proc, /sys: no storage behind them
            return f"{existing} is on a virtual filesystem that holds no files"
        if stats.f_flag & os.ST_RDONLY or not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable" + (
                " (a read-only filesystem)" if stats.f_flag & os.ST_RDONLY else ""
            )
        return None
    return None  # not reached: the root exists


def check_chat_template(template: str) -> None:
    """``model.chat_template`` (a template string or a ``.jinja`` file) compiles with Jinja, as
    transformers compiles it (loop controls and its ``{% generation %}`` block known), so a
    syntax error names the field and the line instead of failing at the first prompt."""
    import jinja2
    import jinja2.ext
    from jinja2 import nodes

    class GenerationBlock(jinja2.ext.Extension):
        """Parses transformers' ``{% generation %}...{% endgeneration %}`` (it marks assistant
        tokens); rendering is not needed here."""

        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    source, where = template, "the template"
    stripped = template.strip()
    if stripped.endswith(".jinja"):
        file = Path(stripped).expanduser()
        check(
            file.is_file(),
            "model.chat_template",
            template,
            "an existing .jinja file, or a Jinja template string",
        )
        source, where = file.read_text(encoding="utf-8"), str(file)
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", GenerationBlock])
    try:
        env.parse(source)
    except jinja2.TemplateSyntaxError as err:
        shown = template if len(template) <= 80 else template[:77] + "..."
        raise ConfigError(
            "model.chat_template",
            shown,
            f"{where} does not compile: {err.message} (line {err.lineno}); fix it, or unset it to use "
            "the tokenizer's own",
        ) from None


def model_config(path: str) -> dict[str, Any] | None:
    """A local model directory's ``config.json`` (None for a Hub id or an unreadable file)."""
    if is_hub_id(path):
        return None
    try:
        return dict(json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def check_model_fit(cfg: DictConfig) -> None:
    """Lengths and token ids against the model's ``config.json``: ``env.max_model_len`` within
    its positions, ``rollout.stop_token_ids`` in its vocabulary, and for ``rollout=vllm`` a
    ``rollout.max_model_len`` that holds ``env.max_model_len`` and a KV cache that holds one
    sequence of it."""
    r, e = cfg.rollout, cfg.env
    stops = list(r.stop_token_ids)
    check(
        all(isinstance(t, int) and t >= 0 for t in stops),
        "rollout.stop_token_ids",
        stops,
        "token ids >= 0 (extra stop ids besides the eos token)",
    )
    engine_len = r.get("max_model_len")
    if r.engine in ("vllm", "vllm_server") and engine_len is not None:
        check(
            engine_len >= e.max_model_len,
            "rollout.max_model_len",
            engine_len,
            f">= env.max_model_len={e.max_model_len} (the engine must hold the longest trajectory), "
            "or null (env.max_model_len)",
        )
    config = model_config(str(cfg.model.path))
    if config is None:
        return
    nested = config.get("text_config")  # a multimodal model's language part
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    positions = text.get("max_position_embeddings") or text.get("n_positions")
    vocab = text.get("vocab_size")
    longest, field = (
        (engine_len, "rollout.max_model_len") if engine_len else (e.max_model_len, "env.max_model_len")
    )
    positions, source = rope_scaled_positions(text, positions)
    if isinstance(positions, int) and longest > positions:
        where = f"the model's {positions} positions ({source} in {cfg.model.path}/config.json)"
        rotary = any(k in text for k in ("rope_theta", "rope_parameters", "rope_scaling"))
        if r.engine == "hf" and rotary:  # rotary positions go on; quality past them is the user's call
            log.warning(
                "%s=%d is beyond %s: longer sequences use positions it was not trained on",
                field,
                longest,
                where,
            )
        else:  # learned positions fail with an index error; vLLM refuses a length beyond them
            raise ConfigError(field, longest, f"<= {where} with rollout.engine={r.engine}; lower it")
    if isinstance(vocab, int):
        check(
            all(t < vocab for t in stops),
            "rollout.stop_token_ids",
            stops,
            f"ids below the model's vocab_size={vocab}",
        )
    kv = r.get("kv_cache_memory_bytes")
    if r.engine == "vllm" and kv is not None and full_attention_everywhere(text):
        need = kv_bytes_per_token(text, str(r.get("dtype", "auto")))
        length = engine_len if engine_len is not None else e.max_model_len
        if need is not None:
            check(
                kv >= need * length,
                "rollout.kv_cache_memory_bytes",
                kv,
                f">= {need * length} bytes: one sequence of {length} tokens needs {need} bytes per token "
                f"of KV cache ({cfg.model.path}); raise it (e.g. {64 << 20}, 64 MiB) or lower env.max_model_len",
            )


def rope_scaled_positions(config: dict[str, Any], positions: Any) -> tuple[Any, str]:
    """The longest sequence vLLM accepts for ``config``'s ``positions`` (max_position_embeddings)
    under its RoPE scaling, as vLLM derives it: ``rope_scaling`` (or transformers 5's
    ``rope_parameters``) with a numeric ``factor`` multiplies the positions (yarn: its
    ``original_max_position_embeddings`` when given), except for the types whose
    max_position_embeddings is already the extended length (llama3, longrope, su) and Gemma 3.
    Returns the positions and where they come from, for messages."""
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if not isinstance(positions, int) or not isinstance(rope, dict):
        return positions, "max_position_embeddings"
    factor = rope.get("factor")
    kind = str(rope.get("rope_type") or rope.get("type") or "")
    if (
        not isinstance(factor, (int, float))
        or isinstance(factor, bool)
        or factor <= 0
        or kind in ("llama3", "longrope", "su")
        or "gemma3" in str(config.get("model_type", ""))
    ):
        return positions, "max_position_embeddings"
    base, name = positions, "max_position_embeddings"
    original = rope.get("original_max_position_embeddings")
    if kind == "yarn" and isinstance(original, int) and original > 0:
        base, name = original, "original_max_position_embeddings"
    return int(base * factor), f"{name}={base} x rope factor {factor}"


def full_attention_everywhere(config: dict[str, Any]) -> bool:
    """Whether every layer of ``config`` keeps keys and values of every position for every KV head
    (what :func:`kv_bytes_per_token` counts). Not so with a sliding window (``sliding_window`` set
    and ``use_sliding_window`` not false), layers of other kinds (``layer_types`` other than
    ``full_attention``: hybrid and sliding layers) or multi-head latent attention (``kv_lora_rank``):
    their cache is smaller, and vLLM checks it itself."""
    sliding = config.get("sliding_window") is not None and config.get("use_sliding_window") is not False
    layer_types = config.get("layer_types")
    mixed = isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types)
    return not (sliding or mixed or config.get("kv_lora_rank") is not None)


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int | None:
    """Keys and values of every layer for one token: 2 x layers x kv heads x head dim x dtype
    bytes (``dtype`` auto: the checkpoint's), or None when ``config`` does not say."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (
        config["hidden_size"] // heads if isinstance(heads, int) and config.get("hidden_size") else None
    )
    if dtype == "auto":
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "")
    size = DTYPE_BYTES.get(dtype)
    dims = [v for v in (layers, kv_heads, head_dim) if isinstance(v, int) and v > 0]
    if len(dims) < 3 or size is None:
        return None
    return 2 * dims[0] * dims[1] * dims[2] * size


# Simple annotations a config value can be checked against: the type, and what a value must be.
_SIMPLE = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string (a number in quotes: key=\"'123'\")",
}


def _fits(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_constructor_kwargs(cls: type, kwargs: Any, prefix: str) -> None:
    """Each of ``kwargs`` whose parameter in ``cls.__init__`` is annotated with a plain type (int,
    float, bool, str, or a union of them with None) has that type: ``env.kwargs.eval_size=abc``
    fails here, naming ``<prefix>.eval_size``, instead of deep inside the env. Parameters without
    such an annotation are not checked. ``kwargs``: a dict or a DictConfig node."""
    import typing

    if isinstance(kwargs, DictConfig):
        kwargs = OmegaConf.to_container(kwargs, resolve=True)

    try:
        hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:  # unresolvable annotations: nothing to check against
        return
    for name, value in kwargs.items():
        hint = hints.get(name)
        options = (
            typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, type(int | None)) else (hint,)
        )
        kinds = [k for k in options if k is not type(None)]
        if not kinds or not all(k in _SIMPLE for k in kinds):
            continue
        if (value is None and type(None) in options) or any(_fits(value, k) for k in kinds):
            continue
        wanted = " or ".join(_SIMPLE[k] for k in kinds) + (" or null" if type(None) in options else "")
        raise ConfigError(
            f"{prefix}.{name}", value, f"{wanted} ({cls.__name__}.__init__ takes {name}: {_hint_name(hint)})"
        )


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)
