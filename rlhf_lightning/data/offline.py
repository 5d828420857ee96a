"""Offline data for SFT and DPO: local files encoded into token-exact trajectories.

An example becomes a :class:`~rlhf_lightning.records.trajectory.Trajectory` exactly as the rollout
harness would have built it (chat-templated prompt, then each assistant reply's ids plus the
end-of-turn token, then the next user turn as the template renders it), so supervised,
preference and RL stages all train on the same token layout. Assistant tokens are the
"actions": the only tokens with loss.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.data.prompts import eval_row_loader, per_rank_batch
from rlhf_lightning.data.resumable import resumable_loader
from rlhf_lightning.envs.files import read_rows, split_rows, warn_shared_rows
from rlhf_lightning.records.trajectory import Trajectory, TrajectoryBatch, collate, segment_positions
from rlhf_lightning.rollout.episodes.harness import ChatFormatter

log = logging.getLogger(__name__)

Message = dict[str, str]


def encode_conversation(messages: list[Message], formatter: ChatFormatter, group_id: int = 0) -> Trajectory:
    """Token ids of a conversation; every assistant message (and its end-of-turn token) is an action."""
    tok = formatter.tokenizer
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError(
            "a conversation needs at least one message before the first assistant reply, and one reply"
        )
    ids = formatter.prompt_ids(messages[:first])
    prompt_len = len(ids)
    turns = [-1] * len(ids)
    turn, i = 0, first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            reply = tok(messages[i]["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids += reply
            turns += [turn] * len(reply)
            turn, i = turn + 1, i + 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] != "assistant":
            j += 1
        if j == len(messages):
            break  # trailing non-assistant messages carry nothing to learn
        obs = formatter.observation_ids(messages[i:j])
        ids += obs
        turns += [-1] * len(obs)
        i = j
    text = formatter.prompt_text(messages[:first])
    return Trajectory(ids, turns, [0.0] * len(ids), [0.0] * turn, group_id, prompt_len, prompt_text=text)


def as_messages(prompt: Any, reply: str | None = None) -> list[Message]:
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return msgs + ([{"role": "assistant", "content": reply}] if reply is not None else [])


# The columns of a row and the ``algo.*_key`` fields that name them.
COLUMN_FIELDS = {
    "messages": "algo.messages_key",
    "prompt": "algo.prompt_key",
    "completion": "algo.completion_key",
    "chosen": "algo.chosen_key",
    "rejected": "algo.rejected_key",
}


def check_rows(
    rows: list[dict[str, Any]], kind: str, keys: dict[str, str], path: str, field: str
) -> list[dict[str, Any]]:
    """The usable rows of ``path``. Every row has the columns ``kind`` reads (SFT: ``messages``,
    else ``prompt`` and ``completion``, as the first row has them; preference: ``prompt``,
    ``chosen``, ``rejected``): else :class:`ConfigError` naming the ``algo.*_key`` field and the
    row's columns (a missing column was a bare ``KeyError``).

    A preference pair whose chosen and rejected replies are the same trains nothing (its loss
    gradient is zero): such rows are dropped with one warning (their count, the first one's row)
    -- real preference sets (HH-RLHF) hold a few. Raises :class:`ConfigError` when no row is left.
    """
    if kind == "preference":
        needed, hint = (
            ["prompt", "chosen", "rejected"],
            "algo.prompt_key, algo.chosen_key and algo.rejected_key",
        )
    else:
        needed = ["messages"] if keys["messages"] in rows[0] else ["prompt", "completion"]
        hint = "algo.messages_key (chat rows), or algo.prompt_key and algo.completion_key"
    for i, row in enumerate(rows):
        for name in needed:
            if keys[name] not in row:
                raise ConfigError(
                    COLUMN_FIELDS[name],
                    keys[name],
                    f"a column of every row of {path} ({field}): row {i} has {sorted(row)}; set {hint} "
                    "to the file's column names",
                )
    if kind != "preference":
        return rows
    same = [i for i, row in enumerate(rows) if row[keys["chosen"]] == row[keys["rejected"]]]
    if not same:
        return rows
    first = f"row {same[0]} (counting from 0): {str(rows[same[0]][keys['chosen']])[:60]!r}"
    if len(same) == len(rows):
        raise ConfigError(
            field,
            path,
            f"a file with at least one usable preference pair: all {len(rows)} rows have the same "
            f"chosen and rejected reply (the first is {first}), and a pair of identical replies "
            "trains nothing; give rows whose chosen and rejected replies differ",
        )
    log.warning(
        "dropped %d of %d preference rows of %s (%s) whose chosen and rejected replies are the "
        "same (they train nothing); the first is %s",
        len(same),
        len(rows),
        path,
        field,
        first,
    )
    dropped = set(same)
    return [row for i, row in enumerate(rows) if i not in dropped]


class _RowDataset(Dataset):
    """Rows of a file, encoded on access with the chat formatter; ``keys`` name the columns."""

    def __init__(self, rows: list[dict[str, Any]], formatter: ChatFormatter, keys: dict[str, str]) -> None:
        self.rows, self.formatter, self.keys = rows, formatter, keys

    def __len__(self) -> int:
        return len(self.rows)


class SFTDataset(_RowDataset):
    """``messages`` rows (chat lists) or ``prompt``/``completion`` rows."""

    def __getitem__(self, i: int) -> list[Trajectory]:
        row, k = self.rows[i], self.keys
        msgs = (
            row[k["messages"]]
            if k["messages"] in row
            else as_messages(row[k["prompt"]], row[k["completion"]])
        )
        return [encode_conversation(msgs, self.formatter, group_id=i)]


class PreferenceDataset(_RowDataset):
    """``prompt``/``chosen``/``rejected`` rows -> (chosen, rejected) trajectories sharing the prompt."""

    def __getitem__(self, i: int) -> list[Trajectory]:
        row, k = self.rows[i], self.keys
        return [
            encode_conversation(as_messages(row[k["prompt"]], row[k[side]]), self.formatter, group_id=i)
            for side in ("chosen", "rejected")
        ]


def pack_trajectories(trajs: list[Trajectory], max_len: int) -> tuple[list[Trajectory], list[list[int]]]:
    """Concatenate examples into rows of at most ``max_len`` tokens (first fit, in order).

    Returns the packed rows and, per row, the lengths of the examples in it.
    """
    rows: list[Trajectory] = []
    lens: list[list[int]] = []
    for t in trajs:
        n = len(t.token_ids)
        for row, seg in zip(rows, lens):
            if sum(seg) + n <= max_len:
                row.token_ids += t.token_ids
                row.action_turn += t.action_turn
                row.sampling_logps += t.sampling_logps
                seg.append(n)
                break
        else:
            rows.append(
                Trajectory(
                    list(t.token_ids),
                    list(t.action_turn),
                    list(t.sampling_logps),
                    list(t.rewards),
                    group_id=len(rows),
                    prompt_len=t.prompt_len,
                )
            )
            lens.append([n])
    return rows, lens


class OfflineCollator:
    """Lists of trajectories -> one right-padded batch; SFT examples longer than ``max_len`` are
    dropped and counted (a preference pair is dropped whole). With ``pack``, SFT examples are
    packed into rows of at most ``max_len`` tokens (:func:`pack_trajectories`)."""

    def __init__(self, pad_token_id: int, max_len: int, pack: bool = False) -> None:
        self.pad_token_id, self.max_len, self.pack = pad_token_id, max_len, pack
        self.dropped = 0

    def __call__(self, items: list[list[Trajectory]]) -> TrajectoryBatch:
        kept = [item for item in items if all(len(t.token_ids) <= self.max_len for t in item)]
        if len(kept) < len(items):
            self.dropped += len(items) - len(kept)
            log.warning(
                "dropped %d example(s) longer than algo.max_len=%d tokens",
                len(items) - len(kept),
                self.max_len,
            )
        if not kept:
            raise ValueError(
                f"every example of this batch is longer than algo.max_len={self.max_len}; raise it"
            )
        # Pairs: all chosen first, then all rejected, so that rows i and i + n are a pair.
        width = len(kept[0])
        trajs = [item[j] for j in range(width) for item in kept]
        for g, t in enumerate(trajs):
            t.group_id = g % len(kept)
        if not (self.pack and width == 1):
            return collate(trajs, self.pad_token_id)
        rows, lens = pack_trajectories(trajs, self.max_len)
        batch = collate(rows, self.pad_token_id)
        batch.position_ids = segment_positions(lens, batch.input_ids.shape[1])
        batch.prefix_ids = torch.arange(len(rows))  # packed rows never share a prompt pass
        return batch


class OfflineDataModule(L.LightningDataModule):
    """Train/eval splits of an SFT or preference file; optionally env rows for accuracy evals.

    Args:
        kind: ``sft`` or ``preference``.
        path, eval_path, eval_fraction: the data files (see :func:`split_rows`).
        keys: column names (``messages``, ``prompt``, ``completion``, ``chosen``, ``rejected``).
        env_eval_rows: rows of the env's eval split to evaluate on too (0: none).
    """

    def __init__(
        self,
        kind: str,
        path: str,
        formatter: ChatFormatter,
        keys: dict[str, str],
        batch_size: int,
        max_len: int,
        eval_path: str | None = None,
        eval_fraction: float = 0.1,
        env_eval_rows: int = 0,
        env_eval_batch_size: int = 200,
        seed: int = 0,
        packing: bool = False,
    ) -> None:
        super().__init__()
        rows = check_rows(read_rows(path, "algo.data_path"), kind, keys, path, "algo.data_path")
        eval_rows = None
        if eval_path:
            read = read_rows(eval_path, "algo.eval_data_path")
            eval_rows = check_rows(read, kind, keys, eval_path, "algo.eval_data_path")
        self.train_rows, self.eval_rows = split_rows(rows, eval_rows, eval_fraction)
        warn_shared_rows(self.train_rows, self.eval_rows, eval_path or path)
        cls = PreferenceDataset if kind == "preference" else SFTDataset
        self.train_set = cls(self.train_rows, formatter, keys)
        self.eval_set = cls(self.eval_rows, formatter, keys)
        self.collator = OfflineCollator(formatter.tokenizer.pad_token_id, max_len, pack=packing)
        self.batch_size, self.seed = batch_size, seed
        self.env_eval_rows, self.env_eval_batch_size = env_eval_rows, env_eval_batch_size

    def train_dataloader(self) -> DataLoader:
        """Shuffled from ``seed + epoch``, each rank its share; resumes mid-epoch from a checkpoint."""
        return resumable_loader(
            self,
            self.train_set,
            per_rank_batch(self, self.batch_size, "algo.batch_size"),
            self.seed,
            self.collator,
        )

    def val_dataloader(self) -> list[DataLoader]:
        # Own generators: creating a loader's iterator otherwise draws from the global RNG
        # (an evaluation would then shift training's random numbers).
        loaders = [
            DataLoader(
                self.eval_set,
                batch_size=self.batch_size,
                collate_fn=self.collator,
                generator=torch.Generator(),
            )
        ]
        if self.env_eval_rows:  # env rows split over ranks, each once (see eval_row_loader)
            loaders.append(eval_row_loader(self, self.env_eval_rows, self.env_eval_batch_size))
        return loaders
