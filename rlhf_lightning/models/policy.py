"""The trainable policy: a causal LM (optionally PEFT-wrapped) that yields token log-probs
from hidden states through the chunked lm-head op, never full logits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from peft import PeftModel
from torch import nn

from rlhf_lightning.models.adapters import adapter_state, copy_adapter, save_adapters
from rlhf_lightning.models.packing import flat_action_rows, unpacked_action_rows, uses_flash_attention
from rlhf_lightning.models.prompt_sharing import (
    cache_kwarg,
    has_shared_prompts,
    output_cache,
    shared_prefix_hidden,
)
from rlhf_lightning.models.sharding import is_sharded, shard_causal_lm
from rlhf_lightning.ops.logprobs import chunked_logprobs
from rlhf_lightning.ops.reverse_kl import chunked_reverse_kl

if TYPE_CHECKING:
    from rlhf_lightning.records.trajectory import TrajectoryBatch

# cache_kwarg and output_cache live in models/prompt_sharing.py; rollout/engines/hf.py imports them from here.
__all__ = ["Policy", "cache_kwarg", "output_cache", "parameter_roles", "shared_prefix_hidden"]


def scatter_rows(action_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per-action-row values (row-major over ``action_mask``) back in place, 0 elsewhere.
    Shapes: action_mask (B, T); rows (N,); out (B, T)"""
    return torch.zeros(action_mask.shape, dtype=rows.dtype, device=rows.device).masked_scatter(
        action_mask, rows
    )


def parameter_roles(
    names: list[str], trainable: set[str], reference_adapter: str | None, critic_adapter: str | None
) -> dict[str, frozenset[str]]:
    """Every parameter name by its role, decided once when the policy is built (the only place
    that reads PEFT's ``.<adapter>.`` naming): ``critic`` (the critic adapter and the value head),
    ``actor`` (every other trainable parameter: the actor adapter, or all weights under full
    fine-tuning), ``reference`` (a separate reference adapter, which may move) and ``frozen``."""
    critic = {
        n
        for n in names
        if n.startswith("value_head.") or (critic_adapter is not None and f".{critic_adapter}." in n)
    }
    reference = {n for n in names if reference_adapter is not None and f".{reference_adapter}." in n}
    actor = (trainable - critic) - reference
    frozen = set(names) - actor - critic - reference
    return {
        "actor": frozenset(actor),
        "critic": frozenset(critic & trainable),
        "reference": frozenset(reference),
        "frozen": frozenset(frozen | (critic - trainable)),
    }


class Policy(nn.Module):
    """Actor, reference and critic on one model.

    Args:
        model: a ``PreTrainedModel`` or a ``PeftModel`` holding the ``adapter_name`` adapter.
        adapter_name: the trained LoRA adapter, or None for full fine-tuning.
        reference: a frozen reference model for full fine-tuning with a KL term.
        share_prompt: run a prompt shared by several rows once (see :func:`shared_prefix_hidden`);
            off under gradient checkpointing, which disables the KV cache.
        reference_adapter: a frozen LoRA adapter serving as the reference; None: the base with
            adapters disabled (LoRA) or ``reference`` (full fine-tuning).
        critic_adapter, value_head: the critic's LoRA adapter and its scalar head on the final
            hidden state (PPO).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter_name: str | None = None,
        reference: nn.Module | None = None,
        share_prompt: bool = True,
        reference_adapter: str | None = None,
        critic_adapter: str | None = None,
        value_head: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.adapter_name = adapter_name
        self.reference = reference
        self.share_prompt = share_prompt
        self.reference_adapter = reference_adapter
        self.critic_adapter = critic_adapter
        self.value_head = value_head
        self._trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        self.roles = parameter_roles(
            [n for n, _ in self.named_parameters()], self._trainable, reference_adapter, critic_adapter
        )
        self._parts: dict[str, list[nn.Parameter]] = {}  # trainable_parameters, by part

    @property
    def is_peft(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def causal_lm(self) -> Any:
        """The transformers CausalLM (LoRA layers injected in place when PEFT-wrapped)."""
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    def shard(self, mesh: Any) -> None:
        """FSDP2 on ``mesh``: the layout is in :mod:`rlhf_lightning.models.sharding`.

        Prompt sharing is turned off: it runs the body once or twice depending on the rows, and
        every sharded forward must be matched by the other ranks.
        """
        self.share_prompt = False
        for lm in (self.causal_lm, self.reference):
            if lm is not None:
                shard_causal_lm(lm, mesh)
        self._parts.clear()  # sharding puts new parameters in

    def generation_model(self) -> nn.Module:
        return self.model

    def trainable_parameters(self, part: str = "all") -> list[nn.Parameter]:
        """``all``, ``actor`` (everything trainable but the critic) or ``critic`` (its adapter and
        value head), in ``named_parameters`` order: the groups of :attr:`roles`. Found once (the
        optimizer step asks several times a step; walking every module costs milliseconds)."""
        if part not in self._parts:
            names = self.roles["actor"] | self.roles["critic"] if part == "all" else self.roles[part]
            self._parts[part] = [p for n, p in self.named_parameters() if n in names]
        return list(self._parts[part])

    @contextmanager
    def use_adapter(self, name: str) -> Iterator[Any]:
        """Run the CausalLM with LoRA adapter ``name`` active; trainability is left as it was."""
        model = cast(PeftModel, self.model)
        model.set_adapter(name)
        try:
            yield self.causal_lm
        finally:
            model.set_adapter(cast(str, self.adapter_name))
            for n, p in self.named_parameters():  # set_adapter toggles requires_grad: restore it
                p.requires_grad_(n in self._trainable)

    @contextmanager
    def reference_mode(self) -> Iterator[Any]:
        """Yields the reference CausalLM: its own adapter, the base with adapters disabled, or the frozen copy."""
        if self.reference_adapter is not None:
            with self.use_adapter(self.reference_adapter) as lm:
                yield lm
        elif isinstance(self.model, PeftModel):
            with self.model.disable_adapter():
                yield self.causal_lm
        elif self.reference is not None:
            yield self.reference
        else:
            raise RuntimeError(
                "full fine-tuning without a reference copy: build the policy with need_reference=True"
            )

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        action_mask: torch.Tensor,
        *,
        prompt_lens: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The critic's value at every action position (predicting that token's return), 0 elsewhere.

        Returns:
            Shape: (B, L-1)
        """
        if self.critic_adapter is None or self.value_head is None:
            raise RuntimeError("this policy has no critic (build it with a critic adapter)")
        with self.use_adapter(self.critic_adapter):
            rows, _ = self.action_hidden(
                input_ids,
                attention_mask,
                action_mask,
                prompt_lens=prompt_lens,
                prefix_ids=prefix_ids,
                position_ids=position_ids,
            )
        v = self.value_head(rows.to(self.value_head.weight.dtype)).squeeze(-1).float()  # (N,)
        return torch.zeros(action_mask.shape, dtype=v.dtype, device=v.device).masked_scatter(action_mask, v)

    @torch.no_grad()
    def copy_actor_to_reference(self) -> None:
        if self.reference_adapter is None or self.adapter_name is None:
            raise RuntimeError("no reference adapter to copy the actor onto")
        copy_adapter(cast(PeftModel, self.model), self.adapter_name, self.reference_adapter)

    def action_hidden(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        action_mask: torch.Tensor,
        *,
        reference: bool = False,
        prompt_lens: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Final hidden states at the action positions (row-major) and the lm head.

        Runs the transformer body only. Given ``prompt_lens`` and ``prefix_ids``, rows that share
        a prompt run it once (:func:`shared_prefix_hidden`).

        Args:
            input_ids, attention_mask: right-padded. Shape: (B, L)
            action_mask: True where token t+1 is an action. Shape: (B, L-1)
            prompt_lens, prefix_ids: Shape: (B,), as in ``TrajectoryBatch``.
            position_ids: packed rows (Shape: (B, L)): positions restart at each sequence and
                attention stays within it (:mod:`~rlhf_lightning.models.packing`).

        Returns:
            (hidden rows of shape (N, H), the output-embedding module holding ``weight``/``bias``)
        """
        shared = None
        if self.share_prompt and prompt_lens is not None and prefix_ids is not None and position_ids is None:
            shared = (prompt_lens, prefix_ids) if has_shared_prompts(prompt_lens, prefix_ids) else None
        ctx = self.reference_mode() if reference else nullcontext(self.causal_lm)
        with ctx as lm:
            body = lm.get_decoder()
            if shared is not None:
                rows = shared_prefix_hidden(body, input_ids, attention_mask, action_mask, *shared)
            else:
                if position_ids is not None:
                    # each packed sequence on its own: flattened to one row under flash attention,
                    # cut into a batch of sequences otherwise (no dense (L, L) mask per row)
                    if uses_flash_attention(lm):
                        flat = flat_action_rows(body, input_ids, attention_mask, position_ids, action_mask)
                        return flat, lm.get_output_embeddings()
                    return unpacked_action_rows(
                        body, input_ids, attention_mask, position_ids, action_mask, self.share_prompt
                    ), lm.get_output_embeddings()
                hidden = body(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False
                ).last_hidden_state  # (B, L, H)
                rows = hidden[:, :-1][action_mask]  # (N, H)
            return rows, lm.get_output_embeddings()

    def batch_hidden(self, sub: TrajectoryBatch, *, reference: bool = False) -> tuple[torch.Tensor, Any]:
        """:meth:`action_hidden` of a (micro-)batch of trajectories (its packing and shared
        prompts as it records them). Returns: (hidden rows of shape (N, H), the lm head)"""
        return self.action_hidden(
            sub.input_ids,
            sub.attention_mask,
            sub.action_mask,
            reference=reference,
            prompt_lens=sub.prompt_lens,
            prefix_ids=sub.prefix_ids,
            position_ids=sub.position_ids,
        )

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        action_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk_rows: int | None = None,
        reference: bool = False,
        return_entropy: bool = False,
        prompt_lens: torch.Tensor | None = None,
        prefix_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of the action tokens, 0 elsewhere, through :func:`chunked_logprobs`:
        no (B, L, V) logits tensor is ever built.

        Args: as :meth:`action_hidden`, plus ``temperature`` and ``chunk_rows`` for the op.

        Returns:
            (logp, entropy), each Shape: (B, L-1); entropy is None unless requested.
        """
        rows, head = self.action_hidden(
            input_ids,
            attention_mask,
            action_mask,
            reference=reference,
            prompt_lens=prompt_lens,
            prefix_ids=prefix_ids,
            position_ids=position_ids,
        )
        return self.rows_logprobs(rows, head, input_ids, action_mask, temperature, chunk_rows, return_entropy)

    @staticmethod
    def rows_logprobs(
        rows: torch.Tensor,
        head: Any,
        input_ids: torch.Tensor,
        action_mask: torch.Tensor,
        temperature: float = 1.0,
        chunk_rows: int | None = None,
        return_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`token_logprobs` from the hidden rows :meth:`action_hidden` gave.
        Shapes: rows (N, H); input_ids (B, L); action_mask (B, L-1); out (B, L-1) each."""
        targets = input_ids[:, 1:][action_mask]  # (N,)
        out = chunked_logprobs(
            rows,
            head.weight,
            targets,
            bias=head.bias,
            temperature=temperature,
            chunk_rows=chunk_rows,
            return_entropy=return_entropy,
        )
        logp_rows, ent_rows = out if isinstance(out, tuple) else (out, None)
        logp = scatter_rows(action_mask, logp_rows)
        entropy = None if ent_rows is None else scatter_rows(action_mask, ent_rows)
        return logp, entropy

    def forward_heads(
        self,
        sub: TrajectoryBatch,
        heads: tuple[str, ...] = ("logp",),
        *,
        temperature: float = 1.0,
        chunk_rows: int | None = None,
        reference: bool = False,
        teacher: Policy | None = None,
    ) -> dict[str, torch.Tensor]:
        """One call for what a (micro-)batch of trajectories needs from the model.

        ``heads``: any of ``logp`` and ``entropy`` (one actor pass, or the reference's with
        ``reference=True``), ``teacher_kl`` (the exact reverse KL from this pass's distribution to
        ``teacher``'s over the whole vocabulary, :func:`chunked_reverse_kl`; the teacher's body
        runs without gradients on the same rows) and ``value`` (the critic's pass). Each comes
        back Shape: (B, L-1), 0 outside the action tokens.
        """
        unknown = set(heads) - {"logp", "entropy", "teacher_kl", "value"}
        if unknown:
            raise ValueError(f"unknown heads {sorted(unknown)}; valid: logp, entropy, teacher_kl, value")
        if "teacher_kl" in heads and teacher is None:
            raise ValueError("the teacher_kl head needs the teacher's policy (teacher=)")
        out: dict[str, torch.Tensor] = {}
        if {"logp", "entropy", "teacher_kl"} & set(heads):
            rows, head = self.batch_hidden(sub, reference=reference)
            logp, entropy = self.rows_logprobs(
                rows, head, sub.input_ids, sub.action_mask, temperature, chunk_rows, "entropy" in heads
            )
            out["logp"] = logp
            if entropy is not None:
                out["entropy"] = entropy
            if teacher is not None and "teacher_kl" in heads:
                with torch.no_grad():
                    t_rows, t_head = teacher.batch_hidden(sub)
                kl_rows = chunked_reverse_kl(
                    rows,
                    head.weight,
                    t_rows,
                    t_head.weight,
                    head.bias,
                    t_head.bias,
                    temperature=temperature,
                    chunk_rows=chunk_rows,
                )
                out["teacher_kl"] = scatter_rows(sub.action_mask, kl_rows)
        if "value" in heads:
            out["value"] = self.values(
                sub.input_ids,
                sub.attention_mask,
                sub.action_mask,
                prompt_lens=sub.prompt_lens,
                prefix_ids=sub.prefix_ids,
                position_ids=sub.position_ids,
            )
        return out

    @property
    def adapter_names(self) -> list[str]:
        return [n for n in (self.adapter_name, self.reference_adapter, self.critic_adapter) if n is not None]

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """Every adapter's full weights (FSDP: a gather every rank joins); None when not sharded
        (the PEFT save reads them itself)."""
        if not isinstance(self.model, PeftModel) or self.adapter_name is None or not is_sharded(self):
            return None
        return adapter_state(self.model, self.adapter_names)

    def save_adapter(
        self, directory: str | Path, state: dict[str, torch.Tensor] | None = None
    ) -> Path | None:
        """Write every LoRA adapter as a PEFT directory (``directory/actor``, ``reference``, ``critic``,
        the critic with its value head); returns the actor's. None for full fine-tuning.

        Sharded (FSDP), every rank calls this (or passes ``state`` from :meth:`adapter_state`)."""
        if not isinstance(self.model, PeftModel) or self.adapter_name is None:
            return None
        if state is None:
            state = self.adapter_state()
        save_adapters(self.model, directory, self.adapter_names, self.value_head, state)
        out = Path(directory) / self.adapter_name
        return out if out.is_dir() else Path(directory)
