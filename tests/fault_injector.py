"""Coordinator faults on a schedule, for the random fault tests (client deadlines, weights): a
thread SIGSTOPs, SIGKILLs and restarts a coordinator, resets the connections through a
``TcpProxy`` or drops its replies, and records when each fault was on; and the check, after
the clients closed, that none of their threads is left."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback

from tests.conftest import CoordinatorProcess
from tests.tcp_proxy import TcpProxy


@dataclasses.dataclass(frozen=True)
class Fault:
    gap_s: float  # quiet time before it
    kind: str  # stop | kill | reset | lose | none
    duration_s: float  # paused, down before the restart, replies lost, or quiet


class Injector:
    """Applies a fault plan from a thread; ``clear`` ends it (SIGCONT, and a restart if the
    coordinator is down) and joins the thread. Records when each fault was on.

    ``afterglow_s``: how long after a fault clears ``faulty`` still counts a call as under it.
    ``lose_after_fault_s``: lost replies only this long after the previous fault cleared."""

    def __init__(self, coordinator: CoordinatorProcess, plan: list[Fault], proxy: TcpProxy, *,
                 afterglow_s: float, lose_after_fault_s: float = 0.0):
        self.coordinator, self.plan, self.proxy = coordinator, plan, proxy
        self.afterglow_s, self.lose_after_fault_s = afterglow_s, lose_after_fault_s
        self.t0 = time.monotonic()
        self.windows: list[tuple[float, float, str]] = []  # (began, cleared, what)
        self.current: tuple[float, str] | None = None
        self.done = threading.Event()
        self._quit = threading.Event()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fault-injector", daemon=True)

    def start(self) -> "Injector":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for fault in self.plan:
                if self._quit.wait(fault.gap_s):
                    break
                if fault.kind == "lose" and self.windows and self.lose_after_fault_s:
                    if self._quit.wait(max(0.0, self.windows[-1][1] + self.lose_after_fault_s - time.monotonic())):
                        break
                if fault.kind == "none":
                    if self._quit.wait(fault.duration_s):
                        break
                    continue
                self._apply(fault)
        except BaseException as exc:  # noqa: BLE001 - reported by clear()
            self.error = exc
        finally:
            self.done.set()

    def _apply(self, fault: Fault) -> None:
        began = time.monotonic()
        what = f"{fault.kind} {fault.duration_s:.1f}s"
        with self._lock:
            self.current = (began, what)
        try:
            if fault.kind == "stop":
                os.kill(self.coordinator.pid, signal.SIGSTOP)
                try:
                    self._quit.wait(fault.duration_s)
                finally:
                    os.kill(self.coordinator.pid, signal.SIGCONT)
            elif fault.kind == "reset":
                self.proxy.reset_all()
            elif fault.kind == "lose":
                self.proxy.drop_replies = True
                try:
                    self._quit.wait(fault.duration_s)
                finally:
                    self.proxy.reset_all()
                    self.proxy.drop_replies = False
            else:
                self.coordinator.kill()
                self._quit.wait(fault.duration_s)
                self.coordinator.start()
        finally:
            with self._lock:
                self.current = None
                self.windows.append((began, time.monotonic(), what))

    def clear(self, timeout_s: float = 30.0) -> None:
        self._quit.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the fault injector did not stop"
        self.proxy.drop_replies = False
        proc = self.coordinator.proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        else:
            self.coordinator.start()
        if self.error is not None:
            raise AssertionError(f"the fault injector failed: {self.error!r}") from self.error

    def faulty(self, start: float, end: float) -> bool:
        """Whether a fault was on (or had just cleared) at some moment of [start, end]."""
        with self._lock:
            windows = list(self.windows)
            if self.current is not None:
                windows.append((self.current[0], float("inf"), self.current[1]))
        return any(began <= end and start <= cleared + self.afterglow_s for began, cleared, _ in windows)

    def timeline(self) -> str:
        with self._lock:
            windows = list(self.windows)
        return ", ".join(f"{what} at {b - self.t0:.2f}-{c - self.t0:.2f}s" for b, c, what in windows) or "no faults"


def safely_end(coordinator: CoordinatorProcess) -> None:
    """SIGCONT and SIGKILL the coordinator, whatever state it was left in."""
    proc = coordinator.proc
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        coordinator.kill()


def thread_stacks() -> str:
    """Every thread's stack but the main thread's (pytest's own frames)."""
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                     for t in threading.enumerate() if t.ident in frames and t is not threading.main_thread())


def wait_threads_gone(before: set[threading.Thread], timeout_s: float = 10.0) -> None:
    """Wait for every thread not in ``before`` to end; AssertionError naming them (with their stacks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"threads left after every client closed: {[t.name for t in left]}\n{thread_stacks()}")
        time.sleep(0.05)
