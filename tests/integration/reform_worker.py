"""A trainer rank for ``test_reform.py``: a tiny model trained step by step with the trainer's DDP
strategy (the gradient all-reduce through ``reform.abortable_ddp``, a step count all-reduced through
``train.dist``), that re-forms its world in place (``elasticrl.train.reform``, then
``DDPStrategy.regroup``) when a peer is lost. Every step checks the gradients DDP left against the
exact average of every rank's own gradient, all-reduced separately. The DDP of the old world is
kept alive on purpose (as a traceback or an autograd graph may keep it in the trainer): it must not
touch the new world's gradients. Prints one JSON line per event on stdout (CLOCK_MONOTONIC times,
comparable across processes on one host):

    python reform_worker.py ADDRESS RUN RANK WORLD_SIZE STEPS
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.rendezvous.store import CoordinatorStore
from elasticrl.train import reform
from elasticrl.train.dist import WorldInfo, all_reduce_int, all_reduce_sum, set_waiter, wait
from elasticrl.train.strategy import StrategyConfig, make_strategy


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
    strategy = make_strategy(StrategyConfig(name="ddp"))
    strategy.wrap(model, lambda params: torch.optim.SGD(params, lr=1e-3))
    reform.abortable_ddp(strategy.module, watch)
    lingering = []  # the DDPs of former worlds, kept alive
    emit(event="ready", rank=rank)
    done = 0
    while done < steps:
        try:
            x = torch.full((8, 64), float(world.rank + 1))
            own = copy.deepcopy(model)  # no DDP hooks on its parameters: this rank's own gradient
            own.zero_grad(set_to_none=True)  # what a failed step left in the model's is not this step's
            own(x).square().mean().backward()
            expected = [p.grad for p in own.parameters()]
            for g in expected:
                wait(dist.all_reduce(g, async_op=True))
                g.div_(world.world_size)
            strategy.module(x).square().mean().backward()
            grads_ok = all(torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7) for p, g in zip(model.parameters(), expected))
            strategy.optimizer.step()
            strategy.optimizer.zero_grad()
            (ranks,) = all_reduce_sum([1.0])
            assert ranks == world.world_size, (ranks, world)
            done += 1
            checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
            emit(event="step", rank=world.rank, world=world.world_size, n=done, checksum=checksum, grads_ok=grads_ok)
            time.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - re-raised unless a rank was lost
            lost = watch.await_loss(10.0)
            if not lost:
                raise
            emit(event="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", lost=list(lost))
            _, world = reformer.reform(membership, watch, 0, world, f"node-{rank}")
            lingering.append(strategy.module)
            strategy.regroup()  # rank 0's parameters to every survivor
            reform.abortable_ddp(strategy.module, watch)
            done = all_reduce_int(done, dist.ReduceOp.MIN)  # a step some finished and others did not is redone
            emit(event="reformed", rank=world.rank, world=world.world_size)
    watch.close()
    membership.leave("done")
    emit(event="done", rank=world.rank)
    reform.exit_if_abandoned(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
