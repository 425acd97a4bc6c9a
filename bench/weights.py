"""Policy weights from the trainer to K rollout workers: through the coordinator vs the peer relay.

For each path and each K in ``--workers``, one coordinator (no state dir), K worker processes
(``bench/weights_worker.py``, each its own process like a real rollout worker, none loading an
engine) and this process as the trainer publish ``--repeats`` versions of a ``--mb`` MiB blob.
``seconds`` = from the trainer starting the publish (sha256 included) until the last of the K
workers holds the version verified; the median over the repeats is reported.

* ``coordinator``: the trainer uploads the blob to the coordinator (``PublishWeights``), every
  worker downloads it from there (``FetchWeights``): one Python process carries K + 1 copies.
* ``relay``: the trainer serves the blob from its own ``WeightPeer``; the coordinator only names
  sources (``LocateWeights``); each worker reads behind the previous one and serves what it has
  on, a pipeline trainer -> w1 -> ... -> wK.

Before the transfer, the blob's codec on the trainer and on a worker: ``pack_state_dict`` /
``unpack_state_dict`` of a state of fp32 tensors of 16 MiB (``--mb`` in all) against
``safetensors.torch.save`` / ``load`` in the same run, in seconds and the longest each kept the GIL
from a 10 ms ticker thread (the trainer publishes in the background beside its lease keep-alive).

Also reported: the most bytes any one process sent per version (from the workers' record of
their sources: the coordinator sends K copies, a relay holder at most one) and the coordinator's
peak RSS. On one host every worker shares the same CPUs, so the relay's hashing and copying grow
with K here, while on a cluster each worker hashes and forwards on its own host: the busiest
sender column shows the part that does not grow with K.

    python bench/weights.py                          # 512 MiB to K = 1, 2, 4; ~2 min on 2 cores
    python bench/weights.py --mb 64 --workers 1,2 --repeats 1 --json-out /tmp/w.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import threading
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

from bench.benchmain import BenchError, run_main  # noqa: E402
from bench.gil import timed  # noqa: E402
from bench.scheduler_procs import Coordinator, child_env, log, process_cpu_s, process_rss_mb, stop_process  # noqa: E402

WORKER = BENCH_DIR / "weights_worker.py"
PATHS = ("coordinator", "relay", "gloo")
GLOO = BENCH_DIR / "weights_gloo.py"
WAIT_S = 300.0


class Worker:
    """A ``weights_worker.py`` process; its JSON events arrive on ``events``."""

    def __init__(self, d: pathlib.Path, address: str, run: str, member: str, mode: str):
        self.member = member
        self.log_path = d / f"{member}.log"
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--address", address, "--run", run, "--member", member, "--mode", mode],
            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True,
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def wait_for(self, event: str, timeout_s: float, version: int | None = None) -> dict:
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                e = self.events.get(timeout=max(0.01, give_up - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"{self.member}: no {event!r} within {timeout_s:.0f}s; log: {self.log_path}") from None
            if e["event"] == "exit":
                raise BenchError(f"{self.member} exited (rc {self.proc.wait()}); log: {self.log_path}")
            if e["event"] == event and (version is None or e.get("version") == version):
                return e


def measure(path: str, k: int, blob: bytes, repeats: int, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    from elasticrl.scheduler.client import SchedulerClient
    from elasticrl.weights.transfer import WeightPublisher

    d = tmp / f"{path}-k{k}"
    coord = Coordinator(d, "coordinator", None, cleanup)
    run = f"bench-{path}-{k}"
    client = cleanup.enter_context(SchedulerClient(coord.address, call_timeout_s=30, reconnect_timeout_s=30))
    publisher = WeightPublisher(client, run, "trainer", mode=path, coordinator_address=coord.address)
    cleanup.callback(publisher.close)
    workers = [Worker(d, coord.address, run, f"w{i}", path) for i in range(k)]
    try:
        for w in workers:
            w.wait_for("ready", 60)
        time.sleep(0.5)  # every worker is waiting on the coordinator for a version
        seconds, busiest, sources, worker_cpu, total_cpu = [], [], [], [], []
        pids = [os.getpid(), coord.proc.pid, *(w.proc.pid for w in workers)]
        for version in range(1, repeats + 1):
            cpu0 = [process_cpu_s(pid) for pid in pids]
            t0 = time.time()
            publisher.publish(version, blob)
            got = [w.wait_for("got", WAIT_S, version) for w in workers]
            seconds.append(max(g["t"] for g in got) - t0)
            cpu = [process_cpu_s(pid) - c for pid, c in zip(pids, cpu0)]
            worker_cpu.append(statistics.mean(cpu[2:]))
            total_cpu.append(sum(cpu))
            sent: dict[str, int] = {}
            for g in got:
                for member, a, b in g["sources"]:
                    sent[member] = sent.get(member, 0) + b - a
            busiest.append(max(sent.values()))
            sources.append({w.member: [s[0] for s in g["sources"] if s[2] > s[1]] for w, g in zip(workers, got)})
            if any(g["sha256"] != got[0]["sha256"] or g["bytes"] != len(blob) for g in got):
                raise BenchError(f"{path}, K={k}, version {version}: the workers hold different blobs")
            log(f"{path:<12} K={k} version {version}: {seconds[-1]:.2f}s")
        rss = process_rss_mb(coord.proc.pid)
    finally:
        for w in workers:
            stop_process(w.proc)
        publisher.close()
        coord.stop()
    return {
        "path": path, "workers": k, "bytes": len(blob), "seconds": round(statistics.median(seconds), 3),
        "seconds_all": [round(s, 3) for s in seconds], "busiest_sender_mb": round(statistics.median(busiest) / 2**20, 1),
        "coordinator_peak_rss_mb": rss[1], "sources_last": sources[-1],
        "worker_cpu_s": round(statistics.median(worker_cpu), 2), "total_cpu_s": round(statistics.median(total_cpu), 2),
    }


def measure_gloo(k: int, mb: int, repeats: int, tmp: pathlib.Path) -> dict:
    """The baseline: a gloo group of the trainer and K workers, ``broadcast`` from rank 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [open(tmp / f"gloo-k{k}-rank{r}.log", "w") for r in range(k + 1)]
    procs = [subprocess.Popen([sys.executable, str(GLOO), "--rank", str(r), "--world", str(k + 1), "--port", str(port),
                               "--mb", str(mb), "--repeats", str(repeats)],
                              cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=logs[r], text=True)
             for r in range(k + 1)]
    try:
        outs = [p.communicate(timeout=WAIT_S)[0] for p in procs]
    except subprocess.TimeoutExpired:
        raise BenchError(f"gloo, K={k}: the broadcast did not finish within {WAIT_S:.0f}s; logs in {tmp}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()
    if any(p.returncode for p in procs):
        raise BenchError(f"gloo, K={k}: a rank failed; logs: {', '.join(f.name for f in logs)}")
    ranks = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    seconds = [max(r["seconds"][i] for r in ranks) for i in range(repeats)]
    log(f"{'gloo':<12} K={k}: {', '.join(f'{x:.2f}s' for x in seconds)}")
    return {
        "path": "gloo", "workers": k, "bytes": mb << 20, "seconds": round(statistics.median(seconds), 3),
        "seconds_all": [round(x, 3) for x in seconds], "group_setup_s": round(max(r["setup_s"] for r in ranks), 3),
        "busiest_sender_mb": None, "coordinator_peak_rss_mb": None, "sources_last": {}, "worker_cpu_s": None,
        "total_cpu_s": None,
    }


def run(args, tmp: pathlib.Path, cleanup: contextlib.ExitStack) -> dict:
    ks = [int(x) for x in args.workers.split(",")]
    paths = [p for p in args.paths.split(",")]
    if any(p not in PATHS for p in paths):
        raise BenchError(f"--paths: {args.paths!r}: each must be one of {', '.join(PATHS)}")
    import torch

    from elasticrl.scheduler.weights import pack_state_dict

    # A safetensors file, like a policy's (the coordinator path checks the format), of random bytes.
    blob = pack_state_dict({"weight": torch.frombuffer(bytearray(os.urandom(args.mb << 20)), dtype=torch.uint8)})
    codec = measure_codec(args.mb)
    rows = []
    for path in paths:
        for k in ks:
            rows.append(measure_gloo(k, args.mb, args.repeats, tmp) if path == "gloo"
                        else measure(path, k, blob, args.repeats, tmp, cleanup))
    summary = {}
    by = {(r["path"], r["workers"]): r["seconds"] for r in rows}
    if ("relay", min(ks)) in by and ("relay", max(ks)) in by:
        summary["relay_growth"] = round(by[("relay", max(ks))] / by[("relay", min(ks))], 2)
    if ("relay", max(ks)) in by and ("coordinator", max(ks)) in by:
        summary["relay_speedup_at_max_k"] = round(by[("coordinator", max(ks))] / by[("relay", max(ks))], 2)
    return {
        "config": {"mb": args.mb, "workers": ks, "repeats": args.repeats},
        "host": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
        "codec": codec, "weights": rows, "summary": summary,
    }


def measure_codec(mb: int) -> dict:
    import torch
    from safetensors.torch import load, save

    from elasticrl.scheduler.weights import pack_state_dict, unpack_state_dict

    state = {f"t{i}": torch.randn(4 << 20) for i in range(max(1, mb // 16))}
    out, blobs = {}, {}
    for name, fn in (("pack", lambda: blobs.update(ours=pack_state_dict(state))),
                     ("safetensors_save", lambda: blobs.update(theirs=save(state))),
                     ("unpack", lambda: unpack_state_dict(blobs["ours"])),
                     ("safetensors_load", lambda: load(blobs["theirs"]))):
        seconds, stall = timed(fn)
        out[name] = {"seconds": round(seconds, 3), "stall_s": round(stall, 3)}
    return out


def render(doc: dict) -> str:
    c = doc["config"]
    out = [f"Weights: {c['mb']} MiB from the trainer (this process) to K worker processes on one host "
           f"({doc['host']['cpus']} CPUs); median of {c['repeats']} versions.",
           "seconds: publish start (sha256 included) -> the last worker holds the version, verified. "
           "busiest sender: the most any one process (coordinator, trainer or worker) sent per version. "
           "cpu: CPU seconds per version, of one worker (mean) and of every process (trainer, coordinator, workers).",
           f"{'path':<12} {'K':>3} {'seconds':>8} {'GB/s per worker':>15} {'busiest sender MiB':>18} {'worker cpu s':>12} {'total cpu s':>11} {'coord peak RSS MB':>17}  sources (last version)"]
    def f(x, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in doc["weights"]:
        chain = " ".join(f"{w}<-{'+'.join(s)}" for w, s in r["sources_last"].items())
        if r["path"] == "gloo":
            chain = f"(a fixed group; forming it took {r['group_setup_s']:.2f}s)"
        out.append(f"{r['path']:<12} {r['workers']:>3} {r['seconds']:>8.2f} {r['bytes'] / 1e9 / r['seconds']:>15.2f} "
                   f"{f(r['busiest_sender_mb'], '.0f'):>18} {f(r['worker_cpu_s'], '.2f'):>12} {f(r['total_cpu_s'], '.2f'):>11} "
                   f"{f(r['coordinator_peak_rss_mb'], '.0f'):>17}  {chain}")
    codec = doc.get("codec")
    if codec:
        out.append("codec (s, and the longest the GIL was held from a ticker thread): " + "; ".join(
            f"{name} {r['seconds']:.2f} s (stall {r['stall_s']:.3f} s)" for name, r in codec.items()))
    s = doc.get("summary", {})
    if "relay_growth" in s:
        out.append(f"relay seconds(K={max(c['workers'])}) / seconds(K={min(c['workers'])}) = {s['relay_growth']:.2f} (goal <= 1.5)")
    if "relay_speedup_at_max_k" in s:
        out.append(f"relay vs coordinator at K={max(c['workers'])}: {s['relay_speedup_at_max_k']:.2f}x faster (goal >= 3)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=512, help="blob size, MiB")
    p.add_argument("--workers", default="1,2,4", help="comma-separated K values")
    p.add_argument("--paths", default="coordinator,relay,gloo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    return run_main("bench/weights.py", args.json_out, lambda tmp, cleanup: run(args, tmp, cleanup), render,
                    prefix="elasticrl-bench-weights-")


if __name__ == "__main__":
    sys.exit(main())
