"""DeepSpeed ZeRO stage 2 (optimizer state and gradients sharded) or 3 (parameters too) on the
existing torch.distributed process group; needs the ``[deepspeed]`` extra.

The caller's torch optimizer (AdamW from ``adamw_factory``) becomes ZeRO's base optimizer over
flat fp32 partitions; ``managed_gradient_accumulation=false`` makes ``step()`` the accumulation
boundary, so micro-batching works as under DDP: several ``backward`` calls, one ``step``. The
engine averages gradients over ranks and clips the global norm exactly as DDP + ``clip_grad_norm_``
do. On CPU DeepSpeed uses its CPU accelerator and gloo; its first use on a machine JIT-compiles
a small shared-memory all-reduce op (``deepspeed_shm_comm``, about 40 s on two cores, then cached
under ``~/.cache/torch_extensions``).

Full state goes through DeepSpeed's public fragment API (``safe_get_full_fp32_param``,
``safe_get/set_full_optimizer_state``), so checkpoints hold full fp32 tensors in torch's
layout and resume under any strategy or world size. Sharded optimizers keep one ``step`` count
per flat partition, so a loaded state must have one common step (true for AdamW on a model whose
every trainable parameter gets a gradient each step).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elasticrl.config import ConfigError
from elasticrl.train.build_lock import BuildLockWatch
from elasticrl.train.dist import final_barrier
from elasticrl.train.strategy import OptimizerFactory, StrategyConfig
from elasticrl.train.strategy_base import check_state_keys, common_step, json_safe, optimizer_params, owned_cpu_tensors, prepare_model

log = logging.getLogger(__name__)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(
            "strategy.name=deepspeed needs DeepSpeed: pip install 'elasticrl[deepspeed]' (or choose ddp or fsdp2)"
        ) from exc
    return deepspeed


def merge_config(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, nested dicts merged key by key."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_config(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def deepspeed_config(config: StrategyConfig) -> dict[str, Any]:
    """The DeepSpeed config elasticrl runs with (``config.deepspeed_config`` merged over it)."""
    base = {
        # Bookkeeping only: elasticrl feeds its own batches, DeepSpeed's data loader is unused.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": config.grad_clip_norm,
        "zero_optimization": {"stage": config.zero_stage},
        # A plain torch optimizer is fine under ZeRO, and on CPU it must not be swapped for
        # DeepSpeedCPUAdam (a compiled op).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": config.bf16},
        "wall_clock_breakdown": False,
    }
    return merge_config(base, config.deepspeed_config)


class DeepSpeedStrategy:
    def __init__(self, config: StrategyConfig):
        self.config = config
        self.engine = None  # deepspeed.DeepSpeedEngine after wrap()
        self._device = torch.device("cpu")
        self._params: list[nn.Parameter] = []  # state_dict() numbering of the optimizer
        self._group_sizes: list[int] = []

    # -- set-up ------------------------------------------------------------------------------

    def wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        with BuildLockWatch():  # DeepSpeed JIT-builds an op at first use, behind a lock a killed build leaves
            self._wrap(model, optimizer_factory)

    def _wrap(self, model: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        deepspeed = _import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        self._device = prepare_model(model, self.config)
        accelerator = get_accelerator().device_name()
        if accelerator != self._device.type:
            raise ConfigError(
                f"strategy.name=deepspeed: DeepSpeed chose its {accelerator!r} accelerator but this rank trains on "
                f"{self._device.type} (backend {dist.get_backend()}); set DS_ACCELERATOR={self._device.type}"
            )
        optimizer = optimizer_factory(model.parameters())
        # ZeRO converts these Parameter objects in place (flat views, or ZeRO-3 partitions), so
        # they stay the handles for the fragment API.
        self._params = optimizer_params(optimizer)
        self._group_sizes = [len(g["params"]) for g in optimizer.param_groups]
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(self.config), dist_init_required=False
        )
        log.info("rank %d: deepspeed ZeRO-%d on %s, bf16=%s", dist.get_rank(), self.config.zero_stage, self._device, self.config.bf16)

    @property
    def module(self) -> nn.Module:
        assert self.engine is not None, "call wrap() first"
        return self.engine

    @property
    def device(self) -> torch.device:
        return self._device

    def unwrap(self) -> nn.Module:
        return self.module.module

    # -- training ----------------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # bf16: the engine holds bf16 weights itself

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        # ZeRO-2/3 reduce-scatter each gradient as backward produces it (that is how they shard
        # it) and accumulate the shards, so there is nothing to defer: sums still come out right.
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> dict[str, float]:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float("nan") if norm is None else float(norm)}

    # -- full state --------------------------------------------------------------------------

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        # keep_vars: the Parameter objects themselves (ZeRO-3 ones are empty placeholders), under
        # state_dict names (tied weights appear under each name, checkpoint wrappers' prefixes not).
        return self.unwrap().state_dict(keep_vars=True)

    def full_model_state_dict(self, *, all_ranks: bool = False) -> dict[str, torch.Tensor]:
        full = {id(param): self._full_param(param).cpu().clone() for param in self._module_params()}
        # Tied weights: one gathered tensor, a copy of it per name (safetensors refuses aliases).
        return owned_cpu_tensors({
            name: full[id(t)] if id(t) in full else t.detach().cpu().clone() for name, t in self._named_tensors().items()
        })

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = {id(p) for p in self._module_params()}
        for name, t in self._named_tensors().items():  # a tied weight is gathered under each name
            yield name, self._full_param(t) if id(t) in params else t.detach()  # (a buffer: every rank holds it)

    def _full_param(self, param: nn.Parameter) -> torch.Tensor:
        """``param`` whole, in fp32, on its device. *Collective* (an all-reduce or all-gather)."""
        from deepspeed.utils import safe_get_full_fp32_param

        value = safe_get_full_fp32_param(param) if param.requires_grad else None
        if value is None:  # frozen: not in ZeRO's partitions
            value = self._gather_frozen(param)
        return value.detach().float()

    def _module_params(self) -> list[nn.Parameter]:
        """Every distinct parameter in ``named_parameters`` order: the same on every rank."""
        return list(self.unwrap().parameters())

    def _gather_frozen(self, param: nn.Parameter) -> torch.Tensor:
        if hasattr(param, "ds_id"):
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters([param]):
                return param.detach().clone()
        return param.detach()

    def load_full_model_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        from deepspeed.runtime.zero import GatheredParameters

        named = self._named_tensors()
        check_state_keys(named.keys(), state.keys())
        by_id = {id(t): (t, state[name]) for name, t in named.items()}  # tied weights: one entry
        params = [(t, v) for t, v in by_id.values() if isinstance(t, nn.Parameter)]
        buffers = [(t, v) for t, v in by_id.values() if not isinstance(t, nn.Parameter)]
        # The working (possibly bf16) weights: ZeRO-3 gathers them, rank 0's copy is scattered back.
        gathered = GatheredParameters([t for t, _ in params], modifier_rank=0) if self.config.zero_stage == 3 else contextlib.nullcontext()
        with torch.no_grad(), gathered:
            for tensor, value in params + buffers:
                tensor.data.copy_(value.to(tensor.device))
        # ...and ZeRO's fp32 master partitions, which the optimizer steps.
        for tensor, value in params:
            if tensor.requires_grad:
                self._set_full(tensor, value.to(device=self._device, dtype=torch.float32))

    def _set_full(self, param: nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """``value`` as ``param``'s whole fp32 master value, or its optimizer state ``key``."""
        from deepspeed.utils import (
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        if self.config.zero_stage != 3:
            if key is None:
                safe_set_full_fp32_param(param, value)
            else:
                safe_set_full_optimizer_state(param, value, key)
            return
        # ZeRO-3's full setter cuts the unpadded value at the padded partition's offset, past its
        # end on the last rank when the size does not divide by the world: this rank's slice of
        # the zero-padded value instead.
        start, n, part = self._z3_slice(param)
        local = torch.zeros(part, dtype=value.dtype, device=value.device)
        local[:n] = value.reshape(-1)[start:start + n]
        if key is None:
            safe_set_local_fp32_param(param, local)
        else:
            safe_set_local_optimizer_state(param, local, key)

    def _base_optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer  # the torch optimizer over flat fp32 partitions

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions, the tensors the base optimizer's state is keyed by.
        (ZeRO-3 puts them into the base optimizer's param_groups only while it steps.)"""
        zero = self.engine.optimizer
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
            flats = getattr(zero, attr, None)
            if flats is not None:
                return list(flats)
        raise NotImplementedError(f"{type(zero).__name__}: no flat fp32 partitions found (this DeepSpeed version is not supported)")

    def _hyper_params(self) -> list[dict[str, Any]]:
        base_groups = self._base_optimizer().param_groups
        assert len(base_groups) == len(self._group_sizes), f"ZeRO has {len(base_groups)} param groups, the optimizer had {len(self._group_sizes)}"
        return [{k: json_safe(v) for k, v in g.items() if k != "params"} for g in base_groups]

    def full_optimizer_state_dict(self, *, all_ranks: bool = False) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_optimizer_state

        base = self._base_optimizer()
        live = [base.state[flat] for flat in self._flat_partitions() if base.state.get(flat)]
        state: dict[int, dict[str, Any]] = {}
        if live:  # no state before the first step, as with a torch optimizer
            step = common_step(live)
            keys = [k for k, v in live[0].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            for index, param in enumerate(self._params):
                if not param.requires_grad:
                    continue
                slots: dict[str, Any] = {} if step is None else {"step": step.clone()}
                for key in keys:
                    slots[key] = safe_get_full_optimizer_state(param, key).detach().float().cpu().clone()  # collective
                state[index] = slots
        groups, start = [], 0
        for size, hyper in zip(self._group_sizes, self._hyper_params()):
            groups.append({**hyper, "params": list(range(start, start + size))})
            start += size
        return {"state": state, "param_groups": groups}

    def load_full_optimizer_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = {int(i): slots for i, slots in state["state"].items()}
        groups = list(state["param_groups"])
        if [len(g["params"]) for g in groups] != self._group_sizes:
            raise ValueError(
                f"optimizer state has groups of {[len(g['params']) for g in groups]} parameters, this optimizer {self._group_sizes}"
            )
        self._set_hyper_params(groups)
        if not saved:
            return
        step = common_step(saved.values())
        first = next(iter(saved.values()))
        keys = [k for k, v in first.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        self._ensure_optimizer_state(keys, step)
        for index, param in enumerate(self._params):
            if not param.requires_grad:
                continue
            if index not in saved:
                raise KeyError(f"optimizer state has no entry for parameter {index} of {len(self._params)}")
            for key in keys:
                value = saved[index][key].to(device=self._device, dtype=torch.float32)
                self._set_full(param, value, key)

    def _set_hyper_params(self, groups: list[dict[str, Any]]) -> None:
        """Each saved param group's hyper-parameters (lr, betas, ...) into ZeRO's base optimizer."""
        for base_group, saved_group in zip(self._base_optimizer().param_groups, groups):
            for key, value in saved_group.items():
                if key != "params" and key in base_group:
                    base_group[key] = tuple(value) if isinstance(value, list) else value

    def _ensure_optimizer_state(self, keys: list[str], step: torch.Tensor | None) -> None:
        """Before the first step the base optimizer has no state for its flat partitions: make it
        (zeros), set the common ``step``, and link ZeRO-1/2's per-parameter fragments to it, so
        that what is loaded next has somewhere to land."""
        base = self._base_optimizer()
        for flat in self._flat_partitions():
            slots = base.state[flat]
            for key in keys:
                if key not in slots:
                    slots[key] = torch.zeros_like(flat)
            if step is not None:
                slots["step"] = step.clone()
        zero = self.engine.optimizer
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2: link fragments to the state
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()

    # -- snapshots: each rank's slice of the ZeRO partitions -----------------------------------------

    def _fragment(self, param: nn.Parameter):
        """ZeRO-1/2's map of ``param`` to this rank's flat fp32 partition; None where this rank
        holds none of it."""
        return getattr(param, "_hp_mapping", None)

    state_replicated = False  # each rank its partition's slices, ZeRO-1/2 and 3 alike

    def _z3_slice(self, param: nn.Parameter) -> tuple[int, int, int]:
        """ZeRO-3: (offset, elements, partition size) of this rank's partition of ``param``
        flattened. Partitions are padded to equal sizes, so the last ranks' hold fewer elements, or
        none."""
        part = param.ds_tensor.numel()
        zero = param._z3_optimizer
        rank = zero._get_param_partition_rank(param) if hasattr(zero, "_get_param_partition_rank") else dist.get_rank()
        start = part * rank
        return start, max(0, min(part, param.ds_numel - start)), part

    def _local_state(self, live: list) -> Iterator[tuple[int, nn.Parameter, int, torch.Tensor, dict[str, torch.Tensor]]]:
        """For every trainable parameter this rank holds a slice of: (index, param, offset in the
        flattened parameter, the fp32 master slice, {optimizer key: its slice}), views of the live
        state. ZeRO-1/2 through each parameter's fragment map, ZeRO-3 through its local partition."""
        if self.config.zero_stage != 3:
            for index, param in enumerate(self._params):
                frag = self._fragment(param) if param.requires_grad else None
                if frag is not None:
                    optim = {key: state.detach() for key, state in (frag.optim_fragment or {}).items()} if live else {}
                    yield index, param, frag.lp_fragment_address.start, frag.hp_fragment.detach(), optim
            return
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        keys = [k for k, v in live[0].items() if isinstance(v, torch.Tensor) and v.dim() > 0] if live else []
        for index, param in enumerate(self._params):
            if not param.requires_grad:
                continue
            start, n, _ = self._z3_slice(param)
            if n:
                optim = {key: safe_get_local_optimizer_state(param, key).detach()[:n] for key in keys}
                yield index, param, start, safe_get_local_fp32_param(param).detach()[:n], optim

    def sharded_state(self):
        """For every trainable parameter, the slice of it (flattened) that this rank's partition
        holds, fp32 master weight and optimizer state alike, as a chunk at its offset in the
        flattened parameter (``zero.param.<index>``, ``zero.optim.<index>.<key>``): ZeRO-1/2's
        fragments, ZeRO-3's partition (nothing is gathered, so a snapshot costs each rank its own
        share only). A world of another size or stage cuts the same flattened tensors elsewhere
        and DCP reads across the cuts. Frozen parameters (gathered, under ZeRO-3) and buffers, the
        same on every rank, are whole replicated chunks."""
        from elasticrl.train.shards import Chunk

        base = self._base_optimizer()
        live = [base.state[flat] for flat in self._flat_partitions() if base.state.get(flat)]
        step = common_step(live) if live else None
        chunks: dict[str, Chunk] = {}
        trainable = {id(p) for p in self._params if p.requires_grad}
        for index, param, start, master, optim in self._local_state(live):
            numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
            chunks[f"zero.param.{index}"] = Chunk.flat(master, start, numel)
            for key, state in optim.items():  # no optimizer state before the first step, as with a torch optimizer
                chunks[f"zero.optim.{index}.{key}"] = Chunk.flat(state, start, numel)
        for name, t in self._named_tensors().items():
            if id(t) not in trainable:  # (collective under ZeRO-3: every rank, in state_dict order)
                chunks[f"model.{name}"] = Chunk.whole(self._gather_frozen(t).detach() if isinstance(t, nn.Parameter) else t.detach(),
                                                      replicated=True)
        rest = {"step": None if step is None else float(step), "param_groups": self._hyper_params()}
        return chunks, {"zero": rest}

    def load_sharded_state(self, read, saved, rest) -> None:
        from elasticrl.train.shards import Chunk, ShardError
        from elasticrl.train.strategy_base import load_replicated_state

        if "zero" not in rest:  # another strategy's replicated state (or an older ZeRO-3 snapshot): through the full state
            load_replicated_state(self, read, saved, rest)
            return
        zero = rest["zero"]
        keys = sorted({name.split(".")[3] for name in saved if name.startswith("zero.optim.")})
        if keys:  # somewhere for the optimizer slices to land
            self._ensure_optimizer_state(keys, None if zero["step"] is None else torch.tensor(zero["step"], dtype=torch.float32))
        if self.config.zero_stage == 3:
            self._load_z3_slices(read, saved, zero, keys)
            return
        named = self._named_tensors()
        index_of = {id(p): i for i, p in enumerate(self._params) if p.requires_grad}
        dest: dict[str, Chunk] = {}
        for name, t in named.items():
            key = f"zero.param.{index_of[id(t)]}" if id(t) in index_of else f"model.{name}"
            if key not in saved:
                raise ShardError(f"the snapshot has no {key} (for {name!r})")
            if key not in dest:  # tied weights: one tensor under two names
                dest[key] = Chunk.whole(torch.empty(saved[key][0], dtype=saved[key][1]))
        for index, param in enumerate(self._params):
            frag = self._fragment(param) if param.requires_grad else None
            if frag is None:
                continue
            for key in keys:
                dest[f"zero.optim.{index}.{key}"] = Chunk.flat(frag.optim_fragment[key], frag.lp_fragment_address.start, param.numel())
        read(dest)  # the optimizer slices land in the partitions' state directly
        full = {}
        for name, t in named.items():
            key = f"zero.param.{index_of[id(t)]}" if id(t) in index_of else f"model.{name}"
            full[name] = dest[key].tensor.reshape(t.shape) if key.startswith("zero.") else dest[key].tensor
        self.load_full_model_state_dict(full)  # the working weights, and each rank's fp32 slice (no communication)
        self._set_hyper_params(zero["param_groups"])

    def _load_z3_slices(self, read, saved, zero: dict[str, Any], keys: list[str]) -> None:
        """ZeRO-3's ``load_sharded_state`` (``keys``: the optimizer state's, already made): each
        rank reads only its partition of every trainable parameter (master weight and optimizer
        state, from whichever saved slices overlap it) straight into its live partition (no second
        copy, unless the optimizer is offloaded: DeepSpeed's getters then return device copies,
        set back after the read); its working copy (``ds_tensor``, possibly bf16) follows. Frozen
        parameters and buffers are read whole. As DeepSpeed's own ZeRO-3 load does, every
        parameter is partitioned first (one kept whole under ``stage3_param_persistence_threshold``
        would not be gathered again from its new partition) and the persistent ones are gathered
        at the end."""
        from deepspeed.runtime.zero import GatheredParameters
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_optimizer_state,
            safe_set_local_fp32_param,
            safe_set_local_optimizer_state,
        )

        from elasticrl.train.shards import Chunk, ShardError

        self.engine.optimizer.checkpoint_event_prologue()
        trainable = {id(p) for p in self._params if p.requires_grad}
        dest: dict[str, Chunk] = {}
        local: dict[int, tuple[int, dict[str | None, torch.Tensor]]] = {}  # index -> (elements held, views)
        for index, param in enumerate(self._params):
            if not param.requires_grad:
                continue
            if f"zero.param.{index}" not in saved:
                raise ShardError(f"the snapshot has no zero.param.{index} (parameter {index} of {len(self._params)})")
            start, n, _ = self._z3_slice(param)
            # Views of the partition's state (copies only where the optimizer is offloaded: set below).
            views = {None: safe_get_local_fp32_param(param).detach(),
                     **{key: safe_get_local_optimizer_state(param, key).detach() for key in keys}}
            local[index] = n, views
            if n:
                for key, buf in views.items():
                    name = f"zero.param.{index}" if key is None else f"zero.optim.{index}.{key}"
                    dest[name] = Chunk.flat(buf[:n], start, param.ds_numel)
        named = self._named_tensors()
        for name, t in named.items():
            if id(t) not in trainable:
                if f"model.{name}" not in saved:
                    raise ShardError(f"the snapshot has no model.{name}")
                dest.setdefault(f"model.{name}", Chunk.whole(torch.empty(saved[f"model.{name}"][0], dtype=saved[f"model.{name}"][1])))
        read(dest)
        with torch.no_grad():
            for index, (n, views) in local.items():
                param = self._params[index]
                safe_set_local_fp32_param(param, views[None])
                for key in keys:
                    safe_set_local_optimizer_state(param, views[key], key)
                param.ds_tensor.data[:n].copy_(views[None][:n])  # the working partition (a view of ZeRO's flat group)
            for name, t in named.items():
                if id(t) in trainable:
                    continue
                value = dest[f"model.{name}"].tensor
                if isinstance(t, nn.Parameter) and hasattr(t, "ds_id"):  # frozen, partitioned: rank 0's copy scattered
                    with GatheredParameters([t], modifier_rank=0):
                        t.data.copy_(value.to(t.device))
                else:
                    t.data.copy_(value.to(t.device))
        # Parameters kept whole on every rank (under stage3_param_persistence_threshold), partitioned
        # above, are gathered again from the partitions just written, as DeepSpeed's own load ends.
        self.engine.optimizer.checkpoint_event_epilogue()
        self._set_hyper_params(zero["param_groups"])

    def close(self) -> None:
        if dist.is_initialized():
            final_barrier()
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()
