"""FSDP2: torch's ``fully_shard`` on each transformer block, then on the root, over a 1-D mesh of
all ranks. Parameters, gradients and optimizer state are DTensor shards (``Shard(0)``); a block's
full weights exist only during its forward and backward.

Runs on CPU with gloo as well as on GPU with NCCL. bf16 is ``MixedPrecisionPolicy`` (bf16 compute,
fp32 gradient reduction and master weights). Full state dicts go through
``torch.distributed.checkpoint.state_dict`` for the model and ``DTensor.full_tensor`` /
``distribute_tensor`` for the optimizer, whose state keeps torch's index numbering.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from elasticrl.train.dist import final_barrier
from elasticrl.train.strategy import OptimizerFactory, StrategyConfig
from elasticrl.train.strategy_base import (
    check_state_keys,
    clip_and_step,
    json_safe,
    load_optimizer_copy,
    optimizer_from_parts,
    optimizer_params,
    optimizer_views,
    owned_cpu_tensors,
    prepare_model,
    transformer_blocks,
)

log = logging.getLogger(__name__)


class FSDP2Strategy:
    def __init__(self, config: StrategyConfig):
        self.config = config
        self.optimizer: torch.optim.Optimizer | None = None
        self._model: nn.Module | None = None
        self._device = torch.device("cpu")

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self._device = prepare_model(model, self.config)
        mesh = init_device_mesh(self._device.type, (dist.get_world_size(),))
        if self.config.bf16:
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            mp_policy = MixedPrecisionPolicy()
        blocks = transformer_blocks(model)  # after checkpoint wrapping: the wrappers are sharded
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        self._model = model
        self.optimizer = optimizer_factory(model.parameters())
        log.info("rank %d: fsdp2 on %s, %d blocks sharded, bf16=%s", dist.get_rank(), self._device, len(blocks), self.config.bf16)

    @property
    def module(self) -> nn.Module:
        assert self._model is not None, "call wrap() first"
        return self._model

    @property
    def device(self) -> torch.device:
        return self._device

    def unwrap(self) -> nn.Module:
        return self.module

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts inside the sharded modules

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        norm = clip_and_step(list(self.module.parameters()), self.optimizer, self.config.grad_clip_norm)
        return {"grad_norm": norm}

    def full_model_state_dict(self, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        # cpu_offload=True gathers onto rank 0 only (others get {}); without it every rank gets all.
        options = StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks)
        state = get_model_state_dict(self.module, options=options)
        # One CPU rank: the full tensors are the parameters' own storage; tied weights: one tensor.
        live = [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]
        return owned_cpu_tensors(state, live)

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # The sharded state dict: the same names as the full one (wrapper prefixes removed), each
        # DTensor still a shard, all-gathered one at a time on the training device.
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=False))
        for name, value in state.items():
            yield name, (value.full_tensor() if isinstance(value, DTensor) else value).detach()

    def load_full_model_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        check_state_keys(self.module.state_dict().keys(), state.keys())
        set_model_state_dict(self.module, dict(state), options=StateDictOptions(full_state_dict=True))

    def full_optimizer_state_dict(self, *, all_ranks: bool = False) -> dict[str, Any]:
        # full_tensor() all-gathers, so every rank walks the same (index-sorted) slots in order.
        saved = self.optimizer.state_dict()
        state = {}
        for index in sorted(saved["state"]):
            slots = {}
            for name, value in saved["state"][index].items():
                if isinstance(value, DTensor):
                    value = value.full_tensor()
                slots[name] = value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            state[index] = slots
        groups = [{k: json_safe(v) if k != "params" else list(v) for k, v in g.items()} for g in saved["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        loaded = load_optimizer_copy(state)
        params = optimizer_params(self.optimizer)
        for index, slots in loaded["state"].items():
            param = params[index]
            if not isinstance(param, DTensor):
                continue
            for name, value in slots.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    # Every rank holds the full value, so each keeps its own shard: no communication.
                    full = value.to(device=param.device, dtype=param.dtype)
                    slots[name] = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        self.optimizer.load_state_dict(loaded)

    # -- snapshots: DTensor shards as they are ----------------------------------------------------

    state_replicated = False  # DTensor shards

    def sharded_state(self):
        from elasticrl.train.shards import Chunk

        def chunk(t: torch.Tensor) -> Chunk:
            return Chunk.of_dtensor(t) if isinstance(t, DTensor) else Chunk.whole(t.detach(), replicated=True)

        chunks = {f"model.{name}": chunk(t) for name, t in get_model_state_dict(self.module).items()}
        opt_tensors, rest = optimizer_views(self.optimizer.state_dict())
        chunks.update({f"optim.{key}": chunk(t) for key, t in opt_tensors.items()})  # step counts: replicated
        return chunks, {"optimizer": rest}

    def load_sharded_state(self, read, saved, rest) -> None:
        from elasticrl.train.shards import Chunk, ShardError

        def like(template: torch.Tensor, shape, dtype) -> Chunk:
            """A destination for ``template``'s part in this world: its local shard, or whole."""
            if isinstance(template, DTensor) and tuple(shape) == tuple(template.shape):
                c = Chunk.of_dtensor(template)
                return Chunk(torch.empty_like(c.tensor, dtype=dtype), c.offsets, c.size)
            return Chunk.whole(torch.empty(shape, dtype=dtype, device=self._device))

        model = get_model_state_dict(self.module)
        params = optimizer_params(self.optimizer)
        dest: dict[str, Chunk] = {}
        for name, t in model.items():
            if f"model.{name}" not in saved:
                raise ShardError(f"the snapshot has no model tensor {name!r}")
            dest[f"model.{name}"] = like(t, *saved[f"model.{name}"])
        for key, (shape, dtype) in saved.items():
            if key.startswith("optim."):
                index = int(key.split(".")[1])
                dest[key] = like(params[index], shape, dtype)
        read(dest)

        def value(template, c: Chunk):
            if isinstance(template, DTensor) and tuple(c.size) == tuple(template.shape):
                return DTensor.from_local(c.tensor, template.device_mesh, template.placements,
                                          shape=template.shape, stride=template.stride(), run_check=False)
            return c.tensor

        set_model_state_dict(self.module, {name: value(t, dest[f"model.{name}"]) for name, t in model.items()})
        opt = {k.removeprefix("optim."): value(params[int(k.split(".")[1])], c) for k, c in dest.items() if k.startswith("optim.")}
        self.optimizer.load_state_dict(load_optimizer_copy(optimizer_from_parts(opt, rest["optimizer"])))

    def close(self) -> None:
        # Destroying the process group while a peer still finishes FSDP2's last collectives aborts
        # the process ("terminate called without an active exception"); meet first.
        if dist.is_initialized():
            final_barrier()
