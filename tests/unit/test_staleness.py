"""Asynchronous RL's pure parts: the submission window, task versions, the staleness bound at
fetch, lag histograms, the engines' idle meter (injected clock), and the rollout worker's
one-batch-per-iteration split."""

from __future__ import annotations

import types

import pytest

from elasticrl.scheduler.state import TaskSpec
from elasticrl.scheduler.worker import Assignment, by_iteration
from elasticrl.train.staleness import IdleMeter, SubmissionWindow, keep_fresh, lag_summary, merge_lags, min_policy_version


def drive(window: SubmissionWindow, last: int, *, presubmit: bool) -> list[tuple[int, int, int]]:
    """(iteration being trained, iteration submitted, its task version) in the order the driver submits."""
    log = []
    for i in range(1, last + 1):
        for j in window.due(i):
            log.append((i, j, window.task_version(j)))
            window.mark(j)
        ahead = window.ahead(i) if presubmit else None
        if ahead is not None:
            log.append((i, ahead, window.task_version(ahead)))
            window.mark(ahead)
    return log


def test_on_policy_the_window_is_todays_schedule():
    """k = 0: iteration i is submitted once (during i - 1's update with presubmit, else when it
    starts), naming version i - 1, the version it trains from."""
    assert drive(SubmissionWindow(0, 4), 4, presubmit=False) == [(1, 1, 0), (2, 2, 1), (3, 3, 2), (4, 4, 3)]
    assert drive(SubmissionWindow(0, 4), 4, presubmit=True) == [(1, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3)]


@pytest.mark.parametrize("k", [1, 2])
def test_k_iterations_are_submitted_ahead_each_naming_the_oldest_version_it_may_be_drawn_with(k):
    log = drive(SubmissionWindow(k, 8), 8, presubmit=True)
    assert sorted(j for _, j, _ in log) == list(range(1, 9))  # each once, none past the last
    assert [j for i, j, _ in log if i == 1] == list(range(1, k + 3))  # the first k + 1, and one more in the update
    for trained, submitted, version in log:
        assert version == max(0, submitted - 1 - k)
        # Never further ahead than the update in progress can serve: its tasks need at most the
        # version this update produces (trained), so no engine waits on a version further off.
        assert version <= trained
    assert drive(SubmissionWindow(k, 8), 8, presubmit=False)[: k + 1] == [(1, j, max(0, j - 1 - k)) for j in range(1, k + 2)]


def test_a_submit_that_may_not_have_landed_is_due_again():
    window = SubmissionWindow(1, 10)
    assert window.due(3) == [3, 4]
    window.mark(3)
    assert window.due(3) == [4] and window.ahead(3) == 5
    window.mark(5)
    assert window.ahead(3) is None and window.due(4) == [4]


def test_min_policy_version_is_never_negative_and_the_window_refuses_a_negative_k():
    assert [min_policy_version(i, 2) for i in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]
    with pytest.raises(ValueError, match="max_staleness"):
        SubmissionWindow(-1, 3)


def group(version: int, samples: int = 2):
    return types.SimpleNamespace(policy_version=version, samples=[object()] * samples)


def test_groups_older_than_k_versions_are_dropped_and_the_rest_histogrammed():
    groups = [group(9), group(8, 3), group(7), group(6, 4), group(11)]  # 11: drawn before a restart to an older version
    kept, dropped, lags = keep_fresh(groups, 9, 2)
    assert [g.policy_version for g in kept] == [9, 8, 7, 11]
    assert dropped == 4 and lags == {0: 2, 1: 3, 2: 2, -2: 2}
    kept, dropped, lags = keep_fresh(groups, 9, 0)
    assert [g.policy_version for g in kept] == [9, 11] and dropped == 9


def test_the_bound_follows_the_trainers_own_version_after_a_restart_from_an_older_checkpoint():
    """Resumed at version 5, iteration 6 trains from 5: a group drawn with 3 is 2 versions old."""
    kept, dropped, _ = keep_fresh([group(3), group(4), group(8)], 5, 1)
    assert [g.policy_version for g in kept] == [4, 8] and dropped == 2


def test_lag_histograms_of_every_rank_sum_and_summarize():
    total = merge_lags([{0: 3, 1: 2}, {"1": 4, "2": 1}, {}, None])
    assert total == {0: 3, 1: 6, 2: 1}
    summary = lag_summary(total)
    assert summary["policy_lag"] == {"0": 3, "1": 6, "2": 1}
    assert summary["policy_lag_mean"] == pytest.approx(8 / 10) and summary["policy_lag_max"] == 2
    assert lag_summary({}) == {"policy_lag": {}, "policy_lag_mean": 0.0, "policy_lag_max": 0}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_idle_meter_counts_time_with_at_least_one_batch_in_hand():
    clock = Clock()
    meter = IdleMeter(clock)
    clock.now += 2.0  # idle
    meter.start()
    clock.now += 1.0
    meter.start()  # a second batch overlaps the first: still one busy stretch
    clock.now += 1.0
    meter.stop()
    clock.now += 1.0
    meter.stop()
    clock.now += 1.0  # idle
    assert meter.take() == pytest.approx(3 / 6)
    meter.start()
    clock.now += 4.0
    assert meter.take() == pytest.approx(0.0)  # busy through the whole window, still in hand
    clock.now += 1.0
    meter.stop()  # the stretch still open at the last take counts from it: 1 s busy here
    clock.now += 1.0
    with meter.busy():
        clock.now += 1.0
    clock.now += 1.0
    assert meter.take() == pytest.approx(2 / 4)
    assert meter.take() == 0.0  # no time passed


def test_a_rollout_worker_plays_each_iteration_of_an_assignment_as_its_own_batch():
    """The tasks of one iteration share a version; a batch that waits for a newer one (an iteration
    submitted ahead) must not hold back an older iteration's results."""
    def a(iteration, task):
        return Assignment(iteration, TaskSpec(task_id=task, prompt_ids=[], num_samples=1), 1.0, False)

    items = [a(5, "x"), a(4, "y"), a(5, "z"), a(4, "w")]
    batches = by_iteration(items)
    assert [[(x.iteration, x.task.task_id) for x in b] for b in batches] == [[(4, "y"), (4, "w")], [(5, "x"), (5, "z")]]
    assert by_iteration([]) == []
