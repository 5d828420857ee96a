"""population.init=sample: members start from the mutation space's prior, as a search draws its
trials; population.selection=truncation: the least fit is replaced, the rest are kept."""

from __future__ import annotations

import csv
import random

import pytest

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.population.evolution import MutationRange, sample_prior
from rlhf_lightning.population.generations import Generations
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.run import run
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config

SPACE = "population.mutate={lr:{low:1e-4,high:1e-2,scale:2},temperature:{low:0.7,high:1.3,scale:1.2}}"
RUN = [
    *FAST,
    "population.size=2",
    "population.batched=true",
    "population.evolve_every=1",
    "population.eval_rows=8",
    SPACE,
    "trainer.val_check_interval=100",
    "eval.before_training=false",
    "eval.at_end=false",
    "checkpoint.every_n_steps=0",
    "trainer.max_steps=4",
    "seed=5",
]


@pytest.mark.slow
def test_members_start_from_the_prior_and_truncation_keeps_the_fitter(tmp_path, monkeypatch):
    scored: list[tuple[list[float], list[int]]] = []  # per evolution: fitness and member id by slot
    assign = Generations.assign_fitness

    def spy(self, fitness):
        scored.append((list(fitness), [m.id for m in self.members]))
        return assign(self, fitness)

    monkeypatch.setattr(Generations, "assign_fitness", spy)
    out = tmp_path / "run"
    result = run(compose_config(RUN, output_dir=out))
    pop = next(c for c in result.trainer.callbacks if isinstance(c, SideBySidePopulation))
    lineage = list(csv.DictReader((out / "lineage.csv").open()))
    init = [r for r in lineage if r["event"] == "init"]
    # the population's RNG is seeded with the run's seed: replay its two draws
    space = {"lr": MutationRange(1e-4, 1e-2, 2.0), "temperature": MutationRange(0.7, 1.3, 1.2)}
    rng = random.Random(5)
    base = {"lr": 1e-3, "temperature": 1.0}
    for row in init:
        drawn, how = sample_prior(base, space, rng)
        assert float(row["lr"]) == pytest.approx(drawn["lr"]) and 1e-4 <= float(row["lr"]) <= 1e-2
        assert float(row["temperature"]) == pytest.approx(drawn["temperature"])
        assert row["mutation"] == how
    assert init[0]["lr"] != init[1]["lr"]
    # two evolutions: each keeps the fitter member and replaces the other with its clone
    events = [r["event"] for r in lineage if r["event"] != "init"]
    assert sorted(events) == ["clone", "clone", "kept", "kept"]
    assert pop.steps == 2
    assert_truncation_kept_the_fitter(lineage, scored)


def assert_truncation_kept_the_fitter(lineage: list[dict[str, str]], scored: list) -> None:
    """Each evolution (two members, one replaced) kept the member of the highest fitness (ties:
    the lower slot) and replaced the other with a clone of it: judged from the fitness scored
    before selection, not from what the lineage says of itself."""
    steps = sorted({int(r["step"]) for r in lineage if r["event"] != "init"})
    assert len(steps) == len(scored) == 2
    for step, (fitness, ids) in zip(steps, scored):
        rows_ = {r["event"]: r for r in lineage if int(r["step"]) == step}
        kept, clone = rows_["kept"], rows_["clone"]
        best = max(range(len(fitness)), key=lambda i: (fitness[i], -i))
        assert int(kept["slot"]) == best and int(kept["id"]) == ids[best], (step, fitness, kept)
        assert int(clone["slot"]) != best and int(clone["parent"]) == ids[best], (step, fitness, clone)
        assert float(kept["parent_fitness"]) == float(clone["parent_fitness"]) == max(fitness)
    assert any(len(set(fitness)) > 1 for fitness, _ in scored), scored  # some evolution had a fitter member


def test_bad_population_settings_are_refused_with_the_fix(tmp_path):
    for override, key in (
        ("population.truncation=0.75", "population.truncation"),
        ("population.resample_prob=1.5", "population.resample_prob"),
        ("population.mutate={lr:{low:0,high:1e-2,scale:2,prior:log}}", "population.mutate.lr"),
        ("population.mutate={lr:{low:1e-4,high:1e-2,scale:2,prior:normal}}", "population.mutate.lr"),
    ):
        cfg = compose_config([*FAST, "population.size=2", override], output_dir=tmp_path)
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(cfg)
    with pytest.raises(Exception, match=r"population\.init"):
        compose_config([*FAST, "population.size=2", "population.init=random"], output_dir=tmp_path)
