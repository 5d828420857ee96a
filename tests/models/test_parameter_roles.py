"""Parameters are grouped by role once, when the policy is built (``Policy.roles``)."""

from __future__ import annotations

from rlhf_lightning.models.policy import parameter_roles

NAMES = [
    "model.base_model.model.layers.0.q_proj.base_layer.weight",
    "model.base_model.model.layers.0.q_proj.lora_A.actor.weight",
    "model.base_model.model.layers.0.q_proj.lora_A.critic.weight",
    "model.base_model.model.layers.0.q_proj.lora_A.reference.weight",
    "value_head.weight",
    "value_head.bias",
]


def test_lora_roles():
    trainable = {NAMES[1], NAMES[2], "value_head.weight", "value_head.bias"}
    roles = parameter_roles(NAMES, trainable, "reference", "critic")
    assert roles["actor"] == {NAMES[1]}
    assert roles["critic"] == {NAMES[2], "value_head.weight", "value_head.bias"}
    assert roles["reference"] == {NAMES[3]}
    assert roles["frozen"] == {NAMES[0]}
    assert set().union(*roles.values()) == set(NAMES)  # every parameter has exactly one role
    assert sum(len(v) for v in roles.values()) == len(NAMES)


def test_full_fine_tuning_roles_keep_a_frozen_reference_copy_out_of_the_trained_groups():
    names = ["model.layers.0.weight", "reference.layers.0.weight"]
    roles = parameter_roles(names, {"model.layers.0.weight"}, None, None)
    assert roles["actor"] == {"model.layers.0.weight"}
    assert roles["reference"] == frozenset() and roles["critic"] == frozenset()
    assert roles["frozen"] == {"reference.layers.0.weight"}  # rebuilt from the base on resume
