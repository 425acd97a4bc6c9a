"""The ``hf`` rollout engine: any local Hugging Face causal LM, sampled with transformers on CPU or GPU.

Prompts of a batch are left-padded so they all end at the same column; positions count real tokens
only (``cumsum(attention_mask) - 1``), so padding does not shift them and each row computes what it
would compute alone. Decoding is our own loop over the model's KV cache rather than
``model.generate``: that gives per-request seeds, per-request temperature/top-k/top-p in one batch,
and log-probabilities taken from exactly the distribution each token was drawn from (see
``elasticrl.rollout.engine`` for the convention). The integration tests check them against a
teacher-forced forward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from elasticrl.rollout.engine import (
    LOGPROBS_MODES,
    EngineStateError,
    Group,
    GroupRequest,
    Sample,
    WeightUpdateError,
    report_progress,
)
from elasticrl.rollout.hf_dir import check_model_dir, eos_token_ids, has_tokenizer
from elasticrl.rollout.offload import HostOffload

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return "auto"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join([*_DTYPES, 'auto'])} (or a torch.dtype)")
    return _DTYPES[dtype]


def _dtype_kwarg(transformers_version: str) -> str:
    # transformers 4.56 renamed from_pretrained(torch_dtype=) to dtype= (the old name warns in 5.x).
    major, minor = (int(p) for p in transformers_version.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k, then outside its nucleus.

    logits: [B, V] (already temperature-scaled); top_k: [B] long, 0 = off; top_p: [B] float, 1 = off.
    The nucleus is the smallest set of most likely tokens whose mass reaches top_p (always at least
    one token), taken after top-k as vLLM does.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    drop = ranks >= k[:, None]  # [B, V] in sorted order
    p = top_p.to(logits.dtype)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop |= (mass_before >= p) & (p < 1)  # rows with top_p == 1 are left alone despite rounding
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, filtered)


@dataclasses.dataclass
class _Chunk:
    """Rows of one batched decode: each request's n samples, contiguous."""

    requests: list[GroupRequest]
    starts: list[int]
    """Row index of each request's first sample."""


class HFEngine:
    """Rollout engine over ``transformers.AutoModelForCausalLM``.

    Args:
        model_dir: a local HF model directory (``config.json`` + weights); nothing is downloaded.
        device: torch device for the model, e.g. "cpu", "cuda", "cuda:1".
        dtype: "float32" (default, exact logprobs), "bfloat16", "float16", "auto" (the checkpoint's)
            or a torch.dtype.
        seed: seeds the engine's generator, which picks a seed for every request that has none.
        logprobs_mode: "processed" (the sampling distribution) or "raw" (the unscaled model); see
            ``elasticrl.rollout.engine``.
        max_batch_rows: most sequences decoded together; a group is never split across batches.
        policy_version: version of the weights in ``model_dir``.
        load_tokenizer: load the directory's tokenizer, if it has one, to fill ``Sample.text``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        seed: int = 0,
        logprobs_mode: str = "processed",
        max_batch_rows: int = 64,
        policy_version: int = 0,
        load_tokenizer: bool = True,
    ):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r} must be one of {', '.join(LOGPROBS_MODES)}")
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows {max_batch_rows!r} must be >= 1")
        path = check_model_dir(model_dir)
        import transformers  # heavy: imported only when an hf engine is built

        self.model_dir = path
        self.device = torch.device(device)
        self.logprobs_mode = logprobs_mode
        self.max_batch_rows = max_batch_rows
        kwargs: dict[str, Any] = {_dtype_kwarg(transformers.__version__): _resolve_dtype(dtype), "local_files_only": True}
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        self._model: Any = model.to(self.device).eval().requires_grad_(False)
        self._tokenizer: Any | None = None
        if load_tokenizer and has_tokenizer(path):
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_ids: tuple[int, ...] = eos_token_ids(path)
        self.vocab_size: int = int(self._model.get_output_embeddings().weight.shape[0])
        self.max_context: int | None = getattr(self._model.config, "max_position_embeddings", None)
        pad = getattr(self._model.config, "pad_token_id", None)
        self._pad_id = int(pad) if isinstance(pad, int) else 0  # any id works: padding is masked out
        params = _forward_params(self._model)
        self._keep_last_logits = "logits_to_keep" in params
        # transformers 5.x names the KV cache `cache` (`past_key_values` is deprecated, gone in 5.40).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._seeds = random.Random(seed)
        self._version = int(policy_version)
        self._sleeping = False
        self._offload = HostOffload(self._model, self.device) if self.device.type == "cuda" else None
        self._closed = False
        logger.info(
            "hf engine: %s on %s (%s, %d parameters, eos %s, logprobs %s)",
            path, self.device, self._model.dtype, sum(p.numel() for p in self._model.parameters()),
            list(self.eos_token_ids), logprobs_mode,
        )

    # ----- RolloutEngine -------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The loaded module (read-only use: tests and weight export)."""
        self._check_open()
        return self._model

    def generate(self, requests: Sequence[GroupRequest]) -> list[Group]:
        self._check_open()
        if self._sleeping:
            raise EngineStateError("hf engine is asleep; call wake() or update_weights() before generate()")
        requests = list(requests)
        for r in requests:
            if not isinstance(r, GroupRequest):
                raise TypeError(f"generate() takes GroupRequests, got {type(r).__name__}")
            if self.max_context is not None and len(r.prompt_ids) >= self.max_context:
                raise ValueError(
                    f"prompt of task {r.task_id!r} has {len(r.prompt_ids)} tokens; the model's context is "
                    f"{self.max_context}, which leaves no room to generate: shorten the prompt"
                )
            if max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"prompt of task {r.task_id!r} has token id {max(r.prompt_ids)} >= vocab size {self.vocab_size}")
        groups: list[Group | None] = [None] * len(requests)
        for chunk, indices in self._chunks(requests):
            start = time.perf_counter()
            samples = self._decode(chunk)
            seconds = time.perf_counter() - start
            for i, req, group_samples in zip(indices, chunk.requests, samples):
                groups[i] = Group(
                    task_id=req.task_id, prompt_ids=list(req.prompt_ids), samples=group_samples,
                    policy_version=self._version, gen_seconds=seconds,
                )
        return [g for g in groups if g is not None]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version {version!r} must be an int >= 0")
        # Asleep on a GPU: the device memory comes back unfilled, the update writes it, and only
        # what it did not write comes back from the host copy (HostOffload), even if it fails.
        refill = self._sleeping and self._offload is not None
        if refill:
            self._offload.allocate()
            self._sleeping = False
        else:
            self.wake()
        try:
            count = self._copy_in(named_tensors, track=self._offload if refill else None)
        finally:
            if refill:
                self._offload.restore()
        self._version = version
        logger.info("hf engine: loaded %d tensors, policy version %d", count, version)

    def _copy_in(self, named_tensors: Iterable[tuple[str, torch.Tensor]], track: HostOffload | None) -> int:
        # state_dict(keep_vars=True) maps every checkpoint name, tied aliases included, to the live
        # Parameter/buffer, so a copy_ into it is seen by the module.
        targets = self._model.state_dict(keep_vars=True)
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    example = next(iter(targets), "")
                    raise WeightUpdateError(
                        f"update_weights: {name!r} is not a parameter of the model in {self.model_dir} "
                        f"(names are HF checkpoint names, e.g. {example!r}); nothing after it was loaded"
                    )
                if tuple(tensor.shape) != tuple(target.shape):
                    raise WeightUpdateError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the model's is "
                        f"{tuple(target.shape)}; nothing after it was loaded"
                    )
                target.copy_(tensor.detach())  # casts dtype and moves across devices
                if track is not None:
                    track.filled(target)
                count += 1
        return count

    def sleep(self) -> None:
        """Move the weights to pinned host memory (allocated at the first sleep and kept) and free
        the CUDA cache; on CPU only the state changes."""
        self._check_open()
        if self._sleeping:
            return
        if self._offload is not None:
            self._offload.offload()
        self._sleeping = True

    def wake(self) -> None:
        self._check_open()
        if not self._sleeping:
            return
        if self._offload is not None:
            self._offload.wake()
        self._sleeping = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._model = None
        if self._offload is not None:
            self._offload.close()  # the pinned host copy
            self._offload = None
        self._tokenizer = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "HFEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- decoding ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("hf engine is closed")

    def _chunks(self, requests: list[GroupRequest]) -> Iterable[tuple[_Chunk, list[int]]]:
        chunk, indices, rows = _Chunk([], []), [], 0
        for i, r in enumerate(requests):
            if chunk.requests and rows + r.sampling.n > self.max_batch_rows:
                yield chunk, indices
                chunk, indices, rows = _Chunk([], []), [], 0
            chunk.requests.append(r)
            chunk.starts.append(rows)
            indices.append(i)
            rows += r.sampling.n
        if chunk.requests:
            yield chunk, indices

    @torch.inference_mode()
    def _decode(self, chunk: _Chunk) -> list[list[Sample]]:
        dev = self.device
        reqs = chunk.requests
        prompts = [r.prompt_ids for r in reqs for _ in range(r.sampling.n)]
        rows = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((rows, width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, W]: real tokens count from 0

        specs = [r.sampling for r in reqs for _ in range(r.sampling.n)]
        temperature = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in specs], device=dev)
        top_k = torch.tensor([s.top_k for s in specs], dtype=torch.long, device=dev)
        top_p = torch.tensor([s.top_p for s in specs], device=dev)
        needs_filter = any(s.top_k > 0 or s.top_p < 1 for s in specs)
        stops = [set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.eos_token_ids)) for s in specs]
        limits = [
            s.max_new_tokens if self.max_context is None else min(s.max_new_tokens, self.max_context - len(p))
            for s, p in zip(specs, prompts)
        ]
        generators = []
        for r in reqs:
            seed = r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63)
            generators.append(torch.Generator(device=dev).manual_seed(seed))

        out_ids: list[list[int]] = [[] for _ in range(rows)]
        out_lps: list[list[float]] = [[] for _ in range(rows)]
        finish = ["length"] * rows
        done = [False] * rows
        past = None
        step_ids, step_pos = ids, positions
        extra = {"logits_to_keep": 1} if self._keep_last_logits else {}
        for _ in range(max(limits)):
            out = self._model(
                input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                use_cache=True, **{self._cache_arg: past}, **extra,
            )
            past = out[self._cache_arg]
            logits = out.logits[:, -1, :].float()  # [B, V]
            tokens, logprobs = self._pick(logits, reqs, chunk.starts, generators, temperature, top_k, top_p, needs_filter)
            for row, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
                if done[row]:
                    continue
                out_ids[row].append(tok)
                out_lps[row].append(lp)
                if tok in stops[row]:
                    done[row], finish[row] = True, "stop"
                elif len(out_ids[row]) >= limits[row]:
                    done[row] = True
            if all(done):
                break
            report_progress()
            # Finished rows keep decoding (their tokens are ignored) so the batch stays rectangular,
            # at their last position: advanced, they passed the context (learned positions raised
            # IndexError; dynamic RoPE rescaled every row of the batch by the largest position).
            step_ids = tokens[:, None]
            step_pos = step_pos[:, -1:] + torch.tensor([not d for d in done], dtype=step_pos.dtype, device=dev)[:, None]
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=dev)], dim=1)

        decode = self._tokenizer.decode if self._tokenizer is not None else None
        samples: list[list[Sample]] = []
        for r, start in zip(reqs, chunk.starts):
            samples.append([
                Sample(
                    completion_ids=out_ids[row], logprobs=out_lps[row], finish_reason=finish[row],  # type: ignore[arg-type]
                    text=decode(out_ids[row], skip_special_tokens=True) if decode else None,
                )
                for row in range(start, start + r.sampling.n)
            ])
        return samples

    def _pick(
        self,
        logits: torch.Tensor,
        reqs: list[GroupRequest],
        starts: list[int],
        generators: list[torch.Generator],
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        needs_filter: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; returns (tokens [B], their logprobs [B]) per the engine's mode."""
        raw = torch.log_softmax(logits, dim=-1)  # [B, V]
        scaled = logits / temperature[:, None]
        if needs_filter:
            scaled = filter_top_k_top_p(scaled, top_k, top_p)
        sampling = torch.log_softmax(scaled, dim=-1)  # the distribution tokens are drawn from
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for r, start, gen in zip(reqs, starts, generators):
            rows = slice(start, start + r.sampling.n)
            if r.sampling.temperature == 0:
                tokens[rows] = logits[rows].argmax(dim=-1)
            else:
                # One generator per request: a group's draws depend only on its seed and its rows.
                tokens[rows] = torch.multinomial(sampling[rows].exp(), 1, generator=gen).squeeze(1)
        report = raw if self.logprobs_mode == "raw" else sampling
        greedy = temperature.new_tensor([r.sampling.temperature == 0 for r in reqs for _ in range(r.sampling.n)]).bool()
        report = torch.where(greedy[:, None], raw, report)
        picked = report.gather(1, tokens[:, None]).squeeze(1)
        assert bool(torch.isfinite(picked).all()), "sampled a token outside the filtered distribution"
        return tokens, picked


def _forward_params(model: torch.nn.Module) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)
