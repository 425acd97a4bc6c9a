"""The ``tiny`` rollout engine: the demo's ``TinyCausalLM`` behind the ``RolloutEngine`` protocol.

It exists so the RL node has one rollout path for every policy: the demo's toy transformer goes
through the same ``GroupRequest`` -> ``Group`` contract as the ``hf`` and ``vllm`` engines. It draws
exactly what ``elasticrl.rl.rollout.sample_groups`` draws for the same seed and prompts (same
left padding, same batch layout, one generator per batch seeded by its first request, the full
sequence recomputed every step: no KV cache, sequences are a few dozen tokens).

Two ways to hold the module:

* **shared** (a trainer node): the engine samples the trainer's own module. The trainer holds
  ``lock`` while the optimizer steps; the engine holds it for a whole batch, so a group never mixes
  two weight versions. After a step the trainer calls ``set_version(v)`` (nothing is copied).
* **owned** (a rollout-only worker): ``update_weights`` copies pushed tensors in under the lock.

Log-probabilities follow ``elasticrl.rollout.engine``'s "processed" convention, with one rule of
this engine: pad and BOS are never drawn, but they are not removed from the distribution the
logprobs are reported under. So at temperature 1 without top-k/top-p a reported logprob is
``log_softmax(logits)`` of the drawn token, which is what ``elasticrl.policy.tiny.token_logprobs``
recomputes in the trainer. With top-k/top-p the kept set is chosen among drawable tokens and the
report is ``log_softmax`` over that set plus pad and BOS at their own logits.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Iterable, Sequence

import torch

from elasticrl.policy.vocab import CharVocab
from elasticrl.rollout.engine import EngineStateError, Group, GroupRequest, Sample, WeightUpdateError, report_progress
from elasticrl.rollout.hf import filter_top_k_top_p

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Kind:
    """Requests of one kind sample alike and are decoded in one batch."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int


def _kind(request: GroupRequest) -> _Kind:
    s = request.sampling
    return _Kind(s.n, s.temperature, s.top_p, s.top_k, s.max_new_tokens)


class TinyEngine:
    """Rollout engine over a ``TinyCausalLM`` (or any module with its ``forward(tokens, valid)``).

    Args:
        model: the policy module; shared with a trainer or owned by this engine.
        vocab: its ``CharVocab`` (pad, BOS and EOS ids; decodes ``Sample.text``).
        lock: held by the engine around every batch and weight copy. Pass the trainer's lock when
            sharing its module; None makes a private one. Pass an ``RLock`` if a thread may call
            ``generate`` or ``update_weights`` while already holding it (a plain ``Lock`` would
            deadlock there).
        policy_version: version of the weights the module holds now.
        device: None samples on the module's device; a device moves the module there (use it only
            for an owned module).
        seed: seeds the engine's generator, which picks the seed of a batch whose first request
            has ``sampling.seed`` None, so unseeded runs stay reproducible.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vocab: CharVocab,
        *,
        lock: threading.Lock | threading.RLock | None = None,
        policy_version: int = 0,
        device: str | torch.device | None = None,
        seed: int = 0,
    ):
        if not isinstance(policy_version, int) or policy_version < 0:
            raise ValueError(f"TinyEngine: policy_version {policy_version!r} must be an int >= 0")
        param = next(model.parameters(), None)
        if param is None:
            raise ValueError("TinyEngine: the model has no parameters; pass a TinyCausalLM")
        if device is not None and torch.device(device) != param.device:
            model.to(device)
        self.device = next(model.parameters()).device
        self.vocab_size: int = int(getattr(model, "vocab_size", len(vocab)))
        if len(vocab) > self.vocab_size:
            raise ValueError(
                f"TinyEngine: the vocabulary has {len(vocab)} tokens but the model only {self.vocab_size}; "
                "build the model with vocab_size=len(vocab)"
            )
        config = getattr(model, "config", None)
        self.max_context: int | None = getattr(config, "max_seq_len", None)
        self._model: torch.nn.Module | None = model
        self._vocab = vocab
        self._lock = lock if lock is not None else threading.RLock()
        self._seeds = random.Random(seed)
        self._version = policy_version
        self._sleeping = False
        self._closed = False
        logger.info(
            "tiny engine: %d parameters on %s, context %s, policy version %d",
            sum(p.numel() for p in model.parameters()), self.device, self.max_context, policy_version,
        )

    # ----- RolloutEngine -------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def tokenizer(self) -> CharVocab:
        """The ``CharVocab`` (the engine works on ids; this decodes them)."""
        return self._vocab

    @property
    def model(self) -> torch.nn.Module:
        self._check_open()
        assert self._model is not None
        return self._model

    def set_version(self, version: int) -> None:
        """Stamp later groups with ``version``: the shared module now holds those weights.

        Does not take the lock (the trainer usually holds it): call it while still holding the lock
        after the optimizer step, so no batch sees the new weights under the old version.
        """
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"set_version: version {version!r} must be an int >= 0")
        self._version = version

    def generate(self, requests: Sequence[GroupRequest]) -> list[Group]:
        self._check_open()
        if self._sleeping:
            raise EngineStateError("tiny engine is asleep; call wake() or update_weights() before generate()")
        requests = list(requests)
        for r in requests:
            self._check_request(r)
        batches: dict[_Kind, list[int]] = {}
        for i, r in enumerate(requests):
            batches.setdefault(_kind(r), []).append(i)
        groups: list[Group | None] = [None] * len(requests)
        for indices in batches.values():
            batch = [requests[i] for i in indices]
            with self._lock:
                # Read under the lock: the trainer bumps the version while holding it.
                version = self._version
                start = time.perf_counter()
                samples = self._decode(batch)
                seconds = time.perf_counter() - start
            for i, req, group_samples in zip(indices, batch, samples):
                groups[i] = Group(
                    task_id=req.task_id, prompt_ids=list(req.prompt_ids), samples=group_samples,
                    policy_version=version, gen_seconds=seconds,
                )
        return [g for g in groups if g is not None]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy tensors in by ``state_dict`` name under the lock (holding it already is fine only
        if it is an ``RLock``)."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version {version!r} must be an int >= 0")
        self.wake()
        count = 0
        with self._lock, torch.no_grad():
            targets = self.model.state_dict(keep_vars=True)
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise WeightUpdateError(
                        f"update_weights: {name!r} is not a parameter of the tiny model (names are its "
                        f"state_dict keys, e.g. {next(iter(targets), '')!r}); nothing after it was loaded"
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise WeightUpdateError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the model's is "
                        f"{tuple(target.shape)}; nothing after it was loaded"
                    )
                target.copy_(tensor.detach())
                count += 1
            self._version = version
        logger.info("tiny engine: loaded %d tensors, policy version %d", count, version)

    def sleep(self) -> None:
        """Only the state changes: the module is tiny (and may be the trainer's)."""
        self._check_open()
        self._sleeping = True

    def wake(self) -> None:
        self._check_open()
        self._sleeping = False

    def close(self) -> None:
        """Drop the engine's reference to the module (a shared module lives on in the trainer)."""
        self._closed = True
        self._model = None

    def __enter__(self) -> "TinyEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- decoding ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("tiny engine is closed")

    def _check_request(self, r: GroupRequest) -> None:
        if not isinstance(r, GroupRequest):
            raise TypeError(f"generate() takes GroupRequests, got {type(r).__name__}")
        if self.max_context is not None and len(r.prompt_ids) >= self.max_context:
            raise ValueError(
                f"prompt of task {r.task_id!r} has {len(r.prompt_ids)} tokens; the model's context "
                f"(policy.max_seq_len) is {self.max_context}, which leaves no room to generate: shorten the prompt"
            )
        if max(r.prompt_ids) >= self.vocab_size:
            raise ValueError(f"prompt of task {r.task_id!r} has token id {max(r.prompt_ids)} >= vocab size {self.vocab_size}")
        if self._vocab.pad_id in r.prompt_ids:
            raise ValueError(
                f"prompt of task {r.task_id!r} contains the pad id {self._vocab.pad_id}; the trainer masks "
                "pad ids out, so a prompt must not use it"
            )

    @torch.no_grad()
    def _decode(self, batch: list[GroupRequest]) -> list[list[Sample]]:
        """Sample one batch of requests of one kind; the caller holds the lock."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            return self._decode_rows(model, batch)
        finally:
            model.train(was_training)

    def _decode_rows(self, model: torch.nn.Module, batch: list[GroupRequest]) -> list[list[Sample]]:
        dev, vocab = self.device, self._vocab
        kind = _kind(batch[0])
        n = kind.n
        # Row layout of sample_groups: each prompt's n samples contiguous, prompts left-padded.
        prompts = [r.prompt_ids for r in batch for _ in range(n)]
        rows, width = len(prompts), max(len(p) for p in prompts)
        tokens = torch.full((rows, width), vocab.pad_id, dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.bool)
        for row, p in enumerate(prompts):
            tokens[row, width - len(p):] = torch.tensor(p)
            valid[row, width - len(p):] = True
        tokens, valid = tokens.to(dev), valid.to(dev)

        stop_mask = torch.zeros((rows, self.vocab_size), dtype=torch.bool)  # [B, V] ids that end a row
        for row, r in enumerate(r for r in batch for _ in range(n)):
            stops = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else {vocab.eos_id})
            stop_mask[row, [t for t in stops if t < self.vocab_size]] = True
        stop_mask = stop_mask.to(dev)
        limits = torch.tensor(
            [kind.max_new_tokens if self.max_context is None else min(kind.max_new_tokens, self.max_context - len(p)) for p in prompts],
            device=dev,
        )
        first_seed = batch[0].sampling.seed
        seed = first_seed if first_seed is not None else self._seeds.getrandbits(63)
        gen = torch.Generator(device=dev).manual_seed(seed)
        greedy = kind.temperature == 0
        filtered = kind.top_k > 0 or kind.top_p < 1
        top_k = torch.full((rows,), kind.top_k, dtype=torch.long, device=dev)
        top_p = torch.full((rows,), kind.top_p, device=dev)
        specials = [vocab.pad_id, vocab.bos_id]

        done = torch.zeros(rows, dtype=torch.bool, device=dev)
        stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
        count = torch.zeros(rows, dtype=torch.long, device=dev)
        step_lps: list[torch.Tensor] = []  # one [B] per step
        for _ in range(int(limits.max())):
            window, window_valid = tokens, valid
            if self.max_context is not None and tokens.shape[1] > self.max_context:
                # Every running row's real tokens fit in the last max_context columns (its limit
                # says so); cropping leading columns only drops padding of running rows.
                window, window_valid = tokens[:, -self.max_context:], valid[:, -self.max_context:]
            logits = model(window, window_valid)[:, -1, :].float()  # [B, V]
            if greedy:
                drawable = logits.clone()
                drawable[:, specials] = float("-inf")
                nxt = drawable.argmax(dim=-1)
                report = torch.log_softmax(logits, dim=-1)
            else:
                scaled = logits / kind.temperature
                drawable = scaled.clone()
                drawable[:, specials] = float("-inf")
                if filtered:
                    drawable = filter_top_k_top_p(drawable, top_k, top_p)
                # The same softmax and multinomial call as sample_groups: identical draws.
                nxt = torch.multinomial(torch.softmax(drawable, dim=-1), 1, generator=gen).squeeze(1)  # [B]
                reported = drawable.clone()
                reported[:, specials] = scaled[:, specials]
                report = torch.log_softmax(reported, dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, vocab.pad_id), nxt)
            step_lps.append(report.gather(1, nxt[:, None]).squeeze(1))
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            valid = torch.cat([valid, (~done)[:, None]], dim=1)
            running = ~done
            count += running.long()
            hit_stop = running & stop_mask.gather(1, nxt[:, None]).squeeze(1)
            stopped |= hit_stop
            done |= hit_stop | (count >= limits)
            if bool(done.all()):
                break
            report_progress()

        ids = tokens[:, width:].tolist()
        lps = torch.stack(step_lps, dim=1).tolist()  # [B, steps]
        counts, stopped_rows = count.tolist(), stopped.tolist()
        samples: list[list[Sample]] = []
        for i in range(len(batch)):
            group = []
            for row in range(i * n, (i + 1) * n):
                k = counts[row]
                group.append(Sample(
                    completion_ids=ids[row][:k], logprobs=lps[row][:k],
                    finish_reason="stop" if stopped_rows[row] else "length",
                    text=vocab.decode(ids[row][:k]),
                ))
            samples.append(group)
        return samples
