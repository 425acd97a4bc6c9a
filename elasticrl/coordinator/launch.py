"""Start ``elasticrl coordinator`` as a subprocess on a free port and wait until it serves.

The demo, the benchmarks and the test fixtures all launch coordinators this one way: port 0 (or a
given port) plus ``--port-file``, then the file is polled under a deadline while the process is
watched for an early exit, whose log tail goes into the error.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time


class CoordinatorStartError(RuntimeError):
    """The coordinator subprocess exited, or did not serve, before its deadline."""


def coordinator_command(
    port_file: str | os.PathLike,
    *,
    port: int = 0,
    lease_ttl_s: float | None = None,
    state_dir: str | os.PathLike | None = None,
    extra_args: tuple[str, ...] | list[str] | None = (),
) -> list[str]:
    cmd = [sys.executable, "-m", "elasticrl", "coordinator", "--port", str(port), "--port-file", str(port_file)]
    if lease_ttl_s is not None:
        cmd += ["--lease-ttl", str(lease_ttl_s)]
    if state_dir is not None:
        cmd += ["--state-dir", str(state_dir)]
    return cmd + list(extra_args or ())


def wait_for_port(
    proc: subprocess.Popen, port_file: str | os.PathLike, *, timeout_s: float, log_path: str | os.PathLike | None = None
) -> int:
    """The port ``proc`` wrote to ``port_file``; CoordinatorStartError if it exits or times out first."""
    path = pathlib.Path(port_file)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise CoordinatorStartError(f"the coordinator exited with status {proc.returncode}{_tail(log_path)}")
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            pass  # not written yet (it is written atomically once the server listens)
        if time.monotonic() > deadline:
            raise CoordinatorStartError(f"the coordinator did not serve within {timeout_s:g}s{_tail(log_path)}")
        time.sleep(0.02)


def start_coordinator(
    port_file: str | os.PathLike,
    log_path: str | os.PathLike,
    *,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    **command,
) -> tuple[subprocess.Popen, int]:
    """Start a coordinator (``command``: see ``coordinator_command``), logging to ``log_path``
    (appended); return the process and its port. A stale ``port_file`` is removed first."""
    pathlib.Path(port_file).unlink(missing_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            coordinator_command(port_file, **command), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
    try:
        return proc, wait_for_port(proc, port_file, timeout_s=timeout_s, log_path=log_path)
    except BaseException:  # a start that failed, or the caller stopping (SIGTERM, Ctrl-C) meanwhile
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        raise


def stop_coordinator(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM (a clean shutdown), then SIGKILL if it lingers past ``timeout_s``; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    return proc.returncode


def _tail(log_path: str | os.PathLike | None, chars: int = 2000) -> str:
    if log_path is None:
        return ""
    try:
        text = pathlib.Path(log_path).read_text(errors="replace")
    except OSError:
        return f"; no log at {log_path}"
    return f"; log {log_path} ends with:\n{text[-chars:]}"
