"""``rollout=vllm_server`` piece by piece, without vLLM: the requests (runs of equal prompts, the
answers' completions), the HTTP client's timeouts and retries against a stub server, the
process-group guard (its command's whole tree ends with its starter, ``kill -9`` included), the
and the config checks (the asynchronous rollouts' thread: ``test_server_async.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.rollout.servers.answers import completions_of
from rlhf_lightning.rollout.servers.client import RequestPolicy, ServerClient, ServerError, resume_hint
from rlhf_lightning.rollout.servers.engine import (
    ServerSettings,
    VLLMServerEngine,
    request_body,
    same_prompt_runs,
)
from rlhf_lightning.rollout.servers.process import (
    LaunchSpec,
    ServerStartError,
    server_command,
    server_env,
    wait_ready,
)
from rlhf_lightning.runtime.group_guard import group_members
from tests.conftest import ROOT, compose_config
from tests.rollout.fake_vllm import FakeVLLM
from tests.runtime.test_workers import alive


# ---------------------------------------------------------------- requests and answers
def test_equal_consecutive_prompts_are_one_request_each_run():
    a, b = [1, 2], [3]
    assert same_prompt_runs([a, a, a, b, b, a], 1) == [(0, 3), (3, 2), (5, 1)]
    assert same_prompt_runs([a, a], 2) == [(0, 1), (1, 1)]  # n > 1: a request per prompt


def test_a_request_sets_every_sampling_field_and_asks_for_ids_and_logprobs():
    p = SamplingParams(7, temperature=0.5, top_p=0.9, top_k=3, stop=("x",), stop_token_ids=(2,), min_p=0.1)
    body = request_body("m", [5, 6], p, seed=11)
    assert body["prompt"] == [5, 6] and body["seed"] == 11 and body["max_tokens"] == 7
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.5, 0.9, 3, 0.1)
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["include_stop_str_in_output"]
    assert body["stop"] == ["x"] and body["stop_token_ids"] == [2]


def choice(index: int, ids: list[int], reason: str = "stop", logprob: float = -0.5) -> dict[str, Any]:
    return {
        "index": index,
        "token_ids": ids,
        "logprobs": {"token_logprobs": [logprob] * len(ids)},
        "finish_reason": reason,
    }


def test_an_answers_choices_map_to_their_prompts():
    answer = {"choices": [choice(1, [8]), choice(0, [7, 2], "length")]}
    one = completions_of(answer, 4, "u")
    assert [(c.token_ids, c.prompt_index, c.finish_reason) for c in one] == [
        ([7, 2], 4, "length"),
        ([8], 4, "stop"),
    ]
    spread = completions_of(answer, 4, "u", spread=True)  # a run of equal prompts: choice c is prompt 4 + c
    assert [c.prompt_index for c in spread] == [4, 5]


def test_an_answer_without_logprobs_or_aborted_is_refused():
    with pytest.raises(ServerError, match="without a log-prob"):
        completions_of({"choices": [{"index": 0, "token_ids": [1], "finish_reason": "stop"}]}, 0, "u")
    with pytest.raises(ServerError, match="finish_reason='abort'"):
        completions_of({"choices": [choice(0, [1], "abort")]}, 0, "u")


def test_a_cpu_server_prefills_whole_prompts_and_gets_lora_slots():
    cmd = server_command(LaunchSpec("/m", lora_rank=12, max_model_len=4096), 1234, None)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16" and "--no-enable-chunked-prefill" in cmd
    assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "4096"
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--enable-lora" not in server_command(LaunchSpec("/m"), 1, None)


def test_a_server_per_device_set_with_tensor_parallel_over_its_devices():
    cmd = server_command(LaunchSpec("/m", gpu_memory_utilization=0.8), 1, "2,3")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert (
        cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.8" and "--no-enable-chunked-prefill" not in cmd
    )
    env = server_env("2,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_what_the_engine_refuses_is_named():
    started = VLLMServerEngine(ServerSettings(launch=LaunchSpec("/m")))
    with pytest.raises(ValueError, match=r"rollout\.servers=null starts servers for one trainer process"):
        started.bind_rank(0, 2, 0)
    full = VLLMServerEngine(ServerSettings(urls=("http://h:1",), lora=False))
    with pytest.raises(ValueError, match=r"model\.finetune=full with rollout=vllm_server and 2 ranks"):
        full.bind_rank(1, 2, 1)
    with pytest.raises(ValueError, match=r"population\.batched=false"):
        full.generate([[1]], SamplingParams(), adapters=["a"])


# ---------------------------------------------------------------- the client against a stub server
class Stub(BaseHTTPRequestHandler):
    """Answers POSTs from ``server.script`` (a list of (status, body), the last repeating; a body
    ``"choices"`` answers a completion request with one choice per sample), counting them and the
    most in flight at once, ``hang`` seconds before answering; GET /v1/models lists ``models``."""

    def do_GET(self) -> None:
        self.answer(200, {"data": [{"id": m, "parent": None} for m in self.server.models]})  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        srv: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        with srv.lock:
            srv.count += 1
            srv.in_flight += 1
            srv.most = max(srv.most, srv.in_flight)
            srv.prompts.append(body.get("prompt"))
            status, answer = srv.script[min(srv.count - 1, len(srv.script) - 1)]
        time.sleep(srv.hang)
        if answer == "choices":  # processed log-probs: 0 with top-k 1 (the start's probe)
            lp = 0.0 if body.get("top_k") == 1 else -0.5
            answer = {"choices": [choice(j, [7, body["prompt"][0]], logprob=lp) for j in range(body["n"])]}
        with srv.lock:
            srv.in_flight -= 1
        self.answer(status, answer)

    def answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def start_stub() -> Any:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.count = server.in_flight = server.most = 0
    server.hang, server.script, server.models, server.prompts = 0.0, [(200, {})], ["m"], []
    server.lock = threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def stub():
    server = start_stub()
    yield server
    server.shutdown()


def client_of(stub: Any, **policy: Any) -> ServerClient:
    return ServerClient(
        f"http://127.0.0.1:{stub.server_address[1]}", RequestPolicy(**{"backoff_s": 0.01, **policy})
    )


def test_server_errors_are_retried_and_a_refusal_is_not(stub):
    stub.script = [(503, {}), (500, {}), (200, {"ok": 1})]
    assert client_of(stub, retries=3).call("/x", {}) == {"ok": 1} and stub.count == 3
    stub.count, stub.script = 0, [(400, {"error": {"message": "bad prompt"}})]
    with pytest.raises(ServerError, match="refused /x: HTTP 400: bad prompt"):
        client_of(stub, retries=3).call("/x", {})
    assert stub.count == 1


def test_a_server_that_does_not_answer_fails_after_its_tries_within_their_timeouts(stub):
    stub.hang = 1.0
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"did not answer /x after 2 tries .*request_timeout_s=0.2"):
        client_of(stub, timeout_s=0.2, retries=1).call("/x", {})
    assert time.monotonic() - t0 < 1.0


def test_a_gone_server_fails_at_once_naming_how_it_ended_and_its_log(stub, tmp_path):
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    stub.shutdown()
    stub.server_close()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    client = ServerClient(
        url,
        RequestPolicy(retries=5, backoff_s=10),
        lambda: "was killed by SIGKILL",
        "its log: x.log",
        lambda: resume_hint(tmp_path / "checkpoints"),
    )
    t0 = time.monotonic()
    with pytest.raises(
        ServerError, match=f"the vLLM server {url} was killed by SIGKILL .*its log: x.log.*resume=true"
    ):
        client.complete({})
    assert time.monotonic() - t0 < 1.0  # no backoff, no retry
    with pytest.raises(ServerError, match=f"no vLLM server answered {url}/health within 0.3 s"):
        ServerClient(url).wait_healthy(0.3)


def test_a_server_that_cannot_load_adapters_or_reload_weights_is_told_the_flag(stub):
    stub.script = [(404, {"detail": "Not Found"})]
    with pytest.raises(ServerError, match=r"--enable-lora .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        client_of(stub).load_lora("a", "/p")
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1"):
        client_of(stub).reload_weights("/p")
    stub.shutdown()
    stub.server_close()
    gone = ServerClient(client_of(stub).url, RequestPolicy(retries=0), lambda: "was killed by SIGKILL")
    with pytest.raises(ServerError, match="killed by SIGKILL") as err:  # a dead server: no flag to blame
        gone.load_lora("a", "/p")
    assert "--enable-lora" not in str(err.value)


def url_engine(*stubs: Any, concurrency: int = 32, name: str | None = None) -> VLLMServerEngine:
    urls = tuple(f"http://127.0.0.1:{s.server_address[1]}" for s in stubs)
    return VLLMServerEngine(
        ServerSettings(urls=urls, lora=False, max_concurrency=concurrency, served_model_name=name)
    )


def test_requests_in_flight_are_bounded_and_split_in_contiguous_shares():
    a, b = start_stub(), start_stub()
    for s in (a, b):
        s.script, s.hang = [(200, "choices")], 0.2
    engine = url_engine(a, b, concurrency=2)
    engine.start()
    a.prompts.clear()  # the start's probe of each server
    b.prompts.clear()
    try:
        out = engine.generate([[p] for p in range(12)], SamplingParams(4, seed=1))
    finally:
        engine.shutdown()
        a.shutdown()
        b.shutdown()
    assert [c.token_ids[1] for c in out] == list(range(12)) and [c.prompt_index for c in out] == list(
        range(12)
    )
    assert sorted(a.prompts) == [[p] for p in range(6)]
    assert sorted(b.prompts) == [[p] for p in range(6, 12)]
    assert a.most == b.most == 2  # rollout.max_concurrency per server


def test_the_base_model_is_the_one_the_servers_serve_or_the_named_one(stub):
    stub.models, stub.script = ["base", "other"], [(200, "choices")]
    engine = url_engine(stub)
    with pytest.raises(ServerError, match=r"name the run's model with rollout\.served_model_name"):
        engine.start()
    named = url_engine(stub, name="other")
    named.start()
    assert named.base == "other" and named.current == "other"  # full fine-tuning samples the base
    named.shutdown()


class TinyLM(torch.nn.Module):
    """What a full fine-tuning version is written from: a state dict and a config."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(4, 512, bias=False)
        self.config = SimpleNamespace(save_pretrained=lambda d: (Path(d) / "config.json").write_text("{}"))

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_full_finetuning_republished_versions_leave_one_directory(tmp_path: Path):
    """A round-robin population republishes the version the servers hold at every member swap
    (invalidate, then sync under the same step count): each reload leaves only the directory of
    the live version, and a new version's sync removes the old one."""
    fake = FakeVLLM()
    engine = VLLMServerEngine(ServerSettings(urls=(fake.url,), lora=False, sync_dir=str(tmp_path)))
    policy = SimpleNamespace(causal_lm=TinyLM(), adapter_name=None)
    try:
        engine.ensure_synced(policy, 0)
        for _ in range(3):  # three member swaps
            engine.invalidate()
            engine.sync_weights(policy)
            assert [d.name for d in engine.files.root.iterdir()] == [engine.held]
        engine.ensure_synced(policy, 1)
        assert [d.name for d in engine.files.root.iterdir()] == [engine.held]
        assert engine.files_of(1) is not None and engine.vocab_size == 512
        assert fake.count("/collective_rpc") == 5  # every sync reloaded the servers
    finally:
        engine.shutdown()
        fake.close()


def test_a_server_that_exits_while_starting_is_named_with_its_log(tmp_path: Path):
    class Starting:
        url, spec = "http://127.0.0.1:9", LaunchSpec("/m", start_timeout_s=60)

        def healthy(self) -> bool:
            return False

        def death(self) -> str | None:
            return "exited with code 1"

        def where(self) -> str:
            return "its log: s.log"

        def log_tail(self) -> str:
            return "    ValueError: no such model /m"

    with pytest.raises(
        ServerStartError, match=r"http://127\.0\.0\.1:9 exited with code 1 while starting; its log"
    ):
        wait_ready(Starting(), time.monotonic() + 60)  # type: ignore[arg-type]
    try:
        wait_ready(Starting(), time.monotonic() + 60)  # type: ignore[arg-type]
    except ServerStartError as err:
        assert "ValueError: no such model /m" in str(err)


@pytest.mark.slow  # a fresh interpreter's torch and transformers imports
def test_a_trainer_given_urls_imports_no_vllm():
    code = "import sys, rlhf_lightning.rollout.asynchronous.servers; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---------------------------------------------------------------- the process-group guard
STARTER = """
import subprocess, sys, time
from rlhf_lightning.runtime.group_guard import popen_guarded
guard = popen_guarded(["sh", "-c", "sleep 300 & sleep 300"])
print(guard.pid, flush=True)
time.sleep(300)
"""


def test_kill_9_of_the_starter_ends_the_guarded_command_and_its_children():
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    guard = int(starter.stdout.readline())  # type: ignore[union-attr]
    end = time.monotonic() + 10
    while len(group_members(guard)) < 3 and time.monotonic() < end:  # the guard, sh, two sleeps
        time.sleep(0.05)
    group = group_members(guard)
    assert len(group) >= 3
    starter.kill()
    starter.wait()
    end = time.monotonic() + 5
    while any(alive(p) for p in group) and time.monotonic() < end:
        time.sleep(0.05)
    assert not [p for p in group if alive(p)]


def test_the_guard_reports_its_command_killed_and_ends_what_it_left(tmp_path: Path):
    marker = tmp_path / "orphan.pid"
    guard = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlhf_lightning.runtime.group_guard",
            "--",
            "sh",
            "-c",
            f"sleep 300 & echo $! > {marker}; kill -9 $$",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _, err = guard.communicate(timeout=20)
    assert guard.returncode == 128 + signal.SIGKILL and "was killed by SIGKILL" in err
    orphan = int(marker.read_text())
    end = time.monotonic() + 5
    while alive(orphan) and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive(orphan)  # the command's own child, left behind, ended with it


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "override, field",
    [
        ("rollout.servers=[localhost:8000]", "rollout.servers"),
        ("rollout.max_concurrency=0", "rollout.max_concurrency"),
        ("rollout.request_retries=-1", "rollout.request_retries"),
    ],
)
def test_bad_server_fields_are_refused_naming_the_field(override: str, field: str):
    from rlhf_lightning.config.early import validate_rollout

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_rollout(compose_config(["rollout=vllm_server", override]).rollout)


def test_members_side_by_side_on_servers_are_refused_at_start_up(tmp_path: Path):
    """population.batched=true with rollout=vllm_server is refused by the start-up validation
    (before any server starts), naming the fix; left null, the members take turns."""
    from rlhf_lightning.population.checks import side_by_side
    from rlhf_lightning.run.validation import validate
    from tests.population.test_side_by_side import POP

    cfg = compose_config([*POP, "rollout=vllm_server"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"rollout='vllm_server'.*population\.batched=false"):
        validate(cfg)
    turns = compose_config(
        [*POP, "rollout=vllm_server", "population.batched=null", "population.evolve_every=2"],
        output_dir=tmp_path,
    )
    validate(turns)
    assert not side_by_side(turns)


def test_server_args_cannot_unset_processed_logprobs():
    from rlhf_lightning.config.early import validate_rollout

    for args in ("[--logprobs-mode,raw_logprobs]", "['--logprobs-mode=raw_logits']"):
        cfg = compose_config(["rollout=vllm_server", f"rollout.server_args={args}"])
        with pytest.raises(ConfigError, match=r"rollout\.server_args=.*processed_logprobs"):
            validate_rollout(cfg.rollout)
        with pytest.raises(ValueError, match=r"--logprobs-mode"):
            server_command(LaunchSpec("/m", extra_args=tuple(cfg.rollout.server_args)), 1, None)
    fine = LaunchSpec("/m", extra_args=("--logprobs-mode", "processed_logprobs"))
    assert server_command(fine, 1, None).count("processed_logprobs") == 2


def test_server_devices_and_urls_together_are_refused():
    from rlhf_lightning.config.early import validate_rollout

    cfg = compose_config(
        ["rollout=vllm_server", "rollout.servers=[http://h:1]", "rollout.server_devices=['0']"]
    )
    with pytest.raises(ConfigError, match=r"rollout\.server_devices"):
        validate_rollout(cfg.rollout)
