"""Members side by side (``population.batched=true``): one rollout for every member, each
member's own update, the module's member API, checkpoints and snapshots."""

from __future__ import annotations

import csv
import dataclasses

import lightning as L
import pytest
import torch

from rlhf_lightning.algorithms.base import RolloutModule
from rlhf_lightning.algorithms.population_step import PopulationStep
from rlhf_lightning.errors import ConfigError
from rlhf_lightning.population.members import Member
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.run import run
from rlhf_lightning.validation import validate
from tests.conftest import FAST, compose_config

# Two members side by side, evolved every population step from mutated starts (test_resume.py too).
MEMBERS = [
    "population.size=2",
    "population.batched=true",
    "population.evolve_every=1",
    "population.eval_rows=8",
    "population.mutate_initial=true",
    "population.no_mutation_prob=0",
]
POP = [
    *FAST,
    *MEMBERS,
    "algo.lr=0.001",
    "trainer.val_check_interval=100",
    "eval.before_training=false",
    "eval.at_end=false",
    "checkpoint.every_n_steps=0",
]


def population_of(result) -> SideBySidePopulation:
    return next(c for c in result.trainer.callbacks if isinstance(c, SideBySidePopulation))


def actor_as_member_weights(module) -> dict[str, torch.Tensor]:
    """A single run's trainable slots keyed like :meth:`MemberAPI.member_state`'s weights (the
    actor, PPO's critic as slot 1 and its value head)."""
    out = {}
    for i, slot in enumerate(("actor", "critic")):
        for n, p in module.policy.model.named_parameters():
            if f".{slot}." in n:
                out[f"{i}:{n.replace(f'.{slot}.', '.{}.')}"] = p.detach().clone()
    if module.policy.value_head is not None:
        out.update(
            {f"value_head:{n}": p.detach().clone() for n, p in module.policy.value_head.named_parameters()}
        )
    return out


def seeded_rollout(module, rows, k_or_none):
    """The episodes of one member (or a single run) for a step, from a seed of that step alone."""
    step = module.global_step // module.steps_per_batch()
    with torch.random.fork_rng():
        torch.manual_seed(1000 + step)
        if k_or_none is None:
            return module.rollout(rows, module.sampling, group_size=module.hp.group_size)
        module.show_member(k_or_none)
        sampling = module.member_sampling(k_or_none)
        return module.rollout(rows, sampling, group_size=module.member_hp(k_or_none).group_size)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["algo=ppo", "algo.critic_warmup_steps=1"]], ids=["grpo", "ppo"])
def test_each_member_updates_exactly_as_a_single_run_with_its_hyper_parameters(tmp_path, monkeypatch, algo):
    """Two population steps, each member given the same episodes a single run with its learning
    rate gets: every member's adapters (PPO: and value head) end bit for bit where that run's
    trainable slots end."""

    def member_rollouts(self, rows, evaluation=False, temperature=None):
        return {name: seeded_rollout(self, rows, k) for k, name in enumerate(self.members.adapters)}

    def training_rollout(self, rows):
        return seeded_rollout(self, rows, None), {}

    monkeypatch.setattr(PopulationStep, "member_rollouts", member_rollouts)
    monkeypatch.setattr(RolloutModule, "training_rollout", training_rollout)
    cfg = compose_config(
        [*POP, *algo, "population.evolve_every=0", "trainer.max_steps=4"], output_dir=tmp_path / "p"
    )
    pop = run(cfg).module
    assert pop.global_step == 4 and pop.members.size == 2
    lrs = [h["lr"] for h in pop.members.hparams]
    assert lrs[0] == 0.001 and lrs[1] in (0.002, 0.0005)  # member 1 mutated once at the start
    for k, lr in enumerate(lrs):
        single = compose_config(
            [*FAST, *algo, f"algo.lr={lr}", "trainer.max_steps=2", "trainer.val_check_interval=100",
             "eval.before_training=false", "eval.at_end=false", "checkpoint.every_n_steps=0"],
            output_dir=tmp_path / f"single_{k}",
        )  # fmt: skip
        expected = actor_as_member_weights(run(single).module)
        got = pop.member_state(k)["weights"]
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) for n in got), f"member {k}"
    first = pop.member_state(0)["weights"]
    assert not all(torch.equal(first[n], w) for n, w in pop.member_state(1)["weights"].items())


@pytest.mark.slow
def test_one_mixed_rollout_gives_each_member_the_episodes_of_its_own_adapter(tmp_path):
    """Greedy, the population's one engine call gives each member the completions that member's
    adapter gives alone in the policy's slot (one call per member)."""
    seen = {}

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            rows = list(range(6))
            mixed = pl_module.score_members(rows, temperature=0.0)
            for k, result in enumerate(mixed):
                pl_module.show_member(k)
                params = dataclasses.replace(pl_module.sampling, temperature=0.0)
                alone = pl_module.rollout(rows, params, group_size=1, evaluation=True)
                seen[k] = (
                    [t.token_ids for t in result.trajectories],
                    [t.token_ids for t in alone.trajectories],
                    {t.adapter for t in result.trajectories},
                )

    cfg = compose_config([*POP, "trainer.max_steps=4", "algo.lr=0.05", "population.evolve_every=0"],
                         output_dir=tmp_path / "r")  # fmt: skip
    run(cfg, extra_callbacks=[Check()])
    assert len(seen) == 2
    for k, (mixed, alone, adapters) in seen.items():
        assert mixed == alone and adapters == {f"member_{k}"}
    assert seen[0][0] != seen[1][0]  # the members have learned apart (lr 0.05 vs 0.1 or 0.025)


@pytest.mark.slow
def test_max_steps_counts_member_updates_and_the_log_shows_both(tmp_path):
    out = tmp_path / "run"
    result = run(compose_config([*POP, "trainer.max_steps=6"], output_dir=out))
    pop = population_of(result)
    assert result.trainer.global_step == 6 and pop.steps == 3  # 3 population steps x 2 members
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("population/steps")]
    assert [(r["population/steps"], r["step"]) for r in rows] == [("1.0", "2"), ("2.0", "4"), ("3.0", "6")]
    updates = [r["population/member_updates"] for r in csv.DictReader((out / "metrics.csv").open())]
    assert [u for u in updates if u] == ["2.0", "4.0", "6.0"]
    lineage = list(csv.DictReader((out / "lineage.csv").open()))
    assert [r["event"] for r in lineage] == ["init", "init"] + ["elite", "clone"] * 3
    assert (out / "population" / "best" / "actor" / "adapter_config.json").is_file()


def test_max_steps_must_be_a_whole_number_of_population_steps(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.max_steps=3.*multiple of 2"):
        run(compose_config([*POP, "trainer.max_steps=3"], output_dir=tmp_path / "r"))


@pytest.mark.slow
def test_evolution_clones_the_parent_exactly_into_its_slot(tmp_path):
    """At an evolution every slot receives its parent's adapter, optimizer moments and schedule
    position; the elite keeps its hyper-parameters, a clone's are mutated."""
    seen = []

    class Spy(SideBySidePopulation):
        def evolve(self, trainer):
            before = [self.module.member_state(k) for k in range(self.size)]
            ids = [m.id for m in self.members]
            super().evolve(trainer)
            for slot, child in enumerate(self.members):
                parent = ids.index(child.id if slot == 0 else child.parent)
                after, was = self.module.member_state(slot), before[parent]
                same_w = all(torch.equal(after["weights"][n], was["weights"][n]) for n in was["weights"])
                moments = [s["exp_avg"] for s in after["optimizer"]["state"].values()]
                same_m = all(
                    torch.equal(a, s["exp_avg"]) for a, s in zip(moments, was["optimizer"]["state"].values())
                )
                seen.append(
                    (same_w, same_m, after["scheduler"]["last_epoch"] == was["scheduler"]["last_epoch"])
                )
                assert (after["hparams"] == was["hparams"]) == (slot == 0)

    cfg = compose_config([*POP, "trainer.max_steps=4"], output_dir=tmp_path / "r")
    from rlhf_lightning.run import population_callback

    spy = population_callback(cfg, tmp_path / "r")
    spy.__class__ = Spy
    cfg.population.size = 1  # the spy is the only population callback
    run(cfg, extra_callbacks=[spy])
    assert len(seen) == 4 and all(all(s) for s in seen)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["algo=ppo"]], ids=["grpo", "ppo"])
def test_a_checkpoint_resumes_the_population_exactly(tmp_path, algo):
    common = [*POP, *algo, "checkpoint.every_n_steps=2", "checkpoint.keep_last=-1", "trainer.max_steps=6"]
    full = run(compose_config(common, output_dir=tmp_path / "full")).module
    ckpt = tmp_path / "full" / "checkpoints" / "step_000002.ckpt"
    assert ckpt.is_file()
    resumed = run(compose_config([*common, f"ckpt_path={ckpt}"], output_dir=tmp_path / "resumed")).module
    assert full.members.hparams == resumed.members.hparams
    for k in range(2):
        a, b = full.member_state(k), resumed.member_state(k)
        assert a["weights"].keys() == b["weights"].keys()
        assert all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
        assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 3
    lineage = [(tmp_path / d / "lineage.csv").read_text() for d in ("full", "resumed")]
    assert lineage[0] == lineage[1]


@pytest.mark.slow
def test_a_snapshot_holds_every_member_as_it_was_at_its_step(tmp_path):
    at_step = {}

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pop = next(c for c in trainer.callbacks if isinstance(c, SideBySidePopulation))
            if pop.steps == 1:
                at_step.update({k: pl_module.member_state(k)["weights"] for k in range(2)})

    out = tmp_path / "run"
    cfg = compose_config([*POP, "trainer.max_steps=4", "population.snapshot_every=1"], output_dir=out)
    run(cfg, extra_callbacks=[Record()])
    snap = torch.load(out / "population" / "snapshot_step_000001.pt", weights_only=False)
    assert snap["steps"] == 1 and [m["id"] for m in snap["members"]] == [0, 2]  # after the first evolution
    for k, m in enumerate(snap["members"]):
        assert all(torch.equal(m["state"]["weights"][n], w) for n, w in at_step[k].items())


@pytest.mark.slow
def test_members_differ_in_group_size_and_temperature(tmp_path):
    """Each member samples its own group size at its own temperature (one engine call each
    temperature); its update sees only its own rows."""
    sizes = []

    class Sizes(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sizes.append([(h["group_size"], h["temperature"]) for h in pl_module.members.hparams])

    space = "population.mutate={group_size:{low:2,high:8,scale:2},temperature:{low:0.5,high:2.0,scale:2}}"
    out = tmp_path / "run"
    run(compose_config([*POP, space, "trainer.max_steps=8"], output_dir=out), extra_callbacks=[Sizes()])
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("member_0/rollout/reward_mean")]
    assert len(rows) == 4
    assert any(a != b for a, b in sizes)  # the members differed at some step
    assert {g for step in sizes for g, _ in step} - {4} or {t for step in sizes for _, t in step} - {1.0}


def test_mutations_are_checked_by_the_module():
    """A value that fails the start-up rules never reaches a member: set_member_hparams raises
    before it changes anything."""
    from types import SimpleNamespace

    from rlhf_lightning.algorithms.members import MemberAPI, MemberBank
    from rlhf_lightning.config import GRPOConfig
    from rlhf_lightning.population.checks import check_member

    api = MemberAPI()
    api.members = MemberBank([{"lr": 1e-3}], own_reference=False)
    api._check_member = check_member  # what enable_members stores (the population passes it)
    api._base_hp = GRPOConfig(prompts_per_step=4, group_size=4, micro_batch_size=8)
    api.world_size = 1
    api.policy = SimpleNamespace()
    with pytest.raises(ConfigError, match=r"population\.mutate\.group_size=3.*micro_batch_size=8"):
        api.set_member_hparams(0, {"lr": 1e-3, "group_size": 3})
    with pytest.raises(ConfigError, match=r"population\.mutate\.lr=-1"):
        api.set_member_hparams(0, {"lr": -1.0})
    assert api.members.hparams == [{"lr": 1e-3}]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["model.finetune=full"], "model.finetune"),
        (["algo=dapo"], "algo.dynamic_sampling"),
    ],
)
def test_what_side_by_side_does_not_cover_is_refused_with_the_fix(tmp_path, extra, field):
    with pytest.raises(ConfigError, match=rf"{field.replace('.', '[.]')}=.*population\.batched=false"):
        validate(compose_config([*POP, *extra], output_dir=tmp_path))


def test_ranks_whose_member_weights_differ_stop_the_run():
    """The digest compares each member's weights too: the same ids and hyper-parameters with
    other weights on rank 1 stop the run."""

    class FakeModule:
        world_size, device = 2, "cpu"

        def member_weights(self, k):
            return {"0:w": torch.full((2, 2), float(k))}

        def all_gather(self, t):
            other = t.clone()
            other[1, -1] += 1e-6  # rank 1's member 1 has other weights
            return torch.stack([t, other])

    pop = SideBySidePopulation(2, 1, {}, "/tmp/unused")
    pop.module = FakeModule()
    pop.members = [Member(0, {"lr": 1e-3}), Member(1, {"lr": 2e-3})]
    with pytest.raises(RuntimeError, match="ranks disagree after selection"):
        pop.check_ranks_agree()
    FakeModule.all_gather = lambda self, t: torch.stack([t, t.clone()])
    pop.check_ranks_agree()


@pytest.mark.slow
def test_each_member_refreshes_its_own_reference_on_its_own_updates(tmp_path):
    """A moving reference (every 2 of a member's updates): after 3 population steps each member's
    reference is its actor after its 2nd update, not its 3rd, and the two members' differ."""
    after = []  # every member's weights after each population step

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after.append([pl_module.member_state(k)["weights"] for k in range(2)])

    overrides = [
        *POP, "population.evolve_every=0", "algo.beta=0.05", "algo.use_separate_reference_adapter=true",
        "algo.ref_update_interval=2", "trainer.max_steps=6",
    ]  # fmt: skip
    module = run(compose_config(overrides, output_dir=tmp_path / "r"), extra_callbacks=[Watch()]).module
    assert len(after) == 3
    for k in range(2):
        final = module.member_state(k)["weights"]
        ref = {n[2:]: w for n, w in final.items() if n.startswith("1:")}
        actor = [{n[2:]: w for n, w in step[k].items() if n.startswith("0:")} for step in after]
        assert ref and ref.keys() == actor[1].keys()
        assert all(torch.equal(ref[n], actor[1][n]) for n in ref)  # its 2nd update
        assert not all(torch.equal(ref[n], actor[2][n]) for n in ref)  # not its 3rd
    refs = [
        {n: w for n, w in module.member_state(k)["weights"].items() if n.startswith("1:")} for k in range(2)
    ]
    assert not all(torch.equal(refs[0][n], refs[1][n]) for n in refs[0])


@pytest.mark.slow
def test_ppo_members_each_have_their_own_critic_and_the_best_is_exported(tmp_path):
    out = tmp_path / "run"
    module = run(
        compose_config([*POP, "algo=ppo", "population.evolve_every=0", "trainer.max_steps=6"], output_dir=out)
    ).module
    states = [module.member_state(k)["weights"] for k in range(2)]
    critic = [{n: w for n, w in s.items() if n.startswith(("1:", "value_head:"))} for s in states]
    assert critic[0] and critic[0].keys() == critic[1].keys()
    assert not all(torch.equal(critic[0][n], critic[1][n]) for n in critic[0])
    assert (out / "population" / "best" / "critic" / "value_head.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["rloo", "cispo", "reinforce_pp", "gspo"])
def test_side_by_side_with_other_rollout_algorithms(tmp_path, algo):
    out = tmp_path / "run"
    space = "population.mutate={lr:{low:1e-5,high:1e-1,scale:2},temperature:{low:0.5,high:1.5,scale:1.2}}"
    result = run(compose_config([*POP, f"algo={algo}", space, "trainer.max_steps=4"], output_dir=out))
    assert population_of(result).steps == 2 and result.trainer.global_step == 4
    assert len(list(csv.DictReader((out / "lineage.csv").open()))) == 6
    rows = [r for r in csv.DictReader((out / "metrics.csv").open()) if r.get("member_1/rollout/reward_mean")]
    assert len(rows) == 2
