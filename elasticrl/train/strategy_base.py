"""Pieces the training strategies share: the rank's device, the bf16 and gradient-checkpointing
options, transformer-block discovery, global-norm clipping, and optimizer ``state_dict`` copies.

Imported only by the strategy backends (it imports torch); see ``elasticrl.train.strategy``.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticrl.config import ConfigError
from elasticrl.train.strategy import StrategyConfig

log = logging.getLogger(__name__)


def strategy_device() -> torch.device:
    """This rank's training device: its GPU under NCCL (``torch.cuda.set_device`` already called),
    the CPU under any other backend."""
    assert dist.is_initialized(), "initialize torch.distributed (elasticrl.train.dist.init_process_group) before wrap()"
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_precision(config: StrategyConfig, device: torch.device) -> None:
    """bf16 is a GPU option: on the CPU it would be slow and is not what the tests compare."""
    if config.bf16 and device.type != "cuda":
        raise ConfigError(
            f"strategy.bf16: true needs a GPU (train.backend=nccl), but this rank trains on {device} "
            f"(backend {dist.get_backend() if dist.is_initialized() else 'none'}), which runs fp32 only; "
            "set strategy.bf16=false"
        )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of the model's largest ``nn.ModuleList`` (by parameters) whose entries all share
    one class: the repeated blocks to shard (fsdp2) or checkpoint. ``[]`` if there is none."""
    best: list[nn.Module] = []
    best_numel = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            numel = sum(p.numel() for p in module.parameters())
            if numel > best_numel:
                best, best_numel = list(module), numel
    return best


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """The model's own ``gradient_checkpointing_enable()`` (Hugging Face models), else a
    non-reentrant checkpoint wrapper around each of ``transformer_blocks(model)``.

    The wrapper's ``_checkpoint_wrapped_module.`` prefix appears in ``named_parameters()`` but not
    in ``state_dict()`` (torch strips it), so checkpoints keep their names.
    """
    if hasattr(model, "gradient_checkpointing_enable"):
        try:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        except TypeError:  # an older signature without kwargs
            model.gradient_checkpointing_enable()
        return
    blocks = transformer_blocks(model)
    if not blocks:
        raise ConfigError(
            f"strategy.gradient_checkpointing: {type(model).__name__} has no gradient_checkpointing_enable() and no "
            "nn.ModuleList of blocks to wrap; set strategy.gradient_checkpointing=false"
        )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    targets = {id(block) for block in blocks}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in targets,
    )
    log.info("gradient checkpointing: %d %s blocks wrapped", len(blocks), type(blocks[0]).__name__)


def prepare_model(model: nn.Module, config: StrategyConfig) -> torch.device:
    """Checks shared by every strategy, then the model on this rank's device (checkpointed if
    asked); returns the device."""
    device = strategy_device()
    check_precision(config, device)
    model.to(device)
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return device


def clip_and_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clip the global gradient norm (0: only measure it), step, zero the gradients; returns the
    norm before clipping. Works for DTensor (fsdp2) parameters too: the norm is reduced over shards."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    if hasattr(norm, "full_tensor"):  # a DTensor: every rank gets the same replicated value
        norm = norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Parameters in ``state_dict()`` numbering: group by group, in each group's order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def json_safe(value: Any) -> Any:
    """A hyper-parameter as JSON can hold it: a tensor (a tensor lr) becomes its number."""
    return value.item() if isinstance(value, torch.Tensor) else value


def owned_cpu_tensors(state: Mapping[str, torch.Tensor], live: Iterable[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
    """``state`` on the CPU, each tensor its own memory: one that shares storage with an earlier
    entry (tied weights: safetensors refuses aliases) or with a ``live`` tensor (a parameter the
    next step changes) is copied; the rest are moved, or kept when already on the CPU."""
    seen = {t.untyped_storage().data_ptr() for t in live}
    out = {}
    for name, t in state.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.to("cpu", copy=True) if ptr in seen else t.cpu()
        seen.add(out[name].untyped_storage().data_ptr())
    return out


def cpu_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of an optimizer ``state_dict`` with every tensor detached on the CPU."""
    return {
        "state": {
            index: {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in slots.items()}
            for index, slots in state["state"].items()
        },
        "param_groups": [{k: json_safe(v) if k != "params" else list(v) for k, v in group.items()} for group in state["param_groups"]],
    }


def load_optimizer_copy(state: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow-enough copy for ``Optimizer.load_state_dict`` (which keeps references to what it is
    given), with integer parameter indices even if the dict went through JSON."""
    return {
        "state": {int(index): dict(slots) for index, slots in state["state"].items()},
        "param_groups": copy.deepcopy(list(state["param_groups"])),
    }


def check_state_keys(expected: Iterable[str], given: Iterable[str], what: str = "model state") -> None:
    """``KeyError`` naming the missing and unexpected names, as a strict ``load_state_dict`` would."""
    expected, given = set(expected), set(given)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise KeyError(f"{what} does not fit the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                       f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def common_step(states: Iterable[Mapping[str, Any]]) -> torch.Tensor | None:
    """The one ``step`` count shared by every parameter's optimizer state (None if there is no
    state). Sharded optimizers keep one count per flat partition, so they need it to be common."""
    steps = {float(s["step"]) for s in states if "step" in s}
    if not steps:
        return None
    if len(steps) != 1:
        raise ValueError(f"optimizer state has different step counts per parameter {sorted(steps)}; this strategy keeps one count")
    return torch.tensor(steps.pop(), dtype=torch.float32)


# -- snapshot state (see TrainStrategy.sharded_state) ------------------------------------------


def optimizer_views(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer ``state_dict`` split like ``checkpoint.flatten_optimizer`` ("<index>.<name>"
    tensors, JSON-able rest) but without copies: the tensors as the optimizer holds them."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, slots in state["state"].items():
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{index}.{name}"] = value.detach()
            else:
                scalars[f"{index}.{name}"] = value
    groups = [{k: json_safe(v) if k != "params" else list(v) for k, v in g.items()} for g in state["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_parts(tensors: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer ``state_dict`` of ``optimizer_views``'s parts (values may be DTensors)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *rest["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in rest["param_groups"]]
    return {"state": state, "param_groups": groups}


def replicated_state(model: Mapping[str, torch.Tensor], optimizer: Mapping[str, Any]):
    """``sharded_state`` of a strategy whose every rank holds the whole state (ddp, or a gathered
    full state): every tensor is replicated, so each is saved by one rank."""
    from elasticrl.train.shards import Chunk

    opt_tensors, rest = optimizer_views(optimizer)
    chunks = {f"model.{name}": Chunk.whole(t.detach(), replicated=True) for name, t in model.items()}
    chunks.update({f"optim.{key}": Chunk.whole(t, replicated=True) for key, t in opt_tensors.items()})
    return chunks, {"optimizer": rest}


def load_replicated_state(strategy, read, saved: Mapping[str, tuple], rest: Mapping[str, Any]) -> None:
    """``load_sharded_state`` through the full state: read every model and optimizer tensor whole
    (from whichever shards hold them), then the strategy's ``load_full_*``."""
    from elasticrl.train.shards import Chunk, ShardError

    if any(name.startswith("zero.") for name in saved):
        raise ShardError("the snapshot holds DeepSpeed ZeRO partitions, which only a ZeRO run loads (the resume falls "
                         "back to the newest checkpoint, if there is one)")
    dest = {name: Chunk.whole(torch.empty(shape, dtype=dtype)) for name, (shape, dtype) in saved.items()
            if name.startswith(("model.", "optim."))}
    read(dest)
    strategy.load_full_model_state_dict({n.removeprefix("model."): c.tensor for n, c in dest.items() if n.startswith("model.")})
    opt = {n.removeprefix("optim."): c.tensor for n, c in dest.items() if n.startswith("optim.")}
    strategy.load_full_optimizer_state_dict(optimizer_from_parts(opt, rest["optimizer"]))
