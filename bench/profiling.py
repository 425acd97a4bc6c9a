"""``--profile`` of the bench scripts: py-spy samples the coordinator process while it is measured.

``Profiler(out_dir)`` attaches ``py-spy record`` to a pid for as long as the ``with`` block runs and
writes ``<label>.collapsed.txt`` (py-spy's collapsed stacks: open it at https://www.speedscope.app,
or feed it to flamegraph.pl) and ``<label>.top.txt``: the functions with the most samples, self (the frame on top) and total (the
frame anywhere on the stack), from py-spy's collapsed stacks. ``summary()`` gives the same tops as
JSON for the bench's document. py-spy needs ptrace rights on the pid (root, or
``kernel.yama.ptrace_scope=0``); where it is missing the bench stops with the install command.
"""

from __future__ import annotations

import collections
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from bench.benchmain import BenchError

TOP = 15


def _py_spy() -> str:
    exe = shutil.which("py-spy") or str(pathlib.Path(sys.executable).with_name("py-spy"))
    if not pathlib.Path(exe).exists():
        raise BenchError(f"--profile needs py-spy: {sys.executable} -m pip install py-spy")
    return exe


class Profiler:
    """Profiles of the processes measured, one per ``attach(pid, label)`` block, in ``out_dir``."""

    def __init__(self, out_dir: str | pathlib.Path, rate_hz: int = 250):
        self.out_dir = pathlib.Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rate_hz = rate_hz
        self.exe = _py_spy()
        self.tops: dict[str, dict] = {}

    def attach(self, pid: int, label: str) -> "_Recording":
        return _Recording(self, pid, label)


class _Recording:
    def __init__(self, profiler: Profiler, pid: int, label: str):
        self.profiler, self.pid, self.label = profiler, pid, label
        self.raw = profiler.out_dir / f"{label}.collapsed.txt"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "_Recording":
        p = self.profiler
        # One sampler: a second one (for another output format) would double the load on the
        # process measured; speedscope reads the collapsed stacks as they are.
        self.proc = subprocess.Popen(
            [p.exe, "record", "--pid", str(self.pid), "--rate", str(p.rate_hz), "--format", "raw",
             "--output", str(self.raw), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(0.5)  # attached before the measured work starts
        if self.proc.poll() is not None:
            raise BenchError(f"py-spy could not attach to pid {self.pid}: {self.proc.stderr.read().strip()}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.raw.exists():
            top = top_functions(self.raw.read_text())
            self.profiler.tops[self.label] = top
            (self.profiler.out_dir / f"{self.label}.top.txt").write_text(render_top(self.label, top))


def _frame(entry: str) -> str:
    """py-spy's ``function (file.py:line)`` without the line: one row per function."""
    name, _, where = entry.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})" if where else name


def top_functions(collapsed: str, n: int = TOP) -> dict:
    """From collapsed stacks (``frame;frame;... count`` per line): the ``n`` functions with the
    most samples on top of the stack (self) and anywhere on it (total), as shares of all samples."""
    own: collections.Counter = collections.Counter()
    anywhere: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [_frame(f) for f in stack.split(";")]
        own[frames[-1]] += k
        for f in set(frames):
            anywhere[f] += k
    share = lambda c: [{"function": f, "share": round(k / total, 4)} for f, k in c.most_common(n)]  # noqa: E731
    return {"samples": total, "self": share(own) if total else [], "total": share(anywhere) if total else []}


def render_top(label: str, top: dict) -> str:
    lines = [f"{label}: {top['samples']} samples", f"{'self':>6}  function"]
    lines += [f"{r['share'] * 100:5.1f}%  {r['function']}" for r in top["self"]]
    lines += ["", f"{'total':>6}  function"]
    lines += [f"{r['share'] * 100:5.1f}%  {r['function']}" for r in top["total"]]
    return "\n".join(lines) + "\n"
