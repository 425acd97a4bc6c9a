"""The ``vllm`` rollout engine: one ``vllm.LLM`` kept alive for the whole run, asleep while training.

Per iteration: ``generate`` -> ``sleep()`` (vLLM sleep mode: level 1 offloads the weights to CPU
RAM and drops the KV cache; level 2 drops both) -> training -> ``update_weights`` (wake only the
weight memory, load the new tensors in place on every worker, then wake the KV cache) ->
``generate``. The engine is never rebuilt between iterations.

vLLM APIs relied on (read in vLLM's source and docs, v0.10-v0.2x, and checked against v0.33's):

* ``LLM(model=..., enable_sleep_mode=True, worker_extension_cls=..., logprobs_mode=...)``;
  ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) makes returned logprobs come from the
  logits after temperature and top-k/top-p (``TopKTopPSampler.forward_native``), the default
  ``"raw_logprobs"`` from the unscaled model (``vllm/v1/sample/sampler.py``).
* ``LLM.generate([{"prompt_token_ids": ids}], sampling_params=[SamplingParams(n=..., logprobs=0,
  seed=..., ...)])``: outputs come back in prompt order; ``CompletionOutput.token_ids`` and
  ``.logprobs[i][token_id].logprob`` (``logprobs=0`` returns just the sampled token's). With a seed
  and n > 1 vLLM gives child i the seed ``seed + i`` (``vllm/v1/engine/parallel_sampling.py``).
* ``LLM.sleep(level=1|2)`` / ``LLM.wake_up(tags=["weights"] | ["kv_cache"] | None)``
  (docs: features/sleep_mode, "wake up only model weights or KV cache to avoid OOM during weight
  updates"); older vLLMs have ``wake_up()`` without tags, handled below.
* ``LLM.collective_rpc(method, args=...)`` runs a worker method on every worker and returns their
  results; we call ``WeightLoaderExtension.elasticrl_load_weights`` (see ``vllm_worker``), which
  ends in ``model.load_weights(weights=[(name, tensor)])`` as vLLM's
  ``examples/offline_inference/rlhf_utils.py`` does, and as verl/OpenRLHF's vLLM weight sync does.
* ``LLM.reset_prefix_cache()``: cached prefixes were computed by the old weights.

Weight transfer: tensors go through ``collective_rpc`` arguments as ``(name, dtype, shape, bytes)``
records (``vllm_worker.to_wire``): the engine core runs in another process and decodes RPC
arguments without type information, which does not rebuild a ``torch.Tensor``. They are sent in
chunks of ``weight_chunk_bytes`` so the driver never holds a second copy of the whole model in
serialised form. After a level-2 sleep (weights discarded) an update must cover every parameter:
the workers report what ``load_weights`` loaded in that very call (a fused parameter counts once
any part of it is loaded) and a partial update is refused. Quantized models are refused: their
loaders post-process weights after loading, which an in-place update skips. With tensor
parallelism every rank receives the full tensor and ``load_weights`` cuts its shard, which is
correct but ships the model tp times; large TP deployments want the NCCL broadcast path of vLLM's
``examples/offline_inference/rlhf.py`` (a ``StatelessProcessGroup`` + ``PyNcclCommunicator``
between trainer rank 0 and the workers) or CUDA IPC handles (``rlhf_colocate.py``), not
implemented here.

Also from v0.33's source:

* tied embeddings: ``AutoWeightsLoader`` refuses ``lm_head.weight`` of a tied model unless the same
  ``load_weights`` call also carries ``model.embed_tokens.weight`` (``_check_skipped_aliases``);
  older versions skipped it silently. The head is the embedding there, so it is never sent.
* the GPU: the engine core is a process of its own and does not inherit the trainer's
  ``torch.cuda.set_device``; with nothing said every rank's engine lands on GPU 0.
  ``EngineArgs.device_ids`` (indices into ``CUDA_VISIBLE_DEVICES``) places it where vLLM has it;
  older ones are given the GPU through ``CUDA_VISIBLE_DEVICES`` while the engine core process
  starts (the default multiprocess mode).
* dtype: ``load_weights`` casts a float32 tensor into a bf16 parameter with a warning per tensor
  per update, so tensors are cast to the engine's dtype before they are sent (half the bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from elasticrl.rollout.engine import (
    LOGPROBS_MODES,
    EngineError,
    EngineStateError,
    EngineUnavailableError,
    Group,
    GroupRequest,
    Sample,
    SamplingSpec,
    WeightUpdateError,
)
from elasticrl.rollout.hf_dir import check_model_dir, eos_token_ids, has_tokenizer, tied_embeddings
from elasticrl.rollout.vllm_worker import WORKER_EXTENSION, WireTensor, to_wire

logger = logging.getLogger(__name__)

_VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


TIED_HEAD = "lm_head.weight"


def _chunks(named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int, *, dtype: torch.dtype | None = None,
            skip: frozenset[str] = frozenset()) -> Iterator[list[WireTensor]]:
    """Group (name, tensor) pairs as wire records into lists of about ``max_bytes`` (a bigger
    tensor goes alone); floating tensors cast to ``dtype`` if given, names in ``skip`` left out."""
    chunk: list[WireTensor] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"update_weights takes (name, tensor) pairs, got ({type(name).__name__}, {type(tensor).__name__})")
        if name in skip:
            continue
        if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        record = to_wire(name, tensor)
        if chunk and size + len(record[3]) > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(record)
        size += len(record[3])
    if chunk:
        yield chunk


def _placement(device: str | torch.device | None, tensor_parallel_size: int, engine_fields: set[str]) -> tuple[dict, dict]:
    """(``vllm.LLM`` kwargs, environment while it starts) that put the engine of the process on
    ``device`` ("cuda:N", its trainer's GPU) on GPUs ``N * tp .. N * tp + tp - 1``: with tp = 1 its
    own, with tp > 1 a block of its own (the processes of a node never share one; the node needs
    nproc-per-node * tp GPUs). Nothing if the device has no index."""
    index = None if device is None else torch.device(device).index
    if index is None:
        return {}, {}
    tp = tensor_parallel_size
    ids = list(range(index * tp, index * tp + tp))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if ids[-1] >= len(physical):
        raise ValueError(f"device {device} with engine.tensor_parallel_size={tp} takes GPUs {ids} (each process of a "
                         f"node a block of its own), and {len(physical)} are visible")
    if "device_ids" in engine_fields:  # indices into CUDA_VISIBLE_DEVICES, as torch's are
        return {"device_ids": ids}, {}
    return {}, {"CUDA_VISIBLE_DEVICES": ",".join(physical[i] for i in ids)}


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``changes`` for the block (what a process started in it inherits)."""
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, value in saved.items():
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value


def _spread_seed(seed: int) -> int:
    """A task's seed, hashed. vLLM seeds sample i of a request with ``seed + i``, and consecutive
    tasks carry consecutive seeds, so unhashed, sample i of task k would repeat sample 0 of task k+i."""
    return int.from_bytes(hashlib.blake2b((int(seed) % (1 << 64)).to_bytes(8, "little"), digest_size=7).digest(), "little")


class VLLMEngine:
    """Rollout engine over ``vllm.LLM`` (CUDA GPUs).

    Args:
        model_dir: a local HF model directory.
        gpu_memory_utilization: fraction of GPU memory vLLM may take for weights + KV cache, shared
            with the trainer on the same GPU (it sleeps while the trainer runs).
        tensor_parallel_size: GPUs per engine.
        enable_sleep_mode: needed for ``sleep``/``wake``; costs a custom CUDA allocator.
        sleep_level: 1 keeps a CPU copy of the weights (``wake`` works); 2 discards them (less CPU
            RAM; then every ``update_weights`` must push the full state dict and ``wake`` alone
            raises).
        dtype: vLLM dtype ("auto", "bfloat16", "float16", "float32").
        seed: vLLM's global seed (used for requests without their own).
        max_model_len: context length; None takes the model's.
        enforce_eager: skip CUDA graphs (faster start, slower decode).
        logprobs_mode: "processed" or "raw", see ``elasticrl.rollout.engine``.
        policy_version: version of the weights in ``model_dir``.
        weight_chunk_bytes: most bytes sent per ``collective_rpc`` in ``update_weights``.
        device: this process's GPU ("cuda:N"); the engine takes GPUs N * tp .. N * tp + tp - 1
            (``_placement``: with tp = 1, this one). None: vLLM's choice (GPU 0 of what is visible).
        llm_kwargs: further ``vllm.LLM`` keyword arguments (override the ones above).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = True,
        sleep_level: int = 1,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        logprobs_mode: str = "processed",
        policy_version: int = 0,
        weight_chunk_bytes: int = 256 << 20,
        device: str | torch.device | None = None,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        try:
            import vllm
        except ImportError as exc:
            raise EngineUnavailableError(
                "the 'vllm' rollout engine needs the vllm package (pip install vllm; Linux + CUDA only); "
                "use the 'hf' engine on CPU"
            ) from exc
        if not torch.cuda.is_available():
            raise EngineUnavailableError("the 'vllm' rollout engine needs a CUDA GPU and none is visible; use the 'hf' engine")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {logprobs_mode!r} must be one of {', '.join(LOGPROBS_MODES)}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level {sleep_level!r} must be 1 (offload weights to CPU) or 2 (discard them)")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization!r} must be in (0, 1]")
        path = check_model_dir(model_dir)
        self.model_dir = path
        self.logprobs_mode = logprobs_mode
        self.eos_token_ids = eos_token_ids(path)
        self._has_tokenizer = has_tokenizer(path)
        kwargs: dict[str, Any] = dict(
            model=str(path),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            # Multi-turn episodes resend their whole, growing context every turn: with prefix
            # caching only the new observation and action tokens are prefilled again.
            enable_prefix_caching=True,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode=_VLLM_LOGPROBS_MODE[logprobs_mode],
            worker_extension_cls=WORKER_EXTENSION,
            # Without tokenizer files vLLM must not try to load one; it then knows no EOS, which is
            # why generate() always passes the EOS ids as stop_token_ids.
            skip_tokenizer_init=not self._has_tokenizer,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        engine_args = getattr(vllm, "EngineArgs", None)
        fields = {f.name for f in dataclasses.fields(engine_args)} if dataclasses.is_dataclass(engine_args) else set()
        placed, environment = _placement(device, tensor_parallel_size, fields)
        kwargs.update(placed)
        kwargs.update(llm_kwargs or {})
        if kwargs.get("quantization"):
            raise ValueError(
                f"llm_kwargs quantization={kwargs['quantization']!r}: in-place weight updates load bf16/fp16 "
                "tensors and skip the quantization post-processing, so quantized vLLM engines are not supported; "
                "drop the quantization setting"
            )
        try:
            with _environment(environment):
                self._llm: Any = vllm.LLM(**kwargs)
        except (ValueError, RuntimeError) as exc:
            # In-process vLLM raises its memory check's ValueError itself: that one will not pass by
            # retrying. Its separate engine core process fails with "Engine core initialization
            # failed" whatever the cause (logged above it; a predecessor still on the GPU passes), so
            # that is only explained, and retried as before.
            text = str(exc).lower()
            hint = (f"if the cause is GPU memory (\"less than desired GPU memory utilization\"), lower "
                    f"engine.gpu_memory_utilization={gpu_memory_utilization:g}: it is a share of the whole GPU, and the "
                    "trainer already holds part of it")
            if isinstance(exc, ValueError) and "memory" in text:
                raise EngineUnavailableError(f"vLLM could not start on {device or 'its default GPU'}: {exc}; {hint}") from exc
            if "engine core initialization failed" in text:
                logger.error("vllm engine: could not start on %s (%s); %s", device or "its default GPU", exc, hint)
            raise
        self._tied_head = frozenset({TIED_HEAD}) if tied_embeddings(path) else frozenset()
        model_dtype = getattr(getattr(getattr(self._llm, "llm_engine", None), "model_config", None), "dtype", None)
        self._wire_dtype = model_dtype if isinstance(model_dtype, torch.dtype) else None
        self._sampling_params_cls = vllm.SamplingParams
        self._wake_takes_tags = "tags" in inspect.signature(self._llm.wake_up).parameters
        self._sleep_mode = enable_sleep_mode
        self._sleep_level = sleep_level
        self._chunk_bytes = weight_chunk_bytes
        self._version = int(policy_version)
        self._sleeping = False
        self._weights_discarded = False
        self._updates = 0
        self._closed = False
        logger.info(
            "vllm engine: %s, tp=%d, gpu_memory_utilization=%.2f, sleep mode %s (level %d), logprobs %s",
            path, tensor_parallel_size, gpu_memory_utilization, enable_sleep_mode, sleep_level, logprobs_mode,
        )

    # ----- RolloutEngine -------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int | None:
        """The engine's context length (``max_model_len``): the episode runner ends an episode as
        truncated before it would overflow it. None if this vLLM does not expose it."""
        config = getattr(getattr(self._llm, "llm_engine", None), "model_config", None)
        value = getattr(config, "max_model_len", None)
        return int(value) if isinstance(value, int) else None

    @property
    def is_sleeping(self) -> bool:
        return self._sleeping

    @property
    def tokenizer(self) -> Any | None:
        return self._llm.get_tokenizer() if self._has_tokenizer and not self._closed else None

    @property
    def llm(self) -> Any:
        """The underlying ``vllm.LLM`` (for tests and diagnostics)."""
        self._check_open()
        return self._llm

    def generate(self, requests: Sequence[GroupRequest]) -> list[Group]:
        self._check_open()
        if self._sleeping:
            raise EngineStateError("vllm engine is asleep; call wake() or update_weights() before generate()")
        if self._weights_discarded:
            raise EngineStateError("vllm engine's weights were discarded (level-2 sleep) and not fully reloaded; call update_weights()")
        requests = list(requests)
        if not requests:
            return []
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [self._sampling_params(r.sampling) for r in requests]
        start = time.perf_counter()
        outputs = self._llm.generate(prompts, sampling_params=params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if len(outputs) != len(requests):
            raise EngineError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts")
        return [
            Group(
                task_id=req.task_id, prompt_ids=list(req.prompt_ids), samples=self._samples(req, out),
                policy_version=self._version, gen_seconds=seconds,
            )
            for req, out in zip(requests, outputs)
        ]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version {version!r} must be an int >= 0")
        kv_asleep = False
        if self._sleeping:
            if self._wake_takes_tags:
                # Weights first, KV cache after loading: the peak is weights + one chunk, not
                # weights + KV cache + chunk (what the sleep-mode docs recommend for RLHF).
                self._llm.wake_up(tags=["weights"])
                kv_asleep = True
            else:
                self._llm.wake_up()
        self._sleeping = False
        count = 0
        self._updates += 1
        update = self._updates  # the workers collect what this call loads under its own number
        try:
            for chunk in _chunks(named_tensors, self._chunk_bytes, dtype=self._wire_dtype, skip=self._tied_head):
                try:
                    self._llm.collective_rpc("elasticrl_load_weights", args=(chunk, update))
                except Exception as exc:
                    raise WeightUpdateError(f"update_weights: vLLM rejected a tensor: {exc}") from exc
                count += len(chunk)
            if self._weights_discarded:
                self._check_complete(update, version)
        finally:
            if kv_asleep:
                self._llm.wake_up(tags=["kv_cache"])
            # Cached prefixes hold the old weights' keys/values. vLLM answers False when it cannot
            # reset (requests still running); older versions answer None.
            reset = self._llm.reset_prefix_cache()
        if reset is False:
            raise WeightUpdateError("update_weights: vLLM refused to reset its prefix cache; no request may run during an update")
        self._weights_discarded = False
        self._version = version
        logger.info("vllm engine: loaded %d tensors, policy version %d", count, version)

    def _check_complete(self, update: int, version: int) -> None:
        """After a level-2 sleep every parameter must have been reloaded, or generation would read
        uninitialised memory."""
        reports = self._llm.collective_rpc("elasticrl_missing_params", args=(update,))
        if any(r is None for r in reports):
            logger.warning("vllm engine: the model's load_weights does not report what it loaded; "
                           "cannot check that version %d reloaded every parameter", version)
            return
        missing = sorted({name for r in reports for name in r})
        if missing:
            raise WeightUpdateError(
                f"update_weights: the level-2 sleep discarded the weights and version {version} reloaded only part of "
                f"them: {len(missing)} parameter(s) missing, e.g. {', '.join(missing[:3])}; push the full state dict"
            )

    def sleep(self) -> None:
        self._check_open()
        if self._sleeping:
            return
        if not self._sleep_mode:
            raise EngineStateError("vllm engine was built with enable_sleep_mode=False; it cannot sleep")
        self._llm.sleep(level=self._sleep_level)
        self._sleeping = True
        self._weights_discarded = self._sleep_level == 2

    def wake(self) -> None:
        self._check_open()
        if not self._sleeping:
            return
        if self._weights_discarded:
            raise EngineStateError(
                "vllm engine slept at level 2, which discarded its weights; call update_weights() with the "
                "full state dict instead of wake()"
            )
        self._llm.wake_up()
        self._sleeping = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, None
        engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(engine_core, "shutdown", None)
        if callable(shutdown):  # v1: stops the engine-core process and its workers now, not at GC
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.warning("vllm engine: engine core shutdown failed", exc_info=True)
        del llm, engine_core, shutdown
        gc.collect()
        torch.cuda.empty_cache()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- helpers -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineStateError("vllm engine is closed")

    def _sampling_params(self, spec: SamplingSpec) -> Any:
        stop = set(spec.stop_token_ids)
        if not spec.ignore_eos:
            stop |= set(self.eos_token_ids)  # explicit, so it holds even with skip_tokenizer_init
        return self._sampling_params_cls(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else -1,  # -1 disables top-k in every vLLM version
            max_tokens=spec.max_new_tokens,
            seed=None if spec.seed is None else _spread_seed(spec.seed),
            stop_token_ids=sorted(stop),
            ignore_eos=spec.ignore_eos,
            logprobs=0,  # just the sampled token's logprob
            detokenize=self._has_tokenizer,
        )

    def _samples(self, req: GroupRequest, out: Any) -> list[Sample]:
        samples = []
        for completion in sorted(out.outputs, key=lambda c: c.index):
            ids = [int(t) for t in completion.token_ids]
            if completion.logprobs is None or len(completion.logprobs) != len(ids):
                raise EngineError(f"vLLM returned no per-token logprobs for task {req.task_id!r}")
            logprobs = [float(completion.logprobs[i][tok].logprob) for i, tok in enumerate(ids)]
            reason = completion.finish_reason
            if reason not in ("stop", "length"):
                raise EngineError(f"vLLM ended a sample of task {req.task_id!r} with finish_reason {reason!r}")
            text = completion.text if self._has_tokenizer else None
            samples.append(Sample(completion_ids=ids, logprobs=logprobs, finish_reason=reason, text=text))
        return samples
