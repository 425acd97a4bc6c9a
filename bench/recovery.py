"""Losing a node mid-run: iterations redone, time to training again, and what snapshots cost.

Two sections (``--sections``), one run:

* ``snapshot``: the per-iteration snapshot of a ``--state-gb`` GB state dict on the CPU (fp32
  tensors of 64 MiB), replicated as under DDP, on one rank of a world of ``--world``: its shard (the
  tensors it owns, ``shards.own_part``) staged into one buffer (the copy on the critical path), then
  written to host memory (``/dev/shm``) as a DCP safetensors shard (``shards.write_shard``,
  streamed, in the background), and read back whole from the shards of the world; against the baseline
  measured in the same run, the full state on every node (a ``clone`` of all of it, then the
  files of a checkpoint), and the shard written by DCP's own safetensors writer (``dcp.save`` with
  ``HuggingFaceStorageWriter``, what ``write_shard`` used before it streamed). Each in GB/s of the
  bytes it moves, with the longest the GIL kept a 10 ms ticker thread waiting meanwhile (``stall``:
  what a keep-alive thread of the process would have waited).
* ``demo``: ``elasticrl run`` of the bundled demo with 3 nodes (lease ``--lease-ttl``, 5 s), once
  undisturbed, then per ``--phases`` entry with the last node SIGKILLed (agent and worker) during
  that phase of iteration ``--kill-at`` (rollout, update, or checkpoint: while a checkpoint is
  being written, with one per iteration on every node), and once with that node gone silent
  (SIGSTOP of all its processes during the update: no socket closes, only its lease tells). The
  ``--baseline-phases`` kills and the silent host run again with torchrun's c10d rendezvous
  (``--baseline``), in the same run. Reported: iterations redone
  (records of an iteration beyond its first, plus iterations finished before the kill that the
  resumed world ran again), ``ready s``: seconds from the kill until both survivors resumed
  training (their workers' "resumed from iteration" log line), the gap in records around the
  failure (includes one iteration), the mean iteration time, the snapshot's share of it
  (``t_snapshot``, on the critical path: staging and the exchange with the buddies) and the
  exchange's part of it (``t_snapshot_exchange``), and the final reward (mean of the last 5
  iterations). ``--lose-host`` adds a case where the killed node's snapshots in host
  memory are deleted too (its host lost with its memory), so its shard must come from its buddy.

    python bench/recovery.py                           # ~10 min on 2 cores
    python bench/recovery.py --state-gb 0.25 --phases update --json-out /tmp/recovery.json
    python bench/recovery.py --sections snapshot --state-gb 2   # the snapshot section alone (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

from bench.benchmain import BenchError, run_main  # noqa: E402
from bench.gil import timed  # noqa: E402


def dcp_write(chunks: dict, directory: str) -> None:
    """The baseline: the whole tensors of ``chunks`` through DCP's own safetensors writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    dcp.save({k: c.tensor for k, c in chunks.items()}, storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True),
             no_dist=True)


def snapshot_cost(state_gb: float, world: int) -> dict:
    import torch

    from elasticrl.train import checkpoint as ckpt
    from elasticrl.train.shard_wire import pack, unpack
    from elasticrl.train.shards import Chunk, own_part, read_shards, write_shard

    n = max(1, round(state_gb * 2**30 / (64 << 20)))
    state = {f"t{i}": torch.randn(16 << 20) for i in range(n)}  # 64 MiB of fp32 each
    size = sum(t.numel() * t.element_size() for t in state.values())
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix="elasticrl-recovery-", dir=root)
    try:
        # Before: every node copies and writes the full state.
        t0 = time.perf_counter()
        copy = {k: v.detach().clone() for k, v in state.items()}
        clone_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ckpt.save_checkpoint(os.path.join(directory, "full"), 1, copy, {"state": {}, "param_groups": []}, {}, keep_last=1)
        write_s = time.perf_counter() - t0
        del copy
        # Now: rank 0 of a world of `world` stages and writes its shard; then the whole is read back.
        chunks = {k: Chunk.whole(v, replicated=True) for k, v in state.items()}
        shards = os.path.join(directory, "shards")
        os.makedirs(shards)
        staged = {}
        stage_s, stage_stall = timed(lambda: staged.update(zip(("header", "payload"), pack(own_part(chunks, 0, world)))))
        shard_bytes = staged["payload"].numel()
        own = unpack(staged["header"], staged["payload"])
        shard_write_s, shard_write_stall = timed(lambda: write_shard(own, os.path.join(shards, "shard-00000.safetensors")))
        dcp_dir = os.path.join(directory, "dcp")
        dcp_write_s, dcp_write_stall = timed(lambda: dcp_write(own, dcp_dir))
        shutil.rmtree(dcp_dir)
        del staged, own
        for rank in range(1, world):  # the others' shards, for the read-back
            write_shard(own_part(chunks, rank, world), os.path.join(shards, f"shard-{rank:05d}.safetensors"))
        dest = {k: Chunk.whole(torch.empty_like(v)) for k, v in state.items()}
        read_s, read_stall = timed(lambda: read_shards(shards, dest))
        assert all(torch.equal(dest[k].tensor, v) for k, v in state.items()), "the shards did not read back"
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    def rate(nbytes: int, seconds: float) -> float:
        return round(nbytes / max(seconds, 1e-9) / 1e9, 2)

    return {"bytes": size, "where": root, "world": world, "shard_bytes": shard_bytes,
            "clone_s": round(clone_s, 3), "clone_gb_s": rate(size, clone_s), "write_s": round(write_s, 3), "write_gb_s": rate(size, write_s),
            "stage_s": round(stage_s, 3), "stage_gb_s": rate(shard_bytes, stage_s), "stage_stall_s": round(stage_stall, 3),
            "shard_write_s": round(shard_write_s, 3), "shard_write_gb_s": rate(shard_bytes, shard_write_s),
            "shard_write_stall_s": round(shard_write_stall, 3),
            "dcp_write_s": round(dcp_write_s, 3), "dcp_write_gb_s": rate(shard_bytes, dcp_write_s),
            "dcp_write_stall_s": round(dcp_write_stall, 3),
            "read_s": round(read_s, 3), "read_gb_s": rate(size, read_s), "read_stall_s": round(read_stall, 3)}


def demo_run(tmp: pathlib.Path, case: dict, args) -> dict:
    """One ``elasticrl run`` of the demo with 3 nodes; ``case``: label, backend, and phase/signal of
    the kill (None: undisturbed)."""
    label, phase = case["label"], case.get("phase")
    out = tmp / label
    cmd = [sys.executable, "-m", "elasticrl.cli", "run", str(REPO / "elasticrl" / "configs" / "demo.toml"),
           "--nodes", "3", "--iterations", str(args.iterations), "--out", str(out), "--lease-ttl", str(args.lease_ttl),
           "--rdzv-backend", case["backend"], "--timeout", str(args.timeout)]
    if phase:
        cmd += ["--kill-at", str(args.kill_at), "--kill-phase", phase, "--kill-signal", case["signal"]]
    if phase == "checkpoint":  # a checkpoint every iteration, each node its own, to strike during one
        cmd += ["--checkpoint-every", "1", "--own-checkpoints"]
    if case.get("lose_host"):
        cmd.append("--lose-host")
    if case.get("restart"):
        cmd.append("--restart-workers")
    cmd += ["--", f"--trainer.strategy={args.strategy}"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout + 60)
        rc, stdout = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc, stdout = None, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    wall = time.monotonic() - t0
    row = {"run": label, "backend": case["backend"], "in_place": case["backend"] == "elasticrl" and not case.get("restart"),
           "wall_s": round(wall, 1)}
    if rc != 0:
        # A baseline that never recovers is a result, not a bench failure.
        if case["backend"] != "elasticrl":
            return {**row, "error": f"exited {rc} after {wall:.0f}s (did not recover within --timeout {args.timeout:g}s)"}
        raise BenchError(f"{label}: elasticrl run exited {rc}:\n{stdout[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    iterations = [r["iteration"] for r in records]
    seconds = [r["seconds"] for r in records]
    snap = [r.get("t_snapshot", 0.0) for r in records]
    exchange = [r.get("t_snapshot_exchange", 0.0) for r in records]
    row.update({
        "iterations": len(set(iterations)),
        "iteration_s_mean": round(statistics.mean(seconds), 4),
        "snapshot_ms_mean": round(1000 * statistics.mean(snap), 2),
        "snapshot_share": round(sum(snap) / sum(seconds), 4),
        "snapshot_exchange_share": round(sum(exchange) / sum(seconds), 4),
        "reward_last5": round(statistics.mean(r["reward_mean"] for r in records[-5:]), 3),
    })
    if phase:
        resumed = [int(m) for m in re.findall(r"resumed from iteration (\d+)", stdout)]
        killed = re.search(r"killing node-2 .*? (?:of|after) iteration (\d+)", stdout)
        k = int(killed.group(1)) if killed else args.kill_at
        before = [r for r in records if r["world_size"] == 3]
        after = [r for r in records if r["world_size"] == 2]
        finished_before = max((r["iteration"] for r in before), default=0)
        rerun = max(0, finished_before - min(resumed)) if resumed else 0
        row.update({
            "kill_phase": phase, "kill_signal": case["signal"], "kill_iteration": k,
            "resumed_from": min(resumed) if resumed else None,
            "iterations_redone": (len(iterations) - len(set(iterations))) + rerun,
            "kill_to_training_s": kill_to_training(out / "logs"),
            "gap_s": round(after[0]["time_unix_s"] - before[-1]["time_unix_s"], 2) if before and after else None,
        })
    return row


LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*resumed from iteration", re.M)


def kill_to_training(logs: pathlib.Path) -> float | None:
    """Seconds from the kill (``events.jsonl``) until the last survivor resumed training (its
    worker's "resumed from iteration" line, the state loaded and the next rollout starting)."""
    events = [json.loads(line) for line in (logs / "events.jsonl").read_text().splitlines()]
    (kill,) = [e for e in events if e["event"] == "kill"]
    ready = []
    for k in (0, 1):  # the survivors; node-2 is the victim
        times = [time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
                 for m in LOG_TIME.finditer((logs / f"node-{k}.log").read_text())]
        after = [t for t in times if t > kill["time_unix_s"]]
        if not after:
            return None
        ready.append(min(after))
    return round(max(ready) - kill["time_unix_s"], 2)


def cases(args) -> list[dict]:
    out = [{"label": "undisturbed", "backend": "elasticrl"}]
    for backend in ["elasticrl"] + ([args.baseline] if args.baseline != "none" else []):
        for phase in (args.phases if backend == "elasticrl" else args.baseline_phases).split(","):
            out.append({"label": f"{backend}-kill-{phase}", "backend": backend, "phase": phase, "signal": "KILL"})
        if args.host_stop:
            out.append({"label": f"{backend}-stop-update", "backend": backend, "phase": "update", "signal": "STOP"})
    for phase in filter(None, args.restart_phases.split(",")):  # the survivors restarted by torchrun, not in place
        out.append({"label": f"restart-kill-{phase}", "backend": "elasticrl", "phase": phase, "signal": "KILL", "restart": True})
    if args.lose_host:  # elasticrl only: c10d runs keep no snapshots
        out.append({"label": "elasticrl-lost-host-update", "backend": "elasticrl", "phase": "update", "signal": "KILL", "lose_host": True})
    return out


def run(args, tmp: pathlib.Path) -> dict:
    sections = args.sections.split(",")
    if not sections or set(sections) - {"snapshot", "demo"}:
        raise BenchError(f"--sections: {args.sections!r}: each must be snapshot or demo")
    doc = {"snapshot": snapshot_cost(args.state_gb, args.world) if "snapshot" in sections else None,
           "lease_ttl_s": args.lease_ttl, "demo": []}
    for case in cases(args) if "demo" in sections else []:
        print(f"bench/recovery.py: {case['label']} ...", file=sys.stderr, flush=True)
        doc["demo"].append(demo_run(tmp, case, args))
    return doc


def render(doc: dict) -> str:
    s = doc["snapshot"]
    lines = [] if s is None else [
        (f"snapshot of {s['bytes'] / 2**30:.2f} GiB on the CPU, one rank of a world of {s['world']} "
         f"(its shard {s['shard_bytes'] / 2**30:.2f} GiB): stage {s['stage_s']:.3f} s ({s['stage_gb_s']} GB/s, on the critical "
         f"path; stall {s['stage_stall_s']:.3f} s); write to {s['where']} {s['shard_write_s']:.3f} s ({s['shard_write_gb_s']} GB/s, "
         f"in the background; stall {s['shard_write_stall_s']:.3f} s); read back whole from {s['world']} shards {s['read_s']:.3f} s "
         f"({s['read_gb_s']} GB/s; stall {s['read_stall_s']:.3f} s)"),
        (f"  baseline, the full state on every node: copy {s['clone_s']:.3f} s ({s['clone_gb_s']} GB/s, on the critical path); "
         f"checkpoint files {s['write_s']:.3f} s ({s['write_gb_s']} GB/s, in the background)"),
        (f"  baseline, the shard through DCP's safetensors writer: {s['dcp_write_s']:.3f} s ({s['dcp_write_gb_s']} GB/s; "
         f"stall {s['dcp_write_stall_s']:.3f} s)"),
    ]
    if not doc["demo"]:
        return "\n".join(lines)
    lines += [
        (f"lease TTL {doc['lease_ttl_s']:g} s; 'ready s': from the kill until both survivors resumed training; 'snapshot': its "
         "share of the iteration (on the critical path), 'exchange': the buddy exchange's part of it"),
        (f"{'run':<26} {'redone':>6} {'resumed':>8} {'ready s':>8} {'gap s':>6} {'iter s':>7} {'snapshot':>9} {'exchange':>9} "
         f"{'reward':>7} {'wall s':>7}"),
    ]
    for r in doc["demo"]:
        if "error" in r:
            lines.append(f"{r['run']:<26} {r['error']}")
            continue
        lines.append(
            f"{r['run']:<26} {r.get('iterations_redone', '-')!s:>6} {r.get('resumed_from', '-')!s:>8} "
            f"{r.get('kill_to_training_s', '-')!s:>8} {r.get('gap_s', '-')!s:>6} {r['iteration_s_mean']:>7.3f} "
            f"{r['snapshot_share'] * 100:>8.2f}% {r.get('snapshot_exchange_share', 0.0) * 100:>8.2f}% {r['reward_last5']:>7.3f} "
            f"{r['wall_s']:>7.1f}"
        )
    by = {(r.get("backend"), r.get("kill_phase"), r.get("kill_signal"), r.get("in_place")): r for r in doc["demo"]}
    for (backend, phase, sig, in_place), r in by.items():
        for base_key, name in (((("c10d", phase, sig, False)), "c10d"), (("elasticrl", phase, sig, False), "restarted workers")):
            base = by.get(base_key)
            if in_place and phase and base and r.get("kill_to_training_s") and base.get("kill_to_training_s"):
                lines.append(f"{phase} SIG{sig}: {name} / in place, time to training = "
                             f"{base['kill_to_training_s'] / r['kill_to_training_s']:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-gb", type=float, default=1.0, help="size of the state dict of the snapshot section, GB (default: %(default)s)")
    p.add_argument("--sections", default="snapshot,demo", help="comma-separated: snapshot, demo (default: %(default)s)")
    p.add_argument("--world", type=int, default=3, help="ranks the snapshot section's state is sharded over (default: %(default)s)")
    p.add_argument("--strategy", choices=["ddp", "deepspeed", "fsdp2"], default="ddp",
                   help="trainer.strategy of the demo runs (deepspeed: ZeRO-2) (default: %(default)s)")
    p.add_argument("--phases", default="rollout,update,checkpoint",
                   help="SIGKILL phases, comma-separated: rollout, update, checkpoint, boundary (default: %(default)s)")
    p.add_argument("--baseline-phases", default="update", help="SIGKILL phases of the baseline runs (default: %(default)s)")
    p.add_argument("--restart-phases", default="update",
                   help="SIGKILL phases run again with the survivors' workers restarted by torchrun (demo --restart-workers) "
                   "instead of re-formed in place; empty: none (default: %(default)s)")
    p.add_argument("--no-host-stop", dest="host_stop", action="store_false",
                   help="skip the silent-host case (SIGSTOP of every process of the node during the update)")
    p.add_argument("--lose-host", action="store_true",
                   help="add a case where the killed node's snapshots in host memory are deleted too (buddy copies only)")
    p.add_argument("--baseline", choices=["c10d", "none"], default="c10d",
                   help="the same kills with torchrun's c10d rendezvous, in the same run (default: %(default)s)")
    p.add_argument("--lease-ttl", type=float, default=5.0, help="coordinator lease, seconds (default: %(default)s)")
    p.add_argument("--iterations", type=int, default=20, help="demo iterations (default: %(default)s)")
    p.add_argument("--kill-at", type=int, default=6, help="iteration during which the node dies (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=300.0, help="limit per demo run, seconds (default: %(default)s)")
    p.add_argument("--json-out", metavar="PATH", help="write the JSON here (the table then goes to stdout)")
    args = p.parse_args(argv)
    if args.world < 1:
        p.error(f"--world: {args.world} must be at least 1")
    return run_main("bench/recovery.py", args.json_out, lambda tmp, cleanup: run(args, tmp), render, prefix="elasticrl-recovery-")


if __name__ == "__main__":
    raise SystemExit(main())
