"""The trainer's side of rollouts through the coordinator's scheduler.

* ``iteration_tasks``: the driver (rank 0) turns an iteration's prompts into scheduler tasks. Task
  ids and sampling seeds depend only on (run seed, iteration, prompt index), so a restarted worker
  group re-submits exactly the same tasks (a no-op) and reuses an iteration that already sealed.
* ``NodeRolloutWorker``: every trainer node also runs a rollout engine: a ``RolloutWorker`` on its
  own event loop in a daemon thread, sampling from the node's current policy. The engine and the
  update share the module, so "pushing weights" is bumping the policy version stamped on every
  trajectory; a lock keeps a late (cancelled) task from sampling while the optimizer steps.
* ``batch_from_groups``: a fetched shard back into the padded tensors the loss expects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import numpy as np
import torch

from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.rollout import RolloutBatch, sample_groups
from elasticrl.rl.tasks import Example, Task
from elasticrl.scheduler.state import FetchedGroup, GroupRecord, SampleRecord, Sampling, TaskSpec
from elasticrl.scheduler.worker import Assignment, RolloutWorker

log = logging.getLogger(__name__)


def task_seed(seed: int, iteration: int, index: int) -> int:
    return (seed * 1_000_003 + iteration * 1_009 + index) % (2**63)


def iteration_tasks(
    examples: list[Example], vocab: CharVocab, *, iteration: int, seed: int, group_size: int,
    max_new_tokens: int, temperature: float,
) -> list[TaskSpec]:
    return [
        TaskSpec(
            task_id=f"i{iteration}-p{k:05d}",
            prompt_ids=vocab.encode(ex.prompt, bos=True),
            prompt_text=ex.prompt,
            num_samples=group_size,
            sampling=Sampling(temperature=temperature, max_new_tokens=max_new_tokens, seed=task_seed(seed, iteration, k)),
            metadata_json=json.dumps({"prompt": ex.prompt, "target": ex.target}),
        )
        for k, ex in enumerate(examples)
    ]


class NodeRolloutWorker:
    """A ``RolloutWorker`` sampling from ``model``, run on a private event loop in a thread."""

    def __init__(
        self, model: torch.nn.Module, vocab: CharVocab, task: Task, model_lock: threading.Lock, *,
        address: str, run_id: str, member_id: str, slots: int, token: str | None, tls_ca: str | None,
        call_timeout_s: float, reconnect_timeout_s: float,
    ):
        self.model = model
        self.vocab = vocab
        self.task = task
        self.lock = model_lock
        self.policy_version = 0
        self.error: BaseException | None = None
        self.worker = RolloutWorker(
            address, run_id, member_id, None, generate_batch=self._generate_batch, slots=slots, token=token, tls_ca=tls_ca,
            call_timeout_s=call_timeout_s, reconnect_timeout_s=reconnect_timeout_s,
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
        except BaseException as exc:  # noqa: BLE001 - surfaced to the trainer by check()
            self.error = exc
            log.error("rollout worker stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._started.set()

    def check(self) -> None:
        """Raise what stopped the worker (fenced, coordinator gone), if it stopped."""
        if self.error is not None:
            raise self.error

    def _generate_batch(self, assignments: list[Assignment]) -> list[GroupRecord]:
        """Sample every task of one assignment message in one batch (tasks that sample alike
        share a forward pass; the generator is seeded by the first task of each batch)."""
        out: dict[str, GroupRecord] = {}
        by_kind: dict[tuple, list[Assignment]] = {}
        for a in assignments:
            s = a.task.sampling
            by_kind.setdefault((a.task.num_samples, s.max_new_tokens, s.temperature), []).append(a)
        for (group_size, max_new_tokens, temperature), batch in by_kind.items():
            examples = []
            for a in batch:
                meta = json.loads(a.task.metadata_json)
                examples.append(Example(prompt=meta["prompt"], target=meta["target"]))
            device = next(self.model.parameters()).device
            gen = torch.Generator(device=device).manual_seed(batch[0].task.sampling.seed)
            t0 = time.perf_counter()
            with self.lock:
                version = self.policy_version
                rollout = sample_groups(
                    self.model, self.vocab, self.task, examples, group_size=group_size,
                    max_new_tokens=max_new_tokens, temperature=temperature, generator=gen,
                )
            gen_s = (time.perf_counter() - t0) / len(batch)
            # Prompts are left-padded to one width in the batch; completions start after it.
            width = max(len(a.task.prompt_ids) for a in batch)
            for i, a in enumerate(batch):
                samples = []
                for row in range(i * group_size, (i + 1) * group_size):
                    n = int(rollout.valid[row, width:].sum())  # completion tokens, EOS included
                    ids = rollout.tokens[row, width:width + n].tolist()
                    lps = rollout.old_logprobs[row, width - 1:width - 1 + n].tolist()
                    samples.append(SampleRecord.pack(
                        ids, lps, float(rollout.rewards[row]), text=rollout.completions[row],
                        finish_reason="stop" if ids and ids[-1] == self.vocab.eos_id else "length",
                    ))
                out[a.task.task_id] = GroupRecord(a.task.task_id, "", version, gen_s, 0.0, samples)
        return [out[a.task.task_id] for a in assignments]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=timeout_s)


def batch_from_groups(groups: list[FetchedGroup], vocab: CharVocab, device: torch.device) -> RolloutBatch:
    """Rebuild ``RolloutBatch`` tensors from fetched groups: prompts left-padded to a common width,
    completions right-padded, logprobs aligned so column t scores token t + 1 (as in
    ``sample_groups``). Samples of a group stay contiguous."""
    rows = [(g, s) for g in groups for s in g.samples]
    if not rows:
        empty = torch.zeros(0, 2, dtype=torch.long, device=device)
        return RolloutBatch(empty, empty.bool(), torch.zeros(0, 1, device=device), torch.zeros(0, 1, device=device),
                            torch.zeros(0, device=device), [], [])
    width = max(len(g.prompt_ids) for g, _ in rows)
    length = max(s.num_tokens for _, s in rows)
    # Filled in numpy from the packed little-endian bytes: one memcpy per sample, no Python lists.
    tokens = np.full((len(rows), width + length), vocab.pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width + length - 1), dtype=np.float32)
    old = np.zeros((len(rows), width + length - 1), dtype=np.float32)
    examples, completions, metas = [], [], {}
    for r, (g, s) in enumerate(rows):
        p = g.prompt_ids
        tokens[r, width - len(p):width] = p
        n = s.num_tokens
        if n:
            tokens[r, width:width + n] = np.frombuffer(s.completion_ids, dtype="<i4")
            mask[r, width - 1:width - 1 + n] = 1.0
            old[r, width - 1:width - 1 + n] = np.frombuffer(s.logprobs, dtype="<f4")
        if g.task_id not in metas:
            meta = json.loads(g.metadata_json)
            metas[g.task_id] = Example(prompt=meta["prompt"], target=meta["target"])
        examples.append(metas[g.task_id])
        completions.append(s.text)
    tokens, mask, old = torch.from_numpy(tokens), torch.from_numpy(mask), torch.from_numpy(old)
    valid = tokens != vocab.pad_id
    rewards = torch.tensor([s.reward for _, s in rows])
    return RolloutBatch(tokens.to(device), valid.to(device), mask.to(device), old.to(device), rewards.to(device),
                        completions, examples)
