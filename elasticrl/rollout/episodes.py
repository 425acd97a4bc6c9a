"""The episode runner: every live episode of an engine, driven in lock step, one batched generate per step.

A scheduler task is one GRPO group: ``G`` episodes of one dataset row, each with its own seed. An
episode is ``reset`` -> (generate an action -> ``step``)* until the env terminates or truncates, the
turn limit (``TurnLimit``) or the context runs out, or the env fails. The runner plays the episodes
of every group its callers hand it on one asyncio loop in a private thread:

* **Batching.** An episode that needs an action parks its context in a queue; a batcher hands the
  engine every parked context in one ``generate`` call, once every live episode is parked (lock
  step) or ``linger_s`` after the first one parked (a slow env does not hold the others up).
  Identical contexts (the G episodes of a single-turn group) go as one request with ``n = k``, so a
  one-turn episode draws exactly what a plain GRPO group would, and vLLM shares their prefill.
* **Envs** run concurrently: ``async def`` methods on the loop, sync ones on a thread of each
  instance's own (``EnvThread``: it is built there too), so a call that hangs holds only its own
  env. Instances are pooled and reused through ``reset``; one that failed is discarded (closed once
  its last call returns), and so is one whose build returns after its episode is gone. Every build,
  reset and step has a deadline (``step_timeout_s``).
* **Failures.** An env that raises, returns garbage or passes its deadline fails that episode;
  the group's other episodes are cancelled and the group comes back as failed with the error
  (the caller gives the task back to the scheduler, which retries it elsewhere once). An engine
  error is not the env's fault: it propagates to the caller unchanged.
* **Context.** An episode that would not fit the context (``max_context`` tokens in all) ends as
  truncated before the overflowing generate or observation; it never crashes the engine.

Only action tokens are trained (loss mask 1) and carry the engine's logprobs; observation and
template tokens have mask 0 and logprob 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticrl.env.base import EnvError, call_reset, call_step, cut_at_stop, env_label, stop_strings
from elasticrl.env.wrappers import TurnLimit
from elasticrl.rollout.engine import GroupRequest, RolloutEngine, Sample, SamplingSpec, reporting_progress
from elasticrl.rollout.env_pool import EnvPool
from elasticrl.rollout.render import Renderer

log = logging.getLogger(__name__)

# How often a task's progress is reported while one generate call of its episodes advances.
PROGRESS_EVERY_S = 1.0

FinalReward = Callable[[str, str, Mapping[str, Any]], float]
"""final(prompt text, transcript text, row) -> reward added to an episode's return."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    max_turns: int = 1
    """Most policy turns per episode; the last one is truncated if the env has not terminated."""
    step_timeout_s: float = 60.0
    """Deadline of one env reset or step, seconds."""
    episodes_in_flight: int = 128
    """Most episodes played at once (more wait for a free place)."""
    max_context: int = 0
    """Most tokens of one episode (observations and actions); 0: no limit beyond the engine's."""
    linger_s: float = 0.02
    """How long the batcher waits for episodes still in their env before it generates anyway."""

    def __post_init__(self) -> None:
        for name, ok in (("max_turns", self.max_turns >= 1), ("episodes_in_flight", self.episodes_in_flight >= 1),
                         ("step_timeout_s", self.step_timeout_s > 0), ("max_context", self.max_context >= 0),
                         ("linger_s", self.linger_s >= 0)):
            if not ok:
                raise ValueError(f"EpisodeSettings.{name}: {getattr(self, name)!r} is out of range (see its docstring)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupTask:
    """One GRPO group to play."""

    task_id: str
    row: Mapping[str, Any]
    """The dataset row: every episode's ``reset(options=row)``."""
    episodes: int
    seed: int
    """The task's seed: episode j resets with ``episode_seed(seed, j)``."""
    sampling: SamplingSpec
    """Temperature etc.; ``max_new_tokens`` is the limit of one action."""
    cancelled: threading.Event | None = None
    """Set when the result is no longer wanted: the group stops at its episodes' next turn."""
    progress: Callable[[], None] | None = None
    """Called each time one of its episodes' turns ends (on the runner's thread), and while a
    ``generate`` of its episodes advances (on the engine's thread, at most every
    ``PROGRESS_EVERY_S``, where the engine calls ``engine.report_progress``): the scheduler renews
    the task's lease, so a long episode, or one long turn, that keeps advancing is not run twice."""


@dataclasses.dataclass
class EpisodeResult:
    token_ids: list[int]
    loss_mask: list[int]
    """1 on action tokens (trained), 0 on observation/template tokens."""
    logprobs: list[float]
    """The engine's logprob on action tokens, 0.0 elsewhere."""
    rewards: list[float]
    """One per step (plus the final reward, if any, as the last entry)."""
    turns: int
    env_s: float
    gen_s: float
    truncated: bool
    finish_reason: str
    """"stop" when the env terminated the episode, "length" when it was cut (turns, context, env)."""
    prompt: str
    """The first observation as text."""
    text: str
    """Everything after the first observation as text: actions and observations in order."""
    policy_version: int = -1
    """The oldest engine policy version any of its actions was drawn with (the weights may change
    between turns); -1: no action drawn."""

    @property
    def reward(self) -> float:
        return float(sum(self.rewards))


@dataclasses.dataclass
class GroupOutcome:
    task_id: str
    episodes: list[EpisodeResult] | None
    """Every episode, in order; None when the group failed or was cancelled."""
    error: str = ""
    env_errors: int = 0
    cancelled: bool = False


class EpisodeFailed(Exception):
    """An episode's env failed (raised, malformed result, deadline); fails its group."""


class _Cancelled(Exception):
    pass


def _every(interval_s: float, callbacks: list[Callable[[], None]]) -> Callable[[], None]:
    """A callable that calls each of ``callbacks`` at most every ``interval_s`` (the first call at
    once): an engine reports every decoding step, a lease needs a word every few seconds."""
    last = -math.inf

    def call() -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= interval_s:
            last = now
            for callback in callbacks:
                callback()

    return call


def context_limit(max_context_tokens: int, model_context: int | None) -> int:
    """Tokens an episode may hold: the smaller of ``env.max_context_tokens`` and the model's
    context (an engine's ``max_context``), where set; 0 when neither is."""
    limits = [x for x in (max_context_tokens, model_context) if x]
    return min(limits) if limits else 0


def episode_seed(seed: int, index: int) -> int:
    """Episode ``index``'s env and sampling seed within its group."""
    return (seed * 1_000_003 + index * 7_919 + 1) % (2**31)


def _turn_seed(seed: int, turn: int) -> int:
    return (seed * 31 + turn) % (2**63)


@dataclasses.dataclass
class _Parked:
    context: list[int]
    spec: SamplingSpec
    future: asyncio.Future
    progress: Callable[[], None] | None = None
    """Its task's ``GroupTask.progress``."""


class EpisodeRunner:
    """Plays groups of episodes with ``engine`` and envs from ``make_env``.

    Args:
        engine: any ``RolloutEngine``; ``generate`` is called from one thread at a time, under
            ``engine_lock``.
        renderer: observation -> tokens (``rollout.render``).
        make_env: builds one env instance (``EnvSpec.make``); called as often as episodes run at once.
        settings: turn limit, deadlines, concurrency, context.
        engine_lock: held around each ``generate`` (the trainer takes it to update the weights).
        decode: action ids -> text, for engines that return no ``Sample.text``.
        final_reward: optional reward over the whole transcript, added to each episode's return.
    """

    def __init__(
        self, engine: RolloutEngine, renderer: Renderer, make_env: Callable[[], Any], settings: EpisodeSettings, *,
        engine_lock: threading.RLock | None = None, decode: Callable[[list[int]], str] | None = None,
        final_reward: FinalReward | None = None,
    ):
        self.engine = engine
        self.renderer = renderer
        self.make_env = make_env
        self.settings = settings
        self.lock = engine_lock or threading.RLock()
        self.decode = decode
        self.final_reward = final_reward
        self.max_context = context_limit(settings.max_context, getattr(engine, "max_context", None)) or 1 << 62
        self.generate_calls = 0
        self.generated_rows = 0
        self._engine_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="generate")
        self._parked: list[_Parked] = []
        self._live = 0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._envs = EnvPool(self._loop, make_env, max_turns=settings.max_turns, timeout_s=settings.step_timeout_s)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="episodes", daemon=True)
        self._thread.start()
        self._started.wait(timeout=30)

    # -- the loop thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self.settings.episodes_in_flight)
        self._batcher = self._loop.create_task(self._batch_forever())
        self._started.set()
        self._loop.run_forever()

    def play(self, tasks: Sequence[GroupTask]) -> list[GroupOutcome]:
        """Play every group (blocking; callable from any thread, concurrently): one outcome per
        group, in order. An engine error (every episode waiting for that batch gets it) raises
        here once every group of this call has finished."""
        if self._closed:
            raise RuntimeError("the episode runner is closed")
        futures = [asyncio.run_coroutine_threadsafe(self._group(t), self._loop) for t in tasks]
        out, error = [], None
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
                error = error or exc
        if error is not None:
            raise error
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, close every pooled env; idempotent."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            # Episodes still playing end now (their ``play`` callers get CancelledError): a
            # caller left waiting on a stopped loop would hang its thread, and with it the exit
            # of the process (which joins pool threads), until torchrun's SIGKILL 30 s later.
            playing = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in self._envs.closing]
            for task in playing:
                task.cancel()
            if playing:
                await asyncio.wait(playing, timeout=timeout_s)
            await self._envs.close(timeout_s)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout_s)
        except concurrent.futures.TimeoutError:
            log.warning("episode runner: closing took longer than %gs (a task that did not end when cancelled, or "
                        "env closes still running); stopped anyway", timeout_s)
        except Exception as exc:  # noqa: BLE001 - best effort at teardown
            log.warning("episode runner: closing envs failed: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        self._envs.stop_threads()
        self._engine_pool.shutdown(wait=False, cancel_futures=True)

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, context: list[int], spec: SamplingSpec,
                        progress: Callable[[], None] | None = None) -> tuple[Sample, float, int]:
        """The engine's sample for ``context``, the seconds of the batch it was drawn in and the
        policy version it was drawn with. ``progress`` is called while the engine advances."""
        future = self._loop.create_future()
        self._parked.append(_Parked(context, spec, future, progress))
        self._wake.set()
        return await future

    async def _batch_forever(self) -> None:
        loop = self._loop
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._parked = [p for p in self._parked if not p.future.done()]
            if not self._parked:
                continue
            # Lock step: wait until every live episode is parked, or linger_s at most.
            deadline = loop.time() + self.settings.linger_s
            while len(self._parked) < self._live and loop.time() < deadline:
                self._wake.clear()
                try:
                    async with asyncio.timeout_at(deadline):  # not wait_for: on 3.11 it can swallow a cancel
                        await self._wake.wait()
                except TimeoutError:
                    break
            batch = [p for p in self._parked if not p.future.done()]
            self._parked = []
            if batch:
                await self._generate_batch(batch)

    async def _generate_batch(self, batch: list[_Parked]) -> None:
        merged: dict[tuple, list[_Parked]] = {}
        for p in batch:
            key = (tuple(p.context), dataclasses.replace(p.spec, seed=None))
            merged.setdefault(key, []).append(p)
        requests = [
            GroupRequest(task_id=f"r{i}", prompt_ids=list(group[0].context),
                         sampling=dataclasses.replace(group[0].spec, n=len(group)))
            for i, group in enumerate(merged.values())
        ]

        reporters = list({id(p.progress): p.progress for p in batch if p.progress is not None}.values())

        def generate() -> list:
            with self.lock, reporting_progress(_every(PROGRESS_EVERY_S, reporters) if reporters else None):
                return self.engine.generate(requests)

        start = time.perf_counter()
        try:
            groups = await self._loop.run_in_executor(self._engine_pool, generate)
        except asyncio.CancelledError:  # the runner is closing: the batcher ends (its episodes are cancelled too)
            for p in batch:
                p.future.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to every episode waiting for this batch
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        seconds = time.perf_counter() - start
        self.generate_calls += 1
        self.generated_rows += len(batch)
        for group, parked in zip(groups, merged.values()):
            for sample, p in zip(group.samples, parked):
                if not p.future.done():
                    p.future.set_result((sample, seconds, group.policy_version))

    # -- episodes ------------------------------------------------------------------------------

    async def _group(self, task: GroupTask) -> GroupOutcome:
        runs = [self._loop.create_task(self._episode(task, j)) for j in range(task.episodes)]
        try:
            episodes = await asyncio.gather(*runs)
        except (EpisodeFailed, _Cancelled) as exc:
            for r in runs:
                r.cancel()
            done = await asyncio.gather(*runs, return_exceptions=True)
            if isinstance(exc, _Cancelled):
                return GroupOutcome(task.task_id, None, cancelled=True)
            failed = sum(isinstance(d, EpisodeFailed) for d in done)
            return GroupOutcome(task.task_id, None, error=str(exc), env_errors=max(failed, 1))
        except BaseException:
            for r in runs:
                r.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        return GroupOutcome(task.task_id, list(episodes))

    async def _episode(self, task: GroupTask, index: int) -> EpisodeResult:
        async with self._slots:
            self._live += 1
            try:
                return await self._play(task, index)
            finally:
                self._live -= 1
                self._wake.set()  # the lock step may be complete without this episode

    async def _play(self, task: GroupTask, index: int) -> EpisodeResult:
        seed = episode_seed(task.seed, index)
        env_s = gen_s = 0.0
        try:
            env = await self._envs.acquire()
        except EnvError as exc:
            raise EpisodeFailed(str(exc)) from exc
        run_sync = self._envs.run_sync(env)
        healthy = False
        try:
            t0 = time.perf_counter()
            obs, _ = await self._envs.call(env, "reset", call_reset(env, seed=seed, options=dict(task.row), run_sync=run_sync))
            env_s += time.perf_counter() - t0
            tokens = self._render(env, self.renderer.first, obs)
            if not tokens:
                raise EnvError(f"env {env_label(env)}.reset(): the first observation renders to no tokens")
            if len(tokens) >= self.max_context:  # no room for one action: it would train on nothing
                raise EnvError(
                    f"env {env_label(env)}.reset(): the first observation renders to {len(tokens)} tokens, and the "
                    f"context holds {self.max_context} (env.max_context_tokens, or the model's if 0 or smaller); "
                    "leave room for an action: a shorter prompt or a longer context")
            mask, logprobs = [0] * len(tokens), [0.0] * len(tokens)
            prompt, transcript, rewards = self.renderer.as_text(obs), [], []
            turns, truncated, last, version = 0, False, "stop", -1
            while True:
                if task.cancelled is not None and task.cancelled.is_set():
                    raise _Cancelled()
                room = self.max_context - len(tokens)
                if room < 1:
                    truncated = True
                    break
                spec = dataclasses.replace(task.sampling, n=1, max_new_tokens=min(task.sampling.max_new_tokens, room),
                                           seed=_turn_seed(seed, turns))
                sample, seconds, drawn_with = await self._generate(tokens, spec, task.progress)
                gen_s += seconds
                version = drawn_with if version < 0 else min(version, drawn_with)
                action_ids, action_logprobs, last = list(sample.completion_ids), list(sample.logprobs), sample.finish_reason
                stops = stop_strings(env)
                keep = cut_at_stop(action_ids, stops, self.decode) if stops and self.decode else len(action_ids)
                cut = keep < len(action_ids)
                if cut:  # as if the engine had stopped there (its own end-of-turn token went with the rest)
                    action_ids, action_logprobs, last = action_ids[:keep], action_logprobs[:keep], "stop"
                    sample = dataclasses.replace(sample, text=None)
                tokens += action_ids
                mask += [1] * len(action_ids)
                logprobs += action_logprobs
                closing = self.renderer.close_action(last == "stop" and not cut)
                if closing and len(tokens) + len(closing) <= self.max_context:
                    tokens += closing
                    mask += [0] * len(closing)
                    logprobs += [0.0] * len(closing)
                action = sample.text if sample.text is not None else (self.decode(action_ids) if self.decode else "")
                transcript.append(action)
                turns += 1
                t0 = time.perf_counter()
                obs, reward, terminated, cut, _ = await self._envs.call(env, "step", call_step(env, action, run_sync=run_sync))
                env_s += time.perf_counter() - t0
                rewards.append(reward)
                if task.progress is not None:
                    task.progress()
                if terminated or cut:
                    truncated = cut and not terminated
                    break
                more = self._render(env, self.renderer.next, obs)
                if len(tokens) + len(more) >= self.max_context:  # no room for it and one more token
                    truncated = True
                    break
                tokens += more
                mask += [0] * len(more)
                logprobs += [0.0] * len(more)
                transcript.append(self.renderer.as_text(obs))
            healthy = True
        except EnvError as exc:
            raise EpisodeFailed(str(exc)) from exc
        finally:
            self._envs.release(env, healthy=healthy)
        text = "\n".join(transcript)
        if self.final_reward is not None:
            rewards.append(float(self.final_reward(prompt, text, task.row)))
        return EpisodeResult(
            token_ids=tokens, loss_mask=mask, logprobs=logprobs, rewards=rewards, turns=turns, env_s=env_s, gen_s=gen_s,
            truncated=truncated, finish_reason="length" if truncated or last == "length" else "stop", prompt=prompt, text=text,
            policy_version=version,
        )

    @staticmethod
    def _render(env: TurnLimit, render: Callable, obs) -> list[int]:
        try:
            return render(obs)
        except EnvError as exc:
            label = env_label(env)
            if label in str(exc):
                raise
            raise EnvError(f"env {label}: {exc}") from exc
        except ValueError as exc:  # e.g. a character the tiny vocabulary lacks
            raise EnvError(f"env {env_label(env)}: its observation cannot be tokenized: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a role the chat template refuses, a lone surrogate: fails this group only
            raise EnvError(f"env {env_label(env)}: its observation cannot be rendered: {type(exc).__name__}: {exc}") from exc
