"""Between the trainer and the coordinator's scheduler: tasks out, engines in the middle, batches back.

* ``iteration_tasks``: the driver (rank 0) turns an iteration's rows into scheduler tasks, one GRPO
  group each, the row travelling in the task's metadata. Task ids and seeds depend only on (run
  seed, iteration, split, row index), so a restarted worker group re-submits exactly the same
  tasks (a no-op) and reuses an iteration that already sealed. Each task names the policy version
  it must be sampled with.
* ``EngineWorker``: a ``RolloutWorker`` whose tasks are played by an ``EpisodeRunner`` (every
  episode of every task this engine holds, batched turn by turn), on its own event loop in a
  daemon thread. It waits until its engine holds at least the version the tasks ask for
  (``VersionGate``) and stamps every group with the version its episodes were actually drawn with
  (the oldest one, should the weights change between turns); a group whose env failed goes back to
  the scheduler as a failed attempt. It measures how much of its time the engine had nothing in
  hand or waited at the gate (``idle``). Trainer nodes and rollout-only workers (``elasticrl
  rollout``) both run one; they differ only in their gate.
* ``batch_from_groups``: a fetched shard back into the padded tensors the loss expects, with each
  episode's loss mask; ``check_failures``: whether a sealed iteration lost too many groups to its env.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time

import numpy as np
import torch

from elasticrl.coordinator import malloc
from elasticrl.env import EnvError
from elasticrl.errors import ElasticRLError, RunClosedError
from elasticrl.repeats import Repeats
from elasticrl.rl.rewards import RewardError
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.rl.tasks import Example
from elasticrl.rl.workload import row_label
from elasticrl.rollout.engine import SamplingSpec
from elasticrl.rollout.episodes import EpisodeRunner, GroupOutcome, GroupTask
from elasticrl.scheduler.state import FetchedGroup, GroupRecord, SampleRecord, Sampling, Split, TaskFailure, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker
from elasticrl.train.staleness import IdleMeter

log = logging.getLogger(__name__)

MAX_METADATA_BYTES = 64 << 10  # the scheduler's limit on a task's metadata_json


class PolicyVersionTimeout(ElasticRLError, TimeoutError):
    """The engine did not get the (minimum) policy version a task asks for in time."""


class GateClosed(ElasticRLError):
    """The worker is stopping: no task waits for a policy version any more."""

    stopping = True  # the scheduler's worker gives the tasks back without calling it a failure


MAX_ENGINE_FAILURES = 3
"""Consecutive failed batches after which a node's engine worker gives up (a transient failure
is retried: the tasks go back to the queue; a persistent one must stop the node, not stall it)."""


def task_seed(seed: int, iteration: int, index: int) -> int:
    return (seed * 1_000_003 + iteration * 1_009 + index) % (2**63)


def iteration_tasks(
    rows: list[dict], *, iteration: int, seed: int, group_size: int, max_new_tokens: int, temperature: float,
    policy_version: int, weights_version: int = 0, split: str = "train",
) -> list[TaskSpec]:
    """One task per row. ``policy_version``: the trainer's version the group must be drawn from;
    ``weights_version``: the coordinator's version of those weights (rollout-only workers fetch
    at least this one)."""
    tag = "p" if split == "train" else "e"
    offset = 0 if split == "train" else 500_000
    tasks = []
    for k, row in enumerate(rows):
        metadata = json.dumps({"row": row, "policy_version": policy_version, "weights_version": weights_version})
        if len(metadata.encode()) > MAX_METADATA_BYTES:
            raise ValueError(
                f"iteration {iteration}: row {k} of the {split} rows is {len(metadata.encode())} bytes as JSON; a task "
                f"carries at most {MAX_METADATA_BYTES} (keep large fields out of the rows the env and rewards need)"
            )
        tasks.append(TaskSpec(
            task_id=f"i{iteration}-{tag}{k:05d}",
            prompt_ids=[],  # the engine renders the row's prompt (or the env's first observation) itself
            prompt_text=row_label(row) or f"row {k}",
            num_samples=group_size,
            sampling=Sampling(temperature=temperature, max_new_tokens=max_new_tokens, seed=task_seed(seed, iteration, offset + k)),
            split=Split(split),
            metadata_json=metadata,
        ))
    return tasks


class VersionGate:
    """Trainer nodes: the engine may draw a task's group once the node pushed at least the policy
    version the task names (a minimum: with ``rollout.max_staleness = k`` it lags the trainer's
    version by up to ``k``, and the engine draws with the newest version it holds).

    The trainer calls ``advance(v)`` after it pushed version ``v`` into its engine; ``wait`` blocks
    the engine's thread until then (a task of the next iteration can arrive before this node's own
    update finished: another rank submitted it).
    """

    def __init__(self, version: int = 0):
        self._version = version
        self._closed = False
        self._cond = threading.Condition()

    @property
    def version(self) -> int:
        return self._version

    def advance(self, version: int) -> None:
        with self._cond:
            self._version = max(self._version, version)
            self._cond.notify_all()

    def reset(self, version: int) -> None:
        """The node holds ``version`` again, possibly older than before (an in-place re-form that
        resumed from an older checkpoint): tasks that name a newer one wait for it again."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with ``GateClosed`` (the worker is stopping: its engine threads must
        not outlive it, or the interpreter waits for them at exit)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, policy_version: int, weights_version: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or self._version >= policy_version, timeout=timeout_s):
                raise PolicyVersionTimeout(
                    f"a task needs policy version {policy_version}; this node still has {self._version} after {timeout_s:.0f}s"
                )
            if self._closed:
                raise GateClosed("the engine worker is stopping")


def task_row(meta: dict) -> dict:
    """The dataset row a task's metadata carries (tasks of older versions carried prompt/target)."""
    if "row" in meta:
        return meta["row"]
    return {"prompt": meta.get("prompt", ""), "target": meta.get("target", "")}


def group_record(task_id: str, outcome: GroupOutcome, version: int, *, with_prompt: bool) -> GroupRecord:
    """The episodes of a played group as the scheduler stores them. ``with_prompt``: the text keeps
    the first observation (an env's transcript); otherwise it is the completion alone. The group's
    policy version is the oldest its episodes were drawn with (``version``, the engine's when the
    group started, for episodes that drew nothing)."""
    samples = []
    for e in outcome.episodes or []:
        text = f"{e.prompt}\n{e.text}" if with_prompt else e.text
        samples.append(SampleRecord.pack(
            e.token_ids, e.logprobs, e.reward, finish_reason=e.finish_reason, text=text, loss_mask=e.loss_mask,
            turns=e.turns, env_s=e.env_s, truncated=e.truncated,
        ))
    episodes = outcome.episodes or []
    drawn = [e.policy_version for e in episodes if e.policy_version >= 0]
    version = min(drawn, default=version)
    return GroupRecord(task_id, "", version, max((e.gen_s for e in episodes), default=0.0), sum(e.env_s for e in episodes), samples)


class EngineWorker:
    """A ``RolloutWorker`` playing its tasks with ``runner``, run on a private event loop in a thread.

    The runner's ``engine_lock`` serializes the engine between its batches and the trainer (sleep,
    update_weights, and, when the engine shares the trainer's module, the optimizer step).
    ``gate.wait(policy_version, weights_version, timeout_s)`` runs before each assignment; ``stop``
    closes the gate (``gate.close()``), which wakes every batch still waiting at it.

    Failures: a group whose env failed goes back to the scheduler as a failed attempt (retried
    elsewhere, given up after ``max_task_failures``). A batch the engine fails on goes back to the
    queue (another engine, or this one a moment later, retries it), but ``MAX_ENGINE_FAILURES``
    failed batches in a row, or any error of the reward function (user code: it fails the same way
    everywhere), stop the worker, and ``check()`` raises it, so the node fails fast instead of
    waiting for a seal that cannot come.
    """

    def __init__(
        self, runner: EpisodeRunner, *, gate, stop_token_ids: tuple[int, ...] = (), version_timeout_s: float = 600.0,
        address: str, run_id: str, member_id: str, slots: int, token: str | None, tls_ca: str | None,
        call_timeout_s: float, reconnect_timeout_s: float, weight: float = 1.0, transcript_with_prompt: bool = False,
    ):
        self.runner = runner
        self.gate = gate
        self.stop_token_ids = tuple(stop_token_ids)
        self.version_timeout_s = version_timeout_s
        self.transcript_with_prompt = transcript_with_prompt
        self.error: BaseException | None = None
        self.groups_done = 0
        self.groups_failed = 0
        self._env_warnings = Repeats()  # a broken env fails every task alike: one line a while, not one a task
        self.idle = IdleMeter()  # busy: some batch in hand past the gate
        self._failures = 0  # consecutive failed batches, over all of the worker's slots
        self._failures_lock = threading.Lock()  # batches run on up to `slots` executor threads
        self.worker = RolloutWorker(
            address, run_id, member_id, None, generate_batch=self._generate_batch, slots=slots, weight=weight,
            token=token, tls_ca=tls_ca, call_timeout_s=call_timeout_s, reconnect_timeout_s=reconnect_timeout_s,
        )
        # This process now serializes a fresh batch of up to batch_bytes for every send.
        malloc.tune_sender(self.worker.batch_bytes)
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"rollout-{member_id}", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait(timeout=30)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            self._started.set()
            await self.worker.run(self._stop)

        try:
            self._loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller by check()
            self.error = exc
            # A closed run is the normal end (training finished), not a failure.
            (log.info if isinstance(exc, RunClosedError) else log.error)("rollout worker stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._started.set()

    def check(self) -> None:
        """Raise what stopped the worker (fenced, coordinator gone), if it stopped."""
        if self.error is not None:
            raise self.error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout=timeout_s)

    def _fail(self, exc: BaseException) -> None:
        """Stop the worker for good with ``exc`` (``check()`` raises it in the trainer)."""
        if self.error is None:
            self.error = exc
        log.error("rollout worker gives up: %s", exc)
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _generate_batch(self, assignments: list[Assignment]) -> list[GroupRecord | TaskFailure]:
        metas = [json.loads(a.task.metadata_json) for a in assignments]
        # Whatever the gate raises (stopping, this engine lags behind, the run closed while a
        # rollout-only worker waited for weights) gives the tasks back and says nothing about the
        # engine: it is not counted as a failure.
        self.gate.wait(
            max(int(m.get("policy_version", 0)) for m in metas),
            max(int(m.get("weights_version", 0)) for m in metas),
            self.version_timeout_s,
        )
        try:
            with self.idle.busy():
                out = self._play(assignments, metas)
        except RewardError as exc:
            self._fail(exc)
            raise
        except Exception as exc:
            with self._failures_lock:
                self._failures += 1
                failures = self._failures
            if failures >= MAX_ENGINE_FAILURES:
                self._fail(ElasticRLError(f"the rollout engine failed {failures} batches in a row; last: {type(exc).__name__}: {exc}"))
            raise
        with self._failures_lock:
            self._failures = 0
        return out

    def _play(self, assignments: list[Assignment], metas: list[dict]) -> list[GroupRecord | TaskFailure]:
        """Play every task of one assignment message; the runner batches their episodes with those
        of every other assignment this engine is playing."""
        version = self.runner.engine.policy_version
        tasks = []
        for a, meta in zip(assignments, metas):
            s = a.task.sampling
            spec = SamplingSpec(
                n=1, temperature=s.temperature, top_p=s.top_p or 1.0, max_new_tokens=s.max_new_tokens or 256,
                stop_token_ids=tuple(s.stop_token_ids) + self.stop_token_ids,
            )
            tasks.append(GroupTask(task_id=a.task.task_id, row=task_row(meta), episodes=a.task.num_samples, seed=s.seed,
                                   sampling=spec, cancelled=a.cancelled, progress=a.progress))
        out: list[GroupRecord | TaskFailure] = []
        for a, outcome in zip(assignments, self.runner.play(tasks)):
            if outcome.episodes is None:
                if not outcome.cancelled:
                    self.groups_failed += 1
                    note = self._env_warnings.take(outcome.error or "")
                    if note is not None:
                        log.warning("task %s failed in its environment (%d episode(s)): %s%s", a.task.task_id, outcome.env_errors,
                                    outcome.error, f" (and {note.left_out} more task(s) the same way since the last such line)"
                                    if note.left_out else " (more tasks failing the same way are counted and written once every "
                                    f"{self._env_warnings.window_s:g}s)")
                out.append(TaskFailure(a.task.task_id, outcome.error or "cancelled", outcome.env_errors))
                continue
            out.append(group_record(a.task.task_id, outcome, version, with_prompt=self.transcript_with_prompt))
            self.groups_done += 1
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        self.gate.close()
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=timeout_s)


def check_failures(iteration: int, manifest: dict, *, min_fraction: float, max_task_failures: int) -> None:
    """Stop the run when too many groups of a sealed iteration failed in their env: every rank sees
    the same manifest, so all stop together, before any collective. Fewer failures than
    ``rollout.min_fraction`` allows are dropped (logged, counted in the metrics)."""
    failed, done, total = manifest["tasks_failed"], manifest["tasks_done"], manifest["tasks_total"]
    if not failed:
        return
    need = max(1, math.ceil(min_fraction * total - 1e-9))
    last = manifest["errors"][-1] if manifest["errors"] else "no reason recorded"
    if done >= need:
        log.warning("iteration %d: %d of %d groups failed in their env and were dropped (%d episode errors); last: %s",
                    iteration, failed, total, manifest["env_errors"], last)
        return
    raise EnvError(
        f"iteration {iteration}: {failed} of {total} groups failed in their environment ({manifest['env_errors']} episode "
        f"errors, each group tried {max_task_failures} times) and only {done} completed, fewer than "
        f"rollout.min_fraction = {min_fraction:g} allows; last error: {last}"
    )


def dummy_batch(pad_id: int, device: torch.device) -> RolloutBatch:
    """One fully masked row: a rank with no groups still runs forward/backward (every strategy's
    collectives need it), with a zero loss."""
    tokens = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    zeros = torch.zeros(1, 1, device=device)
    return RolloutBatch(tokens, torch.ones_like(tokens, dtype=torch.bool), zeros, zeros.clone(), torch.zeros(1, device=device), [""], [])


def batch_from_groups(groups: list[FetchedGroup], pad_id: int, device: torch.device) -> RolloutBatch:
    """Rebuild ``RolloutBatch`` tensors from fetched groups: prompts (if the task had any) left-padded
    to a common width, episodes right-padded after them, logprobs and the loss mask aligned so
    column t scores token t + 1 (as in ``sample_groups``). Samples of a group stay contiguous."""
    rows = [(g, s) for g in groups for s in g.samples]
    if not rows:
        empty = torch.zeros(0, 2, dtype=torch.long, device=device)
        return RolloutBatch(empty, empty.bool(), torch.zeros(0, 1, device=device), torch.zeros(0, 1, device=device),
                            torch.zeros(0, device=device), [], [])
    width = max(len(g.prompt_ids) for g in groups)
    counts = np.fromiter((len(s.completion_ids) // 4 for _, s in rows), dtype=np.int64, count=len(rows))  # [R]
    length = max(int(counts.max()), 1)
    tokens = np.full((len(rows), width + length), pad_id, dtype=np.int64)  # [R, W + L]
    valid = np.zeros((len(rows), width + length), dtype=bool)
    mask = np.zeros((len(rows), width + length - 1), dtype=np.float32)  # column t scores token t + 1
    old = np.zeros((len(rows), width + length - 1), dtype=np.float32)
    # Prompts: one slice per group (its samples are contiguous rows).
    examples, r = [], 0
    starts = np.repeat(np.array([width - len(g.prompt_ids) for g in groups], dtype=np.int64),
                       [len(g.samples) for g in groups])  # [R] each row's first real column
    for g in groups:
        p, k = g.prompt_ids, len(g.samples)
        tokens[r:r + k, width - len(p):width] = p
        valid[r:r + k, width - len(p):width] = True
        row = task_row(json.loads(g.metadata_json))
        examples += [Example(prompt=row_label(row) if "prompt" in row else "", target=str(row.get("target", "")))] * k
        r += k
    # Episodes: every sample's packed little-endian bytes joined, then scattered in one step.
    ids = np.frombuffer(b"".join(s.completion_ids for _, s in rows), dtype="<i4")
    lps = np.frombuffer(b"".join(s.logprobs for _, s in rows), dtype="<f4")
    trained = np.frombuffer(b"".join(s.loss_mask or b"\x01" * s.num_tokens for _, s in rows), dtype=np.uint8)
    row = np.repeat(np.arange(len(rows)), counts)
    col = width + np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens[row, col] = ids
    valid[row, col] = True
    # The first token of an episode without a prompt predicts nothing (it is an observation's):
    # a token is scored only from a real token of its own row, whatever the other rows' prompts.
    scored = col > starts[row]
    mask[row[scored], col[scored] - 1] = trained[scored]
    old[row[scored], col[scored] - 1] = lps[scored]
    completions = [s.text for _, s in rows]
    rewards = torch.tensor([s.reward for _, s in rows])
    samples = [s for _, s in rows]
    stats = {
        "episodes": float(len(samples)), "turns": float(sum(s.turns for s in samples)),
        "env_s": float(sum(s.env_s for s in samples)), "truncated": float(sum(s.truncated for s in samples)),
    }
    return RolloutBatch(
        torch.from_numpy(tokens).to(device), torch.from_numpy(valid).to(device), torch.from_numpy(mask).to(device),
        torch.from_numpy(old).to(device), rewards.to(device), completions, examples, stats,
    )
