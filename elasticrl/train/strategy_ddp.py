"""The default strategy: ``DistributedDataParallel``, every rank holding the full model and
optimizer state (gloo on CPU, NCCL on GPU with ``device_ids=[local_rank]``).

bf16 is ``torch.autocast`` around the forward (weights, gradients and optimizer state stay fp32).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticrl.train.dist import final_barrier
from elasticrl.train.strategy import OptimizerFactory, StrategyConfig
from elasticrl.train.strategy_base import (
    check_state_keys,
    clip_and_step,
    cpu_state_dict,
    load_optimizer_copy,
    load_replicated_state,
    prepare_model,
    replicated_state,
)

log = logging.getLogger(__name__)

# torch >= 2.13 names it forward_sync_buffers (and deprecates broadcast_buffers); both still sync at init.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


class DDPStrategy:
    state_replicated = True  # every rank holds the whole state

    def __init__(self, config: StrategyConfig):
        self.config = config
        self.optimizer: torch.optim.Optimizer | None = None
        self._model: nn.Module | None = None
        self._ddp: DistributedDataParallel | None = None
        self._device = torch.device("cpu")

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self._device = prepare_model(model, self.config)
        self._model = model
        self._ddp = self._wrap_ddp()
        self.optimizer = optimizer_factory(model.parameters())
        log.info("rank %d: ddp on %s, bf16=%s", dist.get_rank(), self._device, self.config.bf16)

    def regroup(self) -> None:
        """DDP again over the current default group (the world re-formed in place): the same module
        and optimizer, whose state the caller then loads from a snapshot. The gradients a failed
        backward left go first, or the next backward would add to them; and the old DDP's autograd
        hooks come off the parameters (it may live on in a traceback; its reducer stays idle unless
        its own forward runs, but nothing of it should remain on the parameters)."""
        if self._ddp is not None:
            self._ddp._remove_autograd_hooks()
        self.optimizer.zero_grad(set_to_none=True)
        self._ddp = self._wrap_ddp()

    def _wrap_ddp(self) -> DistributedDataParallel:
        # broadcast_buffers=False: a policy's buffers (rotary tables) are computed alike on every
        # rank and never trained; broadcasting them before each forward would be a blocking
        # collective that in-place re-forming (train/reform.py) could not abandon.
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        return DistributedDataParallel(self._model, device_ids=device_ids, **_NO_FORWARD_BUFFER_SYNC)

    @property
    def module(self) -> nn.Module:
        assert self._ddp is not None, "call wrap() first"
        return self._ddp

    @property
    def device(self) -> torch.device:
        return self._device

    def unwrap(self) -> nn.Module:
        assert self._model is not None, "call wrap() first"
        return self._model

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.config.bf16:
            return torch.autocast(device_type=self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        norm = clip_and_step(list(self.unwrap().parameters()), self.optimizer, self.config.grad_clip_norm)
        return {"grad_norm": norm}

    def full_model_state_dict(self, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for name, t in self.unwrap().state_dict().items()}

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.unwrap().state_dict().items():  # every rank holds them all
            yield name, t.detach()

    def load_full_model_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        model = self.unwrap()
        check_state_keys(model.state_dict().keys(), state.keys())
        model.load_state_dict(dict(state))

    def full_optimizer_state_dict(self, *, all_ranks: bool = False) -> dict[str, Any]:
        return cpu_state_dict(self.optimizer.state_dict())

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(load_optimizer_copy(state))

    def sharded_state(self):
        # Every rank holds the whole state: views of it, each tensor saved by one rank.
        return replicated_state(self.unwrap().state_dict(), self.optimizer.state_dict())

    def load_sharded_state(self, read, saved, rest) -> None:
        load_replicated_state(self, read, saved, rest)

    def close(self) -> None:
        if dist.is_initialized():
            final_barrier()
