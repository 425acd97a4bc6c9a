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
