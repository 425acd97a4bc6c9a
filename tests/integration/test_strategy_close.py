"""A strategy's ``close()`` lets its process group be destroyed right after it, on the same thread,
without deadlocking against gloo's worker threads (``train/dist.final_barrier``).

With a plain ``dist.barrier()`` there, the loop below hung within its first 15 cycles in each of
three tries: the main thread, holding the GIL, joined a ``pt_gloo_runloop`` thread in
``~ProcessGroupGloo`` while that thread waited for the GIL to free the barrier's tensors. That is
how a DDP rank once never exited in CI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_ddp_strategy_closed_and_destroyed_a_hundred_times_never_hangs(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "integration" / "close_worker.py"), "--dir", str(tmp_path), "--cycles", "100",
         "--cycle-timeout-s", "30"],
        cwd=REPO, capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0 and (tmp_path / "done").read_text() == "100", proc.stdout[-2000:] + proc.stderr[-4000:]
