"""Worker for ``test_strategy_close.py``: ``--cycles`` times, a gloo process group, a DDP strategy
that takes two backward passes, ``strategy.close()``, ``destroy_process_group()``, then the strategy
dropped (DDP's reducer, which holds the group, goes with it: the group's destructor runs here).
A cycle that does not end within ``--cycle-timeout-s`` dumps every thread's stack and exits 1.
Two ranks (``torch.multiprocessing.spawn``), a file store per cycle under ``--dir``:

    python tests/integration/close_worker.py --dir /tmp/x --cycles 100
"""

from __future__ import annotations

import argparse
import faulthandler
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, args) -> None:
    from elasticrl.train.strategy import adamw_factory, make_strategy

    torch.set_num_threads(1)
    for i in range(args.cycles):
        faulthandler.dump_traceback_later(args.cycle_timeout_s, exit=True)
        dist.init_process_group("gloo", init_method=f"file://{args.dir}/store-{i}", rank=rank, world_size=world)
        torch.manual_seed(0)
        strategy = make_strategy("ddp")
        strategy.wrap(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)]), adamw_factory(lr=1e-3))
        for _ in range(2):
            strategy.backward(strategy.module(torch.randn(16, 64)).sum())
        strategy.close()
        dist.destroy_process_group()
        del strategy  # the reducer, and with it the process group, is destroyed on this thread
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        pathlib.Path(args.dir, "done").write_text(str(args.cycles))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--cycle-timeout-s", type=float, default=30.0)
    args = p.parse_args(argv)
    mp.spawn(rank_main, args=(2, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
