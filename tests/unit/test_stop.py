"""A worker leaves on SIGTERM even while its main thread is stuck in C++ (a collective with a
silent peer): the watchdog flushes what was registered and exits; a main thread that can take the
signal leaves the clean way (SystemExit) and the watchdog does nothing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = textwrap.dedent('''
    import datetime, sys, time
    from elasticrl.train import stop
    assert stop.install(grace_s=0.5)
    stop.on_forced_exit(lambda timeout_s: open(sys.argv[1], "w").write("flushed by the watchdog"))
    if sys.argv[2] == "store":
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # "ready" once the main thread is inside the wait, not just before it
        import threading
        threading.Timer(0.5, lambda: print("ready", flush=True)).start()
        store.wait(["never"], datetime.timedelta(seconds=50))  # C++, deaf to Python's handlers
    else:
        try:
            print("ready", flush=True)  # inside the try: the SIGTERM may come right after it
            while True:
                time.sleep(0.05)
        except SystemExit:
            print("clean exit", flush=True)
            raise
''')


def start(tmp_path, mode: str) -> subprocess.Popen:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "flushed"), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def terminate(proc: subprocess.Popen) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    return proc.returncode, time.monotonic() - t0, out


def test_a_worker_blocked_in_cpp_is_flushed_and_exits_soon_after_sigterm(tmp_path):
    proc = start(tmp_path, "store")
    code, took, out = terminate(proc)
    assert code == 128 + signal.SIGTERM, out
    assert took < 10, took  # not torchrun's 30 s SIGKILL
    assert (tmp_path / "flushed").read_text() == "flushed by the watchdog"
    assert "still running 0.5s after SIGTERM" in out


def test_a_worker_that_can_take_the_signal_exits_cleanly_without_the_watchdog(tmp_path):
    proc = start(tmp_path, "python")
    code, _, out = terminate(proc)
    assert code == 128 + signal.SIGTERM and "clean exit" in out, out
    assert not (tmp_path / "flushed").exists() and "still running" not in out
