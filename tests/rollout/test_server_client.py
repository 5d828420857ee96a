"""The HTTP client of one server (``rollout/servers/client.py``) against a fake vLLM server on
127.0.0.1: a LoRA load or unload whose answer was lost and whose retry finds the work done is
success (only then), and a server's death names what the run can resume from, as it exists."""

from __future__ import annotations

import re

import pytest

from rlhf_lightning.rollout.servers.client import RequestPolicy, ServerClient, ServerRefused, resume_hint
from tests.conftest import compose_config
from tests.rollout.fake_vllm import FakeVLLM

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.close()


def client_of(fake: FakeVLLM, retries: int = 3) -> ServerClient:
    return ServerClient(fake.url, RequestPolicy(timeout_s=5.0, retries=retries, backoff_s=0.01))


def test_a_load_whose_answer_was_lost_is_done_when_the_retry_finds_it_loaded(fake):
    """The first try loads the adapter and its answer is lost; the retry's 400 "has already been
    loaded" means the work is done: success, the adapter loaded once."""
    fake.lose[LOAD] = 1
    client_of(fake).load_lora("actor-v1", "/versions/v1")
    assert fake.count(LOAD) == 2 and fake.loaded == {"actor-v1"}


def test_an_unload_whose_answer_was_lost_is_done_when_the_retry_finds_it_gone(fake):
    fake.loaded.add("actor-v1")
    fake.lose[UNLOAD] = 1
    client_of(fake).unload_lora("actor-v1")
    assert fake.count(UNLOAD) == 2 and fake.loaded == set()


def test_already_loaded_or_not_found_without_a_lost_answer_is_still_refused(fake):
    """On a first try the same refusals are real: the server holds another adapter of that name,
    or never had it."""
    fake.loaded.add("actor-v1")
    with pytest.raises(
        ServerRefused, match=r"refused /v1/load_lora_adapter: HTTP 400: .*already been loaded"
    ):
        client_of(fake).load_lora("actor-v1", "/versions/v1")
    with pytest.raises(ServerRefused, match=r"refused /v1/unload_lora_adapter: HTTP 404: .*cannot be found"):
        client_of(fake).unload_lora("actor-v2")
    assert fake.count(LOAD) == fake.count(UNLOAD) == 1


def test_a_lost_answer_with_no_retry_left_fails_naming_the_tries(fake):
    fake.lose[LOAD] = 1
    with pytest.raises(Exception, match=r"did not answer /v1/load_lora_adapter after 1 tries"):
        client_of(fake, retries=0).load_lora("actor-v1", "/versions/v1")


# ---------------------------------------------------------------- a dead server's message
def dead(fake: FakeVLLM, checkpoints: object) -> str:
    fake.close()
    client = ServerClient(
        fake.url,
        RequestPolicy(retries=2, backoff_s=10),
        lambda: "was killed by SIGKILL",
        "its log: s.log",
        lambda: resume_hint(checkpoints),  # type: ignore[arg-type]
    )
    with pytest.raises(Exception) as err:
        client.call("/v1/completions", {})
    return str(err.value)


def test_a_dead_server_without_a_checkpoint_promises_no_resume(tmp_path):
    """Before the first checkpoint (or with no run directory) the message says there is none."""
    (tmp_path / "checkpoints").mkdir()
    for where in (tmp_path / "checkpoints", None):
        message = dead(FakeVLLM(), where)
        assert "killed by SIGKILL" in message and "resume=true" not in message
        assert "The run has no checkpoint to resume from yet (checkpoint.every_n_steps" in message


def test_a_dead_server_names_the_checkpoint_the_run_resumes_from(fake, tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step_000002.ckpt").write_bytes(b"")
    message = dead(fake, ckpts)
    assert (
        f"resume=true output_dir={tmp_path / 'run'}: it continues from {ckpts / 'step_000002.ckpt'}"
        in message
    )
    (ckpts / "last.ckpt").write_bytes(b"")
    assert re.search(r"continues from .*last\.ckpt", resume_hint(ckpts))


def test_the_run_hands_its_checkpoint_directory_to_the_servers(tmp_path):
    from rlhf_lightning.run.server_factory import server_settings

    settings = server_settings(compose_config(["rollout=vllm_server"]), tmp_path)
    assert settings.checkpoint_dir == str(tmp_path / "checkpoints")
    assert server_settings(compose_config(["rollout=vllm_server"]), None).checkpoint_dir is None
