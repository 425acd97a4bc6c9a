"""``owned_dirs``: what a SIGKILLed process leaves in its private temp directories is removed by
the next process that makes one of the same kind, and never a live process's directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticrl.owned_dirs import OWNER_LOCK, OwnedDir


def killed_owner(parent, prefix: str) -> str:
    """A process that makes an OwnedDir under ``parent``, puts a file in it, then SIGKILLs itself."""
    script = (
        "import os, signal, sys; from elasticrl.owned_dirs import OwnedDir; "
        f"d = OwnedDir({prefix!r}, 'test dirs', parent={str(parent)!r}); "
        "open(os.path.join(d.path, 'stop'), 'w').write('x'); print(d.path, flush=True); os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc
    path = proc.stdout.strip()
    assert os.path.isfile(os.path.join(path, "stop")) and os.path.isfile(os.path.join(path, OWNER_LOCK))
    return path


@pytest.mark.timeout(120)
def test_the_next_owner_removes_a_killed_processes_directory_and_nothing_else(tmp_path):
    orphan = killed_owner(tmp_path, "elasticrl-agent-")
    other_kind = killed_owner(tmp_path, "elasticrl-relay-")
    stray = tmp_path / "elasticrl-agent-not-one"  # no owner lock: not ours to delete
    stray.mkdir()
    live = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))
    assert not os.path.exists(orphan)
    assert os.path.isdir(other_kind) and stray.is_dir()  # another prefix, or no lock: left alone
    second = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))
    assert os.path.isdir(live.path) and os.path.isdir(second.path)  # a live owner's stays
    oct_mode = os.stat(live.path).st_mode & 0o777
    assert oct_mode == 0o700, oct(oct_mode)
    live.remove()
    live.remove()  # idempotent
    assert not os.path.exists(live.path)
    second.remove()
