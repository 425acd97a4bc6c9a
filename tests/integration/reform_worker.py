"""A trainer rank for ``test_reform.py``: a tiny DDP model trained step by step (the gradient
all-reduce through ``reform.abortable_ddp``, a step count all-reduced through ``train.dist``), that
re-forms its world in place (``elasticrl.train.reform``) when a peer is lost. Prints one JSON line
per event on stdout (CLOCK_MONOTONIC times, comparable across processes on one host):

    python reform_worker.py ADDRESS RUN RANK WORLD_SIZE STEPS
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.rendezvous.store import CoordinatorStore
from elasticrl.train import reform
from elasticrl.train.dist import WorldInfo, all_reduce_int, all_reduce_sum, set_waiter


def emit(**event) -> None:
    event["t"] = time.monotonic()
    print(json.dumps(event), flush=True)


def main() -> int:
    address, run, rank, size, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    members_run = f"{run}.workers"
    client = CoordinatorClient(address, call_timeout_s=5, reconnect_timeout_s=30)
    membership = Membership(client, members_run, f"rank-{rank}")
    membership.streaming.wait(30)  # from now on a SIGKILL is seen when the stream breaks
    store = CoordinatorStore(client, members_run, "first/", timeout_s=30)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))
    world = WorldInfo(rank=rank, world_size=size, local_rank=0, node_rank=rank)
    watch = reform.WorldWatch(client, members_run, [f"rank-{r}" for r in range(size)])
    set_waiter(watch.wait)
    reformer = reform.Reformer(address=address, timeout_s=30)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    ddp = DistributedDataParallel(model)
    reform.abortable_ddp(ddp, watch)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    emit(event="ready", rank=rank)
    done = 0
    while done < steps:
        try:
            x = torch.full((8, 64), float(world.rank + 1))
            ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            (ranks,) = all_reduce_sum([1.0])
            assert ranks == world.world_size, (ranks, world)
            done += 1
            checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
            emit(event="step", rank=world.rank, world=world.world_size, n=done, checksum=checksum)
            time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - re-raised unless a rank was lost
            lost = watch.await_loss(10.0)
            if not lost:
                raise
            emit(event="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", lost=list(lost))
            _, world = reformer.reform(membership, watch, 0, world, f"node-{rank}")
            ddp = DistributedDataParallel(model)  # rank 0's parameters to every survivor
            reform.abortable_ddp(ddp, watch)
            done = all_reduce_int(done, dist.ReduceOp.MIN)  # a step some finished and others did not is redone
            emit(event="reformed", rank=world.rank, world=world.world_size)
    watch.close()
    membership.leave("done")
    emit(event="done", rank=world.rank)
    reform.exit_if_abandoned(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
