"""One rank of the ``gloo`` baseline of ``bench/weights.py``: the trainer (rank 0) broadcasts the
blob to K workers over a torch.distributed gloo group, the way NCCL-broadcast weight sync works
in OpenRLHF or verl, on CPU.

Every rank prints one JSON line: ``{"rank", "setup_s", "seconds": [...]}``: ``setup_s`` is the
time to form the group (``init_process_group`` + a barrier: paid again whenever a worker joins or
leaves, since the group's membership is fixed), ``seconds`` per repeat from rank 0's start of the
broadcast (after a barrier) until this rank has the tensor (its clock: same host).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mb", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    t0 = time.time()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=120))
    dist.barrier()
    setup_s = time.time() - t0
    n = args.mb << 20
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8) if args.rank == 0 else torch.empty(n, dtype=torch.uint8)
    seconds = []
    for _ in range(args.repeats):
        dist.barrier()
        start = torch.tensor([time.time()], dtype=torch.float64)
        dist.broadcast(start, 0)
        dist.broadcast(buf, 0)
        seconds.append(time.time() - float(start))
    print(json.dumps({"rank": args.rank, "setup_s": setup_s, "seconds": seconds}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
