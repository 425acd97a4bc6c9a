"""A coordinator restarted over damaged trajectory files: a real coordinator subprocess with a
state dir and ``--fsync``, real worker processes (``bench/fake_rollout_worker.py``). A deleted and a
corrupted shard of an open iteration do not stop it from starting: their groups are counted lost,
their tasks go back to the queue, and the iteration completes when a worker finishes them; an
orphan shard is removed."""

from __future__ import annotations

import pytest

from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.store import MANIFEST, TrajectoryStore
from tests.conftest import wait_until
from tests.integration.test_scheduler import fetch_all, tasks, wait_members, workers  # noqa: F401 - a fixture

pytestmark = [pytest.mark.integration, pytest.mark.waits]
N_TASKS = 30


@pytest.mark.timeout(180)
def test_lost_shards_are_requeued_at_restart_and_the_iteration_completes(coordinator_factory, workers):  # noqa: F811
    coordinator = coordinator_factory(lease_ttl_s=3.0, extra_args=["--fsync"])
    run = "lost-shards"
    directory = coordinator.state_dir / "trajectories" / run / "00000001"
    first = workers(coordinator.address, run, "w0", 0.05)
    with SchedulerClient(coordinator.address, call_timeout_s=5, reconnect_timeout_s=30) as client:
        wait_members(client, run, 1)
        client.submit_iteration(run, 1, tasks(N_TASKS))
        wait_until(lambda: client.iteration_status(run, 1)["tasks_done"] >= 10, 30, message="10 tasks done")
        first.stop()  # nothing more is done until the restart
        done_before = client.iteration_status(run, 1)["tasks_done"]
        assert done_before < N_TASKS
        coordinator.kill()

        store = TrajectoryStore(coordinator.state_dir / "trajectories")
        shards = sorted(directory.glob("shard-*.safetensors"))
        assert len(shards) >= 2, shards
        missing, corrupt = shards[0], shards[-1]
        lost = {g.task_id for p in (missing, corrupt) for g, _ in store.read_shard(run, 1, p.name)}
        missing.unlink()
        data = corrupt.read_bytes()
        corrupt.write_bytes(data[: len(data) // 2])  # torn
        orphan = directory / "shard-000999.safetensors"  # written, never committed
        orphan.write_bytes(shards[1].read_bytes())

        coordinator.start()  # starts, instead of failing on the missing file
        status = client.iteration_status(run, 1)
        assert not status["sealed"]
        assert (status["tasks_done"], status["groups_lost"]) == (done_before - len(lost), len(lost)), status
        assert status["tasks_queued"] == N_TASKS - status["tasks_done"]
        log = coordinator.log()
        assert f"{len(lost)} group(s) lost" in log and missing.name in log and corrupt.name in log, log[-3000:]
        assert not orphan.exists() and not corrupt.exists()

        second = workers(coordinator.address, run, "w1", 0.02)
        manifest = client.wait_sealed(run, 1, timeout_s=90)
        assert manifest["tasks_done"] == N_TASKS and manifest["seal_reason"] == f"all {N_TASKS} tasks done", manifest
        assert manifest["groups_lost"] == len(lost) and manifest["requeued"] >= len(lost)
        groups = fetch_all(client, run, 1)
        assert sorted(g.task_id for g in groups) == [t.task_id for t in tasks(N_TASKS)]
        assert {g.task_id for g in groups if g.node == "w1"} >= lost  # redone by the new worker
        assert (directory / MANIFEST).exists()
        assert second.proc.poll() is None
