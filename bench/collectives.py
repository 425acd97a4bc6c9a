"""Collective throughput the way nccl-tests measures it (all_reduce, all_gather, reduce_scatter,
broadcast, all_to_all, sendrecv), run as an ordinary torchrun worker so it sees exactly the fabric,
environment and process layout a training run gets, ``--rdzv-backend=elasticrl`` included.

Per op and size: ``-w`` warm-up calls, a barrier, ``-n`` timed calls (``perf_counter``, with
``torch.cuda.synchronize`` around them under nccl), the per-rank mean combined over ranks by ``-a``
(default: the max, the slowest rank), then ``-c`` checks that fill known rank-dependent values and
count wrong elements summed over ranks. Sizes, counts and the algbw / busbw formulas are
nccl-tests' (see ``bench/collectives_lib.py``: the size column is the largest per-rank buffer, i.e.
the whole receive buffer for all_gather and the whole send buffer for reduce_scatter). One column
set is reported, nccl-tests' "out-of-place" one; torch's all_reduce and broadcast only exist in
place, so those two rows are in-place calls. Timed calls run on zeroed buffers; checked calls on
fresh values. sendrecv is nccl-tests' ring: rank r sends to r+1 and receives from r-1.

``--impl auto`` (default) calls torch's collective for every op except reduce_scatter under gloo,
which torch implements as an all_reduce of the whole buffer plus a local copy (twice the traffic
the busbw factor assumes); there a ring of isend/irecv (n-1 steps, one chunk each) runs instead and
is labelled ``p2p``. ``--impl p2p`` uses the send/recv forms for all_gather (ring), reduce_scatter
(ring) and all_to_all (pairwise, as nccl-tests' alltoall), ``--impl native`` never does.

    torchrun --standalone --nproc-per-node=8 bench/collectives.py --op all -b 8 -e 1G -f 2 --report
    torchrun --nnodes=4 --nproc-per-node=8 --rdzv-backend=elasticrl --rdzv-endpoint=HOST:PORT \\
        bench/collectives.py --op all_reduce,all_gather -b 1M -e 4G --json /tmp/coll.json --plot /tmp/coll.png
    python bench/collectives.py --backend gloo -b 8 -e 1M       # one process, world size 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import sys
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

from bench import collectives_lib as lib  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/collectives.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--op", default="all_reduce", help=f"collectives to run, comma-separated, or 'all' ({', '.join(lib.OPS)}; default: %(default)s)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size, bytes, K/M/G suffixes in powers of 1024 (default: %(default)s)")
    p.add_argument("-e", "--maxbytes", default="128M", help="largest size, bytes, K/M/G suffixes (default: %(default)s)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step; 1: add --stepbytes instead (default: %(default)s)")
    p.add_argument("-i", "--stepbytes", default="1M", help="bytes added each step when --stepfactor is 1 (default: %(default)s)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default: %(default)s)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls per size before timing (default: %(default)s)")
    p.add_argument("-c", "--check", type=int, default=1, help="checked calls per size with known values; 0: no check, #wrong shows N/A (default: %(default)s)")
    p.add_argument("-d", "--dtype", default="float", help="element type: float/float32, half/float16, bfloat16, double, int8, uint8, int32, int64 (default: %(default)s)")
    p.add_argument("-o", "--redop", default="sum", choices=lib.REDOPS, help="reduction of all_reduce and reduce_scatter (default: %(default)s)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="process-group backend (default: nccl when CUDA is available, else gloo)")
    p.add_argument("--impl", default="auto", choices=("auto", "native", "p2p"), help="auto: torch's collectives, but reduce_scatter as an isend/irecv ring under gloo; native: always torch's; p2p: send/recv forms of all_gather, reduce_scatter, all_to_all (default: %(default)s)")
    p.add_argument("-a", "--average", default="max", choices=("max", "avg", "min", "rank0"), help="combine per-rank times by this; nccl-tests' own default is avg (default: %(default)s)")
    p.add_argument("-T", "--timeout", type=float, default=600.0, help="process-group timeout, seconds (default: %(default)s)")
    p.add_argument("--report", action="store_true", help="also print the environment (NCCL_* variables, NCCL version, nodes, IB ports) and a per-op summary")
    p.add_argument("--json", metavar="PATH", help="write the rows and environment as JSON to PATH; '-' for stdout (the tables then go to stderr)")
    p.add_argument("--plot", metavar="PATH.png", help="save busbw against size as a PNG (needs matplotlib)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and validate; sizes become ints, ``op`` a list, ``dtype`` a ``lib.DType``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.ops = lib.parse_ops(args.op)
        args.dtype = lib.parse_dtype(args.dtype)
        args.minbytes, args.maxbytes, args.stepbytes = (lib.parse_size(x) for x in (args.minbytes, args.maxbytes, args.stepbytes))
        lib.size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except ValueError as e:
        parser.error(str(e))
    if args.iters < 1 or args.warmup < 0 or args.check < 0:
        parser.error(f"need --iters >= 1, --warmup >= 0, --check >= 0; got {args.iters}, {args.warmup}, {args.check}")
    if args.plot and (missing := lib.matplotlib_missing()):
        parser.error(missing)
    return args


# ---- torch side (imported after argument parsing) ------------------------------------------------

class Bench:
    """The process group, this rank's device, and the helpers every op shares."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.distributed as dist

        from elasticrl.train.dist import WorldInfo, init_process_group

        self.torch, self.dist, self.args = torch, dist, args
        self.world = WorldInfo.from_env()
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            assert torch.cuda.is_available(), "--backend nccl needs CUDA; use --backend gloo on a CPU-only host"
            torch.cuda.set_device(self.world.local_rank)
            self.device = torch.device("cuda", self.world.local_rank)
        else:
            self.device = torch.device("cpu")
        init_process_group(backend, self.world, args.timeout)
        self.backend = backend
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.tdtype = getattr(torch, args.dtype.torch_name)
        self.redop = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[args.redop]
        # torch 2.13 renamed the *_into_tensor / *_tensor forms to *_single; older torch has only those.
        self.all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def barrier(self) -> None:
        self.dist.all_reduce(self.torch.zeros(1, device=self.device))
        self.sync()

    def gather_floats(self, value: float) -> list[float]:
        """One float from every rank, in rank order."""
        torch = self.torch
        out = torch.empty(self.n, dtype=torch.float64, device=self.device)
        self.all_gather_single(out, torch.tensor([value], dtype=torch.float64, device=self.device))
        return out.tolist()

    def sum_int(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64, device=self.device)
        self.dist.all_reduce(t)
        return int(t.item())

    def gather_json(self, obj) -> list:
        """A JSON-able value from every rank, in rank order (bytes, not pickle)."""
        torch = self.torch
        data = json.dumps(obj).encode()
        width = int(max(self.gather_floats(float(len(data)))))
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(width * self.n, dtype=torch.uint8, device=self.device)
        self.all_gather_single(out, buf.to(self.device))
        rows = out.cpu().view(self.n, width)
        return [json.loads(bytes(r.tolist()).rstrip(b"\0")) for r in rows]

    def p2p(self, pairs) -> None:
        """Post [(send tensor, dst) | (recv tensor, src)] as one batch and wait for all of it."""
        dist = self.dist
        ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer) for kind, t, peer in pairs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def choose_impl(op: str, impl: str, backend: str) -> str:
    """``native`` or ``p2p`` for one op (see the module docstring)."""
    if op not in ("all_gather", "reduce_scatter", "all_to_all"):
        return "native"
    if impl == "auto":
        return "p2p" if (op == "reduce_scatter" and backend == "gloo") else "native"
    return impl


IMPL_NOTES = {
    ("all_reduce", "native"): "torch.distributed.all_reduce, in place",
    ("broadcast", "native"): "torch.distributed.broadcast from root 0, in place",
    ("all_gather", "native"): "torch.distributed.all_gather_single",
    ("reduce_scatter", "native"): "torch.distributed.reduce_scatter_single",
    ("all_to_all", "native"): "torch.distributed.all_to_all_single",
    ("sendrecv", "native"): "batch_isend_irecv ring: send to r+1, receive from r-1",
    ("all_gather", "p2p"): "emulated: ring of isend/irecv, n-1 steps of one chunk",
    ("reduce_scatter", "p2p"): "emulated: ring of isend/irecv, n-1 steps of one chunk, reduce on receive",
    ("all_to_all", "p2p"): "emulated: one batch of isend/irecv with every peer",
}


CHECK_CHUNK = 1 << 24  # elements per slice when filling and comparing check values


class OpRun:
    """One op at one size: its buffers, the call to time, and the check."""

    def __init__(self, b: Bench, op: str, impl: str, counts: lib.Counts):
        torch = b.torch
        self.b, self.op, self.impl, self.c = b, op, impl, counts
        self.inp = torch.zeros(counts.send, dtype=b.tdtype, device=b.device)
        # all_reduce and broadcast are in place in torch: one buffer.
        self.out = self.inp if op in ("all_reduce", "broadcast") else torch.zeros(counts.recv, dtype=b.tdtype, device=b.device)
        self.run = getattr(self, f"_{impl}_{op}", None) or getattr(self, f"_native_{op}")

    # -- the calls
    def _native_all_reduce(self):
        self.b.dist.all_reduce(self.inp, op=self.b.redop)

    def _native_broadcast(self):
        self.b.dist.broadcast(self.inp, src=lib.root_of("broadcast"))

    def _native_all_gather(self):
        self.b.all_gather_single(self.out, self.inp)

    def _native_reduce_scatter(self):
        self.b.reduce_scatter_single(self.out, self.inp, op=self.b.redop)

    def _native_all_to_all(self):
        self.b.dist.all_to_all_single(self.out, self.inp)

    def _native_sendrecv(self):
        b = self.b
        if b.n == 1:  # a send to oneself is a local copy (what NCCL does too)
            self.out.copy_(self.inp)
            return
        b.p2p([("send", self.inp, (b.rank + 1) % b.n), ("recv", self.out, (b.rank - 1) % b.n)])

    def _p2p_all_gather(self):
        b, n, r = self.b, self.b.n, self.b.rank
        blocks = self.out.view(n, -1)  # [n, per]
        blocks[r].copy_(self.inp)
        for s in range(n - 1):  # step s: pass on the block that came from rank r-s
            b.p2p([("send", blocks[(r - s) % n], (r + 1) % n), ("recv", blocks[(r - s - 1) % n], (r - 1) % n)])

    def _p2p_reduce_scatter(self):
        b, n, r, torch = self.b, self.b.n, self.b.rank, self.b.torch
        chunks = self.inp.view(n, -1)  # [n, per]; chunk j ends reduced on rank j
        reduce = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}[b.args.redop]
        if n == 1:
            self.out.copy_(chunks[0])
            return
        recv = torch.empty_like(self.out)
        work = [torch.empty_like(self.out), torch.empty_like(self.out)]
        send = chunks[(r - 1) % n]
        for s in range(n - 1):
            # receive rank r-1's partial of chunk (r-s-2) % n, add our own; after n-1 steps it is chunk r.
            b.p2p([("send", send, (r + 1) % n), ("recv", recv, (r - 1) % n)])
            dst = self.out if s == n - 2 else work[s % 2]
            reduce(recv, chunks[(r - s - 2) % n], out=dst)
            send = dst

    def _p2p_all_to_all(self):
        b, n, r = self.b, self.b.n, self.b.rank
        src, dst = self.inp.view(n, -1), self.out.view(n, -1)  # [n, per]: block j goes to / came from rank j
        dst[r].copy_(src[r])
        pairs = []
        for k in range(1, n):
            pairs += [("send", src[(r + k) % n], (r + k) % n), ("recv", dst[(r - k) % n], (r - k) % n)]
        if pairs:
            b.p2p(pairs)

    # -- timing and checking
    def time_s(self, iters: int, warmup: int) -> float:
        """Mean seconds per call on this rank."""
        self.inp.zero_()
        self.out.zero_()
        for _ in range(warmup):
            self.run()
        self.b.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            self.run()
        self.b.sync()
        return (time.perf_counter() - t0) / iters

    def _slices(self, total: int):
        """(start, arange) over [0, total) in CHECK_CHUNK pieces: bounds the int64 temporaries."""
        torch = self.b.torch
        for start in range(0, total, CHECK_CHUNK):
            yield start, torch.arange(start, min(total, start + CHECK_CHUNK), dtype=torch.int64, device=self.b.device)

    def wrong(self, m: int, exact: bool) -> int:
        """Fill check values, run once, count this rank's wrong elements."""
        b, torch, c = self.b, self.b.torch, self.c
        self.out.fill_(m)  # outside the value range: an element nobody wrote is wrong
        if not (self.op == "broadcast" and b.rank != lib.root_of("broadcast")):
            for start, i in self._slices(c.send):
                self.inp[start:start + len(i)].copy_(lib.check_value(i, b.rank, m))
        self.run()
        b.sync()
        bad = 0
        for start, k in self._slices(c.recv):
            exp = lib.expected_value(self.op, k, b.rank, b.n, c.param, m, b.args.redop, torch.minimum, torch.maximum)
            exp = exp.to(b.tdtype).to(torch.float64)  # integer types wrap the way the collective's sums do
            got = self.out[start:start + len(k)].to(torch.float64)
            if exact:
                bad += int((got != exp).sum().item())
            else:
                tol = torch.finfo(b.tdtype).eps * b.n * exp.abs().clamp(min=1)
                bad += int(((got - exp).abs() > tol).sum().item())
        return bad


def environment(b: Bench) -> dict:
    """This run's environment as every rank sees it, gathered to all ranks."""
    torch = b.torch
    if b.device.type == "cuda":
        device = torch.cuda.get_device_name(b.device)
    else:
        device = f"cpu {platform.machine()} ({os.cpu_count()} cores)"
    mine = {"rank": b.rank, "local_rank": b.world.local_rank, "node_rank": b.world.node_rank, "pid": os.getpid(),
            "host": socket.gethostname(), "device": device}
    if b.world.local_rank == 0:
        mine["ib"] = lib.ib_devices()
        mine["ibv_devinfo"] = lib.ibv_devinfo_list()
    ranks = b.gather_json(mine)
    nccl_version = None
    if b.backend == "nccl":
        try:
            nccl_version = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # a torch built without NCCL
            nccl_version = None
    return {
        "backend": b.backend, "torch": torch.__version__, "nccl_version": nccl_version,
        "dtype": b.args.dtype.nccl_name, "world_size": b.n, "layout": lib.torchrun_layout(os.environ),
        "hosts": lib.host_counts(ranks), "env": lib.relevant_env(os.environ),
        "ib": {r["host"]: r["ib"] for r in ranks if "ib" in r},
        "ibv_devinfo": {r["host"]: r["ibv_devinfo"] for r in ranks if "ibv_devinfo" in r},
        "ranks": [{k: v for k, v in r.items() if k not in ("ib", "ibv_devinfo")} for r in ranks],
    }


def run_op(b: Bench, op: str, sizes: list[int], say) -> dict:
    """Every size of one op; rows are printed (rank 0) as they finish."""
    args = b.args
    impl = choose_impl(op, args.impl, b.backend)
    m = lib.check_modulus(args.dtype, b.n, args.redop)
    exact = lib.check_is_exact(args.dtype, b.n, args.redop, m)
    result = {"op": op, "impl": impl, "impl_note": IMPL_NOTES[(op, impl)], "rows": []}
    say(lib.format_op_header(result))
    for plan in lib.plan_rows(op, sizes, args.dtype.wordsize, b.n):
        run = OpRun(b, op, impl, plan.counts)
        seconds = lib.time_average(b.gather_floats(run.time_s(args.iters, args.warmup)), args.average)
        wrong = None
        for _ in range(args.check):  # like nccl-tests, stop at the first check that finds wrong elements
            wrong = b.sum_int(run.wrong(m, exact))
            if wrong:
                break
        algbw, busbw = lib.bandwidth(op, plan.size, seconds, b.n)
        row = {"size": plan.size, "count": plan.count, "type": args.dtype.nccl_name, "redop": lib.redop_of(op, args.redop),
               "root": lib.root_of(op), "time_us": seconds * 1e6, "algbw": algbw, "busbw": busbw, "wrong": wrong}
        result["rows"].append(row)
        say(lib.format_row(row))
        del run
    say(lib.format_op_footer(result))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    b = Bench(args)
    is_rank0 = b.rank == 0
    stream = sys.stderr if args.json == "-" else sys.stdout

    def say(text: str) -> None:
        if is_rank0:
            print(text, file=stream, flush=True)

    sizes = lib.size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    env = environment(b)
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    say(f"# elasticrl collectives  backend: {b.backend}  ranks: {b.n}  minBytes {args.minbytes} maxBytes {args.maxbytes} "
        f"step: {step} warmup iters: {args.warmup} iters: {args.iters} validation: {args.check} time: {args.average} over ranks")
    say("#\n" + lib.format_devices(env["ranks"]))
    if args.report:
        say("#\n" + lib.format_env_report(env))
    results = []
    for op in args.ops:
        say("#")
        results.append(run_op(b, op, sizes, say))
    wrong = lib.total_wrong(results)
    say(f"# Wrong elements total : {wrong} {'FAILED' if wrong else 'OK'}" if args.check else "# Wrong elements total : N/A (-c 0)")
    if args.report:
        say("#\n" + lib.format_summary(results))
    if is_rank0:
        settings = {k: v for k, v in vars(args).items() if k not in ("dtype", "op")} | {"dtype": args.dtype.nccl_name}
        if args.json:
            lib.write_json(lib.build_report(settings, env, results), args.json)
        if args.plot:
            hosts = len(env["hosts"])
            title = f"busbw, {b.backend}, {b.n} ranks on {hosts} host{'s' * (hosts != 1)}, {args.dtype.nccl_name}"
            lib.plot_busbw(results, args.plot, title)
            say(f"# plot written to {args.plot}")
    b.barrier()
    b.dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
