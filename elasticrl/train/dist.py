"""torch.distributed plumbing for a torchrun worker: world from the environment, and broadcasts of
JSON and named tensors without pickle (``broadcast_object_list`` pickles, so it is not used).

Every collective here is issued asynchronously and waited through ``wait``: by default the work's
own wait, and while a ``WorldWatch`` is installed (``set_waiter``, in-place re-forming), a wait that
a lost rank fails at once instead of leaving this thread blocked in gloo until its timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import logging
import os
import socket
import struct
import sys
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from elasticrl.weights.peer import route_source

log = logging.getLogger(__name__)

_waiter: Callable[[dist.Work], None] | None = None


def set_waiter(waiter: Callable[[dist.Work], None] | None) -> None:
    """How ``wait`` waits for a collective from now on (None: the work's own, blocking, wait)."""
    global _waiter
    _waiter = waiter


def wait(work: dist.Work) -> None:
    """Wait for an asynchronous collective (``async_op=True``) through the installed waiter."""
    if _waiter is None:
        work.wait()
    else:
        _waiter(work)


_last_barrier: dist.Work | None = None  # see final_barrier


def final_barrier() -> None:
    """``dist.barrier()`` before the process group is torn down, its work kept referenced here
    until the next call (or the interpreter's last clean-up, after the group is gone).

    gloo's worker thread drops its reference to a finished work after the caller's wait returned.
    If that reference is the last, the worker thread frees the work's tensors, and those of the
    collectives the barrier waited for (DDP's gradient buckets), which takes the GIL. If this
    thread is destroying the process group at that moment (DDP's reducer freed as the strategy
    goes, or ``destroy_process_group``), it holds the GIL while it joins that worker thread: a
    deadlock (seen in CI: a DDP rank that never exited; ``gdb`` showed the main thread in
    ``~ProcessGroupGloo`` joining ``pt_gloo_runloop``, which waited for the GIL in
    ``~AsyncBarrierWork``). Holding the work here makes this thread's reference the last one."""
    global _last_barrier
    work = dist.barrier(async_op=True)
    work.wait()
    _last_barrier = work


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
    """Join the default process group from torchrun's MASTER_ADDR/MASTER_PORT (env:// init).

    Under nccl the group is bound to this rank's GPU (``torch.cuda.set_device`` already called), so
    collectives without a tensor, such as ``barrier()``, need not guess the device."""
    timeout = datetime.timedelta(seconds=timeout_s)
    bound = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
    if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
        # Started without torchrun: a one-rank group on an in-memory store keeps the code path the same.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
        return
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = interface_towards(os.environ.get("MASTER_ADDR", ""))
        if ifname:
            # Gloo otherwise binds to the address the hostname resolves to, which on many hosts (and
            # in network namespaces) is a loopback address the other nodes cannot reach.
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
            log.info("gloo uses interface %s (the route to MASTER_ADDR %s); set GLOO_SOCKET_IFNAME to choose another",
                     ifname, os.environ["MASTER_ADDR"])
    dist.init_process_group(backend=backend, rank=world.rank, world_size=world.world_size, timeout=timeout, **bound)


def interface_towards(address: str) -> str | None:
    """Linux: the name of the local interface the kernel routes ``address`` through; None when it
    is a loopback address, unresolvable, or not on Linux (then gloo's own choice stands)."""
    if not address or not sys.platform.startswith("linux"):
        return None
    try:
        target = socket.gethostbyname(address)
        if ipaddress.ip_address(target).is_loopback:
            return None
        local = route_source(target)
        import fcntl

        siocgifaddr = 0x8915
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except OSError:
        return None
    return None


def comm_device() -> torch.device:
    """Where collectives' tensors must live: this rank's GPU under nccl, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_bytes(data: bytes | None, src: int) -> bytes:
    """``data`` from rank ``src`` to every rank (other ranks pass None)."""
    device = comm_device()
    size = torch.tensor([len(data) if dist.get_rank() == src else 0], dtype=torch.long, device=device)
    wait(dist.broadcast(size, src, async_op=True))
    if dist.get_rank() == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait(dist.broadcast(buf, src, async_op=True))
    return bytes(buf.cpu().tolist()) if dist.get_rank() != src else data


def broadcast_json(obj, src: int):
    """A JSON-able value from rank ``src`` to every rank."""
    data = json.dumps(obj).encode() if dist.get_rank() == src else None
    return json.loads(broadcast_bytes(data, src))


def all_gather_json(obj) -> list:
    """Every rank's JSON-able value, in rank order (no pickle, unlike ``all_gather_object``)."""
    data = json.dumps(obj).encode()
    device = comm_device()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), async_op=True))
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)  # never empty: JSON
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    wait(dist.all_gather(parts, mine, async_op=True))
    return [json.loads(p[:int(n)].cpu().numpy().tobytes()) for p, n in zip(parts, sizes)]


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
        wait(dist.broadcast(t, src, async_op=True))
        out[name] = t.cpu()
    return out


def all_reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    wait(dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True))
    return t.tolist()


def all_reduce_int(value: int, op: dist.ReduceOp) -> int:
    t = torch.tensor([value], dtype=torch.long, device=comm_device())
    wait(dist.all_reduce(t, op=op, async_op=True))
    return int(t.item())
