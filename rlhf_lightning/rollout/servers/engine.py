"""Rollouts on vLLM inference servers (``rollout=vllm_server``): the run's generation goes over
HTTP to one or more vLLM OpenAI-compatible servers, started by the run
(:mod:`~rlhf_lightning.rollout.servers.process`) or by someone else (``rollout.servers``: URLs).

Token ids in, token ids and the sampled tokens' log-probs out (``/v1/completions`` with a
token-id prompt, ``logprobs=0`` and ``return_token_ids``), so trajectories stay token-exact and
each turn of a multi-turn episode is a request of its own (the server's prefix cache holds the
conversation so far). Prompt i of a call is sampled with the seed the call's seed + i (the
call's seed drawn from torch's generator when it has none: a run is reproducible and resumes
exactly); a run of equal prompts (a group's episodes) is one request for that many samples,
which draws the same. Up to ``rollout.max_concurrency`` requests are in flight per server, the
call's requests split into one contiguous share per server.

Weights by version: :meth:`VLLMServerEngine.publish` writes the trainable weights as a directory
the servers read (:mod:`~rlhf_lightning.rollout.servers.weights`); :meth:`~VLLMServerEngine.use`
makes a published version the one requests sample: with LoRA the adapter is loaded under a name
of its own (runtime LoRA loading) and requests name it, so several versions can be held at once
(asynchronous rollouts) and a version is never confused with another in the prefix cache; with
full fine-tuning every server reloads its weights from the directory in place (``reload_weights``
through ``/collective_rpc``), then empties its prefix cache. Versions no request needs any more
are dropped (unloaded, their directories removed).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rlhf_lightning.records.sampling import Completion, SamplingParams
from rlhf_lightning.rollout.servers.answers import answer_limit, check_processed_logprobs, completions_of
from rlhf_lightning.rollout.servers.client import RequestPolicy, ServerClient, ServerError
from rlhf_lightning.rollout.servers.process import LaunchSpec, ServerProcess, launch
from rlhf_lightning.rollout.servers.weights import VersionFiles
from rlhf_lightning.runtime.local_server import resume_hint


@dataclass(frozen=True)
class ServerSettings:
    """``rollout=vllm_server``'s settings (see ``VLLMServerRolloutConfig``).

    Attributes:
        urls: the servers to use (``rollout.servers``); None: start them (``launch``).
        launch: how the run starts its servers (needed when ``urls`` is None).
        lora: the run trains a LoRA adapter (loaded per version) or every weight (reloaded).
        max_concurrency: requests in flight per server.
        request: each request's timeout and retries.
        start_timeout_s: how long to wait for the servers to answer ``/health``.
        sync_dir: where versions are written (a directory the servers read); None: a
            temporary one (servers on this machine only).
        log_dir: where started servers write their logs (``<run>/servers``); None: a temporary one.
        served_model_name: the base model's name on the servers; None: the one they serve.
        checkpoint_dir: the run's checkpoints (``<run>/checkpoints``), named when a server dies.
        vocab_size: the model's vocabulary (an answer's ids must lie in it); None: learned from
            the first published policy.
    """

    urls: tuple[str, ...] | None = None
    launch: LaunchSpec | None = None
    lora: bool = True
    max_concurrency: int = 32
    request: RequestPolicy = field(default_factory=RequestPolicy)
    start_timeout_s: float = 600.0
    sync_dir: str | None = None
    log_dir: str | None = None
    served_model_name: str | None = None
    checkpoint_dir: str | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class Published:
    """A published version: its name on the servers (the LoRA adapter's, or the model
    directory's) and its directory."""

    name: str
    path: Path


class VLLMServerEngine:
    """A :class:`~rlhf_lightning.rollout.engines.base.RolloutEngine` whose generation runs on vLLM
    servers (see the module docstring). It connects, or starts its servers, at the first call
    that needs them; ``shutdown`` stops the servers it started and unloads its adapters from
    the others."""

    outlives_fit = True  # servers take minutes to start: the run shuts them down at its very end

    def __init__(self, settings: ServerSettings) -> None:
        if settings.urls is None and settings.launch is None:
            raise ValueError("VLLMServerEngine: either the servers' URLs or how to launch them")
        self.s = settings
        self.rank, self.world_size = 0, 1
        self.processes: list[ServerProcess] = []
        self.clients: list[ServerClient] = []
        self.pools: list[ThreadPoolExecutor] = []
        self.base: str | None = None
        self.published: dict[int, Published] = {}
        self.loaded: set[str] = set()  # LoRA adapters the servers hold, by name
        self.held: str | None = None  # full fine-tuning: the directory the servers' weights are from
        self.current: str | None = None  # the model requests name
        self.version: int | None = None  # the version requests sample
        self.synced_version: int | None = None  # ensure_synced's
        self.tag = f"actor-{uuid.uuid4().hex[:6]}"  # this engine's adapters, whoever else uses the servers
        self.serial = 0
        self.vocab_size = settings.vocab_size
        self._files: VersionFiles | None = None
        self._temp: str | None = None
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- lifecycle
    def bind_rank(self, rank: int, world_size: int, local_rank: int) -> None:
        """Each rank its own versions (named apart) on the shared servers."""
        if (rank, world_size) == (self.rank, self.world_size):
            return
        if self.clients:
            raise RuntimeError("bind_rank must run before the engine starts")
        if world_size > 1 and self.s.urls is None:
            raise ValueError(
                f"rollout.servers=null starts servers for one trainer process, this run has {world_size} "
                "ranks: start the servers yourself and pass rollout.servers=[http://host:port, ...] (every "
                "rank shares them; docs/guides/inference-servers.md)"
            )
        if world_size > 1 and not self.s.lora:
            raise ValueError(
                f"model.finetune=full with rollout=vllm_server and {world_size} ranks: a server holds one "
                "set of full weights at a time, so ranks would swap them under each other; use LoRA"
            )
        self.rank, self.world_size = rank, world_size

    def start(self) -> None:
        """Connect to the servers (waiting for ``/health``), or start them, once."""
        if self.clients:
            return
        try:
            if self.s.urls is None:
                assert self.s.launch is not None
                self.processes = launch(self.s.launch, Path(self.s.log_dir or self._tempdir()))
                self.clients = [
                    ServerClient(p.url, self.s.request, p.death, p.where(), self._resume_hint)
                    for p in self.processes
                ]
            else:
                self.clients = [ServerClient(u, self.s.request) for u in self.s.urls]
                for client in self.clients:
                    client.wait_healthy(self.s.start_timeout_s)
            self.base = self._base_model()
            for client in self.clients:  # processed log-probs, or the ratio's are wrong
                check_processed_logprobs(client, self.base)
        except BaseException:
            self.shutdown()
            raise
        self.pools = [
            ThreadPoolExecutor(self.s.max_concurrency, thread_name_prefix=f"vllm-server-{i}")
            for i in range(len(self.clients))
        ]
        if not self.s.lora:
            self.current = self.base

    def wake(self) -> None:
        self.start()

    def sleep(self) -> None:
        """Nothing to free: the servers run elsewhere."""

    def shutdown(self) -> None:
        """Stop the servers this engine started (or unload its adapters from the others) and
        remove its version directories."""
        for pool in self.pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for server in self.processes:  # every server stops at once
            if server.guard.poll() is None:
                server.guard.terminate()
        for server in self.processes:
            server.stop()
        if not self.processes:
            for name in list(self.loaded):
                for client in self.clients:
                    with contextlib.suppress(ServerError):
                        client.call("/v1/unload_lora_adapter", {"lora_name": name}, retries=0, timeout_s=10.0)
        if self._files is not None:
            self._files.clear()
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
        self.processes, self.clients, self.pools = [], [], []
        self.published.clear()
        self.loaded.clear()
        self.held = self.current = self.version = self.synced_version = None
        self._files = self._temp = None

    def _resume_hint(self) -> str:
        return resume_hint(self.s.checkpoint_dir)

    def _tempdir(self) -> str:
        if self._temp is None:
            self._temp = tempfile.mkdtemp(prefix="rlhf-vllm-server-")
        return self._temp

    def _base_model(self) -> str:
        """The base model's name, the same on every server."""
        want = self.s.served_model_name
        served = [client.base_models() for client in self.clients]
        for client, names in zip(self.clients, served):
            if want is not None and want not in names:
                raise ServerError(f"{client.url} serves {names}, not rollout.served_model_name={want!r}")
            if want is None and len(names) != 1:
                raise ServerError(
                    f"{client.url} serves {names}: name the run's model with rollout.served_model_name"
                )
        if want is None and len({names[0] for names in served}) > 1:
            raise ServerError(f"the servers serve different models: {[names[0] for names in served]}")
        return want or served[0][0]

    # ---------------------------------------------------------------- versions
    @property
    def files(self) -> VersionFiles:
        """This rank's version directories (``<sync_dir>/rank<r>``)."""
        if self._files is None:
            root = Path(self.s.sync_dir or self._tempdir()) / f"rank{self.rank}"
            self._files = VersionFiles(root, self.s.lora)
        return self._files

    def ensure_synced(self, policy: Any, version: int) -> None:
        """Publish ``policy``'s weights as ``version`` and sample it, unless that was done."""
        if self.synced_version != version:
            self._sync(policy, version)

    def sync_weights(self, model: Any) -> None:
        """Publish the weights now (again under the last synced version, or as version 0)."""
        self._sync(model, self.synced_version if self.synced_version is not None else 0)

    def invalidate(self) -> None:
        """Forget the synced version: the policy's weights were swapped under the same step count."""
        self.synced_version = None

    def _sync(self, policy: Any, version: int) -> None:
        self.publish(version, policy)
        self.use(version)
        self.drop_before(version)
        self.synced_version = version

    def publish(self, version: int, policy: Any) -> None:
        """Write ``policy``'s trainable weights as ``version`` (replacing an earlier publication
        of the same version)."""
        name = self._next_name(version)
        self.vocab_size = vocab_of(policy) or self.vocab_size
        self._register(version, Published(name, self.files.write(name, policy)))

    def publish_files(self, version: int, files: dict[str, bytes]) -> None:
        """``version`` from its files (:meth:`files_of`, kept in a checkpoint)."""
        name = self._next_name(version)
        self._register(version, Published(name, self.files.write_files(name, files)))

    def files_of(self, version: int) -> dict[str, bytes] | None:
        """The files of published ``version``, or None."""
        pub = self.published.get(version)
        return None if pub is None else self.files.files(pub.name)

    def use(self, version: int) -> None:
        """Make published ``version`` the one requests sample (loading it on every server)."""
        self.start()
        with self._lock:
            pub = self.published.get(version)
            if pub is None:
                raise KeyError(f"version {version} was not published (published: {sorted(self.published)})")
            if self.s.lora:
                if pub.name not in self.loaded:
                    for client in self.clients:
                        client.load_lora(pub.name, str(pub.path))
                    self.loaded.add(pub.name)
                self.current = pub.name
            elif self.held != pub.name:
                for client in self.clients:
                    client.reload_weights(str(pub.path))
                before, self.held = self.held, pub.name
                if before is not None and before not in {p.name for p in self.published.values()}:
                    self.files.remove(before)  # a republished version's old directory, held till now
            self.version = version

    def drop_before(self, version: int) -> None:
        """Drop the versions older than ``version`` (but the one requests sample)."""
        with self._lock:
            old = [v for v in self.published if v < version and v != self.version]
            for v in old:
                self._retire(self.published.pop(v))

    def _next_name(self, version: int) -> str:
        with self._lock:
            self.serial += 1
            return f"{self.tag}-r{self.rank}-v{version}-{self.serial}"

    def _register(self, version: int, pub: Published) -> None:
        with self._lock:
            old = self.published.get(version)
            self.published[version] = pub
            if old is not None:
                self._retire(old)

    def _retire(self, pub: Published) -> None:
        """Unload an adapter no version names any more, and remove its directory."""
        if pub.name in self.loaded:
            for client in self.clients:
                client.unload_lora(pub.name)
            self.loaded.discard(pub.name)
        if self.current == pub.name:
            self.current = None
        if pub.name != self.held:
            self.files.remove(pub.name)

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, adapters: list[str] | None = None
    ) -> list[Completion]:
        """``params.n`` completions of each prompt, prompt-major, from the version in use."""
        if adapters is not None:
            raise ValueError(
                "rollout=vllm_server samples one adapter per call: run a population round-robin "
                "(population.batched=false)"
            )
        self.start()
        model = self.current
        if model is None:
            raise RuntimeError(
                "VLLMServerEngine: sync_weights(policy) (or use(version)) must run before generate"
            )
        first = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, (1,)).item())
        runs = same_prompt_runs(prompt_token_ids, params.n)
        bodies = [
            request_body(model, prompt_token_ids[i], replace(params, n=params.n * count), first + i)
            for i, count in runs
        ]
        owners = [r * len(self.clients) // max(len(runs), 1) for r in range(len(runs))]
        futures = [
            self.pools[k].submit(self.clients[k].complete, b, answer_limit(b)) for k, b in zip(owners, bodies)
        ]
        out: list[Completion] = []
        try:
            for (i, count), k, body, future in zip(runs, owners, bodies, futures):
                try:
                    answer = future.result(timeout=self.s.request.longest_s())
                except FutureTimeout:
                    raise ServerError(f"no answer from {self.clients[k].url} within its retries") from None
                url = self.clients[k].url
                out += completions_of(answer, i, url, count > 1, body, self.vocab_size)
        finally:
            for future in futures:
                future.cancel()
        return out


def same_prompt_runs(prompts: list[list[int]], n: int) -> list[tuple[int, int]]:
    """(first index, length) of each run of equal consecutive prompts (a group's episodes), sent as
    one request for that many samples: vLLM seeds sample j of a request seeded s with s + j, so
    they draw what one request per prompt would (prompt i seeded with the call's seed + i). With
    ``n > 1`` every prompt is a request of its own."""
    runs: list[tuple[int, int]] = []
    for i, prompt in enumerate(prompts):
        if n == 1 and runs and prompts[runs[-1][0]] == prompt:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def request_body(model: str, prompt: list[int], p: SamplingParams, seed: int) -> dict[str, Any]:
    """One ``/v1/completions`` request: every sampling setting explicit (the model's generation
    config adds nothing), the sampled tokens' ids and (processed) log-probs asked back."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": p.max_new_tokens,
        "n": p.n,
        "seed": seed,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop": list(p.stop),
        "include_stop_str_in_output": True,  # the reply keeps the stop string, as the other engines do
        "stop_token_ids": list(p.stop_token_ids),
        "logprobs": 0,
        "return_token_ids": True,
    }


def vocab_of(policy: Any) -> int | None:
    """The width of ``policy``'s logits (its output embedding's rows), or None if it has none."""
    model = getattr(policy, "causal_lm", None)
    head = model.get_output_embeddings() if model is not None else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else None
