"""The coordinator's allocator tuning (``coordinator/malloc.py``) and the ways to keep glibc's defaults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = "from elasticrl.coordinator import malloc; print(malloc.tune())"


def tuned(env: dict[str, str]) -> str:
    """``malloc.tune()`` in a fresh process (the thresholds are process-wide)."""
    import os

    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_thresholds_are_set_unless_the_environment_says_otherwise():
    assert tuned({"ELASTICRL_MALLOC_TUNE": "1"}) == "True"
    assert tuned({"ELASTICRL_MALLOC_TUNE": "0"}) == "False"
    assert tuned({"MALLOC_TRIM_THRESHOLD_": "1048576"}) == "False"  # glibc's own tunable wins


def test_a_sender_stays_within_glibcs_own_dynamic_range():
    from elasticrl.coordinator.malloc import GLIBC_MMAP_MAX, sender_thresholds

    assert sender_thresholds(1 << 20) == (4 << 20, 64 << 20)  # 4 MiB at least
    assert sender_thresholds(4 << 20) == (8 << 20, 64 << 20)  # twice the batch (RolloutWorker's default)
    assert sender_thresholds(1 << 30) == (GLIBC_MMAP_MAX, 64 << 20)  # never past glibc's own ceiling


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_an_engine_worker_process_tunes_its_allocator_as_a_sender():
    probe = "from elasticrl.coordinator import malloc; print(malloc.tune_sender(4 << 20))"
    import os

    for env, expected in (({}, "True"), ({"ELASTICRL_MALLOC_TUNE": "0"}, "False")):
        out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True, timeout=30, check=True)
        assert out.stdout.strip() == expected


def test_the_collector_thresholds_default_to_the_coordinators_and_the_environment_overrides_them():
    from elasticrl.coordinator import malloc

    assert malloc.gc_thresholds(None) == malloc.gc_thresholds("") == malloc.GC_THRESHOLDS
    assert malloc.gc_thresholds("700,10,10") == (700, 10, 10)
    for bad in ("700", "a,b,c", "1,2,3,4", "-1,10,10"):
        with pytest.raises(ValueError, match="ELASTICRL_GC_THRESHOLD"):
            malloc.gc_thresholds(bad)


def test_a_coordinator_started_with_a_malformed_collector_setting_says_which_and_exits():
    import os

    out = subprocess.run([sys.executable, "-m", "elasticrl", "coordinator", "--port", "0"],
                         env={**os.environ, "ELASTICRL_GC_THRESHOLD": "lots"}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "ELASTICRL_GC_THRESHOLD='lots'" in out.stderr, out.stderr
