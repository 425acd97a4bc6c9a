"""torch.distributed plumbing for a torchrun worker: world from the environment, and broadcasts of
JSON and named tensors without pickle (``broadcast_object_list`` pickles, so it is not used).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """Where this worker sits, as torchrun's environment describes it."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    """torchrun's GROUP_RANK: the index of this worker's agent (node) in the current round."""

    @staticmethod
    def from_env(env: Mapping[str, str] = os.environ) -> "WorldInfo":
        def get(name: str, default: int) -> int:
            return int(env.get(name, default))

        return WorldInfo(
            rank=get("RANK", 0),
            world_size=get("WORLD_SIZE", 1),
            local_rank=get("LOCAL_RANK", 0),
            node_rank=get("GROUP_RANK", 0),
        )


def init_process_group(backend: str, world: WorldInfo, timeout_s: float) -> None:
    """Join the default process group from torchrun's MASTER_ADDR/MASTER_PORT (env:// init)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # Started without torchrun: a one-rank group on an in-memory store keeps the code path the same.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size, timeout=timeout)


def comm_device() -> torch.device:
    """Where collectives' tensors must live: this rank's GPU under nccl, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(data: bytes | None, src: int) -> bytes:
    """``data`` from rank ``src`` to every rank (other ranks pass None)."""
    device = comm_device()
    size = torch.tensor([len(data) if dist.get_rank() == src else 0], dtype=torch.long, device=device)
    dist.broadcast(size, src)
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    return bytes(buf.cpu().tolist()) if dist.get_rank() != src else data


def broadcast_json(obj, src: int):
    """A JSON-able value from rank ``src`` to every rank."""
    data = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(data, src))


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None, src: int) -> dict[str, torch.Tensor]:
    """Named tensors from rank ``src``, returned on the CPU: a JSON header (names, dtypes, shapes),
    then each tensor."""
    header = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()} if tensors is not None else None
    header = broadcast_json(header, src)
    device = comm_device()
    out = {}
    for name, (dtype, shape) in header.items():
        if dist.get_rank() == src:
            t = tensors[name].to(device).contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(t, src)
        out[name] = t.cpu()
    return out


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_int(value: int, op: dist.ReduceOp) -> int:
    t = torch.tensor([value], dtype=torch.long, device=comm_device())
    dist.all_reduce(t, op=op)
    return int(t.item())
