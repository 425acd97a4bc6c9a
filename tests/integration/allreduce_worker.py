"""A torchrun worker for the rendezvous tests and bench: all-reduce in a loop, report as JSON lines.

Appends one JSON object per line to ``<out>/<node>.jsonl`` (``node`` from ``--node`` or
$ELASTICRL_TEST_NODE, set on the torchrun process): ``start`` (pid, rank, world size, the
MASTER_ADDR/PORT it bootstraps from), ``ok`` every ``--report-every`` seconds while all-reducing
(the sum is checked against the world size), ``error`` on a failure, ``done`` on a clean stop.
A stop is agreed collectively (every step all-reduces a stop flag too), so all ranks leave the
loop at the same step once ``--stop-file`` exists. Once ``--fatal-file`` holds this node's name,
its worker fails as user code would that restarts do not fix: it asks its agent to stop after one
more try (``request_stop``), reports ``fatal`` and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="directory for the <node>.jsonl reports")
    p.add_argument("--node", default=os.environ.get("ELASTICRL_TEST_NODE", "node"), help="name of this node in the reports")
    p.add_argument("--interval", type=float, default=0.05, help="sleep between all-reduces, seconds (default: %(default)s)")
    p.add_argument("--report-every", type=float, default=0.2, help="seconds between 'ok' lines (default: %(default)s)")
    p.add_argument("--grace", type=float, default=-1.0, help="on a collective error wait this long for a restart, seconds; <0: elasticrl's default, 0: exit at once")
    p.add_argument("--stop-file", default="", help="stop cleanly (all ranks together) once this file exists")
    p.add_argument("--fatal-file", default="", help="fail for good (request_stop, exit 1) once this file holds this node's name")
    p.add_argument("--init-timeout", type=float, default=30.0, help="init_process_group timeout, seconds (default: %(default)s)")
    args = p.parse_args(argv)

    out = pathlib.Path(args.out) / f"{args.node}.jsonl"

    def report(event: str, **fields) -> None:
        rec = {"event": event, "node": args.node, "pid": os.getpid(), "t": time.time(), **fields}
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")

    env = {k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    report("start", rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), master=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
           restart=int(env["TORCHELASTIC_RESTART_COUNT"] or 0))

    import torch
    import torch.distributed as dist

    from elasticrl.rendezvous.worker import request_stop, restart_grace

    torch.set_num_threads(1)
    grace = restart_grace(None if args.grace < 0 else args.grace) if args.grace != 0 else contextlib.nullcontext()
    with grace:
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.init_timeout))
            rank, world = dist.get_rank(), dist.get_world_size()
            report("ready", rank=rank, world=world)
            step, last = 0, 0.0
            stop_file = pathlib.Path(args.stop_file) if args.stop_file else None
            fatal_file = pathlib.Path(args.fatal_file) if args.fatal_file else None
            while True:
                if fatal_file is not None and fatal_file.exists() and fatal_file.read_text().strip() == args.node:
                    asked = request_stop("ValueError", f"{args.node}: ValueError: a user's bug", at_once=False)
                    report("fatal", rank=rank, world=world, asked=asked is not None)
                    return 1
                flag = 1.0 if stop_file is not None and stop_file.exists() else 0.0
                t = torch.tensor([1.0, flag])
                dist.all_reduce(t)
                if int(t[0].item()) != world:
                    raise AssertionError(f"all_reduce sum {t[0].item()} != world size {world}")
                step += 1
                now = time.time()
                if now - last >= args.report_every:
                    report("ok", rank=rank, world=world, step=step)
                    last = now
                if t[1].item() > 0:
                    break
                time.sleep(args.interval)
            dist.barrier()
            dist.destroy_process_group()
            report("done", rank=rank, world=world, step=step)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            report("error", error=f"{type(exc).__name__}: {first}"[:300])
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
