"""Shard durability: the store fsyncs the shard's directory after the rename (with fsync on), and
a restart on damaged files does not stop the scheduler: a missing or corrupt shard's groups are
lost (counted, their tasks queued again while the iteration is open), orphan shards are removed.
A real SchedulerCore on an injected clock over the same state dir, as in test_scheduler_core."""

from __future__ import annotations

import json
import logging
import os

import pytest

from elasticrl.scheduler.state import IterationConfig, Split, TaskStatus
from elasticrl.scheduler.store import MANIFEST, TrajectoryStore

from tests.unit.scheduler_harness import RUN, Clock, Harness, assigned, drain, group, specs


def ids(*numbers: int) -> list[str]:
    return [f"t{i:02d}" for i in numbers]


def accept(h: Harness, conn, *task_ids: str, iteration: int = 1):
    return h.sched.accept(conn, [(iteration, group(tid)) for tid in task_ids])


def restart(h: Harness, tmp_path, seconds: float = 10.0) -> Harness:
    h.coord.db.close()
    return Harness(clock=Clock(now=5.0, wall_offset=h.clock.wall() + seconds - 5.0), state_dir=tmp_path)


def lost_with_its_ack(tmp_path, *, slots: int, tasks: int = 2, config: IterationConfig | None = None) -> Harness:
    """Worker a (``slots``) has t00's result stored (batch "a-1"), then the coordinator restarts
    with that shard file lost (a rename that never reached the disk) and a's ack lost with the
    crash: the restarted Harness, with a's incarnation kept and t00 queued again."""
    h1 = Harness(state_dir=tmp_path)
    a = h1.worker("a", slots=slots)
    h1.sched.submit(RUN, 1, specs(tasks), config or IterationConfig())
    assert assigned(drain(a)) == ids(*range(min(slots, tasks)))
    ack, _ = h1.sched.accept(a, [(1, group("t00"))], "a-1")
    assert ack.accepted == 1
    (h1.store.iteration_dir(RUN, 1) / h1.it().shard_of["t00"]).unlink()
    incarnation = h1.incarnations["a"]
    h2 = restart(h1, tmp_path)
    h2.incarnations["a"] = incarnation
    assert h2.it().tasks["t00"].status is TaskStatus.QUEUED
    return h2


def test_with_fsync_a_shard_and_its_directory_are_synced_after_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    store = TrajectoryStore(tmp_path / "trajectories", fsync=True)
    directory = store.iteration_dir(RUN, 1)
    name = store.write_shard(RUN, 1, [(group("t00"), [1, 2])])
    # the directories it had to create first, each in its parent; then the file; then the rename
    parents = [str(tmp_path), str(tmp_path / "trajectories"), str(directory.parent)]
    assert synced == parents + [f"{directory}/{name}.tmp", str(directory)], synced
    synced.clear()
    name = store.write_shard(RUN, 1, [(group("t01"), [1, 2])])
    assert synced == [f"{directory}/{name}.tmp", str(directory)], synced
    synced.clear()
    TrajectoryStore(tmp_path / "other").write_shard(RUN, 1, [(group("t00"), [1, 2])])
    assert synced == []  # fsync off: nothing synced


def test_a_missing_and_a_corrupt_shard_of_an_open_iteration_are_requeued_and_it_completes(tmp_path, caplog):
    h1 = Harness(state_dir=tmp_path)
    a = h1.worker("a", slots=4)
    h1.sched.submit(RUN, 1, specs(6), IterationConfig())
    assert assigned(drain(a)) == ids(0, 1, 2, 3)
    accept(h1, a, "t00", "t01")
    accept(h1, a, "t02")
    accept(h1, a, "t03")
    shards = h1.it().shard_of
    directory = h1.store.iteration_dir(RUN, 1)
    (directory / shards["t00"]).unlink()  # t00 and t01: a rename that never reached the disk
    data = (directory / shards["t02"]).read_bytes()
    (directory / shards["t02"]).write_bytes(data[: len(data) // 2])  # t02: a torn file

    with caplog.at_level(logging.WARNING, logger="elasticrl.scheduler"):
        h2 = restart(h1, tmp_path)  # starts instead of raising
    it = h2.it()
    assert "3 group(s) lost" in caplog.text and shards["t00"] in caplog.text and shards["t02"] in caplog.text
    assert [it.tasks[t].status for t in ids(0, 1, 2, 3)] == [TaskStatus.QUEUED] * 3 + [TaskStatus.DONE]
    assert list(it.queue) == ids(0, 1, 2, 4, 5)  # the lost ones first, in order
    assert sorted(it.groups) == ["t03"] and sorted(it.shard_of) == ["t03"]
    m = h2.sched.manifest(it)
    assert (m["groups_lost"], m["tasks_done"], m["requeued"]) == (3, 1, 3)
    assert [(n["node"], n["done"]) for n in m["nodes"]] == [("a", 1)]
    assert not (directory / shards["t02"]).exists()  # unreferenced now: removed with the orphans

    b = h2.worker("b", slots=8)
    assert assigned(drain(b)) == ids(0, 1, 2, 4, 5)
    accept(h2, b, *ids(0, 1, 2, 4, 5))
    assert it.sealed and it.seal_reason == "all 6 tasks done"
    got = {g.task_id: g for g, _ in h2.sched.shard(RUN, 1, 0, 1, Split.TRAIN)}
    assert sorted(got) == ids(0, 1, 2, 3, 4, 5) and got["t00"].node == "b" and got["t03"].node == "a"
    assert json.loads((directory / MANIFEST).read_text())["groups_lost"] == 3
    from elasticrl.status_table import render_iteration

    assert "3 group(s) lost with their shard files" in render_iteration(h2.sched.manifest(it))  # `elasticrl status`

    caplog.clear()
    h3 = restart(h2, tmp_path)  # the loss was recorded: nothing is found lost again
    assert h3.it().counters.groups_lost == 3 and "lost" not in caplog.text
    assert sorted(g.task_id for g, _ in h3.sched.shard(RUN, 1, 0, 1, Split.TRAIN)) == ids(0, 1, 2, 3, 4, 5)


def test_a_missing_shard_of_a_sealed_iteration_drops_its_groups(tmp_path):
    h1 = Harness(state_dir=tmp_path)
    a = h1.worker("a", slots=4)
    h1.sched.submit(RUN, 1, specs(3), IterationConfig())
    accept(h1, a, "t00")
    accept(h1, a, "t01", "t02")
    assert h1.it().sealed
    directory = h1.store.iteration_dir(RUN, 1)
    (directory / h1.it().shard_of["t00"]).unlink()

    h2 = restart(h1, tmp_path)
    it = h2.it()
    assert it.sealed and it.tasks["t00"].status is TaskStatus.DROPPED
    assert [g.task_id for g, _ in h2.sched.shard(RUN, 1, 0, 1, Split.TRAIN)] == ids(1, 2)
    on_disk = json.loads((directory / MANIFEST).read_text())  # rewritten with the loss
    assert (on_disk["groups_lost"], on_disk["tasks_done"]) == (1, 2)


def test_orphan_shards_and_temp_files_are_removed_at_start_up(tmp_path):
    h1 = Harness(state_dir=tmp_path)
    a = h1.worker("a", slots=2)
    h1.sched.submit(RUN, 1, specs(4), IterationConfig())
    accept(h1, a, "t00")
    committed = h1.it().shard_of["t00"]
    # killed between writing a shard and committing it: never referenced by SQLite
    orphan = h1.store.write_shard(RUN, 1, [(group("t01"), [1])])
    directory = h1.store.iteration_dir(RUN, 1)
    (directory / "shard-000009.safetensors.tmp").write_bytes(b"half a shard")
    (directory / "notes.txt").write_text("not ours: left alone")

    h2 = restart(h1, tmp_path)
    assert sorted(p.name for p in directory.iterdir()) == sorted([committed, "notes.txt"])
    it = h2.it()
    assert it.tasks["t00"].status is TaskStatus.DONE and it.tasks["t01"].status is TaskStatus.QUEUED
    assert it.counters.groups_lost == 0
    a2 = h2.worker("b", slots=4)
    accept(h2, a2, *ids(1, 2, 3))
    assert it.sealed


def test_a_done_task_is_a_row_of_its_own_and_one_marked_done_in_its_task_row_by_an_older_coordinator_is_read(tmp_path):
    h1 = Harness(state_dir=tmp_path)
    a = h1.worker("a", slots=3)
    h1.sched.submit(RUN, 1, specs(4), IterationConfig())
    assert assigned(drain(a)) == ids(0, 1, 2)
    accept(h1, a, "t00", "t01")
    db = h1.coord.db.connection
    shard = h1.it().shard_of["t00"]
    # the task's row (its spec) is not rewritten when it is done: a narrow row records that
    assert db.execute("SELECT task_id, done_by, shard FROM sched_done ORDER BY task_id").fetchall() == [("t00", "a", shard), ("t01", "a", shard)]
    assert db.execute("SELECT DISTINCT done_by, shard FROM sched_tasks").fetchall() == [("", "")]
    with h1.coord.db.tx():  # as a coordinator before sched_done recorded them: in the tasks' rows
        db.execute("UPDATE sched_tasks SET done_by='a', shard=? WHERE task_id IN ('t00', 't01')", (shard,))
        db.execute("DELETE FROM sched_done")
        db.execute("UPDATE meta SET value='1' WHERE key='schema_version'")

    h2 = restart(h1, tmp_path)
    # marked with this version once open: a coordinator from before refuses it instead of misreading it
    assert h2.coord.db.connection.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)
    it = h2.it()
    assert [it.tasks[t].status for t in ids(0, 1, 2, 3)] == [TaskStatus.DONE, TaskStatus.DONE, TaskStatus.QUEUED, TaskStatus.QUEUED]
    assert it.groups["t01"].task_id == "t01" and it.shard_of["t00"] == shard

    # their shard lost: not done any more, in either place, so a second restart requeues them too
    (h2.store.iteration_dir(RUN, 1) / shard).unlink()
    h3 = restart(h2, tmp_path)
    assert all(h3.it().tasks[t].status is TaskStatus.QUEUED for t in ids(0, 1, 2, 3))
    assert h3.it().counters.groups_lost == 2
    h4 = restart(h3, tmp_path)
    assert all(h4.it().tasks[t].status is TaskStatus.QUEUED for t in ids(0, 1, 2, 3)) and h4.it().counters.groups_lost == 2


def test_a_state_dir_of_an_unknown_schema_version_is_refused_by_name(tmp_path):
    h = Harness(state_dir=tmp_path)
    with h.coord.db.tx():
        h.coord.db.connection.execute("UPDATE meta SET value='9' WHERE key='schema_version'")
    with pytest.raises(RuntimeError, match="state schema version 9, this coordinator reads 1, 2; start with a fresh --state-dir"):
        restart(h, tmp_path)


def test_a_copy_handed_to_a_worker_holding_its_result_is_given_back_when_the_resent_batch_is_answered(tmp_path):
    """A worker holds a batch's results until its ack, and skips a task it holds the result of
    (``RolloutWorker._has``). Here the stored result is lost at a restart (its shard file is gone:
    a rename that never reached the disk) and the ack never reached the worker: the task is queued
    again and handed to that same worker on its hello, which skips it, then re-sends the batch.
    The re-sent batch gets its first ack, and the copy it skipped is given back: before, it held
    the worker's slot and the task until the task lease ran out (600 s by default)."""
    h2 = lost_with_its_ack(tmp_path, slots=1)
    a2 = h2.worker("a", slots=1, running=[])  # the hello: nothing runs
    assert assigned(drain(a2)) == ids(0)  # handed to a again: a skips it (it holds the result)
    ack, _ = h2.sched.accept(a2, [(1, group("t00"))], "a-1")  # the batch whose ack it lost
    assert ack.accepted == 1 and not ack.refused  # its first answer, counted once
    task = h2.it().tasks["t00"]
    assert not a2.worker.holding and "a" not in task.holders and task.status is TaskStatus.QUEUED
    assert not assigned(drain(a2))  # not straight back: this ack is not out yet when it is given back
    h2.advance(1.0, alive=("a",))  # the next tick offers it to anyone, a included
    assert assigned(drain(a2)) == ids(0)
    ack, _ = h2.sched.accept(a2, [(1, group("t00"))], "a-2")  # a runs it now: its result is stored
    assert ack.accepted == 1 and h2.it().tasks["t00"].status is TaskStatus.DONE


def test_the_copy_handed_again_to_a_worker_that_does_not_say_what_runs_is_kept(tmp_path):
    """A worker whose hello does not name what it runs (``reports_running``, an older one) may run
    a task handed to it while it holds the task's result: its copy stays until its own result or
    its lease, as before."""
    h2 = lost_with_its_ack(tmp_path, slots=1)
    a2 = h2.worker("a", slots=1)  # no running list
    assert assigned(drain(a2)) == ids(0)
    ack, _ = h2.sched.accept(a2, [(1, group("t00"))], "a-1")
    assert ack.accepted == 1 and a2.worker.holding == {(1, "t00")} and "a" in h2.it().tasks["t00"].holders


def test_a_skipped_copy_whose_lease_ran_out_before_the_resent_batch_commits_is_given_back(tmp_path):
    """The re-sent batch waits for its commit (a batch ahead of it on the stream is being written)
    while the skipped copy's lease runs out: the tick drops a from the task's holders and queues it
    again, and a keeps the slot. Neither the decision (a was a holder then) nor, as first written,
    the commit (a is not now) freed it, and with one worker t00 stayed queued for good (a review
    found it)."""
    h2 = lost_with_its_ack(tmp_path, slots=2, tasks=3, config=IterationConfig(task_lease_s=30.0))
    a2 = h2.worker("a", slots=2, running=[])
    assert sorted(assigned(drain(a2))) == ids(0, 1)  # a skips t00 (it holds the result), runs t01
    first = h2.sched.decide(a2, [(1, group("t01"))], "a-2")  # being written (a thread)
    resent = h2.sched.decide(a2, [(1, group("t00"))], "a-1")  # the re-sent batch, behind it
    assert resent.replay is not None
    h2.advance(31.0, alive=("a",))  # t00's lease runs out: queued again, a keeps the slot
    h2.sched.write(first)
    h2.sched.commit(first)
    h2.sched.commit(resent)
    assert (1, "t00") not in a2.worker.holding and h2.it().tasks["t00"].status is TaskStatus.QUEUED
    drain(a2)
    h2.advance(1.0, alive=("a",))
    assert "t00" in assigned(drain(a2))  # handed out again, after the ack


def test_a_skipped_copy_whose_slot_was_freed_while_another_result_was_stored_leaves_no_holder(tmp_path):
    """The re-sent batch arrives while a backup copy's result for the same task is being stored:
    its decision frees the skipped copy's slot, and a stayed one of the task's holders. When that
    other result is abandoned (its shard write failed) and its worker goes, the task stayed RUNNING
    held by a, which neither runs it nor counts it, until the task lease ran out (a review found it)."""
    h2 = lost_with_its_ack(tmp_path, slots=2, config=IterationConfig(backup_tasks=1))
    a2 = h2.worker("a", slots=2, running=[(1, "t01")])
    assert assigned(drain(a2)) == ids(0)  # t01 claimed; a skips t00: it holds the result of a-1
    b = h2.worker("b", slots=1, running=[])
    assert assigned(drain(b)) == ids(0)  # a backup copy of t00
    stored_by_b = h2.sched.decide(b, [(1, group("t00"))], "b-1")  # being written
    ack, _ = h2.sched.accept(a2, [(1, group("t00"))], "a-1")  # a re-sends a-1: its first ack
    assert ack.accepted == 1
    task = h2.it().tasks["t00"]
    assert "a" not in task.holders and (1, "t00") not in a2.worker.holding
    drain(a2)
    h2.sched.abandon(stored_by_b, "store failed: disk full")  # b's shard could not be written
    h2.sched.disconnect(b, "b died")
    # queued again, and handed to a (the ack went first): a copy a runs, counted on its stream
    assert assigned(drain(a2)) == ids(0) and list(task.holders) == ["a"] and (1, "t00") in a2.worker.holding


def _resent_while_a_backup_result_is_stored(tmp_path):
    """a's result for t00 lost at a restart with its ack; t00 handed to a again (skipped) and to b
    as a backup, whose result is being stored; then a re-sends its batch: decided, not committed."""
    h2 = lost_with_its_ack(tmp_path, slots=2, config=IterationConfig(backup_tasks=1))
    a2 = h2.worker("a", slots=2, running=[(1, "t01")])
    assert assigned(drain(a2)) == ids(0)
    b = h2.worker("b", slots=1, running=[])
    assert assigned(drain(b)) == ids(0)
    stored_by_b = h2.sched.decide(b, [(1, group("t00"))], "b-1")
    resent = h2.sched.decide(a2, [(1, group("t00"))], "a-1")
    task = h2.it().tasks["t00"]
    assert resent.replay is not None and "a" not in task.holders and (1, "t00") not in a2.worker.holding
    return h2, a2, b, stored_by_b, resent, task


def test_a_resent_batch_whose_stream_ends_before_its_commit_leaves_no_holder_behind(tmp_path):
    """The other result abandoned, its worker gone, and a's stream ends before the re-sent batch
    commits (the give-back at the commit is skipped then): t00 was left RUNNING, held by a, until
    the task lease ran out (a review found it); now a is no holder from the decision on."""
    h2, a2, b, stored_by_b, resent, task = _resent_while_a_backup_result_is_stored(tmp_path)
    drain(a2)
    h2.sched.abandon(stored_by_b, "store failed")
    h2.sched.disconnect(b, "b died")
    h2.sched.disconnect(a2, "a's stream broke")
    h2.sched.commit(resent)
    assert task.status is TaskStatus.QUEUED and not task.holders and not h2.sched.conns[RUN]


def test_the_other_result_abandoned_before_the_resent_batch_commits_queues_its_task_once(tmp_path):
    h2, a2, b, stored_by_b, resent, task = _resent_while_a_backup_result_is_stored(tmp_path)
    drain(a2)
    requeues = task.requeues
    h2.sched.abandon(stored_by_b, "store failed")  # b's slot comes back: b still holds t00
    h2.sched.disconnect(b, "b died")  # t00 queued again, handed to a, which skips it (no ack yet)
    assert task.requeues == requeues + 1 and assigned(drain(a2)) == ids(0)
    ack, end = h2.sched.commit(resent)
    assert ack.accepted == 1 and end is None
    # given back at the commit, once, and not straight back to a: its ack goes first
    assert task.status is TaskStatus.QUEUED and task.requeues == requeues + 2 and list(h2.it().queue).count("t00") == 1
    assert assigned(drain(a2)) == []
    h2.advance(1.0, alive=("a",))
    assert assigned(drain(a2)) == ids(0) and list(task.holders) == ["a"] and (1, "t00") in a2.worker.holding


def test_a_batch_resent_after_a_restart_gives_back_the_copy_handed_out_again_that_its_worker_skipped(tmp_path):
    """As above, with the re-sent batch's first answer a refusal: another worker's copy was being
    stored (then lost with the crash)."""
    h1 = Harness(state_dir=tmp_path)
    a, b = h1.worker("a", slots=1), h1.worker("b", slots=1)
    h1.sched.submit(RUN, 1, specs(3), IterationConfig())
    assert assigned(drain(a)) == ids(0) and assigned(drain(b)) == ids(1)
    h1.sched.decide(b, [(1, group("t00"))], "b-1")  # b's copy of t00: decided, never committed
    ack, _ = h1.sched.accept(a, [(1, group("t00"))], "a-1")  # a's is refused meanwhile
    assert ack.refused == [(1, "t00", "duplicate")]
    incarnation = h1.incarnations["a"]
    h2 = restart(h1, tmp_path)  # the crash loses b's batch: t00 is queued again
    h2.incarnations["a"] = incarnation
    a2 = h2.worker("a", slots=1, running=[])
    assert assigned(drain(a2)) == ids(0)  # handed to a again, which skips it: its ack of a-1 was lost
    ack, _ = h2.sched.accept(a2, [(1, group("t00"))], "a-1")  # a re-sends the batch
    assert ack.refused == [(1, "t00", "duplicate")]  # its first answer
    # The skipped copy is given back (an older code freed its slot and kept a as its holder: a then
    # got a second task beyond its one slot; the code after that kept both until t00's lease ran out).
    assert not a2.worker.holding and h2.it().tasks["t00"].status is TaskStatus.QUEUED
    h2.advance(1.0, alive=("a",))
    assert assigned(drain(a2)) == ids(0) and a2.worker.holding == {(1, "t00")}
    h2.sched.disconnect(a2, "gone")
    assert h2.it().tasks["t00"].status is TaskStatus.QUEUED  # and its stream closing requeues it


def test_a_batch_resent_on_a_reopened_stream_frees_the_slot_its_first_copy_could_not(tmp_path):
    """The worker reopens its stream (same incarnation: its slots move to the new stream) while the
    old one's reader still decides a batch it had read; that first copy frees nothing (the old
    stream holds nothing now), so the re-sent copy on the new stream frees the slot."""
    h = Harness(state_dir=tmp_path)
    s1 = h.worker("a", slots=2)
    h.sched.submit(RUN, 1, specs(4), IterationConfig())
    assert assigned(drain(s1)) == ids(0, 1)
    s2 = h.worker("a", slots=2)
    assert s2.worker.holding == {(1, "t00"), (1, "t01")}
    h.sched.accept(s1, [(1, group("t00"))], "b-1")
    assert h.it().tasks["t00"].status is TaskStatus.DONE
    ack, _ = h.sched.accept(s2, [(1, group("t00"))], "b-1")
    assert ack.accepted == 1 and (1, "t00") not in s2.worker.holding
