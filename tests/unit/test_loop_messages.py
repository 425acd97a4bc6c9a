"""What a trainer says when a wait runs out: the key that sets the deadline, by name."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from elasticrl.errors import CoordinatorTimeoutError
from elasticrl.train.loop import NodeTrainer

pytestmark = pytest.mark.timeout(30)


def test_a_rollout_that_does_not_seal_in_time_names_rollout_seal_timeout_s():
    class Client:
        def wait_sealed(self, run, iteration, *, timeout_s, check, while_progressing):
            assert while_progressing  # the deadline counts from the last group that finished
            raise CoordinatorTimeoutError(f"iteration {iteration} of run {run!r} did not seal with no group finished "
                                          f"for {timeout_s:.1f}s: 3/10 done")

    t = NodeTrainer.__new__(NodeTrainer)
    t.cfg = SimpleNamespace(run=SimpleNamespace(run_id="r", rl_phase="both"), rollout=SimpleNamespace(seal_timeout_s=7.5))
    t.rollout, t.reformer, t.client = None, None, Client()
    with pytest.raises(CoordinatorTimeoutError, match=r"no group finished for 7.5s: 3/10 done \(rollout.seal_timeout_s = 7.5: raise it"):
        t._rollout(4)


def test_an_iteration_too_large_for_one_message_is_refused_before_it_is_sent_naming_what_to_change():
    from elasticrl.errors import ResourceLimitError
    from elasticrl.scheduler.client import SchedulerClient
    from elasticrl.scheduler.state import TaskSpec

    tasks = [TaskSpec(task_id=f"t{i}", prompt_ids=list(range(1000, 3000)), num_samples=8) for i in range(8)]  # ~32 KB of prompt ids
    with SchedulerClient("127.0.0.1:9", max_message_bytes=4096, reconnect_timeout_s=0.1) as client:  # nothing listens
        with pytest.raises(ResourceLimitError, match=r"iteration 3's 8 tasks are .* MiB in one SubmitIteration, over .*"
                                                     r"task.prompts_per_iteration"):
            client.submit_iteration("r", 3, tasks)


def test_a_wait_while_progressing_counts_from_the_last_group_that_finished_even_after_groups_were_lost(monkeypatch):
    """done 10 -> 5 (a restarted coordinator found shards lost: their tasks run again) -> 6 -> 7
    -> 8 -> sealed, a reply every 0.3 s and a 1 s limit: each new group restarts the wait."""
    from elasticrl.scheduler import client as client_mod
    from elasticrl.scheduler.client import SchedulerClient

    done = iter([10, 5, 6, 7, 8, None])

    def call(self, name, request, *, stub, timeout_s):
        n = next(done)
        time.sleep(0.3)
        return SimpleNamespace(manifest=dict(sealed=n is None, tasks_done=n or 12, tasks_failed=0, tasks_total=12, tasks_running=1))

    monkeypatch.setattr(SchedulerClient, "_call", call)
    monkeypatch.setattr(client_mod, "manifest_from_pb", lambda m: m)
    c = SchedulerClient.__new__(SchedulerClient)
    c._sched = None
    assert c.wait_sealed("r", 1, timeout_s=1.0, while_progressing=True)["sealed"]
