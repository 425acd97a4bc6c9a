"""The rollout-engine contract: request/result dataclasses, the ``RolloutEngine`` protocol, errors,
and the string registry that builds an engine by name.

Everything here is pure Python (torch appears only in type hints), so the trainer, the CLI and the
unit tests can import it without loading a model backend.

Log-probability convention (both engines): ``Sample.logprobs[i]`` is the log-probability of
``completion_ids[i]`` given the prompt and the completion tokens before it. With the default
``logprobs_mode="processed"`` it is taken under the distribution the token was actually drawn from:
``log_softmax(filter(logits / temperature))`` where ``filter`` applies top-k then top-p and leaves
the kept tokens renormalised (vLLM's ``logprobs_mode="processed_logprobs"``). With
``logprobs_mode="raw"`` it is ``log_softmax(logits)`` of the unscaled model (vLLM's default
``"raw_logprobs"``). The two agree when temperature is 1 and top-k/top-p are off, which is the
setting in which a teacher-forced forward pass of the same weights reproduces them; a trainer that
samples at another temperature must divide its logits by that temperature to get the same numbers.
Greedy requests (temperature 0) report ``log_softmax(logits)`` in both modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from elasticrl.errors import ElasticRLError

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]
LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES: tuple[str, ...] = ("processed", "raw")


class EngineError(ElasticRLError):
    """Base of the errors a rollout engine raises on purpose."""


class UnknownEngineError(EngineError, ValueError):
    """``make_engine`` was given a name that is not registered; the message lists the valid ones."""


class EngineUnavailableError(EngineError, ImportError):
    """The backend cannot run here (package not installed, no GPU); the message says what is missing."""


class EngineStateError(EngineError, RuntimeError):
    """The call does not fit the engine's state (generate while asleep, any call after close)."""


class WeightUpdateError(EngineError, ValueError):
    """A pushed tensor does not fit the model: unknown name or wrong shape. The message names it.

    Tensors are applied as they stream in, so those before the bad one may already be loaded; the
    policy version is not bumped, and the caller should push the full set again.
    """


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How to sample one prompt's group. Mirrors the subset of vLLM's ``SamplingParams`` GRPO needs."""

    n: int = 1
    """Samples per prompt: the GRPO group size."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (every sample of the group is then the same)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables it."""
    max_new_tokens: int = 256
    """Most completion tokens per sample, the stop token included."""
    seed: int | None = None
    """Seed of this group's draws; None lets the engine pick one (HF: from its own seeded generator,
    so a run stays reproducible; vLLM: unseeded, which keeps vLLM's fast batched sampler)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a sample (kept as its last token), on top of the model's EOS ids."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS ids (``stop_token_ids`` still stop)."""

    def __post_init__(self) -> None:
        _check(
            isinstance(self.n, int) and self.n >= 1,
            f"SamplingSpec.n: {self.n!r} must be an int >= 1 (the GRPO group size, e.g. 8)",
        )
        _check(self.temperature >= 0, f"SamplingSpec.temperature: {self.temperature!r} must be >= 0 (0 = greedy, 1 = plain sampling)")
        _check(0 < self.top_p <= 1, f"SamplingSpec.top_p: {self.top_p!r} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            f"SamplingSpec.top_k: {self.top_k!r} must be an int >= 0; use 0 to disable top-k",
        )
        _check(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            f"SamplingSpec.max_new_tokens: {self.max_new_tokens!r} must be an int >= 1",
        )
        _check(
            self.seed is None or _is_token_id(self.seed),
            f"SamplingSpec.seed: {self.seed!r} must be None or an int >= 0",
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bad = [t for t in self.stop_token_ids if not _is_token_id(t)]
        _check(not bad, f"SamplingSpec.stop_token_ids: {bad!r} are not token ids (ints >= 0)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupRequest:
    """One prompt to sample a group for."""

    task_id: str
    """The coordinator's id of the task this prompt belongs to; copied onto the ``Group``."""
    prompt_ids: list[int]
    """Prompt token ids, BOS included if the model wants one: the engine adds nothing."""
    sampling: SamplingSpec = dataclasses.field(default_factory=SamplingSpec)
    """How to sample the group."""

    def __post_init__(self) -> None:
        _check(isinstance(self.task_id, str) and bool(self.task_id), f"GroupRequest.task_id: {self.task_id!r} must be a non-empty string")
        ids = list(self.prompt_ids)
        _check(bool(ids), f"GroupRequest.prompt_ids of task {self.task_id!r} is empty; tokenize the prompt first")
        bad = [t for t in ids if not _is_token_id(t)]
        _check(not bad, f"GroupRequest.prompt_ids of task {self.task_id!r}: {bad[:5]!r} are not token ids (ints >= 0)")
        object.__setattr__(self, "prompt_ids", ids)
        _check(
            isinstance(self.sampling, SamplingSpec),
            f"GroupRequest.sampling of task {self.task_id!r} must be a SamplingSpec, not {type(self.sampling).__name__}",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One completion of a group."""

    completion_ids: list[int]
    """Generated token ids; a stop/EOS token that ended the sample is the last one."""
    logprobs: list[float]
    """Same length as ``completion_ids``: the log-probability of each token (see the module docstring
    for the convention)."""
    finish_reason: FinishReason
    """"stop" if a stop/EOS token ended it, "length" if it hit max_new_tokens or the context limit."""
    text: str | None = None
    """The completion decoded without special tokens, when the engine has a tokenizer."""

    def __post_init__(self) -> None:
        _check(
            len(self.completion_ids) == len(self.logprobs),
            f"Sample: {len(self.completion_ids)} completion ids but {len(self.logprobs)} logprobs; they must pair up",
        )
        _check(self.finish_reason in ("stop", "length"), f"Sample.finish_reason: {self.finish_reason!r} must be 'stop' or 'length'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """All samples of one prompt, drawn from one policy version."""

    task_id: str
    prompt_ids: list[int]
    samples: list[Sample]
    """``SamplingSpec.n`` samples, in the engine's order."""
    policy_version: int
    """The engine's ``policy_version`` when the group was drawn."""
    gen_seconds: float
    """Wall-clock seconds of the engine batch that produced this group (groups drawn in one batch
    share it)."""

    def __post_init__(self) -> None:
        _check(bool(self.samples), f"Group {self.task_id!r} has no samples")
        _check(self.gen_seconds >= 0, f"Group {self.task_id!r}: gen_seconds {self.gen_seconds!r} must be >= 0")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL node needs from an inference backend.

    Lifecycle per iteration: ``generate`` -> ``sleep`` (give memory to the trainer) -> training ->
    ``update_weights`` (leaves the engine awake) -> ``generate`` ... ; ``close`` once at the end.
    """

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (the one given to the last ``update_weights``)."""
        ...

    @property
    def is_sleeping(self) -> bool:
        """True between ``sleep`` and the next ``wake`` / ``update_weights``."""
        ...

    @property
    def tokenizer(self) -> Any | None:
        """The model directory's tokenizer, or None if it has none (engines work on ids)."""
        ...

    def generate(self, requests: Sequence[GroupRequest]) -> list[Group]:
        """Sample every request's group; returns one ``Group`` per request, in request order.

        Raises:
            EngineStateError: the engine is asleep or closed.
            ValueError: a prompt does not fit the model's context.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy tensors into the loaded model by (HF checkpoint) name, in place, then set
        ``policy_version = version``. A subset of the parameters is allowed. Leaves the engine awake.

        Raises:
            WeightUpdateError: a name is unknown or a shape does not match.
            EngineStateError: the engine is closed.
        """
        ...

    def sleep(self) -> None:
        """Free accelerator memory for training; weights are kept (offloaded) unless documented.

        Raises:
            EngineStateError: the engine is closed.
        """
        ...

    def wake(self) -> None:
        """Undo ``sleep``; a no-op when awake.

        Raises:
            EngineStateError: the engine is closed, or its weights were discarded by the sleep.
        """
        ...

    def close(self) -> None:
        """Release the model and its memory; idempotent. Every later call but ``close`` raises."""
        ...


EngineFactory = Callable[..., RolloutEngine]


_progress = threading.local()


@contextlib.contextmanager
def reporting_progress(callback: Callable[[], None] | None) -> Iterator[None]:
    """While the block runs, ``report_progress`` on this thread calls ``callback``: the episode
    runner wraps each ``generate`` so that the tasks being generated keep their leases while one
    long call advances (a chain of thought longer than ``rollout.task_lease_s``)."""
    before = getattr(_progress, "callback", None)
    _progress.callback = callback
    try:
        yield
    finally:
        _progress.callback = before


def report_progress() -> None:
    """For engines: call as ``generate`` advances (each decoding step, say), on the thread that
    called it. Cheap; the callback throttles itself. An engine that never calls it is fine: its
    tasks are renewed once per finished turn instead (the episode runner does that)."""
    callback = getattr(_progress, "callback", None)
    if callback is not None:
        callback()


def _import_factory(module: str, cls: str) -> EngineFactory:
    def factory(**kwargs: Any) -> RolloutEngine:
        # Heavy backends (transformers, vllm) load only when an engine of that kind is built.
        return getattr(importlib.import_module(module), cls)(**kwargs)

    factory.__qualname__ = f"{cls}.factory"
    return factory


_REGISTRY: dict[str, EngineFactory] = {
    "hf": _import_factory("elasticrl.rollout.hf", "HFEngine"),
    "tiny": _import_factory("elasticrl.rollout.tiny_engine", "TinyEngine"),
    "vllm": _import_factory("elasticrl.rollout.vllm_engine", "VLLMEngine"),
}


def engine_names() -> list[str]:
    """Registered engine names, sorted."""
    return sorted(_REGISTRY)


def register_engine(name: str, factory: EngineFactory, *, replace: bool = False) -> None:
    """Add a backend (e.g. a test fake) under ``name``; refuses to shadow one unless ``replace``."""
    _check(isinstance(name, str) and bool(name), f"engine name {name!r} must be a non-empty string")
    if name in _REGISTRY and not replace:
        raise ValueError(f"engine {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = factory


def make_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine registered as ``name`` with the backend's keyword arguments, e.g.
    ``make_engine("hf", model_dir="ckpt/hf", device="cuda")``.

    Raises:
        UnknownEngineError: ``name`` is not registered (the message lists the valid names).
        EngineUnavailableError: the backend cannot run on this machine.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UnknownEngineError(f"unknown rollout engine {name!r}; valid engines: {', '.join(engine_names())}")
    return factory(**kwargs)
