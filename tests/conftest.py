"""Shared fixtures: a real ``elasticrl coordinator`` subprocess on a free port, killable by pid."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02, message: str = "condition"):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {message}")
        time.sleep(interval_s)


class CoordinatorProcess:
    """One coordinator subprocess. ``kill()`` is SIGKILL; ``start()`` again reuses the state dir
    and, after the first start, the same port (so clients reconnect to the same address)."""

    def __init__(self, tmp: pathlib.Path, *, lease_ttl_s: float = 1.0, extra_args: list[str] | None = None, durable: bool = True):
        self.tmp = tmp
        self.state_dir = tmp / "state" if durable else None
        self.lease_ttl_s = lease_ttl_s
        self.extra_args = list(extra_args or [])
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / "coordinator.log"
        self._starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 20.0) -> "CoordinatorProcess":
        from elasticrl.coordinator.launch import start_coordinator

        port_file = self.tmp / f"port-{self._starts}"
        self._starts += 1
        self.proc, self.port = start_coordinator(
            port_file,
            self.log_path,
            timeout_s=timeout_s,
            cwd=REPO,
            port=self.port,
            lease_ttl_s=self.lease_ttl_s,
            state_dir=self.state_dir,
            extra_args=self.extra_args,
        )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        from elasticrl.coordinator.launch import stop_coordinator

        return None if self.proc is None else stop_coordinator(self.proc)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


@pytest.fixture
def coordinator_factory(tmp_path):
    """Make coordinators with custom settings; every one is killed at teardown."""
    made: list[CoordinatorProcess] = []

    def make(**kwargs) -> CoordinatorProcess:
        sub = tmp_path / f"coord{len(made)}"
        sub.mkdir()
        proc = CoordinatorProcess(sub, **kwargs).start()
        made.append(proc)
        return proc

    yield make
    for proc in made:
        with contextlib.suppress(Exception):
            proc.kill()


@pytest.fixture
def coordinator(coordinator_factory) -> CoordinatorProcess:
    """A durable coordinator with a 1 s lease TTL on a free port."""
    return coordinator_factory()


@pytest.fixture
def client(coordinator):
    from elasticrl.coordinator.client import CoordinatorClient

    with CoordinatorClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=10) as c:
        yield c


@pytest.fixture(autouse=True)
def _elasticrl_environment():
    """Restore the ``ELASTICRL_*`` environment after each test: a rendezvous handler built in
    process exports the coordinator's address, token file and CA for the workers its agent would
    start (as a real torchrun agent does), which must not leak into later tests' subprocesses."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("ELASTICRL_")}
    yield
    for key in [k for k in os.environ if k.startswith("ELASTICRL_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _free_snapshots(tmp_path_factory):
    """Runs that a test stops before they finish keep their snapshots in host memory (a resumed
    run would need them); free the ones this session made: those of run dirs under its base temp
    directory (``run_root`` names them by the run dir's hash), not another pytest session's on the
    same machine, whose running demos still need theirs."""
    from elasticrl.train.snapshot_plan import run_dir_tag

    root = pathlib.Path("/dev/shm/elasticrl")
    before = set(root.iterdir()) if root.is_dir() else set()
    yield
    if not root.is_dir():
        return
    new = set(root.iterdir()) - before
    if not new:
        return
    base = tmp_path_factory.getbasetemp()
    tags = set()
    for dirpath, _, _ in os.walk(base):  # a run dir may sit anywhere in a test's tmp_path
        tags.add(run_dir_tag(dirpath))
    for path in new:
        if path.name.rsplit("-", 1)[-1] in tags:
            shutil.rmtree(path, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--part", choices=("all", "waits", "busy"), default="all",
        help="all tests, or only those marked waits (they mostly wait, not on the CPU: run on several "
             "processes), or only the others (timed on this machine's cores: run one at a time)",
    )


def pytest_collection_modifyitems(config, items):
    part = config.getoption("part")
    if part == "all":
        return
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("waits") is not None) == (part == "waits") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def gloo_world_of_one():
    """A gloo process group of one rank in this process (and one intra-op thread, as run.num_threads
    would give a worker: a tiny model's backward is slower on several threads of a busy machine)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
