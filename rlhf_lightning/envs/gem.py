"""GEM environments (github.com/axon-rl/gem, ``pip install 'rlhf_lightning[gem]'``) as TextEnvs.

    python train.py env=gem model=tiny_chat                                  # game:Sudoku-v0-easy
    python train.py env=gem env.kwargs.id=game:Minesweeper-v0-easy env.max_turns=25

A thin adapter: GEM builds the game (``gem.make(id, **kwargs)``), scores every move and ends the
episode; its rewards, ``terminated`` and ``truncated`` come back unchanged. Each user turn is
GEM's observation followed by ``info["suffix"]`` (the current board), joined the way GEM's own
observation wrappers join them; the harness keeps the conversation, so a turn holds only the new
feedback and board, not the history. Episodes are seeded: train row ``i`` plays GEM seed
``seed + i``, eval row ``j`` seed ``seed + train_size + j`` (:func:`gem_seed`), so eval seeds are
never train seeds.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np

from rlhf_lightning.config.errors import ConfigError
from rlhf_lightning.records.trajectory import ANCHOR_STATE

log = logging.getLogger(__name__)

GEM_EXTRA = "pip install 'rlhf_lightning[gem]'"
SEED_LIMIT = 2**32  # GEM seeds NumPy's legacy global RNG, which takes seeds in [0, 2**32)
WIN_PREFIX = "Congratulations!"  # every GEM game (gem 0.1.0) opens its winning message with it
SUCCESS_KEYS = ("correct", "success", "solved")  # what our evaluation reads (episode_success)
# Process-wide: GEM envs draw from Python's and NumPy's global RNGs; one env swaps its own in at a time.
_RNG_LOCK = threading.RLock()


def import_gem(env_id: str | None = None) -> ModuleType:
    """``gem``, imported without letting it configure the root logger.

    ``gem/__init__.py`` calls ``logging.basicConfig(level=INFO)``; a temporary handler on the
    root logger makes that a no-op, so importing GEM does not turn on INFO logs everywhere.
    """
    root = logging.getLogger()
    guard = None if root.handlers else logging.NullHandler()
    if guard is not None:
        root.addHandler(guard)
    try:
        return importlib.import_module("gem")
    except ImportError as err:
        raise ConfigError(
            "env.kwargs.id", env_id, f"an installed GEM: env=gem needs the gem extra ({err}): {GEM_EXTRA}"
        ) from None
    finally:
        if guard is not None:
            root.removeHandler(guard)


def registry(env_id: str | None = None) -> dict[str, Any]:
    """GEM's registered ids and their specs (``gem.envs.registration.ENV_REGISTRY``)."""
    import_gem(env_id)
    from gem.envs.registration import ENV_REGISTRY

    return dict(ENV_REGISTRY)


def unknown_id(env_id: str, ids: list[str]) -> ConfigError:
    """The error for an id GEM does not register, with the closest registered ids."""
    close = difflib.get_close_matches(env_id, ids, n=5, cutoff=0.4)
    games = sorted(i for i in ids if i.startswith("game:"))
    examples = close or [*games[:4], "rg:basic_arithmetic"]
    return ConfigError(
        "env.kwargs.id",
        env_id,
        f"an id GEM registers ({len(ids)} in gem.envs.registration.ENV_REGISTRY), e.g. "
        f"{', '.join(examples)}. Offline: game:* (but Wordle, Hangman and WordSearch need NLTK data) "
        "and rg:*",
    )


def entry_class(spec: Any) -> Any:
    """The class (or callable) a GEM spec builds, imported the way ``gem.make`` imports it."""
    entry = spec.entry_point
    if not isinstance(entry, str):
        return entry
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def check_kwargs(env_id: str, spec: Any, kwargs: dict[str, Any]) -> None:
    """``kwargs`` are named parameters of the entry point (GEM's envs take ``**_`` and would
    ignore a misspelt one silently)."""
    try:
        params = inspect.signature(entry_class(spec)).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return  # the build reports an entry point that does not import
    named = sorted(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
    unknown = sorted(set(kwargs) - set(named))
    if unknown:
        raise ConfigError(
            "env.kwargs.kwargs",
            kwargs,
            f"keyword arguments of {spec.entry_point} (the env behind {env_id}): {unknown} are not "
            f"among {named}",
        )


def build_error(env_id: str, spec: Any, err: BaseException) -> ConfigError:
    """Why ``gem.make(env_id)`` failed, as a ConfigError with the fix: a Hub dataset without
    network, NLTK data it downloads, a package GEM does not install, or GEM's own error."""
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = f"{type(err).__name__}: {str(err).strip()[:300]}"
    dataset = spec.kwargs.get("dataset_name")
    missing = next((e for e in chain if isinstance(e, ModuleNotFoundError) and e.name), None)
    if missing is not None:
        allowed = (
            f"an id whose code imports: {spec.entry_point} needs the package {missing.name!r}, which "
            f"gem-llm does not install (pip install {missing.name}), or pick a game:* or rg:* id"
        )
    elif dataset:
        allowed = (
            f"an id that builds offline: {env_id} loads the Hugging Face dataset {dataset!r} "
            f"(datasets.load_dataset), which failed with {text}. Without network, download it "
            "elsewhere into the Hugging Face cache and set HF_HUB_OFFLINE=1, pick a game:* or rg:* id, "
            "or use env=dataset on local files"
        )
    elif any(isinstance(e, LookupError) and "nltk" in str(e).lower() for e in chain):
        allowed = (
            f"an id that builds offline: {env_id} needs NLTK's 'words' corpus, which it downloads "
            "with nltk.download at start-up. Run python -m nltk.downloader words where there is "
            "network and copy nltk_data here (or set NLTK_DATA), or pick another game:* id"
        )
    else:
        allowed = f"an id gem.make builds: gem.make({env_id!r}) raised {text}"
    return ConfigError("env.kwargs.id", env_id, allowed)


class PrivateRng:
    """The states of Python's and NumPy's global RNGs that one GEM env sees.

    GEM's ``reset(seed)`` reseeds both global RNGs (``random.seed``, ``np.random.seed``) and its
    games draw from them while they play (a 2048 tile, Minesweeper's mines). Inside ``active()``
    this env's own states replace the process's, and the process's come back afterwards: the
    trainer's RNGs are untouched, and an episode plays the same whatever other episodes do in
    between (it equals ``gem.make`` + ``reset(seed)`` + its ``step``s run alone).
    """

    def __init__(self) -> None:
        self.state: tuple[Any, Any] | None = None

    @contextmanager
    def active(self) -> Iterator[None]:
        with _RNG_LOCK:
            outer = (random.getstate(), np.random.get_state())
            if self.state is not None:
                random.setstate(self.state[0])
                np.random.set_state(self.state[1])
            try:
                yield
            finally:
                self.state = (random.getstate(), np.random.get_state())
                random.setstate(outer[0])
                np.random.set_state(outer[1])


@functools.lru_cache(maxsize=16)
def prototype(env_id: str, kwargs_json: str) -> Any:
    """One built GEM env per id and kwargs per process; every episode plays a deep copy of it
    (building can take long: GEM's Crosswords reads a word list, Sokoban-hard generates a room).
    Raises ConfigError for an unknown id, unknown kwargs, or an env that cannot be built here."""
    gem = import_gem(env_id)
    specs = registry(env_id)
    if env_id not in specs:
        raise unknown_id(env_id, sorted(specs))
    spec, kwargs = specs[env_id], json.loads(kwargs_json)
    check_kwargs(env_id, spec, kwargs)
    try:
        with PrivateRng().active():  # a game's __init__ plays an unseeded reset
            env = gem.make(env_id, **kwargs)
    except Exception as err:
        raise build_error(env_id, spec, err) from None
    if env_id.startswith("rg:") or spec.kwargs.get("dataset_name"):
        log.warning(
            "GEM's %s draws every episode at random from one dataset, whatever the seed: its train and "
            "eval episodes overlap%s",
            env_id,
            " (env=reasoning_gym keeps them apart)" if env_id.startswith("rg:") else "",
        )
    return env


def gem_seed(row: int, evaluation: bool, seed: int, train_size: int, eval_size: int) -> int:
    """The GEM seed of a task row: train row ``i`` -> ``seed + i``, eval row ``j`` ->
    ``seed + train_size + j`` (rows taken modulo their split's size), so the two splits' seeds
    never meet."""
    if evaluation:
        return seed + train_size + row % eval_size
    return seed + row % train_size


@functools.lru_cache(maxsize=8)
def unseen_eval_seeds(
    env_id: str, kwargs_json: str, seed: int, train_size: int, eval_size: int
) -> tuple[int, ...]:
    """``eval_size`` seeds after the train seeds whose first observation (the puzzle) is none of
    the train seeds' first observations: evaluation then plays only boards that training can
    never have played. Each train seed is reset once (game:Sudoku-v0-easy: ~1.7 ms each), once
    per process. The first observation stands for the puzzle: right for Sudoku (its board), not
    for a game that hides it (GuessTheNumber's target: its observation differs only in an
    example number). A game whose starts all look alike has no unseen ones: at most
    ``100 x eval_size`` seeds are tried before a ConfigError says so."""
    env = copy.deepcopy(prototype(env_id, kwargs_json))
    rng = PrivateRng()

    def first_obs(s: int) -> str:
        with rng.active():
            obs, info = env.reset(seed=s)
        return compose(str(obs), {k: plain(v) for k, v in dict(info or {}).items()})

    seen = {first_obs(s) for s in range(seed, seed + train_size)}
    out: list[int] = []
    start = seed + train_size
    for s in range(start, min(start + 100 * eval_size, SEED_LIMIT)):
        if first_obs(s) not in seen:
            out.append(s)
            if len(out) == eval_size:
                return tuple(out)
    raise ConfigError(
        "env.kwargs.eval_unseen",
        True,
        f"a game whose first observation shows its puzzle: {env_id} gave {len(out)} unseen starts in "
        f"{100 * eval_size} seeds after the {train_size} train seeds (set env.kwargs.eval_unseen=false, "
        "or fewer train seeds)",
    )


def compose(obs: str, info: dict[str, Any]) -> str:
    """One user turn as GEM's observation wrappers (``gem.wrappers.observation_wrapper``) write
    it: ``info["prefix"]``, the observation on its own line(s), then ``info["suffix"]``."""
    from gem.wrappers.observation_wrapper import maybe_add_new_line

    prefix, suffix = str(info.get("prefix", "")), str(info.get("suffix", ""))
    return prefix + (maybe_add_new_line(obs) + suffix if suffix else obs)


def plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (logged as ``env/<key>``); anything else unchanged."""
    return value.item() if isinstance(value, np.generic) else value


def _filled_cells(game: Any) -> int:
    return sum(v != 0 for row in game.board for v in row)


# Games whose state tells whether GEM accepted a move: id prefix -> a count that grows exactly then.
# Sudoku fills a cell only for a right digit (wrong digits, filled or out-of-bounds cells and
# replies without a move leave the board as it was); GuessTheNumber records only in-range guesses
# it has not seen (out-of-range and repeated guesses are refused).
MOVE_COUNTERS: dict[str, Callable[[Any], int]] = {
    "game:Sudoku": _filled_cells,
    "game:GuessTheNumber": lambda game: len(game.previous_guesses),
}


def move_counter(env_id: str) -> Callable[[Any], int] | None:
    """The counter of :data:`MOVE_COUNTERS` for ``env_id`` (None: the game has none)."""
    return next((f for prefix, f in MOVE_COUNTERS.items() if env_id.startswith(prefix)), None)


def is_solved(env_id: str, obs: str, reward: float, terminated: bool) -> bool:
    """GEM's own success signal: a game (``game:*``) is won when it ends with its
    "Congratulations!" message; a reasoning-gym task (``rg:*``) when ``score_answer`` gives full
    marks. Other ids get no ``solved`` (evaluation then counts a positive return)."""
    if env_id.startswith("game:"):
        return terminated and obs.startswith(WIN_PREFIX)
    return terminated and reward >= 1.0


def anchor_state(info: dict[str, Any]) -> dict[str, str]:
    """The state GiGPO's step-level groups match on (``info["anchor_state"]``,
    :data:`~rlhf_lightning.records.trajectory.ANCHOR_STATE`): a game's board (``info["suffix"]``),
    without the feedback, which names the turn and the last move and so rarely repeats (on
    ``experiment=gem_sudoku``'s start 4-5% of later turns shared feedback and board, 93% the
    board). Nothing where GEM gives no board."""
    return {ANCHOR_STATE: str(info["suffix"])} if "suffix" in info else {}


class GemEnv:
    """A GEM environment: GEM's game, moves, rewards and termination; our seeds and splits.

    Observations: at reset, GEM's instructions then the board (``info["suffix"]``); after each
    move, GEM's feedback then the new board (:func:`compose`). Rewards, ``terminated`` and
    ``truncated`` are GEM's as it returns them (``game:Sudoku-v0-easy``: 1/#empty cells for a
    right move, 0 for an illegal one, -0.1 for a reply without ``\\boxed{row col value}``, which
    ends the episode; GEM truncates at the game's own turn limit, 15 there, so keep
    ``env.max_turns`` at least that). ``info``: GEM's (NumPy numbers as Python numbers; strings
    such as the suffix are not logged) plus ``solved`` (:func:`is_solved`) unless GEM reports
    ``correct``/``success``/``solved`` itself, and for the games of :data:`MOVE_COUNTERS`
    (Sudoku, GuessTheNumber) ``valid_move``: GEM accepted the move (its mean over a batch's turns
    is ``env/valid_move``), and ``anchor_state`` where GEM gives a board (:func:`anchor_state`:
    GiGPO's state). Reset info holds ``gem_seed`` and ``instructions`` (GEM's rules
    without the board: with ``env.history=last`` each turn's prompt is they and the latest
    feedback and board).

    Seeds, not puzzles, are disjoint: a game with few distinct starts repeats them (with 100,000
    train seeds, 8 of game:Sudoku-v0-easy's 200 eval boards are also train boards;
    GuessTheNumber-v0-easy has 10 targets in all). GEM's rg:* and Hub-dataset ids draw each
    episode at random from one dataset whatever the seed, so their splits overlap (a warning says
    so; env=reasoning_gym keeps reasoning-gym items apart).

    Args:
        id: a GEM id (``gem.envs.registration.ENV_REGISTRY``), e.g. ``game:Sudoku-v0-easy``,
            ``game:GuessTheNumber-v0-easy``, ``game:Minesweeper-v0-easy``, ``rg:basic_arithmetic``.
            Hub-dataset ids (math:*, qa:*, code:*, eval:*) need network or a filled cache.
        kwargs: keyword arguments for ``gem.make`` (they override the id's registered ones).
        train_size, eval_size: rows (seeds) per split.
        seed: the first train seed (see :func:`gem_seed`).
        eval_unseen: eval rows play only seeds whose puzzle (first observation) no train seed
            starts with (:func:`unseen_eval_seeds`: every train seed is reset once, at the first
            evaluation reset of a process), so held-out boards are boards training never saw.
    """

    def __init__(
        self,
        id: str = "game:Sudoku-v0-easy",
        kwargs: dict[str, Any] | None = None,
        train_size: int = 100_000,
        eval_size: int = 200,
        seed: int = 0,
        eval_unseen: bool = False,
    ) -> None:
        for field, value in (("train_size", train_size), ("eval_size", eval_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"env.kwargs.{field}", value, "a positive number of rows (GEM seeds)")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError("env.kwargs.seed", seed, "an integer >= 0 (GEM's first seed)")
        if seed + train_size + eval_size > SEED_LIMIT:
            raise ConfigError(
                "env.kwargs.seed",
                seed,
                f"seed + train_size + eval_size <= 2**32 (GEM seeds NumPy with them): {seed} + "
                f"{train_size} + {eval_size} is more",
            )
        if not isinstance(kwargs, (dict, type(None))):
            raise ConfigError("env.kwargs.kwargs", kwargs, "a mapping of keyword arguments for gem.make")
        self.id, self.seed, self.eval_unseen = id, seed, bool(eval_unseen)
        self.train_size, self.eval_size = train_size, eval_size
        try:
            key = json.dumps(kwargs or {}, sort_keys=True)
        except TypeError as err:
            raise ConfigError(
                "env.kwargs.kwargs", kwargs, f"plain values (numbers, strings, lists): {err}"
            ) from None
        self.key = key
        self.env = copy.deepcopy(prototype(id, key))
        self.rng = PrivateRng()
        self.started = False

    def num_rows(self, evaluation: bool) -> int:
        return self.eval_size if evaluation else self.train_size

    def reset(
        self, seed: int | None = None, *, row_index: int | None = None, evaluation: bool = False
    ) -> tuple[str, dict[str, Any]]:
        row = row_index if row_index is not None else seed or 0
        if evaluation and self.eval_unseen:
            seeds = unseen_eval_seeds(self.id, self.key, self.seed, self.train_size, self.eval_size)
            s = seeds[row % self.eval_size]
        else:
            s = gem_seed(row, evaluation, self.seed, self.train_size, self.eval_size)
        with self.rng.active():
            obs, info = self.env.reset(seed=s)
        self.started = True
        info = {k: plain(v) for k, v in dict(info or {}).items()}
        # env.history=last: each turn's prompt is these instructions and the latest observation
        return compose(str(obs), info), {
            **info,
            **anchor_state(info),
            "gem_seed": s,
            "instructions": str(obs),
        }

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self.started:
            raise RuntimeError("GemEnv.step called before reset")
        counter = move_counter(self.id)
        before = counter(self.env) if counter is not None else 0
        with self.rng.active():
            obs, reward, terminated, truncated, info = self.env.step(action)
        reward, terminated, truncated = float(reward), bool(terminated), bool(truncated)
        info = {k: plain(v) for k, v in dict(info or {}).items()}
        if self.id.startswith(("game:", "rg:")) and not any(k in info for k in SUCCESS_KEYS):
            info["solved"] = is_solved(self.id, str(obs), reward, terminated)
        if counter is not None and "valid_move" not in info:
            # env/valid_move: the share of a batch's turns whose move GEM accepted
            info["valid_move"] = counter(self.env) > before
        info.update(anchor_state(info))
        return compose(str(obs), info), reward, terminated, truncated, info
