"""Between the trainer and the coordinator's scheduler: tasks out, engines in the middle, batches back.

* ``iteration_tasks``: the driver (rank 0) turns an iteration's prompts into scheduler tasks. Task
  ids and sampling seeds depend only on (run seed, iteration, split, prompt index), so a restarted
  worker group re-submits exactly the same tasks (a no-op) and reuses an iteration that already
  sealed. Each task names the policy version it must be sampled with.
* ``EngineWorker``: a ``RolloutWorker`` around any ``RolloutEngine`` (tiny, hf, vllm), on its own
  event loop in a daemon thread. It turns assignments into ``GroupRequest`` batches, waits until
  its engine holds the version the tasks ask for (``VersionGate``), scores the samples with the
  reward function, and stamps every group with the engine's policy version. Trainer nodes and
  rollout-only workers (``elasticrl rollout``) both run one; they differ only in their gate.
* ``batch_from_groups``: a fetched shard back into the padded tensors the loss expects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from elasticrl.errors import ElasticRLError
from elasticrl.rl.rewards import RewardError
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.rl.tasks import Example
from elasticrl.rollout.engine import GroupRequest, RolloutEngine, SamplingSpec
from elasticrl.scheduler.state import FetchedGroup, GroupRecord, SampleRecord, Sampling, Split, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str, str], float]
"""fn(prompt, completion, target) -> reward; ``rl.rewards.reward_function`` builds one that raises
``RewardError`` (naming the function and the prompt) whenever the user's code fails."""


class PolicyVersionTimeout(ElasticRLError, TimeoutError):
    """The engine did not get the policy version a task asks for in time."""


class GateClosed(ElasticRLError):
    """The worker is stopping: no task waits for a policy version any more."""


MAX_ENGINE_FAILURES = 3
"""Consecutive failed batches after which a node's engine worker gives up (a transient failure
is retried: the tasks go back to the queue; a persistent one must stop the node, not stall it)."""


def task_seed(seed: int, iteration: int, index: int) -> int:
    return (seed * 1_000_003 + iteration * 1_009 + index) % (2**63)


def iteration_tasks(
    examples: list[Example], encode: Callable[[str], list[int]], *, iteration: int, seed: int, group_size: int,
    max_new_tokens: int, temperature: float, policy_version: int, weights_version: int = 0, split: str = "train",
) -> list[TaskSpec]:
    """One task per example. ``policy_version``: the trainer's version the group must be drawn
    from; ``weights_version``: the coordinator's version of those weights (rollout-only workers
    fetch at least this one)."""
    tag = "p" if split == "train" else "e"
    offset = 0 if split == "train" else 500_000
    return [
        TaskSpec(
            task_id=f"i{iteration}-{tag}{k:05d}",
            prompt_ids=encode(ex.prompt),
            prompt_text=ex.prompt,
            num_samples=group_size,
            sampling=Sampling(temperature=temperature, max_new_tokens=max_new_tokens, seed=task_seed(seed, iteration, offset + k)),
            split=Split(split),
            metadata_json=json.dumps({
                "prompt": ex.prompt, "target": ex.target,
                "policy_version": policy_version, "weights_version": weights_version,
            }),
        )
        for k, ex in enumerate(examples)
    ]


class VersionGate:
    """Trainer nodes: the engine may draw a task's group once the node pushed that policy version.

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


class EngineWorker:
    """A ``RolloutWorker`` drawing groups with ``engine``, run on a private event loop in a thread.

    ``engine_lock`` serializes the engine between this thread (generate) and the trainer (sleep,
    update_weights, and, when the engine shares the trainer's module, the optimizer step).
    ``gate.wait(policy_version, weights_version, timeout_s)`` runs before each batch; ``stop``
    closes the gate (``gate.close()``), which wakes every batch still waiting at it.

    Failures: a batch the engine fails on goes back to the queue (another engine, or this one a
    moment later, retries it), but ``MAX_ENGINE_FAILURES`` failed batches in a row, or any error
    of the reward function (user code: it fails the same way everywhere), stop the worker, and
    ``check()`` raises it, so the node fails fast instead of waiting for a seal that cannot come.
    """

    def __init__(
        self, engine: RolloutEngine, *, decode: Callable[[list[int]], str], reward: RewardFn,
        engine_lock: threading.RLock, gate, stop_token_ids: tuple[int, ...] = (), version_timeout_s: float = 600.0,
        address: str, run_id: str, member_id: str, slots: int, token: str | None, tls_ca: str | None,
        call_timeout_s: float, reconnect_timeout_s: float, weight: float = 1.0,
    ):
        self.engine = engine
        self.decode = decode
        self.reward = reward
        self.lock = engine_lock
        self.gate = gate
        self.stop_token_ids = tuple(stop_token_ids)
        self.version_timeout_s = version_timeout_s
        self.error: BaseException | None = None
        self.groups_done = 0
        self._failures = 0  # consecutive failed batches, over all of the worker's slots
        self._failures_lock = threading.Lock()  # batches run on up to `slots` executor threads
        self.worker = RolloutWorker(
            address, run_id, member_id, None, generate_batch=self._generate_batch, slots=slots, weight=weight,
            token=token, tls_ca=tls_ca, call_timeout_s=call_timeout_s, reconnect_timeout_s=reconnect_timeout_s,
        )
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
            log.error("rollout worker stopped: %s: %s", type(exc).__name__, exc)
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

    def _generate_batch(self, assignments: list[Assignment]) -> list[GroupRecord]:
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
            out = self._draw_and_score(assignments, metas)
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

    def _draw_and_score(self, assignments: list[Assignment], metas: list[dict]) -> list[GroupRecord]:
        """Draw every task of one assignment message in one engine call, then score the samples."""
        requests = []
        for a in assignments:
            s = a.task.sampling
            spec = SamplingSpec(
                n=a.task.num_samples, temperature=s.temperature, top_p=s.top_p or 1.0,
                max_new_tokens=s.max_new_tokens, seed=s.seed,
                stop_token_ids=tuple(s.stop_token_ids) + self.stop_token_ids,
            )
            requests.append(GroupRequest(task_id=a.task.task_id, prompt_ids=list(a.task.prompt_ids), sampling=spec))
        with self.lock:
            groups = self.engine.generate(requests)
        out = []
        for a, meta, group in zip(assignments, metas, groups):
            t0 = time.perf_counter()
            samples = []
            for sample in group.samples:
                text = sample.text if sample.text is not None else self.decode(sample.completion_ids)
                reward = self.reward(meta["prompt"], text, meta.get("target", ""))
                samples.append(SampleRecord.pack(
                    sample.completion_ids, sample.logprobs, reward, finish_reason=sample.finish_reason, text=text,
                ))
            out.append(GroupRecord(a.task.task_id, "", group.policy_version, group.gen_seconds, time.perf_counter() - t0, samples))
        self.groups_done += len(out)
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        self.gate.close()
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=timeout_s)


def batch_from_groups(groups: list[FetchedGroup], pad_id: int, device: torch.device) -> RolloutBatch:
    """Rebuild ``RolloutBatch`` tensors from fetched groups: prompts left-padded to a common width,
    completions right-padded, logprobs aligned so column t scores token t + 1 (as in
    ``sample_groups``). Samples of a group stay contiguous."""
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
    for g in groups:
        p, k = g.prompt_ids, len(g.samples)
        tokens[r:r + k, width - len(p):width] = p
        valid[r:r + k, width - len(p):width] = True
        meta = json.loads(g.metadata_json)
        examples += [Example(prompt=meta["prompt"], target=meta.get("target", ""))] * k
        r += k
    # Completions: every sample's packed little-endian bytes joined, then scattered in one step.
    ids = np.frombuffer(b"".join(s.completion_ids for _, s in rows), dtype="<i4")
    lps = np.frombuffer(b"".join(s.logprobs for _, s in rows), dtype="<f4")
    row = np.repeat(np.arange(len(rows)), counts)
    col = width + np.arange(len(ids)) - np.repeat(np.cumsum(counts) - counts, counts)
    tokens[row, col] = ids
    valid[row, col] = True
    mask[row, col - 1] = 1.0
    old[row, col - 1] = lps
    completions = [s.text for _, s in rows]
    rewards = torch.tensor([s.reward for _, s in rows])
    return RolloutBatch(
        torch.from_numpy(tokens).to(device), torch.from_numpy(valid).to(device), torch.from_numpy(mask).to(device),
        torch.from_numpy(old).to(device), rewards.to(device), completions, examples,
    )
