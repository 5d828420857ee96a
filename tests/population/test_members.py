"""What each member owns in a real run: the exported adapters are the fittest member's, fitness
is measured at one temperature, each member has its own moving reference, its own critic
warm-up and its own schedule, and the reported best lr is the fittest member's."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from rlhf_lightning.population.callback import Member, Population
from rlhf_lightning.population.evolution import MutationRange
from rlhf_lightning.run import run
from tests.conftest import compose_config
from tests.population.test_population import POP, final_population, population_of

QUIET = ["checkpoint.every_n_steps=0"]


def resident_of(trainer) -> tuple[Population, int]:
    pop = next(c for c in trainer.callbacks if isinstance(c, Population))
    assert pop.resident is not None
    return pop, pop.resident


def adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "actor" / "adapter_model.safetensors"))


def saved_names(policy) -> list[str]:
    """The actor's trainable parameters as the exported adapter names them (PEFT drops the
    adapter name), in ``trainable_parameters`` order (the order of a member's weights)."""
    name_of = {id(p): n for n, p in policy.model.named_parameters()}
    return [name_of[id(p)].replace(".actor.", ".") for p in policy.trainable_parameters("actor")]


def named(policy, adapter: str) -> dict[str, torch.Tensor]:
    """Copies of one adapter's weights, keyed by their names with the adapter name left out."""
    return {
        n.replace(f".{adapter}.", "."): p.detach().clone()
        for n, p in policy.named_parameters()
        if f".{adapter}." in n
    }


@pytest.mark.slow
def test_exported_last_adapters_are_the_fittest_member(tmp_path):
    """The issue's case: size 2, evolve every 4 of 6 steps, checkpoints every 3. The last
    checkpoint (step 6) is taken with slot 1 resident; the elite sits in slot 0."""
    out = tmp_path / "run"
    overrides = [*POP, "population.evolve_every=4", "trainer.max_steps=6", "checkpoint.every_n_steps=3"]
    result = run(compose_config(overrides, output_dir=out))
    pop = population_of(result)
    best = pop.best_slot()
    assert best == 0 and pop.members[0].fitness is not None  # the elite
    last = adapter_tensors(out / "checkpoints" / "adapters" / "last")
    assert last.keys() == adapter_tensors(out / "population" / "best").keys()
    for k, v in adapter_tensors(out / "population" / "best").items():
        assert torch.equal(last[k], v), k
    names = saved_names(result.module.policy)
    for member, same in ((pop.members[best], True), (pop.members[1 - best], False)):
        weights = dict(zip(names, member.weights[: len(names)], strict=True))
        equal = all(torch.equal(last[k], weights[k].cpu()) for k in last)
        assert equal is same, f"adapters/last vs member {member.id}"


@pytest.mark.slow
@pytest.mark.parametrize(("fitness", "expected"), [("accuracy_sampled", 1.0), ("return_greedy", 0.0)])
def test_every_member_is_scored_at_the_same_temperature(tmp_path, fitness, expected):
    scored = []  # (the resident member's own temperature, the temperature it was scored at)

    class Watch(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            rollout = pl_module.source.generate

            def spy(rows, params, *, group_size, evaluation=False):
                if evaluation:
                    pop, slot = resident_of(trainer)
                    scored.append((pop.members[slot].hparams["temperature"], params.temperature))
                return rollout(rows, params, group_size=group_size, evaluation=evaluation)

            pl_module.source.generate = spy

    space = "population.mutate={temperature:{low:0.3,high:3.0,scale:2}}"
    cfg = compose_config(
        [*POP, space, f"population.fitness={fitness}", "trainer.max_steps=2", *QUIET],
        output_dir=tmp_path / "r",
    )
    assert cfg.rollout.temperature == 1.0
    run(cfg, extra_callbacks=[Watch()])
    own = sorted(t for t, _ in scored)
    assert len(own) == 2 and 1.0 in own and own[0] != own[1]  # member 1 was mutated (x2 or /2)
    assert [at for _, at in scored] == [expected, expected]


@pytest.mark.slow
def test_each_member_keeps_and_refreshes_its_own_reference(tmp_path):
    """Reference refreshed every 2 of a member's own updates (slot 0 trains at steps 1, 3, 5;
    slot 1 at 2, 4, 6): each reference is its member's actor after that member's 2nd update,
    and the KL of every step is taken against the resident member's own reference."""
    after = {0: [], 1: []}  # each slot's actor after each of its updates
    at_start = []  # (the policy's reference, the resident member's stored reference) at each step

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            pop, slot = resident_of(trainer)
            ref_names = list(named(pl_module.policy, "reference"))
            at_start.append(
                (
                    named(pl_module.policy, "reference"),
                    {k: w.clone() for k, w in zip(ref_names, pop.members[slot].reference)},
                )
            )
            # the population refreshes, per member: its learner member's setting, not the module's
            assert pl_module.schedule.members[0].hp.ref_update_interval is None
            assert pl_module.hp.ref_update_interval == 2

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _, slot = resident_of(trainer)
            after[slot].append(named(pl_module.policy, "actor"))

    overrides = [
        *POP, "population.evolve_every=0", "algo.beta=0.05", "algo.use_separate_reference_adapter=true",
        "algo.ref_update_interval=2", "trainer.max_steps=6", *QUIET,
    ]  # fmt: skip
    result = run(compose_config(overrides, output_dir=tmp_path / "r"), extra_callbacks=[Watch()])
    pop = population_of(result)
    pop.store()
    policy = result.module.policy
    ref_names = list(named(policy, "reference"))
    for slot in (0, 1):
        own = dict(zip(ref_names, pop.members[slot].reference, strict=True))
        assert len(after[slot]) == 3
        assert all(torch.equal(own[k], after[slot][1][k]) for k in own)  # its 2nd update
        assert not all(torch.equal(own[k], after[slot][2][k]) for k in own)  # not its 3rd
    other = dict(zip(ref_names, pop.members[1].reference))
    assert not all(torch.equal(v, other[k]) for k, v in zip(ref_names, pop.members[0].reference))
    for live, stored in at_start:
        assert all(torch.equal(live[k], stored[k]) for k in live)


@pytest.mark.slow
def test_each_ppo_member_has_its_own_critic_warm_up(tmp_path):
    from rlhf_lightning.algorithms.ppo import warming_up

    warming = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            warming.append(warming_up(pl_module.schedule.members[0]))  # the resident's learner state

    overrides = [
        *POP, "algo=ppo", "algo.critic_warmup_steps=1", "population.evolve_every=0", "trainer.max_steps=4", *QUIET
    ]  # fmt: skip
    result = run(compose_config(overrides, output_dir=tmp_path / "r"), extra_callbacks=[Watch()])
    assert warming == [True, True, False, False]  # each member's first step only
    state = population_of(result).population_state()
    assert [m["counters"] for m in state["members"]] == [{"learn_steps": 2}, {"learn_steps": 2}]


@pytest.mark.slow
def test_each_member_schedule_spans_its_share_of_an_epoch_run(tmp_path):
    """``max_steps=-1`` with one epoch of 16 rows / 4 prompts = 4 steps: each member's cosine
    spans its 2 updates (lr 0.01 -> 0.01 * (0.1 + 0.9 * (1 + cos(pi / 2)) / 2) -> 0.001)."""
    out = tmp_path / "r"
    overrides = [
        *POP, "trainer.max_steps=-1", "trainer.max_epochs=1", "env.kwargs.train_size=16",
        "trainer.val_check_interval=null", "trainer.limit_val_batches=0", "population.evolve_every=0",
        "population.mutate_initial=false", *QUIET,
    ]  # fmt: skip
    result = run(compose_config(overrides, output_dir=out))
    assert population_of(result).steps == 4
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    for slot in (0, 1):
        lrs = [float(r[f"member_{slot}/lr"]) for r in rows if r.get(f"member_{slot}/lr")]
        expected = [0.01 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 2))) for k in (1, 2)]
        assert lrs == pytest.approx(expected, rel=1e-6)


def test_best_lr_is_the_fittest_members_without_elitism():
    logged = {}
    pop = Population(
        2, 2, {"lr": MutationRange(1e-5, 1e-1, 2.0)}, "/tmp/unused", elitism=False, no_mutation_prob=0.0
    )
    pop.module = SimpleNamespace(world_size=1, log_metrics=logged.update)
    pop.members = [Member(0, {"lr": 1e-3}, [], {}, {}), Member(1, {"lr": 5e-3}, [], {}, {})]
    pop.score = lambda trainer: [0.1, 0.9]  # member 1 is the fittest
    pop.load = lambda slot: None  # no model to load members into
    pop.evolve(SimpleNamespace(global_step=2, is_global_zero=False))
    assert float(logged["population/best_lr"]) == pytest.approx(5e-3)
    # Slot 0 holds a mutated clone (no elitism), whose lr is not the one reported.
    assert pop.members[0].parent == 1 and pop.members[0].hparams["lr"] != pytest.approx(5e-3)


@pytest.mark.slow
def test_a_resume_restores_each_members_reference_and_counters(tmp_path):
    """PPO with a moving reference, every member's own warm-up, evolution every 2 steps: resumed
    from step 4 (both references refreshed by then), the run ends as the uninterrupted one."""
    common = [
        *POP, "algo=ppo", "algo.critic_warmup_steps=2", "algo.beta=0.05",
        "algo.use_separate_reference_adapter=true", "algo.ref_update_interval=2",
        "checkpoint.every_n_steps=2", "checkpoint.keep_last=-1", "trainer.max_steps=6",
    ]  # fmt: skip
    run(compose_config(common, output_dir=tmp_path / "full"))
    ckpt = tmp_path / "full" / "checkpoints" / "step_000004.ckpt"
    run(compose_config([*common, f"ckpt_path={ckpt}"], output_dir=tmp_path / "resumed"))
    a, b = final_population(tmp_path / "full"), final_population(tmp_path / "resumed")
    assert a["lineage"] == b["lineage"]
    for ma, mb in zip(a["members"], b["members"], strict=True):
        assert ma["counters"] == mb["counters"] and ma["counters"]["learn_steps"] >= 3
        assert len(ma["reference"]) > 0
        for key in ("weights", "reference"):
            assert all(torch.equal(x, y) for x, y in zip(ma[key], mb[key], strict=True)), key
