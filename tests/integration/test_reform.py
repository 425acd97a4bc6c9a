"""In-place re-forming (``elasticrl.train.reform``) with a real coordinator and real worker
processes: a rank that is SIGKILLed (its sockets close) or SIGSTOPped (nothing closes; only its
lease tells) is left behind by the other ranks, which stop waiting in their collectives, meet at
one leased barrier, form a smaller gloo group over the coordinator's KV and go on training DDP,
in the same processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

WORKER = REPO / "tests" / "integration" / "reform_worker.py"


class Rank:
    def __init__(self, address: str, run: str, rank: int, size: int, steps: int, log_dir):
        self.events: list[dict] = []
        self.log = open(log_dir / f"rank-{rank}.log", "w")
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), address, run, str(rank), str(size), str(steps)],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def seen(self, event: str) -> list[dict]:
        return [e for e in list(self.events) if e["event"] == event]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.mark.parametrize("victim, how", [(0, "KILL"), (1, "KILL"), (1, "STOP")])
def test_the_survivors_of_a_lost_rank_re_form_in_place_and_go_on_training(coordinator, tmp_path, victim, how):
    """Rank 0 or 1 of 3 dies mid-training. Each survivor re-forms once, in its own process; old
    ranks keep their order (the lowest survivor becomes rank 0); every step after it is all-reduced
    over exactly 2 ranks (the worker asserts it), its gradients are exactly the average of the
    world's (with the old world's DDP still alive), the two hold the same parameters after every
    step, and both finish and exit 0. A SIGSTOPped rank keeps its
    sockets open: the survivors are stuck in gloo until its lease lapses and their watch fails the wait."""
    ranks = [Rank(coordinator.address, f"reform-{victim}-{how.lower()}", r, 3, 150, tmp_path) for r in range(3)]
    try:
        wait_until(lambda: all(len(r.seen("step")) >= 10 for r in ranks), 60, message="three ranks training")
        lost_at = time.monotonic()
        os.kill(ranks[victim].proc.pid, getattr(signal, f"SIG{how}"))
        survivors = [r for i, r in enumerate(ranks) if i != victim]
        wait_until(lambda: all(r.seen("done") for r in survivors), 90, message="the survivors finishing their steps")
        for r in survivors:
            assert r.proc.wait(timeout=30) == 0, (tmp_path / f"rank-{ranks.index(r)}.log").read_text()[-2000:]
        reformed = [r.seen("reformed") for r in survivors]
        assert all(len(x) == 1 for x in reformed), reformed  # one re-form each, same processes
        assert [x[0]["rank"] for x in reformed] == [0, 1] and {x[0]["world"] for x in reformed} == {2}
        assert all(r.seen("failed")[0]["lost"] == [f"rank-{victim}"] for r in survivors)
        after = [[e for e in r.seen("step") if e["t"] > r.seen("reformed")[0]["t"]] for r in survivors]
        assert all(a and all(e["world"] == 2 for e in a) for a in after), after
        wrong = [(e["world"], e["n"]) for r in survivors for e in r.seen("step") if not e["grads_ok"]]
        assert not wrong, f"(world, step) whose gradients were not the world's average: {wrong}"
        by_step = [{e["n"]: e["checksum"] for e in a} for a in after]
        common = sorted(set(by_step[0]) & set(by_step[1]))
        assert common and all(by_step[0][n] == by_step[1][n] for n in common), by_step
        first = max(min(e["t"] for e in a) for a in after)
        print(f"SIG{how} of rank {victim} -> both survivors training in a world of 2: {first - lost_at:.3f}s")
    finally:
        for r in ranks:
            r.stop()
