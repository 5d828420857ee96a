"""A mixture of environments (``env=mix``): each row of the mix is a row of one member env.

    python train.py env=mix                                        # arithmetic + guess_number, 1:1
    python train.py env=mix env.kwargs.weights.add=3               # 3 arithmetic rows per guessing one
    python train.py -m env=mix env.kwargs.weights.add=1,3          # a sweep over the weights

``env.kwargs.envs`` names the members, each a whole env node (``_target_``, ``kwargs`` and its own
``max_turns``, ``system_prompt``, ``train_size``, ``eval_size``). Training rows come either

- by **weight** (``weights: {name: w}``): a fixed interleave with period ``W = sum of the integer
  weights`` (``{a: 1, b: 3}``: 1 + 3; ``{a: 0.25, b: 0.75}`` is the same mix). Within a period,
  member m's k-th row sits at the k-th of its times ``(k + 1/2) / w_m`` (Sainte-Lague's
  order; ties go to the member named first), so after any n rows member m holds within
  ``(1 + M w_m / W) / 2`` of ``n w_m / W`` rows (M members). Member m's j-th row overall is its
  train row ``j mod n_m`` (a small member cycles: that is what its weight asks for). The mix has
  ``train_size`` rows (default: enough for the member with the most rows per unit of weight to
  pass once). The map is a pure function of the row index, the weights and the members' sizes:
  the run's resumable loader shuffles mix rows, and a resume draws the same ones;
- or by **route** (``route: <column>``, with ``path``: one local data file): each row of the file
  names its member in that column; member m gets the file's rows that name it (as a JSONL file of
  its own, its ``kwargs.path``), so members are dataset envs (``env=dataset`` nodes, each with its
  own scorer, instruction, extractor). The mix's rows are member 0's train rows, then member 1's...

Evaluation rows are every member's own eval rows, one member after the other: each member's
split rules hold (a member never evaluates on its training rows), and ``eval/<name>/accuracy_*``
and ``eval/<name>/return_*`` are logged per member (:mod:`rlhf_lightning.algorithms.evaluation`).

Every info a member returns is passed on as it is (``env/correct``, held-out accuracy over the
whole mix) and again as ``<name>/<key>`` (``env/<name>/<key>``), with ``<name>/reward`` (each
turn's reward), ``<name>/return`` (the episode's, when the member or its turn limit ends it) and,
on every episode's first step, ``<m>/share`` for every member (1 for the episode's own: the
share of the batch's episodes that member ``m`` played). Rewards are the members' own: the
``reward`` group applies to all members alike.

What the harness runs with one value for all (``env.max_model_len``, ``apply_chat_template``,
``history``, ``concurrency``, ``step_workers``, ``step_timeout_s``, ``on_reward_error``, the tool
list) must not differ in a member's node: such a member is refused, naming the field. Members
may differ in ``max_turns`` (each episode stops at its member's, ``env.max_turns`` must hold the
largest) and in ``system_prompt`` (the member's goes into its prompts as a system message).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from math import gcd, lcm
from pathlib import Path
from typing import Any

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.envs.agent import AgentEnv
from rlhf_lightning.envs.base import Observation, TextEnv
from rlhf_lightning.envs.dataset_files import load_rows
from rlhf_lightning.envs.factory import env_class, env_factory, split_sizes

MIX_KEY = "mix_env"  # the reset info's key naming the episode's member (per-member evaluation)
MAX_PERIOD = 100_000  # rows in one period of the weighted interleave
MAX_ROWS = 10_000_000  # the default train_size's cap (the loader shuffles that many indices)
# Member fields the harness applies to every member alike: a member must not set another value.
SHARED_FIELDS = (
    "apply_chat_template",
    "on_reward_error",
    "concurrency",
    "step_timeout_s",
    "step_workers",
    "history",
    "history_k",
)


def integer_weights(weights: Mapping[str, Any], names: list[str]) -> dict[str, int]:
    """``weights`` as the smallest integers in the same ratio (``{a: 0.25, b: 0.75}`` -> 1, 3)."""
    if sorted(weights) != sorted(names):
        raise ConfigError(
            "env.kwargs.weights",
            dict(weights),
            f"one weight per member of env.kwargs.envs ({', '.join(names)})",
        )
    exact = {}
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise ConfigError(f"env.kwargs.weights.{name}", w, "a number >= 0")
        exact[name] = Fraction(str(w))  # the decimal as written: 0.1 is 1/10
    if not any(exact.values()):
        raise ConfigError("env.kwargs.weights", dict(weights), "at least one weight above 0")
    scale = lcm(*(f.denominator for f in exact.values()))
    ints = {n: int(f * scale) for n, f in exact.items()}
    common = gcd(*ints.values())
    out = {n: v // common for n, v in ints.items()}
    if sum(out.values()) > MAX_PERIOD:
        raise ConfigError(
            "env.kwargs.weights",
            dict(weights),
            f"weights whose integer ratio sums to at most {MAX_PERIOD} (these make {sum(out.values())}): "
            "round them, e.g. 1:3 or 0.25:0.75",
        )
    return out


def interleave(weights: dict[str, int]) -> list[tuple[str, int]]:
    """One period of the weighted interleave: (member, its k-th row in the period) in order of
    the times ``(k + 1/2) / w`` (ties: the member named first). Length: the sum of the weights."""
    order = list(weights)
    events = [
        (Fraction(2 * k + 1, 2 * w), order.index(n), n, k) for n, w in weights.items() for k in range(w)
    ]
    return [(n, k) for _, _, n, k in sorted(events)]


@dataclass
class Member:
    """One member env: its factory, sizes and the settings the mix applies per episode."""

    factory: Callable[[], TextEnv]
    train_rows: int
    eval_rows: int
    max_turns: int
    system_prompt: str | None
    settings: dict[str, Any] = field(
        default_factory=dict
    )  # its node's harness fields (SHARED_FIELDS, max_model_len)


@dataclass
class MixPlan:
    """Which member and member row every mix row is: built once per process, shared by every
    episode's :class:`MixEnv`."""

    members: dict[str, Member]
    weights: dict[str, int] | None  # weights mode; None: route mode (rows concatenated)
    train_size: int
    period: list[tuple[str, int]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.members)

    def num_rows(self, evaluation: bool) -> int:
        if evaluation:
            return sum(m.eval_rows for m in self.members.values())
        return self.train_size

    def locate(self, row: int, evaluation: bool) -> tuple[str, int]:
        """Mix row ``row`` of the train or eval split as (member, that member's row)."""
        row = row % self.num_rows(evaluation)
        if evaluation or self.weights is None:  # each member's rows, one member after the other
            for name, m in self.members.items():
                n = m.eval_rows if evaluation else m.train_rows
                if row < n:
                    return name, row
                row -= n
            raise AssertionError("unreachable: row < num_rows")
        cycles, pos = divmod(row, len(self.period))
        name, k = self.period[pos]
        j = cycles * self.weights[name] + k  # member's rows before this one, over the whole mix
        return name, j % self.members[name].train_rows


def _member_node(name: str, node: Any) -> dict[str, Any]:
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(
            f"env.kwargs.envs.{name}", node, "an env node with _target_ and kwargs (e.g. env=arithmetic's)"
        )
    return dict(node)


def check_member(name: str, node: Mapping[str, Any], mix: Mapping[str, Any]) -> None:
    """A member's harness settings (``node``) against the mix's env node ``mix``: those the
    harness applies to all must not differ, its ``max_model_len`` not exceed the mix's, its
    ``max_turns`` not exceed ``env.max_turns``."""
    if "max_turns" in node and "max_turns" in mix and node["max_turns"] > mix["max_turns"]:
        raise ConfigError(
            "env.max_turns",
            mix["max_turns"],
            f"at least the longest member's max_turns (env.kwargs.envs.{name}.max_turns={node['max_turns']}): "
            "each episode stops at its own member's",
        )
    for key in SHARED_FIELDS:
        mine, theirs = (getattr(v, "value", v) for v in (node.get(key), mix.get(key)))  # an enum: its string
        if key in node and key in mix and mine != theirs:
            raise ConfigError(
                f"env.kwargs.envs.{name}.{key}",
                mine,
                f"env.{key}={theirs!r}: the harness runs every member with the mix's value; set both alike",
            )
    if "max_model_len" in node and "max_model_len" in mix and node["max_model_len"] > mix["max_model_len"]:
        raise ConfigError(
            f"env.kwargs.envs.{name}.max_model_len",
            node["max_model_len"],
            f"at most env.max_model_len={mix['max_model_len']} (one limit for every member's episodes): raise env.max_model_len",
        )


def route_files(path: str, column: str, names: list[str]) -> dict[str, Path]:
    """The rows of the data file ``path`` split by ``column`` into one JSONL file per member
    (written once per file content, atomically, under the temporary directory)."""
    rows = load_rows(path, None, "train", None, False, None)
    groups: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i, row in enumerate(rows):
        value = row.get(column)
        if value not in groups:
            raise ConfigError(
                "env.kwargs.route",
                column,
                f"a column of {path} naming a member ({', '.join(names)}) in every row: row {i} has {column}={value!r}",
            )
        groups[value].append(row)
    empty = [n for n, g in groups.items() if not g]
    if empty:
        raise ConfigError(
            "env.kwargs.route", column, f"rows for every member: no row of {path} names {', '.join(empty)}"
        )
    digest = hashlib.blake2b(Path(path).expanduser().read_bytes(), digest_size=16)
    digest.update(json.dumps([column, names]).encode())
    folder = Path(tempfile.gettempdir()) / "rlhf_lightning_mix" / digest.hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, group in groups.items():
        file = folder / f"{name}.jsonl"
        if not file.exists():
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in group), encoding="utf-8")
            os.replace(tmp, file)
        out[name] = file
    return out


def build_plan(
    envs: Mapping[str, Any],
    weights: Mapping[str, Any] | None = None,
    route: str | None = None,
    path: str | None = None,
    train_size: int | None = None,
) -> MixPlan:
    """The members built from their nodes and the row map (see the module's docstring)."""
    names = [str(n) for n in envs]
    if len(names) < 1:
        raise ConfigError("env.kwargs.envs", dict(envs), "at least one member env: {name: env node}")
    if (weights is None) == (route is None):
        raise ConfigError(
            "env.kwargs.weights" if weights is not None else "env.kwargs.route",
            dict(weights) if weights is not None else route,
            "exactly one of env.kwargs.weights ({name: weight}) and env.kwargs.route (a column of env.kwargs.path)",
        )
    if route is not None and not path:
        raise ConfigError("env.kwargs.path", path, "the data file whose route column names each row's member")
    if route is None and path:
        raise ConfigError(
            "env.kwargs.path", path, "null with env.kwargs.weights (a file is routed by env.kwargs.route)"
        )
    files = route_files(path, route, names) if route is not None and path else {}
    members: dict[str, Member] = {}
    tools: list[tuple[str, Any]] = []
    for name in names:
        node = _member_node(name, envs[name])
        if node["_target_"] == MIX_TARGET:
            raise ConfigError(f"env.kwargs.envs.{name}._target_", node["_target_"], "an env other than a mix")
        kwargs = dict(node.get("kwargs") or {})
        if route is not None:
            cls = env_class(node["_target_"])
            if "path" not in inspect.signature(cls).parameters:
                raise ConfigError(
                    f"env.kwargs.envs.{name}._target_",
                    node["_target_"],
                    "an env with a path argument (e.g. env=dataset's) with env.kwargs.route",
                )
            if kwargs.get("path") not in (None, "???"):
                raise ConfigError(
                    f"env.kwargs.envs.{name}.kwargs.path",
                    kwargs["path"],
                    "unset: env.kwargs.route gives each member its rows of env.kwargs.path",
                )
            kwargs["path"] = str(files[name])
        factory = env_factory(node["_target_"], kwargs)
        if isinstance(factory, AgentEnv):
            raise ConfigError(
                f"env.kwargs.envs.{name}._target_",
                node["_target_"],
                "a TextEnv: agents drive their own episodes and cannot mix",
            )
        n_train, n_eval = split_sizes(factory, node.get("train_size"), node.get("eval_size"))
        schemas = getattr(factory(), "tool_schemas", None)
        tools.append((name, list(schemas()) if callable(schemas) else None))
        settings = {k: node[k] for k in (*SHARED_FIELDS, "max_model_len", "max_turns") if k in node}
        members[name] = Member(
            factory, n_train, n_eval, int(node.get("max_turns", 1)), node.get("system_prompt"), settings
        )
    with_tools = {json.dumps(t, sort_keys=True) for _, t in tools if t}
    if len(with_tools) > 1 or (with_tools and any(t is None for _, t in tools)):
        raise ConfigError(
            "env.kwargs.envs",
            [n for n, t in tools if t],
            "members with the same tools or none: one tool list goes into every prompt of the mix",
        )
    if route is not None:
        size = sum(m.train_rows for m in members.values())
        if train_size is not None and train_size != size:
            raise ConfigError(
                "env.kwargs.train_size",
                train_size,
                f"null with env.kwargs.route (the members' {size} train rows)",
            )
        return MixPlan(members, None, size, tools=tools[0][1])
    ints = integer_weights(weights or {}, names)
    members = {n: m for n, m in members.items() if ints[n] > 0}  # weight 0: not in the mix at all
    ints = {n: w for n, w in ints.items() if w > 0}
    period = interleave(ints)
    if train_size is None:  # the member with the most rows per unit of weight passes once
        train_size = max(-(-m.train_rows * len(period) // ints[n]) for n, m in members.items())
        if train_size > MAX_ROWS:
            raise ConfigError(
                "env.kwargs.train_size", None, f"a row count: the default ({train_size}) is over {MAX_ROWS}"
            )
    if train_size < 1:
        raise ConfigError("env.kwargs.train_size", train_size, "a positive number of rows")
    return MixPlan(members, ints, int(train_size), period, tools[0][1])


class MixFactory:
    """Makes each episode's :class:`MixEnv` from one shared :class:`MixPlan` (``env_factory`` calls
    :meth:`MixEnv.shared_factory`); ``close`` closes what the members' factories hold."""

    def __init__(self, plan: MixPlan) -> None:
        self.plan = plan

    def check_harness(self, mix: Mapping[str, Any]) -> None:
        """Each member's node against the mix's env node ``mix`` (:func:`check_member`): called
        by ``run.parts.harness_from`` before the harness is built."""
        for name, m in self.plan.members.items():
            check_member(name, m.settings, mix)

    @property
    def member_names(self) -> tuple[str, ...]:
        return self.plan.names

    def __call__(self) -> MixEnv:
        env = MixEnv.__new__(MixEnv)
        env._attach(self.plan)
        return env

    def close(self) -> None:
        for m in self.plan.members.values():
            close = getattr(m.factory, "close", None)
            if callable(close):
                close()


MIX_TARGET = f"{__name__}.MixEnv"


class MixEnv:
    """Plays each row with the member env the mix assigns it to (see the module's docstring).

    Args:
        envs: ``{name: env node}`` (``_target_``, ``kwargs``, ``max_turns``, ``system_prompt``,
            ``train_size``, ``eval_size``, ...): the members.
        weights: ``{name: weight}`` (every member; 0 leaves one out): rows by weight.
        route: a column of ``path`` naming each row's member: rows by route.
        path: the local data file routed by ``route`` (JSONL/JSON/Parquet/CSV).
        train_size: the mix's train rows (weights; null: see the module's docstring).
    """

    plan: MixPlan

    def __init__(
        self,
        envs: dict[str, Any],
        weights: dict[str, Any] | None = None,
        route: str | None = None,
        path: str | None = None,
        train_size: int | None = None,
    ) -> None:
        self._attach(build_plan(envs, weights, route, path, train_size))

    @classmethod
    def shared_factory(cls, **kwargs: Any) -> MixFactory:
        """One plan for every episode: members and their rows are built once per process."""
        return MixFactory(build_plan(**kwargs))

    def _attach(self, plan: MixPlan) -> None:
        self.plan = plan
        self.member: TextEnv | None = None
        self.name = ""
        self.turns = 0
        self.episode_return = 0.0

    @property
    def member_names(self) -> tuple[str, ...]:
        return self.plan.names

    def num_rows(self, evaluation: bool) -> int:
        return self.plan.num_rows(evaluation)

    def tool_schemas(self) -> list[dict[str, Any]]:
        return list(self.plan.tools or [])

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[Observation, dict[str, Any]]:
        row = row_index if row_index is not None else seed or 0
        self.name, member_row = self.plan.locate(row, evaluation)
        m = self.plan.members[self.name]
        self.member = m.factory()
        self.turns, self.episode_return = 0, 0.0
        obs, info = self.member.reset(seed=member_row, row_index=member_row, evaluation=evaluation)
        if m.system_prompt:  # the member's own system prompt (a message of the obs wins: it is the row's)
            msgs = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
            if not any(msg.get("role") == "system" for msg in msgs):
                obs = [{"role": "system", "content": m.system_prompt}, *msgs]
        return obs, {**(info or {}), MIX_KEY: self.name}

    def step(self, action: str) -> tuple[Observation, float, bool, bool, dict[str, Any]]:
        if self.member is None:
            raise RuntimeError("MixEnv.step called before reset")
        obs, reward, terminated, truncated, info = self.member.step(action)
        self.turns += 1
        self.episode_return += float(reward)
        if not (terminated or truncated) and self.turns >= self.plan.members[self.name].max_turns:
            truncated = True  # the member's own turn limit (the harness holds the largest)
        out = dict(info or {})
        for k, v in (info or {}).items():
            if isinstance(v, (bool, int, float)):
                out[f"{self.name}/{k}"] = v
        out[f"{self.name}/reward"] = float(reward)
        if terminated or truncated:
            out[f"{self.name}/return"] = self.episode_return
        if self.turns == 1:
            out.update({f"{n}/share": float(n == self.name) for n in self.plan.names})
        return obs, reward, terminated, truncated, out
