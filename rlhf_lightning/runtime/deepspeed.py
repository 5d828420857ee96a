"""``strategy=deepspeed_zero2|deepspeed_zero3``: Lightning's DeepSpeedStrategy around the
project's own optimizer (one AdamW, manual optimization, LoRA adapters).

    deepspeed_zero2   optimizer state and gradients partitioned (ZeRO-2)
    deepspeed_zero3   composes, and is refused at start-up (:data:`ZERO3_REFUSED`): the policy
                      reads weights outside a module's forward, where ZeRO-3 has released them

What the run keeps doing itself, and what DeepSpeed does instead:
    - gradient accumulation: the learner runs any number of backward passes per optimizer step,
      so DeepSpeed's own accumulation is off (``managed_gradient_accumulation: false``, every
      ``engine.step()`` is the boundary; with it on, only the last pass would count), and each
      backward pass is announced as ``engine.forward()`` would (:func:`before_backward`);
    - gradient clipping: DeepSpeed clips by the global norm (``gradient_clipping`` =
      ``algo.grad_clip``); Lightning's ``clip_gradients`` is a no-op under DeepSpeed;
    - ``strategy.offload_optimizer=true``: the optimizer states and step on the CPU (ZeRO-Offload).

deepspeed is imported only when the strategy is built: composing, validating and the start-up
refusals (:mod:`rlhf_lightning.run.deepspeed_checks`) work without it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from rlhf_lightning.config.errors import ConfigError

ZERO_STAGES = {"deepspeed_zero2": 2, "deepspeed_zero3": 3}
# Why strategy=deepspeed_zero3 is refused at start-up. Seen on the CPU (DS_ACCELERATOR=cpu,
# deepspeed 0.19.8): three steps run, but the exported adapters (adapters/step_*, last) came out
# as empty tensors, and its parameters are released between the policy's own forward passes.
ZERO3_REFUSED = (
    "deepspeed_zero2, or strategy=fsdp to partition the weights as well: under ZeRO-3 the policy "
    "reads weights outside a module's forward (the lm head in the chunked log-prob op, the "
    "adapters when they are exported), where DeepSpeed has released them (exports came out empty)"
)
# The release these settings were written against (``managed_gradient_accumulation`` is recent).
MIN_DEEPSPEED = (0, 19, 8)


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def deepspeed_missing(version: str | None = "installed") -> str | None:
    """Why deepspeed cannot be used here (not installed, too old), or None.

    ``version``: the installed version to judge ("installed": ask the environment; None: absent).
    """
    if version == "installed":
        try:
            version = (
                importlib.metadata.version("deepspeed")
                if importlib.util.find_spec("deepspeed") is not None
                else None
            )
        except importlib.metadata.PackageNotFoundError:
            version = None
    want = ".".join(map(str, MIN_DEEPSPEED))
    if version is None:
        return f"deepspeed is not installed: pip install 'deepspeed>={want}'"
    if _version_tuple(version) < MIN_DEEPSPEED:
        return f"deepspeed {version} is too old (needs managed_gradient_accumulation): pip install 'deepspeed>={want}'"
    return None


def deepspeed_config(stage: int, grad_clip: float | None, offload_optimizer: bool) -> dict[str, Any]:
    """The DeepSpeed config for ZeRO ``stage`` with the project's own optimizer and schedule."""
    zero: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": False}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW, built by configure_optimizers
        "zero_force_ds_cpu_optimizer": False,  # offloaded: torch's AdamW steps on the CPU
        # the learner accumulates; step() is the boundary. (gradient_accumulation_steps is not
        # set: Lightning refuses it in the config and takes trainer.accumulate_grad_batches, 1.)
        "managed_gradient_accumulation": False,
        "train_micro_batch_size_per_gpu": 1,  # DeepSpeed's throughput log only
        "gradient_clipping": float(grad_clip) if grad_clip is not None else 0.0,
        "steps_per_print": 2**31 - 1,  # no progress lines of its own
    }


def deepspeed_strategy(
    name: str,
    grad_clip: float | None,
    offload_optimizer: bool,
    process_group_backend: str | None,
    timeout: timedelta,
) -> Any:
    """Lightning's DeepSpeedStrategy for ``strategy=<name>`` (a ``ZERO_STAGES`` key)."""
    problem = deepspeed_missing()
    if problem is not None:
        raise ConfigError("strategy.name", name, f"a strategy whose library is installed: {problem}")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class ProjectDeepSpeed(DeepSpeedStrategy):
        """Checkpoints as single Lightning files of the trainable weights (what the run's
        checkpoint callbacks prune, export and check)."""

        def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            before_backward(self.model)
            return super().backward(closure_loss, optimizer, *args, **kwargs)

        @contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            """No ``engine.no_sync()``: ZeRO-2/3 refuse it (they reduce and partition gradients in
            every backward pass); the learner's backward passes run as they are."""
            yield None

        def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
            return {}  # partitioned by ZeRO; resuming is refused at start-up

        def lightning_module_state_dict(self) -> dict[str, Any]:
            module: Any = self.lightning_module
            keys = getattr(module, "checkpoint_keys", None)
            keep = (
                keys() if keys is not None else {n for n, p in module.named_parameters() if p.requires_grad}
            )
            return {n: p.detach().cpu().clone() for n, p in module.named_parameters() if n in keep}

        def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any = None) -> None:
            checkpoint = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    return ProjectDeepSpeed(
        stage=ZERO_STAGES[name],
        config=deepspeed_config(ZERO_STAGES[name], grad_clip, offload_optimizer),
        process_group_backend=process_group_backend,
        timeout=timeout,
    )


def before_backward(engine: Any) -> None:
    """What ``engine.forward()`` does before a backward pass and the learner's own forward passes
    (through the policy, not the engine) skip: without it ZeRO-3 keeps only the last backward
    pass's gradients of an optimizer step instead of their sum (it counts micro-steps there)."""
    clear = getattr(getattr(engine, "optimizer", None), "clear_backward_seen_flag", None)
    if callable(clear):
        clear()
