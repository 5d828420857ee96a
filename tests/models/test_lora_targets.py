"""``model.lora.target_modules`` names that match no module of the model fail when the policy is
built, naming the field and listing the model's linear modules (PEFT's own error named no field,
and a list with one wrong name among right ones passed silently)."""

from __future__ import annotations

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.models.build import build_policy

# Qwen2's linear layers (attention, MLP, and the output head tied to the embeddings).
QWEN2_LINEAR = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


@pytest.mark.parametrize("targets", [["nope"], ["q_proj", "qproj"]])
def test_a_target_module_that_matches_nothing_names_the_field_and_the_linear_modules(tiny_model, targets):
    with pytest.raises(ConfigError) as err:
        build_policy(tiny_model, lora_target_modules=targets)
    bad = targets[-1]
    assert str(err.value) == (
        f"invalid config: model.lora.target_modules={targets!r}: names of the model's modules: {bad} match "
        f"none; its linear modules are {QWEN2_LINEAR} (or all-linear)"
    )


def test_matching_target_modules_get_adapters(tiny_model):
    policy = build_policy(tiny_model, lora_target_modules=["q_proj", "self_attn.v_proj"])
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in policy.model.named_parameters() if "lora_A" in n
    }
    assert adapted == {"q_proj", "v_proj"}
