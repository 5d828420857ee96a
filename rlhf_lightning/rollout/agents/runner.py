"""The episode driver of ``env=agent``: agents drive their own conversations against the policy
endpoint, and the run trains on what the endpoint recorded.

:class:`AgentRunner` has the harness's ``rollout`` (so the rollout source, evaluation and the
async producer take it as they take :class:`~rlhf_lightning.rollout.episodes.harness.RolloutHarness`):
for each task row, ``group_size`` episodes, each an agent in a worker process with its own
address on the endpoint; while they run, the calling thread (which owns the engine) serves their
model calls in batches; each episode's recorded calls become one token-exact trajectory
(:func:`~rlhf_lightning.rollout.agents.assembly.trajectory`) with the agent's reward on its last
call.

An episode that hangs past ``env.step_timeout_s`` (its worker killed), raises, returns a bad value,
or never calls the model is an error: ``env.on_reward_error=raise`` ends the run naming it, ``zero``
scores it 0 (an episode without calls keeps its task prompt and no action token, so it adds
nothing to the loss) and counts it in ``env/reward_errors``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Callable
from typing import Any

from rlhf_lightning.envs.agent import AgentEnv
from rlhf_lightning.records.metrics import episode_metrics
from rlhf_lightning.records.result import RolloutResult
from rlhf_lightning.records.sampling import SamplingParams
from rlhf_lightning.records.trajectory import Trajectory, collate
from rlhf_lightning.rollout.agents.assembly import Call, trajectory
from rlhf_lightning.rollout.agents.endpoint import PolicyEndpoint
from rlhf_lightning.runtime.workers import Outcome, WorkerPool

log = logging.getLogger(__name__)


class AgentEpisodeError(RuntimeError):
    """An agent's episode failed (``env.on_reward_error=raise``)."""


class AgentRunner:
    """Episodes of ``env=agent`` (see the module's docstring).

    Args:
        env: the tasks and the agent's path.
        tokenizer: the run's (its chat template renders every call's prompt).
        formatter: renders a task's question as a prompt (the trajectory of an episode that made
            no call).
        max_model_len: the endpoint refuses a call whose prompt and ``max_tokens`` exceed it.
        concurrency: agents running at once (worker processes).
        step_timeout_s: each episode's deadline as a whole (None: none).
        on_reward_error: ``raise`` or ``zero`` (see the module's docstring).
        parser: the tool-call parser (``rollout.tool_parser``).
        reward: the run's ``reward`` group, applied over the recorded conversation, or None.
        host: the endpoint's interface.
    """

    def __init__(
        self,
        env: AgentEnv,
        tokenizer: Any,
        formatter: Any,
        *,
        max_model_len: int,
        concurrency: int = 8,
        step_timeout_s: float | None = 300.0,
        on_reward_error: str = "raise",
        parser: str = "hermes",
        reward: Any = None,
        host: str = "127.0.0.1",
    ) -> None:
        if on_reward_error not in ("raise", "zero"):
            raise ValueError(f"on_reward_error must be raise or zero, got {on_reward_error!r}")
        self.env, self.tokenizer, self.formatter = env, tokenizer, formatter
        self.env_factory = env
        self.max_model_len, self.concurrency = max_model_len, max(1, concurrency)
        self.step_timeout_s, self.on_reward_error, self.reward = step_timeout_s, on_reward_error, reward
        self.max_turns = 1  # calls are counted as turns per episode; the harness's cap does not apply
        self.records_call_versions = True  # each call records the version that served it (rollout(version=))
        self.history = "agent"
        self.endpoint = PolicyEndpoint(tokenizer, max_model_len=max_model_len, parser=parser, host=host)
        self.pool: WorkerPool | None = None

    def rollout(
        self,
        engine: Any,
        rows: list[int],
        params: SamplingParams,
        *,
        group_size: int = 1,
        evaluation: bool = False,
        progress: Callable[[str], None] | None = None,
        device: Any = "cpu",
        adapters: list[str] | None = None,
        group_sizes: list[int] | None = None,
        version: Callable[[], int] | None = None,
    ) -> RolloutResult:
        """``group_size`` agent episodes for each task row, trajectories row-major. ``version``: the
        policy version each call records (None: the current weights; none recorded)."""
        if adapters is not None:
            raise ValueError(
                "env=agent does not sample a population's members side by side (population.batched=false)"
            )
        sizes = list(group_sizes) if group_sizes is not None else [group_size] * len(rows)
        self.endpoint.start()
        if self.pool is None:
            self.pool = WorkerPool(self.concurrency)
        episodes: list[tuple[str, int, Any, dict[str, Any]]] = []  # (id, group, question, task)
        for g, (row, n) in enumerate(zip(rows, sizes)):
            question, task = self.env.task(row, evaluation)
            for _ in range(n):
                episodes.append((uuid.uuid4().hex[:16], g, question, task))
        urls = {eid: self.endpoint.open_episode(eid) for eid, *_ in episodes}
        calls_before = self.endpoint.engine_calls
        with concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="agent") as threads:
            futures = [threads.submit(self._play, urls[eid], task) for eid, _, _, task in episodes]
            running = set(futures)
            while running:
                if progress is not None:
                    progress(f"rollout: {len(running)} of {len(futures)} agent episodes running")
                live = min(self.concurrency, len(running)) if self.env.batching == "rounds" else None
                self.endpoint.serve(engine, params, version or (lambda: -1), live=live)
                running = {f for f in running if not f.done()}
        self.endpoint.drop_pending()
        trajs: list[Trajectory] = []
        errors = extended = restarted = excluded = 0
        for (eid, g, question, task), future in zip(episodes, futures):
            record = self.endpoint.close_episode(eid)
            outcome: Outcome = future.result()
            calls = [c for c in record.calls if c.main or self.env.other_calls == "train"]
            excluded += len(record.calls) - len(calls)
            failure = self._failure(outcome, calls)
            if failure is not None:
                errors += 1
                if self.on_reward_error == "raise":
                    raise AgentEpisodeError(
                        f"the agent {self.env.agent} failed on the task {str(question)[:200]!r}: {failure} "
                        "(env.on_reward_error=zero scores such an episode 0 instead)"
                    )
            reward, infos = (0.0, {}) if failure is not None else outcome.output
            traj = self._trajectory(calls, reward, g, question, task)
            traj.infos = [{**infos, "agent_error": failure is not None}]
            if version is None:
                traj.turn_versions = []
            if calls:  # each call after the first extended its sequence or opened one
                restarted += len(traj.segment_starts) - 1
                extended += len(calls) - len(traj.segment_starts)
            trajs.append(traj)
        metrics = episode_metrics(trajs, missing="zero")  # a failed episode was not correct
        if self.reward is not None and not evaluation:
            metrics.update(self.reward.apply(trajs, device))
        joins = extended + restarted
        metrics.update(
            {
                "env/reward_errors": float(errors),
                "agent/engine_calls": float(self.endpoint.engine_calls - calls_before),
                "agent/calls_per_episode": sum(t.num_turns for t in trajs) / max(len(trajs), 1),
                "agent/extended_share": extended / joins if joins else 1.0,
                "agent/restarted_share": restarted / joins if joins else 0.0,
                "agent/excluded_calls": float(excluded),
                "rollout/dropped_long_prompts": 0.0,
            }
        )
        return RolloutResult(collate(trajs, self.tokenizer.pad_token_id), trajs, metrics)

    def _play(self, base_url: str, task: dict[str, Any]) -> Outcome:
        assert self.pool is not None
        fn, args = self.env.worker_call(base_url, task, self.step_timeout_s)
        return self.pool.call(fn, args, timeout_s=self.step_timeout_s)

    @staticmethod
    def _failure(outcome: Outcome, calls: list[Call]) -> str | None:
        if outcome.error is not None:
            err = outcome.error
            if outcome.timed_out:
                return f"it did not finish within its deadline ({err}; env.step_timeout_s)"
            return f"it raised {type(err).__name__}: {err}"
        if not calls:
            return "it never called the model"
        return None

    def _trajectory(
        self, calls: list[Call], reward: float, g: int, question: Any, task: dict[str, Any]
    ) -> Trajectory:
        if calls:
            t = trajectory(calls, reward, g)
        else:  # nothing was generated: the task's prompt, no action token, reward on one empty turn
            ids = self.formatter.prompt_ids(question)
            t = Trajectory(ids, [-1] * len(ids), [0.0] * len(ids), [float(reward)], g, len(ids))
            t.finish_reasons, t.turn_lengths, t.replies = ["stop"], [0], [""]
        t.observation, t.task_info = question, task
        t.prompt_text = self.tokenizer.decode(t.token_ids[: t.prompt_len])
        return t

    def close(self) -> None:
        """Stop the agents' worker processes (a later rollout starts new ones)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def shutdown(self) -> None:
        """The run's end: the workers and the endpoint."""
        self.close()
        self.endpoint.close()
