"""Training strategies: how a policy's forward/backward/optimizer step is spread over the ranks.

A ``TrainStrategy`` wraps a bare ``nn.Module`` and an optimizer for the current torch.distributed
world and hides which data-parallel scheme runs underneath: ``ddp`` (DistributedDataParallel, the
default; gloo on CPU, NCCL on GPU), ``deepspeed`` (ZeRO stage 2 or 3; the ``[deepspeed]`` extra)
or ``fsdp2`` (torch's ``fully_shard``). Every strategy averages gradients over the ranks the same
way, so a run's loss trajectory does not depend on the choice beyond float rounding.

Checkpoints stay strategy-neutral: ``full_model_state_dict`` gives plain ``state_dict`` names and
full tensors, and ``full_optimizer_state_dict`` gives a torch-style optimizer ``state_dict`` keyed
by parameter index (the order of ``unwrap().parameters()``), exactly what
``elasticrl.train.checkpoint.save_checkpoint`` writes for DDP today. A checkpoint saved under one
strategy therefore resumes under another and at another world size. Snapshots, taken every
iteration, avoid that gather: ``sharded_state`` gives what this rank holds (a DTensor shard, a
slice of a ZeRO partition), and ``load_sharded_state`` reads it back into a world of another size
through ``torch.distributed.checkpoint``.

This module imports no torch: ``StrategyConfig`` can live in a config file that must answer
``--help`` at once. The backends (``strategy_ddp``, ``strategy_deepspeed``, ``strategy_fsdp2``)
are imported by ``make_strategy`` only when chosen.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

# The module, not the name: elasticrl.config may import StrategyConfig from here as a section.
from elasticrl import config as _config

if TYPE_CHECKING:
    import torch
    from torch import nn

    from elasticrl.train.shards import Chunk

OptimizerFactory = Callable[[Iterable["torch.nn.Parameter"]], "torch.optim.Optimizer"]
"""Builds the optimizer from the parameters ``wrap`` hands it (see ``adamw_factory``)."""

# name -> "module:class"; the module is imported only when its strategy is made.
_BACKENDS: dict[str, str] = {
    "ddp": "elasticrl.train.strategy_ddp:DDPStrategy",
    "deepspeed": "elasticrl.train.strategy_deepspeed:DeepSpeedStrategy",
    "fsdp2": "elasticrl.train.strategy_fsdp2:FSDP2Strategy",
}
STRATEGY_NAMES: tuple[str, ...] = tuple(_BACKENDS)
ZERO_STAGES = (2, 3)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise _config.ConfigError(message)


@dataclasses.dataclass(kw_only=True)
class StrategyConfig:
    """Which data-parallel scheme trains the policy, and its precision and memory options."""

    name: str = "ddp"
    """ddp: DistributedDataParallel (gloo on CPU, NCCL on GPU); deepspeed: ZeRO (needs
    ``pip install 'elasticrl[deepspeed]'``); fsdp2: torch ``fully_shard`` per transformer block."""
    zero_stage: int = 2
    """deepspeed only: 2 shards optimizer state and gradients, 3 shards the parameters as well."""
    bf16: bool = False
    """bf16 compute on GPU (autocast under ddp, mixed precision under deepspeed and fsdp2; master
    weights and optimizer state stay fp32). CPU (gloo) runs refuse it: they train in fp32."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations during backward instead of keeping them:
    less memory, about a third more compute. Uses the model's ``gradient_checkpointing_enable()``
    if it has one, else wraps the blocks of its largest ``nn.ModuleList``."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this before each step; 0 disables clipping (the norm is
    still reported)."""
    deepspeed_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """deepspeed only: extra DeepSpeed config keys merged (nested tables too) over the ones
    elasticrl sets, e.g. ``{zero_optimization = {stage3_param_persistence_threshold = 0}}``."""

    def __post_init__(self) -> None:
        _check(
            self.name in _BACKENDS,
            f"strategy.name: {self.name!r} is not a training strategy; choose one of {', '.join(STRATEGY_NAMES)}",
        )
        _check(self.zero_stage in ZERO_STAGES, f"strategy.zero_stage: {self.zero_stage} must be 2 or 3")
        _check(self.grad_clip_norm >= 0, f"strategy.grad_clip_norm: {self.grad_clip_norm} must be >= 0 (0 disables)")
        _check(
            isinstance(self.deepspeed_config, Mapping),
            f"strategy.deepspeed_config: {self.deepspeed_config!r} must be a table of DeepSpeed config keys",
        )


class TrainStrategy(Protocol):
    """One rank's view of a data-parallel training scheme.

    Call order: ``wrap`` once, after ``torch.distributed`` is initialized (and, on GPU,
    ``torch.cuda.set_device(local_rank)``); then per optimizer step any number of
    ``forward -> backward`` micro-batches (all but the last inside ``no_sync()``), then ``step()``.
    Methods marked *collective* must be called by every rank in the same order.
    """

    config: StrategyConfig
    state_replicated: bool
    """``sharded_state`` gives every rank the same replicated state (ddp): a snapshot's buddy
    copies are then cut locally. The same on every rank, whatever its share."""

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        """Move ``model`` to this rank's device, apply gradient checkpointing, shard or replicate
        it, and build its optimizer with ``optimizer_factory(parameters)``. Every rank must pass
        the same initial weights. *Collective.*

        Raises:
            ConfigError: an option this device or model cannot honour (bf16 on CPU, gradient
                checkpointing on a model without blocks, a missing optional dependency).
        """
        ...

    @property
    def module(self) -> nn.Module:
        """What to call forward on (the DDP wrapper, the DeepSpeed engine, the sharded model)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where inputs must live: this rank's GPU under NCCL, the CPU under gloo."""
        ...

    def unwrap(self) -> nn.Module:
        """The bare model (under fsdp2 and ZeRO-3 its parameters are shards, not full tensors)."""
        ...

    def autocast(self) -> AbstractContextManager[None]:
        """Wrap each forward in this: bf16 autocast where the strategy needs it, else a no-op."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Forward and backward inside accumulate gradients without synchronizing them; the next
        backward outside it synchronizes the sum. A no-op where the backend reduces every backward
        (ZeRO-2/3 partition gradients as they are produced)."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` as given: the strategy never rescales it (callers that accumulate
        micro-batches weight their losses; gradients are averaged over ranks as DDP does)."""
        ...

    def step(self) -> dict[str, float]:
        """Clip, optimizer step, zero the gradients; returns ``{"grad_norm": <global norm before
        clipping>}``. *Collective.*"""
        ...

    def full_model_state_dict(self, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights under plain ``state_dict`` names, as CPU tensors: complete on rank 0,
        and on every rank when ``all_ranks``; other ranks may get ``{}``. *Collective.*"""
        ...

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights one tensor at a time, on every rank, under the names of
        ``full_model_state_dict`` and in the same order on every rank: what a rank pushes into its
        rollout engine. Each tensor is gathered when it is asked for, stays on the training
        device, and may be the live parameter or a buffer the next one reuses: copy what must
        outlive the next step. The peak is one full tensor, not the model. *Collective*: every rank
        consumes the whole iterator (``push_full_tensors`` drains it when the consumer fails)."""
        ...

    def load_full_model_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load full weights; every rank passes the same complete dict. *Collective.*

        Raises:
            KeyError: ``state`` lacks names the model has, or has names it lacks.
        """
        ...

    def full_optimizer_state_dict(self, *, all_ranks: bool = False) -> dict[str, Any]:
        """The optimizer's full state in ``torch.optim.Optimizer.state_dict()`` layout (``state``
        keyed by parameter index, CPU tensors; ``param_groups`` JSON-able), ready for
        ``checkpoint.save_checkpoint``. Complete on rank 0, and on every rank when ``all_ranks``.
        *Collective.*"""
        ...

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state in the layout ``full_optimizer_state_dict`` returns (for instance
        ``checkpoint.Checkpoint.optimizer``); every rank passes the same dict. *Collective.*"""
        ...

    def sharded_state(self) -> tuple[dict[str, Chunk], dict[str, Any]]:
        """This rank's part of the training state, for a snapshot (``train/snapshot.py``): named
        ``shards.Chunk``s, views the caller copies (``replicated`` ones are whole tensors every rank
        holds alike, saved by one of them), and the JSON-able rest (optimizer hyper-parameters,
        step counts). No communication for the sharded state (fsdp2: DTensor shards; ZeRO: each
        parameter's slice of this rank's partition; ddp: views of the replicated state); ZeRO-3
        gathers frozen parameters, which no optimizer partition holds (*collective* there)."""
        ...

    def load_sharded_state(
        self, read: Callable[[dict[str, Chunk]], None], saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        rest: Mapping[str, Any],
    ) -> None:
        """Load what ``sharded_state`` gave, saved by a world of any size and strategy settings
        alike: build this rank's destination chunks for the current world, let ``read(chunks)``
        fill them (DCP reads the parts of every saved shard they overlap), then apply them.
        ``saved``: name -> (whole shape, dtype) of every tensor in the snapshot; ``rest``: the
        saved JSON part. *Collective* where ``sharded_state`` is.

        Raises:
            ShardError: the snapshot lacks a tensor this model needs, or has another shape.
        """
        ...

    def close(self) -> None:
        """Wait for the other ranks and release the backend's resources; call before
        ``destroy_process_group``. *Collective.*"""
        ...


def make_strategy(config: StrategyConfig | str = "ddp", **options: Any) -> TrainStrategy:
    """A strategy from its config, or from a name plus ``StrategyConfig`` fields as keywords.

    >>> make_strategy("deepspeed", zero_stage=3, grad_clip_norm=1.0)  # doctest: +SKIP

    Raises:
        ConfigError: unknown name or option, a bad value, or the backend's package is missing.
    """
    if isinstance(config, str):
        fields = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}
        unknown = sorted(set(options) - fields)
        _check(not unknown, f"make_strategy: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
        config = StrategyConfig(name=config, **options)
    else:
        _check(not options, "make_strategy: pass options either in the StrategyConfig or as keywords, not both")
        config.__post_init__()  # a config edited after it was built is checked again
    module_name, class_name = _BACKENDS[config.name].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)(config)


def adamw_factory(*, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> OptimizerFactory:
    """An ``optimizer_factory`` for ``wrap``: AdamW over all parameters, one group (what the
    trainer uses today)."""

    def build(params):
        import torch

        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    return build
