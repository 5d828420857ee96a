"""Gradient clipping goes through Lightning, after mixed precision has unscaled the gradients."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from rlhf_lightning.run import build
from tests.conftest import FAST, compose_config


def grad_norm_of_first_step(tmp_path, precision: str) -> float:
    """The gradient norm (before clipping) of the first optimizer step, and a check that the
    clipped gradients have the clip norm (they were unscaled before clipping)."""
    cfg = compose_config([*FAST, "algo.grad_clip=1e-3"], output_dir=tmp_path / precision)
    L.seed_everything(0)
    module, dm = build(cfg, tmp_path)
    kwargs: dict = {"precision": precision}
    if precision == "16-mixed":
        # Lightning's Trainer(precision="16-mixed") turns into bf16 autocast on a CPU; the
        # plugin built directly runs real fp16 autocast with fp16's loss scaler, here at a large
        # scale as at the start of training (2**10: fp16 gradients of this model do not overflow).
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kwargs = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **kwargs,
    )
    assert trainer.precision == precision
    seen: list[torch.Tensor] = []
    original = module.stepper.before_step  # the clip and the non-finite check, in optimizer.step()

    def spy(*args):
        out = original(*args)
        # after clipping, the (unscaled) gradients have the clip norm
        grads = [p.grad for p in module.policy.trainable_parameters() if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
        return out

    module.stepper.before_step = spy
    trainer.fit(module, datamodule=dm)
    assert seen, "no optimizer step ran"
    torch.testing.assert_close(seen[0], torch.tensor(1e-3), rtol=1e-3, atol=0)
    return float(trainer.callback_metrics["actor/grad_norm"])


def rounding_tolerance(dtype: torch.dtype, num_layers: int) -> float:
    """A first-order bound on the relative error of a gradient computed under autocast.

    Autocast rounds the inputs of every matmul to ``dtype`` (unit roundoff u = eps / 2). Along
    one path through a decoder layer the forward pass rounds about 6 times (q/k -> scores ->
    values -> output projection; gate/up -> down), plus once for the lm head, and the backward
    pass as often again: to first order the relative error is at most (that count) x u.
    """
    roundings = 2 * (6 * num_layers + 1)
    return roundings * torch.finfo(dtype).eps / 2


@pytest.mark.parametrize(
    ("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
)
@pytest.mark.slow
def test_clipping_sees_unscaled_gradients_under_mixed_precision(tmp_path, precision, dtype):
    full = grad_norm_of_first_step(tmp_path, "32-true")
    mixed = grad_norm_of_first_step(tmp_path, precision)
    layers = tiny_layers()
    # The same gradient up to the dtype's rounding (fp16: 2**10 times larger were it still scaled).
    assert abs(mixed - full) / full < rounding_tolerance(dtype, layers), (mixed, full)


def tiny_layers() -> int:
    from transformers import AutoConfig

    from rlhf_lightning.models.tiny import TINY_MODEL_DIR

    return int(AutoConfig.from_pretrained(TINY_MODEL_DIR).num_hidden_layers)


def test_grad_norm_and_clip_by_norm_match_torch():
    from rlhf_lightning.runtime.distributed import clip_by_norm, grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params[:2]:
        p.grad = torch.randn_like(p) * 3
    ref = [p.grad.clone() if p.grad is not None else None for p in params]
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in ref if g is not None))
    norm = grad_norm(params)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    clip_by_norm(params, 1.0, norm)
    for p, g in zip(params[:2], ref[:2]):
        torch.testing.assert_close(p.grad, g * (1.0 / (expected.float() + 1e-6)), rtol=1e-6, atol=1e-7)
    assert params[2].grad is None
    assert float(grad_norm(params)) == pytest.approx(1.0, rel=1e-5)
    clip_by_norm(params, 10.0, grad_norm(params))  # below the bound: unchanged
    assert float(grad_norm(params)) == pytest.approx(1.0, rel=1e-5)
