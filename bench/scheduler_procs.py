"""Processes and readings for ``bench/scheduler.py``: the coordinator, rollout worker processes
(``scheduler_worker.py``) and the driver's helpers (submit and wait, /proc CPU and memory).

Every process started here is stopped with SIGTERM, then SIGKILL if it lingers; every wait has a
deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench.benchmain import BenchError  # noqa: E402,F401 - re-exported for bench/scheduler.py

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORKER = BENCH_DIR / "scheduler_worker.py"

_STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"[bench {time.monotonic() - _STARTED:6.1f}s] {msg}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    """This environment, with the repository first on PYTHONPATH (for every process started)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def tail(path: pathlib.Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it lingers past ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used; Linux /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_mb(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MB of process ``pid``; Linux /proc."""
    fields = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(round(int(fields[k].split()[0]) / 1024, 1) for k in ("VmRSS", "VmHWM"))


# -- processes -------------------------------------------------------------------------------


class Coordinator:
    """An ``elasticrl coordinator`` subprocess on a free port; stopped by ``cleanup``."""

    def __init__(
        self, tmp: pathlib.Path, label: str, state_dir: pathlib.Path | None, cleanup: contextlib.ExitStack,
        extra_args: list[str] | None = None,
    ):
        from elasticrl.coordinator.launch import CoordinatorStartError, start_coordinator

        d = tmp / label
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / "coordinator.log"
        try:
            self.proc, port = start_coordinator(
                d / "port", self.log_path, cwd=REPO, env=child_env(), state_dir=state_dir, extra_args=extra_args
            )
        except CoordinatorStartError as exc:
            raise BenchError(str(exc)) from None
        cleanup.callback(self.stop)
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> None:
        from elasticrl.coordinator.launch import stop_coordinator

        stop_coordinator(self.proc)

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)


class WorkerProc:
    """One ``scheduler_worker.py``; SIGTERM on stop (it then writes its report), SIGKILL if it lingers."""

    def __init__(self, d: pathlib.Path, address: str, run: str, member: str, **opts):
        self.member = member
        self.ready_path, self.report_path, self.log_path = d / f"{member}.ready", d / f"{member}.report.json", d / f"{member}.log"
        cmd = [sys.executable, str(WORKER), "--coordinator", address, "--run", run, "--member", member,
               "--ready", str(self.ready_path), "--report", str(self.report_path)]
        for key, value in opts.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        with open(self.log_path, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=child_env())

    def stop(self) -> dict | None:
        stop_process(self.proc)
        if not self.report_path.exists():
            log(f"  worker {self.member} wrote no report (exit {self.proc.returncode}): {tail(self.log_path, 500)}")
            return None
        return json.loads(self.report_path.read_text())


class WorkerSet:
    """Worker processes of one run, all connected before ``__enter__`` returns."""

    def __init__(self, d: pathlib.Path, client, address: str, run: str, specs: list[dict], timeout_s: float):
        d.mkdir(parents=True, exist_ok=True)
        self.client, self.run, self.timeout_s = client, run, timeout_s
        self.workers: list[WorkerProc] = []
        self.reports: list[dict | None] = []
        try:
            for spec in specs:
                self.workers.append(WorkerProc(d, address, run, **spec))
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "WorkerSet":
        try:
            self._wait_connected()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_connected(self) -> None:
        # Join (the coordinator's status lists the live members), then the Work stream (each
        # worker writes its ready file once its stream is up): only then does a static split
        # count it.
        deadline = time.monotonic() + self.timeout_s
        while True:
            for w in self.workers:
                if w.proc.poll() is not None:
                    raise BenchError(f"worker {w.member} exited with {w.proc.returncode}:\n{tail(w.log_path)}")
            runs = self.client.status(self.run).get("runs", [])
            live = [m for r in runs for m in r.get("snapshot", {}).get("members", []) if m.get("state") == "MEMBER_STATE_LIVE"]
            if len(live) >= len(self.workers) and all(w.ready_path.exists() for w in self.workers):
                break
            if time.monotonic() > deadline:
                raise BenchError(f"run {self.run}: {len(live)}/{len(self.workers)} workers joined within {self.timeout_s:.0f}s")
            time.sleep(0.05)
        time.sleep(0.2)  # the coordinator registers the stream right after it answers the hello

    def stop(self) -> list[dict | None]:
        if not self.reports:
            self.reports = [w.stop() for w in self.workers]
        return self.reports


def tasks(prefix: str, n: int, samples: int):
    from elasticrl.scheduler.state import TaskSpec

    return [TaskSpec(task_id=f"{prefix}{i:06d}", prompt_ids=list(range(1, 17)), num_samples=samples) for i in range(n)]


def run_iteration(client, run: str, iteration: int, specs, timeout_s: float, **submit) -> tuple[dict, float, float]:
    """Submit and wait for the seal: (manifest, submit call start, seal seen), monotonic seconds."""
    started = time.monotonic()
    client.submit_iteration(run, iteration, specs, **submit)
    from elasticrl.errors import CoordinatorTimeoutError

    try:
        manifest = client.wait_sealed(run, iteration, timeout_s)
    except CoordinatorTimeoutError as exc:
        raise BenchError(str(exc)) from None
    return manifest, started, time.monotonic()
