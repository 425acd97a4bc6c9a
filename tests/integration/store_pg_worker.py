"""One rank of the store contract's gloo test: its own store client, a gloo group, one all-reduce.

``--store coordinator`` connects a ``CoordinatorStore`` to the coordinator at ``--address`` (KV of
``--run-id``); ``--store tcp`` connects a ``TCPStore`` client to the test's server at ``--address``.
The rank then calls ``init_process_group("gloo", store=...)``, all-reduces ``[rank + 1]`` and
prints ``{"rank", "world", "sum"}`` as one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True, choices=["coordinator", "tcp"], help="which store to bootstrap from")
    p.add_argument("--address", required=True, metavar="HOST:PORT", help="coordinator, or TCPStore server, address")
    p.add_argument("--run-id", default="store-contract", help="coordinator run whose KV holds the store (default: %(default)s)")
    p.add_argument("--rank", type=int, required=True, help="this process's rank")
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S", help="store and process group timeout, seconds (default: %(default)s)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=args.timeout)
    if args.store == "coordinator":
        from elasticrl.coordinator.client import CoordinatorClient
        from elasticrl.rendezvous.store import CoordinatorStore

        client = CoordinatorClient(args.address, call_timeout_s=5, reconnect_timeout_s=10)
        store = CoordinatorStore(client, args.run_id, "pg/", timeout_s=args.timeout)
    else:
        host, port = args.address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    # ``store`` stays referenced until the group is destroyed: C++ holds only its C++ half.
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    t = torch.tensor([float(args.rank + 1)])
    dist.all_reduce(t)
    print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item()}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
