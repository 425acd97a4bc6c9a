"""The scheduler's side of multi-turn episodes, on an injected clock: a task whose env failed is
retried on another worker and given up after ``max_task_failures`` (the iteration then seals
without it, and says so); episodes' loss masks, turns, env time and truncation survive the wire,
the shard files and a coordinator restart."""

from __future__ import annotations

import json

import pytest

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.errors import InvalidRequestError
from elasticrl.scheduler.convert import group_from_pb, manifest_from_pb, manifest_to_pb, result_to_pb
from elasticrl.scheduler.state import GroupRecord, IterationConfig, SampleRecord, Split, TaskStatus
from elasticrl.scheduler.store import MANIFEST, decode_shard, encode_shard
from tests.unit.scheduler_harness import RUN, Clock, Harness, assigned, drain, group, specs

pytestmark = pytest.mark.timeout(30)


def episode_group(task_id: str) -> GroupRecord:
    """Two episodes: a 2-turn one with observation tokens, and a plain completion."""
    samples = [
        SampleRecord.pack([5, 6, 7, 8, 9, 10], [0, 0, -0.5, -1.0, 0, -2.0], 1.0, "stop", "guess:|7|hi:|9",
                          loss_mask=[0, 0, 1, 1, 0, 1], turns=2, env_s=0.125, truncated=False),
        SampleRecord.pack([3, 4], [-0.25, -0.75], 0.0, "length", "x", turns=5, env_s=0.5, truncated=True),
    ]
    return GroupRecord(task_id, "", 4, 1.0, 0.625, samples)


def test_a_failed_attempt_is_retried_on_another_worker_then_given_up_and_the_iteration_seals():
    h = Harness()
    a, b = h.worker("a", slots=2), h.worker("b", slots=1)
    h.sched.submit(RUN, 1, specs(3), IterationConfig(max_task_failures=2))
    on_a, on_b = assigned(drain(a)), assigned(drain(b))
    assert (on_a, on_b) == (["t00", "t02"], ["t01"])
    failing = on_a[0]
    h.sched.release(a, 1, [failing], "env x.step() raised ValueError: boom", failed=True, env_errors=3)
    it = h.it()
    task = it.tasks[failing]
    assert task.failures == 1 and task.status is TaskStatus.QUEUED
    assert it.counters.env_errors == 3 and it.counters.errors == ["env x.step() raised ValueError: boom"]
    # The retry goes elsewhere: a has a free slot but b gets it, once b delivers its own task.
    h.sched.accept(a, [(1, group("t02"))])
    assert assigned(drain(a)) == []
    h.sched.accept(b, [(1, group(on_b[0]))])
    assert assigned(drain(b)) == [failing] and assigned(drain(a)) == []
    h.sched.release(b, 1, [failing], "env x.step() did not return within env.step_timeout_s = 5s", failed=True, env_errors=1)
    assert task.failures == 2 and task.status is TaskStatus.FAILED
    assert it.sealed and it.seal_reason == "all tasks finished: 2/3 done, 1 failed"
    m = h.sched.manifest(it)
    assert (m["tasks_done"], m["tasks_failed"], m["env_errors"]) == (2, 1, 4)
    assert m["errors"] == ["env x.step() raised ValueError: boom", "env x.step() did not return within env.step_timeout_s = 5s"]
    assert h.coord.metrics.env_errors.value(run=RUN) == 4
    # The failed task never reaches a trainer.
    shards = [g.task_id for r in range(2) for g, _ in h.sched.shard(RUN, 1, r, 2, Split.TRAIN)]
    assert sorted(shards) == ["t01", "t02"]


def test_a_failed_task_goes_back_to_its_worker_when_no_other_takes_it():
    h = Harness()
    a = h.worker("a", slots=1)
    h.sched.submit(RUN, 1, specs(1), IterationConfig(max_task_failures=3))
    drain(a)
    h.sched.release(a, 1, ["t00"], "boom", failed=True, env_errors=1)
    assert assigned(drain(a)) == []
    h.advance(1.0, alive=("a",), step=0.25)
    assert assigned(drain(a)) == ["t00"]


def test_a_plain_release_does_not_count_as_a_failure():
    h = Harness()
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig(max_task_failures=1))
    drain(a)
    h.sched.release(a, 1, ["t00"], "engine error: CUDA out of memory")
    it = h.it()
    assert it.tasks["t00"].failures == 0 and it.tasks["t00"].status is TaskStatus.QUEUED and it.counters.env_errors == 0


def test_failures_and_failed_tasks_survive_a_restart(tmp_path):
    clock = Clock(now=100.0)
    h1 = Harness(clock=clock, state_dir=tmp_path)
    a = h1.worker("a", slots=3)
    h1.sched.submit(RUN, 1, specs(3), IterationConfig(max_task_failures=2))
    drain(a)
    h1.sched.release(a, 1, ["t00"], "boom", failed=True, env_errors=1)
    assert assigned(drain(a)) == []  # only a is connected: the retry waits for the redispatch pause
    h1.advance(1.0, alive=("a",))
    assert assigned(drain(a)) == ["t00"]
    h1.sched.release(a, 1, ["t00", "t01"], "boom", failed=True, env_errors=2)
    assert h1.it().tasks["t00"].status is TaskStatus.FAILED and h1.it().tasks["t01"].failures == 1
    h1.coord.db.close()

    h2 = Harness(clock=Clock(now=5.0, wall_offset=clock.wall() + 1.0 - 5.0), state_dir=tmp_path)
    it = h2.it()
    assert it.tasks["t00"].status is TaskStatus.FAILED and it.tasks["t01"].failures == 1
    assert it.tasks["t01"].status is TaskStatus.QUEUED and list(it.queue) == ["t01", "t02"]
    assert it.counters.env_errors == 3 and it.counters.errors == ["boom"]


def test_episodes_cross_the_wire_and_the_shards_with_their_masks(tmp_path):
    g = episode_group("t00")
    msg = result_to_pb(1, g)
    iteration, back = group_from_pb("results.groups[0]", spb.TrajectoryGroup.FromString(msg.SerializeToString()))
    assert iteration == 1 and back.samples == g.samples
    assert back.samples[0].mask_list() == [0, 0, 1, 1, 0, 1] and back.samples[1].loss_mask == b""
    assert back.samples[0].num_trained_tokens == 3 and back.samples[1].num_trained_tokens == 2
    shard = decode_shard(encode_shard(RUN, 1, [(g, [1, 2])]))
    assert shard[0][0].samples == g.samples and shard[0][1] == [1, 2]


def test_a_malformed_loss_mask_is_refused():
    msg = result_to_pb(1, episode_group("t00"))
    msg.samples[0].loss_mask = b"\x01\x00"  # 2 values for 6 tokens
    with pytest.raises(InvalidRequestError, match=r"samples\[0\].loss_mask: 2 bytes for 6 tokens"):
        group_from_pb("g", msg)
    msg.samples[0].loss_mask = b"\x01" * 5 + b"\x02"
    with pytest.raises(InvalidRequestError, match="one 0/1 byte per token"):
        group_from_pb("g", msg)


def test_a_v1_shard_reads_as_single_turn_completions_trained_on_every_token():
    """Shards written before episodes had masks (no loss_mask/turns/env_s/truncated tensors)."""
    import numpy as np
    from safetensors.numpy import save

    tensors = {
        "completion_ids": np.array([7, 8, 9], dtype="<i4"), "logprobs": np.array([-1, -2, -3], dtype="<f4"),
        "sample_tokens": np.array([2, 1], dtype="<i4"), "rewards": np.array([1, 0], dtype="<f4"),
        "group_samples": np.array([2], dtype="<i4"), "prompt_ids": np.array([1, 4], dtype="<i4"),
        "prompt_lengths": np.array([2], dtype="<i4"),
    }
    header = [{"task_id": "t00", "node": "a", "policy_version": 2, "gen_seconds": 0.5, "reward_seconds": 0.0,
               "finish_reasons": ["stop", "length"], "texts": ["ab", "c"]}]
    data = save(tensors, metadata={"format": "elasticrl.trajectories.v1", "groups": json.dumps(header)})
    [(g, prompt)] = decode_shard(data)
    assert prompt == [1, 4] and [s.token_ids() for s in g.samples] == [[7, 8], [9]]
    assert all(s.loss_mask == b"" and s.turns == 1 and s.env_s == 0 and not s.truncated for s in g.samples)


def test_the_manifest_carries_failures_over_the_wire(tmp_path):
    h = Harness(state_dir=tmp_path)
    a = h.worker("a")
    h.sched.submit(RUN, 1, specs(1), IterationConfig(max_task_failures=1))
    drain(a)
    h.sched.release(a, 1, ["t00"], "env raised", failed=True, env_errors=2)
    it = h.it()
    assert it.sealed and it.seal_reason == "all tasks finished: 0/1 done, 1 failed"
    m = h.sched.manifest(it)
    assert manifest_from_pb(manifest_to_pb(m)) == m
    on_disk = json.loads((h.store.iteration_dir(RUN, 1) / MANIFEST).read_text())
    assert (on_disk["tasks_failed"], on_disk["env_errors"], on_disk["errors"]) == (1, 2, ["env raised"])
    from elasticrl.status_table import render_iteration

    assert "env errors 2, 1 task(s) given up; last: env raised" in render_iteration(m)  # `elasticrl status`
