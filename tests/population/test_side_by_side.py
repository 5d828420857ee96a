"""Members side by side (``population.batched=true``): one rollout for every member, each
member's own update, the module's member API, checkpoints and snapshots."""

from __future__ import annotations

import csv
import dataclasses
import json

import lightning as L
import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.population.bank import SideBySide
from rlhf_lightning.population.side_by_side import SideBySidePopulation
from rlhf_lightning.rollout.source import RolloutSource
from rlhf_lightning.run import run
from tests.conftest import FAST, compose_config

# Two members side by side, evolved every population step from mutated starts (test_resume.py too).
MEMBERS = [
    "population.size=2",
    "population.batched=true",
    "population.evolve_every=1",
    "population.eval_rows=8",
    "population.init=config",
    "population.selection=tournament",
    "population.resample_prob=0",
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
    """A single run's trainable slots keyed like :meth:`SideBySide.member_state`'s weights (the
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
            return module.source.generate(rows, module.sampling, group_size=module.hp.group_size)
        module.schedule.show(k_or_none)
        member = module.schedule.members[k_or_none]
        return module.source.generate(rows, member.sampling, group_size=member.hp.group_size)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["algo=ppo", "algo.critic_warmup_steps=1"]], ids=["grpo", "ppo"])
def test_each_member_updates_exactly_as_a_single_run_with_its_hyper_parameters(tmp_path, monkeypatch, algo):
    """Two population steps, each member given the same episodes a single run with its learning
    rate gets: every member's adapters (PPO: and value head) end bit for bit where that run's
    trainable slots end."""

    def member_rollouts(self, rows, evaluation=False, temperature=None, source=None):
        return {name: seeded_rollout(self.module, rows, k) for k, name in enumerate(self.adapters)}, {}

    def collect(
        self, rows, sampling, group_size
    ):  # a single run's source: seeded_rollout(module, rows, None)
        with torch.random.fork_rng():
            torch.manual_seed(1000 + self.batches_done)
            return self.generate(rows, sampling, group_size=group_size), {}

    monkeypatch.setattr(SideBySide, "member_rollouts", member_rollouts)
    monkeypatch.setattr(RolloutSource, "collect", collect)
    cfg = compose_config(
        [*POP, *algo, "population.evolve_every=0", "trainer.max_steps=4"], output_dir=tmp_path / "p"
    )
    pop = run(cfg).module
    assert pop.global_step == 4 and pop.schedule.size == 2
    lrs = [h["lr"] for h in pop.schedule.hparams]
    assert lrs[0] == 0.001 and lrs[1] in (0.002, 0.0005)  # member 1 mutated once at the start
    for k, lr in enumerate(lrs):
        single = compose_config(
            [*FAST, *algo, f"algo.lr={lr}", "trainer.max_steps=2", "trainer.val_check_interval=100",
             "eval.before_training=false", "eval.at_end=false", "checkpoint.every_n_steps=0"],
            output_dir=tmp_path / f"single_{k}",
        )  # fmt: skip
        expected = actor_as_member_weights(run(single).module)
        got = pop.schedule.member_state(k)["weights"]
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) for n in got), f"member {k}"
    first = pop.schedule.member_state(0)["weights"]
    assert not all(torch.equal(first[n], w) for n, w in pop.schedule.member_state(1)["weights"].items())


@pytest.mark.slow
def test_one_mixed_rollout_gives_each_member_the_episodes_of_its_own_adapter(tmp_path):
    """Greedy, the population's one engine call gives each member the completions that member's
    adapter gives alone in the policy's slot (one call per member)."""
    seen = {}

    class Check(L.Callback):
        def on_train_end(self, trainer, pl_module):
            rows = list(range(6))
            mixed = pl_module.schedule.score_members(rows, temperature=0.0)
            for k, result in enumerate(mixed):
                pl_module.schedule.show(k)
                params = dataclasses.replace(pl_module.sampling, temperature=0.0)
                alone = pl_module.source.generate(rows, params, group_size=1, evaluation=True)
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
    # Counts of the whole rollout are logged once, not copied into every member's columns.
    header = next(csv.reader((out / "metrics.csv").open()))
    for key in ("rollout/dropped_long_prompts", "env/reward_errors"):
        assert key in header and not any(h.endswith(f"/{key}") and h.startswith("member_") for h in header)


@pytest.mark.slow
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
            before = [self.bank.member_state(k) for k in range(self.size)]
            ids = [m.id for m in self.members]
            super().evolve(trainer)
            for slot, child in enumerate(self.members):
                parent = ids.index(child.id if slot == 0 else child.parent)
                after, was = self.bank.member_state(slot), before[parent]
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
    assert full.schedule.hparams == resumed.schedule.hparams
    for k in range(2):
        a, b = full.schedule.member_state(k), resumed.schedule.member_state(k)
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
                at_step.update({k: pl_module.schedule.member_state(k)["weights"] for k in range(2)})

    out = tmp_path / "run"
    cfg = compose_config([*POP, "trainer.max_steps=4", "population.snapshot_every=1"], output_dir=out)
    run(cfg, extra_callbacks=[Record()])
    snap = torch.load(out / "population" / "snapshot_step_000001.pt", weights_only=False)
    assert snap["steps"] == 1 and [m["id"] for m in snap["members"]] == [0, 2]  # after the first evolution
    for k, m in enumerate(snap["members"]):
        assert all(torch.equal(m["state"]["weights"][n], w) for n, w in at_step[k].items())


@pytest.mark.slow
def test_members_differ_in_group_size_and_temperature(tmp_path):
    """Each member samples its own group size at its own temperature (the engine is called at it,
    with that member's rows) and its update sees exactly its own episodes: prompts x its group size,
    all from its adapter."""
    seen = []  # per population step: [(group size, temperature)] and what each update and call got

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = {"hp": [(int(h["group_size"]), float(h["temperature"])) for h in pl_module.schedule.hparams],
                    "calls": [], "updates": [], "prompts": len(batch)}  # fmt: skip
            seen.append(step)

    def spy(module):
        generate, update, step = module.engine.generate, module.finalize_rewards, module.training_step
        training = [False]  # the step's own calls, not the fitness scoring after it

        def recorded_generate(prompts, params, adapters=None):
            if training[0]:
                seen[-1]["calls"].append((params.temperature, sorted(set(adapters or []))))
            return generate(prompts, params, adapters=adapters) if adapters else generate(prompts, params)

        def recorded_update(result):
            trajs = result.trajectories
            seen[-1]["updates"].append((module.schedule.active, len(trajs), {t.adapter for t in trajs}))
            return update(result)

        def recorded_step(batch, batch_idx):
            training[0] = True
            try:
                return step(batch, batch_idx)
            finally:
                training[0] = False

        module.engine.generate, module.finalize_rewards = recorded_generate, recorded_update
        module.training_step = recorded_step

    class Hook(L.Callback):
        def setup(self, trainer, pl_module, stage):
            if stage == "fit":
                spy(pl_module)

    space = "population.mutate={group_size:{low:2,high:8,scale:2},temperature:{low:0.5,high:2.0,scale:2}}"
    out = tmp_path / "run"
    run(
        compose_config([*POP, space, "trainer.max_steps=8"], output_dir=out),
        extra_callbacks=[Hook(), Record()],
    )
    assert len(seen) == 4
    assert any(len(set(step["hp"])) > 1 for step in seen)  # the members differed at some step
    for step in seen:
        temps = {t for _, t in step["hp"]}
        for t, adapters in step["calls"]:  # one call per temperature (and turn), for exactly its members
            assert t in temps
            assert adapters == sorted(f"member_{k}" for k, (_, tk) in enumerate(step["hp"]) if tk == t)
        assert [(k, n) for k, n, _ in step["updates"]] == [
            (k, step["prompts"] * g) for k, (g, _) in enumerate(step["hp"])
        ]
        assert [a for _, _, a in step["updates"]] == [{f"member_{k}"} for k in range(2)]


@pytest.mark.slow
def test_each_member_refreshes_its_own_reference_on_its_own_updates(tmp_path):
    """A moving reference (every 2 of a member's updates): after 3 population steps each member's
    reference is its actor after its 2nd update, not its 3rd, and the two members' differ."""
    after = []  # every member's weights after each population step

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            after.append([pl_module.schedule.member_state(k)["weights"] for k in range(2)])

    overrides = [
        *POP, "population.evolve_every=0", "algo.beta=0.05", "algo.use_separate_reference_adapter=true",
        "algo.ref_update_interval=2", "trainer.max_steps=6",
    ]  # fmt: skip
    module = run(compose_config(overrides, output_dir=tmp_path / "r"), extra_callbacks=[Watch()]).module
    assert len(after) == 3
    for k in range(2):
        final = module.schedule.member_state(k)["weights"]
        ref = {n[2:]: w for n, w in final.items() if n.startswith("1:")}
        actor = [{n[2:]: w for n, w in step[k].items() if n.startswith("0:")} for step in after]
        assert ref and ref.keys() == actor[1].keys()
        assert all(torch.equal(ref[n], actor[1][n]) for n in ref)  # its 2nd update
        assert not all(torch.equal(ref[n], actor[2][n]) for n in ref)  # not its 3rd
    refs = [
        {n: w for n, w in module.schedule.member_state(k)["weights"].items() if n.startswith("1:")}
        for k in range(2)
    ]
    assert not all(torch.equal(refs[0][n], refs[1][n]) for n in refs[0])


@pytest.mark.slow
def test_ppo_members_each_have_their_own_critic_and_the_best_is_exported(tmp_path):
    """Each member trains a critic adapter and a value head of its own (both differ between the
    members), and population/best holds the best member's critic adapter and value head."""
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "run"
    result = run(
        compose_config([*POP, "algo=ppo", "population.evolve_every=0", "trainer.max_steps=6"], output_dir=out)
    )
    module, pop = result.module, population_of(result)
    states = [module.schedule.member_state(k)["weights"] for k in range(2)]
    for prefix in ("1:", "value_head:"):  # the critic adapter, then the value head
        part = [{n: w for n, w in s.items() if n.startswith(prefix)} for s in states]
        assert part[0] and part[0].keys() == part[1].keys()
        assert not all(torch.equal(part[0][n], part[1][n]) for n in part[0]), prefix
    best = pop.best_slot()
    exported = out / "population" / "best" / "critic"
    head = load_file(str(exported / "value_head.safetensors"))
    assert head and all(torch.equal(head[n], states[best][f"value_head:{n}"]) for n in head)
    base = module.policy.model.get_base_model()
    peft = PeftModel.from_pretrained(copy_of(base), str(exported), adapter_name="critic")
    lora = {n.replace(".critic.", ".{}."): p for n, p in peft.named_parameters() if ".critic." in n}
    mine = {n[2:]: w for n, w in states[best].items() if n.startswith("1:")}
    assert lora.keys() == mine.keys() and all(torch.equal(lora[n], mine[n]) for n in mine)


def copy_of(model):
    import copy

    return copy.deepcopy(model)


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


@pytest.mark.slow
def test_the_exported_best_member_is_scored_at_the_end_and_named_with_its_checkpoint(tmp_path):
    """The last evolution (population step 2) is older than the fit's end (step 3), and without
    elitism slot 0 is a mutated child: every member is scored again at the end, the exported
    best is the fittest by those scores, and the checkpoint's adapters are that member's, named
    in member.json."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    overrides = [*POP, "population.evolve_every=2", "population.elitism=false",
                 "population.fitness=accuracy_greedy", "trainer.max_steps=6", "algo.lr=0.05"]  # fmt: skip
    result = run(compose_config(overrides, output_dir=out))
    pop, module = population_of(result), result.module
    assert pop.steps == 3 and pop.scored_at == 3
    fresh = pop.score(result.trainer)  # greedy: the same numbers again
    assert [m.fitness for m in pop.members] == fresh
    best = max(range(2), key=lambda i: (fresh[i], -i))
    info = json.loads((out / "checkpoints" / "adapters" / "last" / "member.json").read_text())
    assert (info["slot"], info["id"], info["fitness"]) == (best, pop.members[best].id, fresh[best])
    mine = {n[2:]: w for n, w in module.schedule.member_state(best)["weights"].items() if n.startswith("0:")}
    for where in ("population/best/actor", "checkpoints/adapters/last/actor"):
        saved = load_file(str(out / where / "adapter_model.safetensors"))
        assert len(saved) == len(mine)
        for name, w in saved.items():  # PEFT's file names drop the adapter's name
            key = next(
                k
                for k in mine
                if k.replace(".{}", "") == name.replace("base_model.model.", "base_model.model.")
            )
            assert torch.equal(w, mine[key]), where
