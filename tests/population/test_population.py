"""Population training end to end: members, evolution, lineage, checkpoints, snapshots."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.population.callback import Member, Population
from rlhf_lightning.run import run
from rlhf_lightning.run.validation import validate
from tests.conftest import FAST, compose_config

POP = [
    *FAST,
    "population.size=2",
    "population.batched=false",  # round-robin (test_side_by_side.py: side by side)
    "population.evolve_every=2",
    "population.eval_rows=8",
    "population.init=config",  # the config's values, mutated once (init=sample: test_evolution_init.py)
    "population.selection=tournament",
    "population.resample_prob=0",
    "population.mutate_initial=true",
    "population.no_mutation_prob=0",
    "algo.lr=0.01",
    "trainer.val_check_interval=100",
    "eval.before_training=false",
    "eval.at_end=false",
]


def population_of(result) -> Population:
    return next(c for c in result.trainer.callbacks if isinstance(c, Population))


def base_weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if not p.requires_grad}


def test_clone_copies_weights_and_optimizer_state_and_shares_nothing():
    w = [torch.randn(3, 2), torch.randn(2)]
    opt = {
        "state": {0: {"exp_avg": torch.randn(3, 2), "step": torch.tensor(4.0)}},
        "param_groups": [{"lr": 1e-3}],
    }
    m = Member(7, {"lr": 1e-3}, w, opt, {"last_epoch": 4}, fitness=0.5)
    c = m.clone(9)
    # a clone has no fitness of its own until it is scored (its parent's described the parent)
    assert (c.id, c.parent, c.hparams, c.fitness) == (9, 7, {"lr": 1e-3}, None)
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(c.weights, m.weights))
    a, b = c.optimizer["state"][0]["exp_avg"], m.optimizer["state"][0]["exp_avg"]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    c.weights[0].add_(1.0)
    c.hparams["lr"] = 2.0
    assert not torch.equal(c.weights[0], m.weights[0]) and m.hparams["lr"] == 1e-3


@pytest.mark.slow
def test_population_trains_evolves_and_writes_its_lineage(tmp_path):
    out = tmp_path / "run"
    cfg = compose_config([*POP, "trainer.max_steps=4", "checkpoint.every_n_steps=0"], output_dir=out)
    base_before = None

    class Watch(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            nonlocal base_before
            base_before = base_weights(pl_module)

    result = run(cfg, extra_callbacks=[Watch()])
    pop = population_of(result)
    # The frozen base is shared and untouched; members differ (each trained on its own steps).
    after = base_weights(result.module)
    assert base_before is not None and all(torch.equal(after[n], base_before[n]) for n in after)
    assert pop.steps == 4 and len(pop.members) == 2
    rows = list(csv.DictReader((out / "lineage.csv").open()))
    assert [r["event"] for r in rows] == ["init", "init", "elite", "clone", "elite", "clone"]
    assert rows[1]["mutation"].startswith("lr ")  # mutate_initial: member 1 starts mutated
    # Each evolution: slot 0 keeps the fittest member as it was, slot 1 is a new id cloned from a parent.
    for r in (rows[2], rows[4]):
        assert r["slot"] == "0" and r["mutation"] == "none"
    for r in (rows[3], rows[5]):
        assert int(r["id"]) >= 2 and r["parent"] != "" and r["mutation"].startswith("lr ")
    metrics = list(csv.DictReader((out / "metrics.csv").open()))
    keys = set().union(*(r for r in metrics if any(r.values())))
    assert {"member_0/reward_mean", "member_1/reward_mean", "population/fitness_best"} <= keys
    assert (out / "population" / "best" / "actor" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_clone_at_evolution_copies_the_parent_exactly(tmp_path):
    """Cloning inside a run: the child's weights and optimizer state equal its parent's at selection."""
    seen = {}

    class Spy(Population):
        def evolve(self, trainer):
            self.store()
            before = {m.id: (m.weights, m.optimizer) for m in self.members}
            super().evolve(trainer)
            for m in self.members:
                w, o = before[m.parent if m.id not in before else m.id]
                seen[m.id] = all(torch.equal(a, b) for a, b in zip(m.weights, w)) and torch.equal(
                    m.optimizer["state"][0]["exp_avg"], o["state"][0]["exp_avg"]
                )

    cfg = compose_config(
        [*POP, "trainer.max_steps=2", "checkpoint.every_n_steps=0"], output_dir=tmp_path / "r"
    )
    from rlhf_lightning.run import population_callback

    spy = population_callback(cfg, tmp_path / "r")
    spy.__class__ = Spy
    cfg.population.size = 1  # the spy is the only population callback
    run(cfg, extra_callbacks=[spy])
    assert len(seen) == 2 and all(seen.values())


def final_population(out: Path) -> dict:
    state = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    (pop,) = [v for k, v in state["callbacks"].items() if k.startswith("Population")]
    return pop


@pytest.mark.slow
def test_population_checkpoint_resumes_exactly(tmp_path):
    common = [*POP, "checkpoint.every_n_steps=2", "checkpoint.keep_last=-1"]
    run(compose_config([*common, "trainer.max_steps=6"], output_dir=tmp_path / "full"))
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002.ckpt"
    assert ckpt.is_file()
    run(
        compose_config([*common, "trainer.max_steps=6", f"ckpt_path={ckpt}"], output_dir=tmp_path / "resumed")
    )
    a, b = final_population(tmp_path / "full"), final_population(tmp_path / "resumed")
    assert a["steps"] == b["steps"] == 6 and a["lineage"] == b["lineage"]
    for ma, mb in zip(a["members"], b["members"]):
        assert ma["hparams"] == mb["hparams"] and ma["id"] == mb["id"]
        assert all(torch.equal(x, y) for x, y in zip(ma["weights"], mb["weights"]))


@pytest.mark.slow
def test_background_snapshot_equals_the_state_at_its_step(tmp_path):
    out = tmp_path / "run"
    at_step = {}

    class Record(L.Callback):
        """Right after the snapshot starts (its thread may still be writing), copy the state, then
        change every live member in place: the file must hold the state of step 2 all the same."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pop = next(c for c in trainer.callbacks if isinstance(c, Population))
            if pop.steps == 2:
                at_step.update(pop.population_state())
                with torch.no_grad():
                    for m in pop.members:
                        for w in m.weights:
                            w.add_(1.0)

    cfg = compose_config(
        [*POP, "trainer.max_steps=4", "population.snapshot_every=2", "checkpoint.every_n_steps=0"],
        output_dir=out,
    )
    result = run(cfg, extra_callbacks=[Record()])
    snap = torch.load(out / "population" / "snapshot_step_000002.pt", weights_only=False)
    assert snap["steps"] == at_step["steps"] == 2 and snap["lineage"] == at_step["lineage"]
    for ms, ma in zip(snap["members"], at_step["members"]):
        assert all(torch.equal(x, y) for x, y in zip(ms["weights"], ma["weights"]))
    assert population_of(result).steps == 4 and (out / "population" / "snapshot_step_000004.pt").is_file()


def test_population_config_errors_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"population\.evolve_every=3.*multiple of population\.size=2"):
        validate(
            compose_config(
                ["population.size=2", "population.batched=false", "population.evolve_every=3"],
                output_dir=tmp_path,
            )
        )
    with pytest.raises(ConfigError, match=r"population\.mutate"):
        validate(
            compose_config(
                ["population.size=2", "population.mutate={momentum:{low:0,high:1}}"], output_dir=tmp_path
            )
        )
    with pytest.raises(ConfigError, match=r"population\.size=2.*SFT and DPO"):
        validate(compose_config(["algo=sft", "population.size=2"], output_dir=tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(
    "algo",
    [["algo=ppo"], ["algo=rloo"], ["algo=cispo"], ["algo=reinforce_pp"]],
    ids=["ppo", "rloo", "cispo", "reinforce_pp"],
)
def test_population_with_other_rollout_algorithms(tmp_path, algo):
    out = tmp_path / "run"
    space = "population.mutate={lr:{low:1e-5,high:1e-1,scale:2},temperature:{low:0.5,high:1.5,scale:1.2}}"
    result = run(
        compose_config(
            [*POP, *algo, space, "trainer.max_steps=4", "checkpoint.every_n_steps=0"], output_dir=out
        )
    )
    pop = population_of(result)
    assert pop.steps == 4 and len(list(csv.DictReader((out / "lineage.csv").open()))) == 6
    if algo == ["algo=ppo"]:  # members carry the critic adapter and value head too
        n_critic = len(result.module.policy.trainable_parameters("critic"))
        assert n_critic > 0 and len(pop.members[0].weights) == len(
            result.module.policy.trainable_parameters()
        )
        assert (out / "population" / "best" / "critic" / "value_head.safetensors").is_file()


@pytest.mark.slow
def test_every_mutable_hyper_parameter_of_grpo_takes_effect(tmp_path):
    """Members whose group size, clip bound, KL coefficient and temperature were mutated train with
    them: the rollout batch, the objective and the sampler follow the resident member."""
    seen = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pop = next(c for c in trainer.callbacks if isinstance(c, Population))
            hp, member = pop.members[pop.resident].hparams, pl_module.schedule.members[0]  # its learner state
            seen.append((hp, member.hp.group_size, member.hp.clip_high, member.hp.beta,
                         member.sampling.temperature, pl_module.learner.objective(member).kl_term is not None))  # fmt: skip

    space = (
        "population.mutate={group_size:{low:2,high:8,scale:2},clip_high:{low:0.1,high:0.4,scale:1.5},"
        "beta:{low:0.01,high:0.1,scale:2},temperature:{low:0.5,high:1.5,scale:1.25}}"
    )
    cfg = compose_config(
        [*POP, space, "trainer.max_steps=12", "checkpoint.every_n_steps=0"], output_dir=tmp_path / "r"
    )
    run(cfg, extra_callbacks=[Watch()])
    assert len(seen) == 12
    for hp, group, clip, beta, temperature, has_kl in seen:
        assert (group, clip, beta, temperature) == (
            hp["group_size"],
            hp["clip_high"],
            hp["beta"],
            hp["temperature"],
        )
        assert has_kl == (beta > 0)
    lineage = list(csv.DictReader((tmp_path / "r" / "lineage.csv").open()))
    changed = {r["mutation"].split(" ")[0] for r in lineage if r["mutation"] != "none"}
    assert len(changed) >= 3  # several of the four were mutated along the way


def test_ranks_that_disagree_after_selection_stop_the_run():
    class FakeModule:
        world_size, device = 2, "cpu"

        def all_gather(self, t):
            other = t.clone()
            other[0, 1] += 1e-3  # rank 1 drew another lr
            return torch.stack([t, other])

    pop = Population(2, 2, {}, "/tmp/unused")
    pop.module = FakeModule()
    pop.members = [Member(0, {"lr": 1e-3}, [], {}, {}), Member(1, {"lr": 2e-3}, [], {}, {})]
    with pytest.raises(RuntimeError, match="ranks disagree after selection"):
        pop.check_ranks_agree()
    FakeModule.all_gather = lambda self, t: torch.stack([t, t.clone()])
    pop.check_ranks_agree()  # the same population everywhere: nothing to say
