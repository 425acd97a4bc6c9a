"""``owned_dirs``: what a SIGKILLed process leaves in its private temp directories is removed by
the next process that makes one of the same kind, and never a live process's directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from elasticrl.owned_dirs import OWNER_LOCK, OwnedDir, host_prefix


def start_owner(parent, prefix: str, *, die: bool) -> tuple[subprocess.Popen, str]:
    """A process that makes an OwnedDir under ``parent`` and puts a file in it, then SIGKILLs
    itself (``die``) or waits to be killed."""
    end = "os.kill(os.getpid(), 9)" if die else "sys.stdin.read()"
    script = (
        "import os, sys; from elasticrl.owned_dirs import OwnedDir; "
        f"d = OwnedDir({prefix!r}, 'test dirs', parent={str(parent)!r}); "
        f"open(os.path.join(d.path, 'stop'), 'w').write('x'); print(d.path, flush=True); {end}"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert os.path.isfile(os.path.join(path, "stop")) and os.path.isfile(os.path.join(path, OWNER_LOCK)), path
    if die:
        assert proc.wait(60) == -signal.SIGKILL
    return proc, path


@pytest.mark.timeout(120)
def test_the_next_owner_removes_a_killed_processes_directory_and_nothing_else(tmp_path):
    _, orphan = start_owner(tmp_path, "elasticrl-agent-", die=True)
    _, other_kind = start_owner(tmp_path, "elasticrl-relay-", die=True)
    alive, theirs = start_owner(tmp_path, "elasticrl-agent-", die=False)
    assert os.path.basename(orphan).startswith(host_prefix("elasticrl-agent-"))
    stray = tmp_path / (host_prefix("elasticrl-agent-") + "not-one")  # no owner lock: not ours to delete
    stray.mkdir()
    try:
        mine = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))
        assert not os.path.exists(orphan)
        assert os.path.isdir(other_kind) and stray.is_dir()  # another kind, or no lock: left alone
        assert os.path.isfile(os.path.join(theirs, "stop"))  # a live process's stays
        second = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))
        assert os.path.isdir(mine.path) and os.path.isdir(second.path)  # and so do this process's own
        assert os.stat(mine.path).st_mode & 0o777 == 0o700
    finally:
        alive.kill()
        alive.wait(60)
    third = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))  # its owner is gone now
    assert not os.path.exists(theirs) and os.path.isdir(mine.path)
    for d in (mine, second, third):
        d.remove()
        d.remove()  # idempotent
        assert not os.path.exists(d.path)


@pytest.mark.timeout(120)
def test_a_directory_goes_with_its_object_or_at_exit_without_a_remove(tmp_path):
    d = OwnedDir("elasticrl-agent-", "test dirs", parent=str(tmp_path))
    path = d.path
    del d  # collected: removed, as a TemporaryDirectory is
    assert not os.path.exists(path)
    script = (
        "from elasticrl.owned_dirs import OwnedDir; "
        f"d = OwnedDir('elasticrl-agent-', 'test dirs', parent={str(tmp_path)!r}); print(d.path, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip().startswith(str(tmp_path)) and not os.path.exists(out.stdout.strip())
    assert list(tmp_path.iterdir()) == []
