"""Rank 0's record of the run's progress on the coordinator (``NodeTrainer._record_progress``): it
is on the coordinator before the iteration is reported, since the node may be killed as soon as
the iteration's line is out (a world that then finds nothing to resume from says what it lost by
that record), and a coordinator that does not answer holds the iteration up for at most
``PROGRESS_HEAD_START_S``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from elasticrl.errors import CoordinatorUnavailableError
from elasticrl.train import loop
from elasticrl.train.loop import PROGRESS_KEY, NodeTrainer

pytestmark = pytest.mark.timeout(30)


class Client:
    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.delay_s, self.fail, self.kv = delay_s, fail, {}
        self.release = threading.Event()

    def kv_set(self, run: str, values: dict) -> None:
        if not self.release.wait(self.delay_s) and self.fail:
            raise CoordinatorUnavailableError("the coordinator is restarting")
        self.kv.update(values)


def trainer(client: Client, events: list) -> NodeTrainer:
    t = NodeTrainer.__new__(NodeTrainer)
    t.cfg = SimpleNamespace(run=SimpleNamespace(run_id="r", iterations=3, rl_phase="both"),
                            checkpoint=SimpleNamespace(every_iterations=0))
    t.world = SimpleNamespace(rank=0)
    t.logctx = SimpleNamespace(iteration=None)
    t.client, t._progress, t.ckpt_dir, t.strategy, t.reference = client, None, "ckpt", None, None
    t._iteration = lambda iteration, extra: {"iteration": iteration, "reward_mean": 0.0}
    t._report = lambda metrics: events.append(("report", metrics["iteration"], client.kv.get(PROGRESS_KEY)))
    t._state_meta = lambda iteration, reward: {}
    t.recovery = SimpleNamespace(save_checkpoint=lambda *a: events.append(("checkpoint", a[1], None)))
    return t


def test_each_iteration_s_progress_is_on_the_coordinator_before_it_is_reported():
    events: list = []
    client = Client(delay_s=0.05)  # a round trip, slower than the report
    trainer(client, events)._train(1)
    assert events == [("report", 1, b"1"), ("report", 2, b"2"), ("report", 3, b"3"), ("checkpoint", 3, None)]


def test_a_coordinator_that_does_not_answer_holds_an_iteration_up_for_the_head_start_only(monkeypatch):
    monkeypatch.setattr(loop, "PROGRESS_HEAD_START_S", 0.2)
    events: list = []
    client = Client(delay_s=5.0, fail=True)
    t = trainer(client, events)
    start = time.monotonic()
    t._train(1)
    assert time.monotonic() - start < 2.0  # not 3 x 5 s: the later records are skipped while one still tries
    assert [e[:2] for e in events] == [("report", 1), ("report", 2), ("report", 3), ("checkpoint", 3)]
    client.release.set()
    assert t._progress.settle(5.0)
