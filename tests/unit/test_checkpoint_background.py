"""A disk checkpoint is written in the background on its writer ranks: training goes on (the
other nodes do not wait at the next barrier for a big model's files), the next checkpoint and the
end of the run wait for it, and its failure, or a disk slower than the limit, is raised there."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from elasticrl.errors import ElasticRLError
from elasticrl.train import background, recovery
from elasticrl.train import dist as dist_helpers
from elasticrl.train.recovery import Recovery

pytestmark = pytest.mark.timeout(30)


class Strategy:
    def full_model_state_dict(self, *, all_ranks=False):
        return {"w": torch.ones(4)}

    def full_optimizer_state_dict(self, *, all_ranks=False):
        return {"state": {}, "param_groups": []}


def made(rank: int = 0, world_size: int = 1) -> Recovery:
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(every_node=False, keep_last=2))
    r = Recovery.__new__(Recovery)
    r.cfg, r.world, r.ckpt_dir = cfg, SimpleNamespace(rank=rank, local_rank=rank, world_size=world_size), "/nonexistent/ckpts"
    r.last_checkpoint, r._checkpointing, r._checkpoint_deadline = "", None, 0.0
    return r


@pytest.fixture
def writes(monkeypatch):
    """ckpt.save_checkpoint that blocks until its gate opens, or raises what it is told to."""
    state = SimpleNamespace(gate=threading.Event(), started=[], fail=None)

    def save(root, iteration, model, optimizer, meta, *, keep_last, reference=None):
        state.started.append(iteration)
        assert state.gate.wait(10)
        if state.fail is not None:
            raise state.fail
        return f"{root}/iter-{iteration:06d}"

    monkeypatch.setattr(recovery.ckpt, "save_checkpoint", save)
    return state


def test_the_write_goes_on_in_the_background_and_the_end_waits_for_it(writes):
    r = made()
    r.save_checkpoint(Strategy(), 4, {}, None, {})  # returns with the write blocked
    assert writes.started == [4] and r.last_checkpoint == ""
    writes.gate.set()
    r.wait_checkpoint()
    assert r.last_checkpoint == "/nonexistent/ckpts/iter-000004"
    r.save_checkpoint(Strategy(), 8, {}, None, {})
    r.snapshots, r._forget_flush = None, lambda: None  # (snapshots off)
    r.before_finish()
    assert r.last_checkpoint == "/nonexistent/ckpts/iter-000008"


def test_a_failed_write_is_raised_at_the_next_checkpoint(writes):
    r = made()
    writes.fail = OSError(28, "No space left on device")
    r.save_checkpoint(Strategy(), 4, {}, None, {})
    writes.gate.set()
    with pytest.raises(OSError, match="No space left"):
        r.save_checkpoint(Strategy(), 8, {}, None, {})
    assert writes.started == [4]  # the next one was not started on top of a failure


def test_a_write_slower_than_the_limit_stops_the_run_naming_the_checkpoint(writes, monkeypatch):
    monkeypatch.setattr(recovery, "CHECKPOINT_WRITE_MIN_S", 0.2)
    r = made()
    r.save_checkpoint(Strategy(), 4, {}, None, {})
    with pytest.raises(ElasticRLError, match=r"writing checkpoint /nonexistent/ckpts/iter-000004: not written by its deadline"):
        r.wait_checkpoint()
    writes.gate.set()


def test_a_write_that_fails_while_the_node_closes_is_logged_not_lost(writes, caplog):
    r = made()
    r.snapshots, r._forget_flush, r._finished = None, lambda: None, False
    writes.fail = OSError(28, "No space left on device")
    r.save_checkpoint(Strategy(), 4, {}, None, {})
    writes.gate.set()
    with caplog.at_level("INFO", logger="elasticrl.train.recovery"):
        r.close()
    assert any(rec.levelname == "ERROR" and "iter-000004 failed: OSError" in rec.getMessage() for rec in caplog.records), caplog.text


def test_ranks_that_do_not_write_gather_and_return(writes):
    r = made(rank=1)
    r.save_checkpoint(Strategy(), 4, {}, None, {})
    r.wait_checkpoint()
    assert writes.started == [] and r._checkpointing is None


class Gathering(Strategy):
    """Notes when a rank gathers the full state, and whether its writer was still writing then."""

    def __init__(self, log: list, writes):
        self.log, self.writes = log, writes

    def full_model_state_dict(self, *, all_ranks=False):
        self.log.append(("gather", len(self.writes.started), self.writes.gate.is_set()))
        return super().full_model_state_dict(all_ranks=all_ranks)


def two_ranks(monkeypatch):
    """An all-reduce (MAX) between two threads, each a rank; counts the rounds."""
    barrier, values, rounds = threading.Barrier(2, timeout=10), {}, []

    def all_reduce_int(value, op):
        rank = int(threading.current_thread().name[-1])
        values[rank] = value
        barrier.wait()
        result = max(values.values())
        if barrier.wait() == 0:
            rounds.append(result)
        return result

    monkeypatch.setattr(dist_helpers, "all_reduce_int", all_reduce_int)  # what background.wait_together calls
    monkeypatch.setattr(background, "POLL_S", 0.05)
    return rounds


def run_ranks(*fns):
    errors = {}

    def run(rank, fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(rank, fn), name=f"rank{rank}") for rank, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
        assert not t.is_alive()
    return errors


def test_no_rank_gathers_the_next_checkpoint_while_the_one_before_is_written(writes, monkeypatch):
    """A writer whose last write lags would hold two full copies of the state: every rank waits
    (polling together, no collective held open) until it is written, then gathers."""
    rounds = two_ranks(monkeypatch)
    writer, other, log = made(0, 2), made(1, 2), []
    assert run_ranks(lambda: writer.save_checkpoint(Gathering(log, writes), 4, {}, None, {}),
                     lambda: other.save_checkpoint(Gathering(log, writes), 4, {}, None, {})) == {}
    def open_after_two_polls():  # the first save's round, then two while checkpoint 4 is still written
        deadline = time.monotonic() + 10
        while len(rounds) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        writes.gate.set()

    threading.Thread(target=open_after_two_polls).start()
    log.clear()
    assert run_ranks(lambda: writer.save_checkpoint(Gathering(log, writes), 8, {}, None, {}),
                     lambda: other.save_checkpoint(Gathering(log, writes), 8, {}, None, {})) == {}
    assert log == [("gather", 1, True)] * 2  # both after checkpoint 4 was written, before 8 started
    assert rounds[-1] == 0 and len(rounds) >= 3 and set(rounds[1:-1]) == {1}  # polled while it lagged
    writer.wait_checkpoint()
    assert writes.started == [4, 8] and writer.last_checkpoint.endswith("iter-000008")


def test_a_failed_write_stops_every_rank_before_the_gather(writes, monkeypatch):
    two_ranks(monkeypatch)
    writer, other, log = made(0, 2), made(1, 2), []
    writes.fail = OSError(28, "No space left on device")
    run_ranks(lambda: writer.save_checkpoint(Gathering(log, writes), 4, {}, None, {}),
              lambda: other.save_checkpoint(Gathering(log, writes), 4, {}, None, {}))
    writes.gate.set()
    log.clear()
    errors = run_ranks(lambda: writer.save_checkpoint(Gathering(log, writes), 8, {}, None, {}),
                       lambda: other.save_checkpoint(Gathering(log, writes), 8, {}, None, {}))
    assert isinstance(errors[0], OSError) and "No space left" in str(errors[0])
    assert isinstance(errors[1], ElasticRLError) and "checkpoint 8: the checkpoint before it failed on a writer rank" in str(errors[1])
    assert log == [] and writes.started == [4]  # nobody gathered, nothing started on top of it


@pytest.fixture
def reads(monkeypatch):
    """ckpt.load_checkpoint that blocks until its gate opens, or raises what it is told to."""
    state = SimpleNamespace(gate=threading.Event(), fail=None)

    def load(path, *, read_now=False):
        assert read_now  # the reader thread reads the bytes: the broadcast after it must wait for no disk
        assert state.gate.wait(10)
        if state.fail is not None:
            raise state.fail
        return SimpleNamespace(path=path)

    monkeypatch.setattr(recovery.ckpt, "load_checkpoint", load)
    return state


def test_a_resume_reads_the_checkpoint_while_every_rank_polls_within_its_time_limit(reads, monkeypatch, tmp_path):
    """Rank 0 reads a big checkpoint from a slow disk: no rank sits in one collective meanwhile
    (the process group's time limit would end the resume), every one polls."""
    rounds = two_ranks(monkeypatch)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    src, other, got = made(0, 2), made(1, 2), {}

    def open_after_two_polls():
        deadline = time.monotonic() + 10
        while len(rounds) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        reads.gate.set()

    threading.Thread(target=open_after_two_polls).start()
    assert run_ranks(lambda: got.setdefault(0, src._read_checkpoint(str(tmp_path), 0)),
                     lambda: got.setdefault(1, other._read_checkpoint(str(tmp_path), 0))) == {}
    assert got == {0: SimpleNamespace(path=str(tmp_path)), 1: None}
    assert rounds[-1] == 0 and len(rounds) >= 3 and set(rounds[:-1]) == {1}


def test_a_checkpoint_that_cannot_be_read_or_not_in_time_stops_every_rank(reads, monkeypatch, tmp_path):
    two_ranks(monkeypatch)
    reads.fail = ValueError("checkpoint x: model.safetensors cannot be read: truncated")
    reads.gate.set()
    errors = run_ranks(lambda: made(0, 2)._read_checkpoint(str(tmp_path), 0), lambda: made(1, 2)._read_checkpoint(str(tmp_path), 0))
    assert isinstance(errors[0], ValueError) and "truncated" in str(errors[0])
    assert isinstance(errors[1], ElasticRLError) and "rank 0 could not read it" in str(errors[1])

    reads.gate.clear()
    reads.fail = None
    monkeypatch.setattr(recovery, "CHECKPOINT_WRITE_MIN_S", 0.2)
    errors = run_ranks(lambda: made(0, 2)._read_checkpoint(str(tmp_path), 0), lambda: made(1, 2)._read_checkpoint(str(tmp_path), 0))
    reads.gate.set()
    assert f"reading checkpoint {tmp_path}: not done within 0.2s" in str(errors[0]) and "rank 0 could not read it" in str(errors[1])


def test_a_checkpoint_directory_gone_before_the_read_stops_every_rank_too(monkeypatch, tmp_path):
    two_ranks(monkeypatch)
    gone = str(tmp_path / "iter-000004")
    errors = run_ranks(lambda: made(0, 2)._read_checkpoint(gone, 0), lambda: made(1, 2)._read_checkpoint(gone, 0))
    assert isinstance(errors[0], ValueError) and "meta.json cannot be read" in str(errors[0])
    assert "rank 0 could not read it" in str(errors[1])


def test_run_together_returns_each_ranks_result_and_stops_every_rank_on_a_failure(monkeypatch):
    """What the start-up check of a dataset's prompts runs each rank's share in."""
    rounds = two_ranks(monkeypatch)
    got = {}
    assert run_ranks(lambda: got.setdefault(0, background.run_together(lambda: time.sleep(0.2) or "a", "scan", reduce=True)),
                     lambda: got.setdefault(1, background.run_together(lambda: "b", "scan", reduce=True))) == {}
    assert got == {0: "a", 1: "b"} and rounds[-1] == 0 and 1 in rounds  # rank 1 polled while rank 0 worked

    def fails():
        raise ValueError("row 7 broke the tokenizer")

    errors = run_ranks(lambda: background.run_together(fails, "scan", reduce=True),
                       lambda: background.run_together(lambda: "b", "scan", reduce=True))
    assert isinstance(errors[0], ValueError) and str(errors[1]) == "scan: failed on another rank (its log says why)"
