"""What every bench script's ``main`` does once its arguments are parsed: a temporary directory
and an ``ExitStack`` that clean up whatever happens, the run, then JSON plus a readable table.

With ``--json-out`` the JSON goes to that file and the table to stdout; without it the JSON goes to
stdout and the table to stderr, so ``bench/x.py | jq`` works.

SIGTERM (``kill``, a job scheduler's timeout) unwinds like Ctrl-C: the processes a bench started
(coordinators, workers, sinks) are stopped and its directory removed, instead of being left running.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable


class BenchError(RuntimeError):
    """A benchmark could not measure what it set out to (a process failed, a wait timed out)."""


def run_main(
    script: str,
    json_out: str | None,
    run: Callable[[pathlib.Path, contextlib.ExitStack], dict],
    render: Callable[[dict], str],
    *,
    prefix: str,
) -> int:
    started = time.monotonic()
    previous = unwind_on_sigterm()
    try:
        with contextlib.ExitStack() as cleanup:
            tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
            cleanup.callback(shutil.rmtree, tmp, True)
            try:
                doc = run(tmp, cleanup)
            except BenchError as exc:
                print(f"{script}: {exc}", file=sys.stderr)
                return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(doc, indent=2)
    table = render(doc)
    if json_out:
        pathlib.Path(json_out).write_text(text + "\n")
        print(table)
    else:
        print(text)
        print(table, file=sys.stderr)
    return 0


def unwind_on_sigterm():
    """From now on SIGTERM raises ``SystemExit`` in the main thread, so ``finally`` blocks and
    ``ExitStack`` callbacks stop what the bench started (the default action ends the process at
    once and leaves its children running). Returns the handler it replaced (None off the main
    thread, where nothing is installed)."""
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, _terminated)
    return None


def _terminated(signum: int, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short (SIGKILL still does)
    raise SystemExit(128 + signum)
