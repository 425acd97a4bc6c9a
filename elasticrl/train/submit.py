"""The driver's submissions (rank 0): each iteration's rows as scheduler tasks, in the order of the
staleness window (``staleness.SubmissionWindow``), the next one in the background during an update.

Tasks of iteration ``j`` name the oldest policy version they may be drawn with (``j - 1`` on-policy,
``j - 1 - rollout.max_staleness`` with asynchronous RL) and the matching published weights version.
A restarted worker group submits the same tasks again, which is a no-op on the scheduler (and an
iteration that already sealed is reused), so nothing here needs to survive a restart.
"""

from __future__ import annotations

import logging

from elasticrl.config import NodeConfig
from elasticrl.errors import ElasticRLError
from elasticrl.rl.workload import RowSource
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.train.background import BackgroundCall
from elasticrl.train.names import rollout_run, weights_version
from elasticrl.train.rollout_link import iteration_tasks
from elasticrl.train.staleness import SubmissionWindow

log = logging.getLogger(__name__)


def is_eval(cfg: NodeConfig, iteration: int) -> bool:
    """Whether ``iteration`` also rolls out the held-out rows (``run.eval_interval``)."""
    every = cfg.run.eval_interval
    return bool(every) and iteration % every == 0


class Submitter:
    """Rank 0's submits for one incarnation of the worker group (``generation``)."""

    def __init__(self, cfg: NodeConfig, rows: RowSource, client: SchedulerClient, *, generation: int, max_new_tokens: int):
        self.cfg = cfg
        self.rows = rows
        self.client = client
        self.generation = generation
        self.max_new_tokens = max_new_tokens
        self.window = SubmissionWindow(cfg.rollout.max_staleness, cfg.run.iterations)
        self._pending: tuple[int, BackgroundCall] | None = None

    def submit(self, iteration: int, policy_version: int) -> None:
        """The iteration's prompts as scheduler tasks, to be drawn with ``policy_version`` or newer."""
        cfg = self.cfg
        common = dict(
            iteration=iteration, seed=cfg.run.seed, group_size=cfg.task.group_size, max_new_tokens=self.max_new_tokens,
            temperature=cfg.rollout.temperature, policy_version=policy_version,
            weights_version=weights_version(self.generation, policy_version),
        )
        # Rows depend only on (seed, iteration, data position): every world size trains on the same data.
        tasks = iteration_tasks(self.rows.train_rows(iteration, cfg.task.prompts_per_iteration), **common)
        if is_eval(cfg, iteration):  # held-out rows, the same ones at every evaluation
            held_out = self.rows.eval_rows(cfg.task.eval_prompts)
            if held_out:
                tasks += iteration_tasks(held_out, split="eval", **common)
        r = cfg.rollout
        self.client.submit_iteration(
            rollout_run(cfg.run.run_id), iteration, tasks, policy=r.policy, deadline_s=r.deadline_s,
            min_fraction=r.min_fraction, task_lease_s=r.task_lease_s, backup_tasks=r.backup_tasks,
            max_task_failures=r.max_task_failures,
        )

    def submit_due(self, iteration: int, version: int) -> None:
        """Before ``iteration``'s rollout is waited for: the previous update's background submit
        (re-raises its failure), then every iteration of the window not submitted yet.
        ``version``: the trainer's policy version now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            j, call = pending
            try:
                call.wait(self.cfg.coordinator.reconnect_timeout_s + self.cfg.coordinator.call_timeout_s)
                self.window.mark(j)
            except ElasticRLError:
                if not call.running:
                    raise  # the submit itself failed
                # Still retrying a slow coordinator: submit again below (a no-op if the other lands).
                log.warning("the background submit of iteration %d is still running; submitting it again", j)
        for j in self.window.due(iteration):
            # rl_phase = rollout: no update, every iteration is drawn with the version the run holds.
            self.submit(j, self.window.task_version(j) if self.cfg.run.rl_phase == "both" else version)
            self.window.mark(j)

    def presubmit(self, iteration: int) -> None:
        """``rollout.presubmit``: while ``iteration`` updates, submit the iteration the window reaches
        next (``iteration + 1 + rollout.max_staleness``) off the critical path. Its tasks name the
        version this update produces, so no engine draws them before it has that policy; with
        ``rollout.deadline_s`` the next submit waits for its iteration instead (the deadline counts
        from the submit)."""
        cfg, j = self.cfg, self.window.ahead(iteration)
        if cfg.run.rl_phase != "both" or not cfg.rollout.presubmit or cfg.rollout.deadline_s or j is None:
            return
        self._pending = (j, BackgroundCall(lambda: self.submit(j, self.window.task_version(j)), f"submitting iteration {j}"))
