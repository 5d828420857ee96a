"""A population's ``trainer.max_steps`` that is not a whole number of population steps, and a
``population.tournament_size`` above the population, are refused by the start-up checks, before
any model loads (the first was refused only at fit start, after the model load; the second was
silently clamped to the population size)."""

from __future__ import annotations

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.run.validation import validate
from tests.conftest import compose_config


def test_max_steps_not_a_multiple_of_a_population_step_is_refused_before_loading(monkeypatch):
    import rlhf_lightning.models.build as build

    monkeypatch.setattr(build, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    # Side by side, one optimizer step per member and batch: a population step is 3 updates.
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["population.size=3", "trainer.max_steps=10"]))
    assert str(err.value) == (
        "invalid config: trainer.max_steps=10: it counts member updates: each population step takes 3 "
        "(3 members x 1 optimizer steps); set a multiple of 3"
    )
    validate(compose_config(["population.size=3", "trainer.max_steps=9"]))
    # Two mini-batches per rollout batch: each member takes 2 optimizer steps a population step.
    mini = ["algo.prompts_per_step=4", "algo.group_size=4", "algo.mini_batch_size=8"]
    with pytest.raises(ConfigError, match=r"each population step takes 6 \(3 members x 2 optimizer steps\)"):
        validate(compose_config(["population.size=3", "trainer.max_steps=9", *mini]))
    validate(compose_config(["population.size=3", "trainer.max_steps=12", *mini]))


@pytest.mark.parametrize(("size", "tournament", "ok"), [(4, 4, True), (4, 5, False), (3, 0, False)])
def test_tournament_size_is_within_the_population(size, tournament, ok):
    overrides = [
        f"population.size={size}",
        f"population.tournament_size={tournament}",
        "population.selection=tournament",
        f"trainer.max_steps={size * 10}",
    ]
    if ok:
        validate(compose_config(overrides))
        return
    with pytest.raises(
        ConfigError, match=rf"population\.tournament_size={tournament}: in \[1, population\.size={size}\]"
    ):
        validate(compose_config(overrides))
