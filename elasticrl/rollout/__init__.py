"""Rollout engines: the part of an RL node that samples GRPO groups from the current policy.

An engine turns ``GroupRequest``s (a prompt as token ids plus how to sample it) into ``Group``s of
completions with the per-token log-probabilities the loss needs, takes new weights in place after
every policy update (no restart between iterations), and can sleep to give its accelerator memory
to the trainer. Backends sit behind the ``RolloutEngine`` protocol and a string registry:
``make_engine("hf", ...)`` (transformers, CPU or GPU, the embedded default) and
``make_engine("vllm", ...)`` (GPU). Importing this package imports neither torch, transformers nor
vllm; each factory imports its backend when called.
"""

from __future__ import annotations

from elasticrl.rollout.engine import (
    EngineError,
    EngineStateError,
    EngineUnavailableError,
    Group,
    GroupRequest,
    RolloutEngine,
    Sample,
    SamplingSpec,
    UnknownEngineError,
    WeightUpdateError,
    engine_names,
    make_engine,
    register_engine,
)

__all__ = [
    "EngineError",
    "EngineStateError",
    "EngineUnavailableError",
    "Group",
    "GroupRequest",
    "RolloutEngine",
    "Sample",
    "SamplingSpec",
    "UnknownEngineError",
    "WeightUpdateError",
    "engine_names",
    "make_engine",
    "register_engine",
]
