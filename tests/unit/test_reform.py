"""In-place re-forming's pure parts (``elasticrl.train.reform``): the rendezvous option, the new
world's numbering, and the watch that fails collective waits, driven by scripted watch views."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from elasticrl.config import IN_PLACE_ENV, in_place_unsupported
from elasticrl.coordinator.client import RoundView, RunView
from elasticrl.rendezvous.config import RendezvousConfig
from elasticrl.rendezvous.handler import export_to_workers
from elasticrl.train import reform
from elasticrl.train.dist import WorldInfo


def params(**conf):
    return SimpleNamespace(config=conf, endpoint="coord:50051", run_id="r", min_nodes=1, max_nodes=3, local_addr=None)


@pytest.mark.parametrize("value, expected", [("true", True), ("1", True), ("False", False), ("off", False)])
def test_in_place_is_a_rendezvous_option_the_workers_inherit(value, expected):
    cfg = RendezvousConfig.from_params(params(in_place=value))
    assert cfg.in_place is expected
    environ: dict[str, str] = {}
    export_to_workers(cfg, environ)
    assert (environ.get(IN_PLACE_ENV) == "1") is expected
    assert reform.enabled(environ) is expected
    assert RendezvousConfig.from_params(params()).in_place is False


def test_a_bad_in_place_value_names_the_key():
    with pytest.raises(ValueError, match=r"--rdzv-conf in_place='maybe': expected true or false"):
        RendezvousConfig.from_params(params(in_place="maybe"))


def test_only_ddp_on_gloo_re_forms_in_place():
    assert in_place_unsupported("ddp", "gloo") is None
    assert "only ddp" in in_place_unsupported("deepspeed", "gloo")
    assert "nccl" in in_place_unsupported("ddp", "nccl")


def test_survivors_keep_their_order_and_nodes_are_numbered_by_their_first_rank():
    survivors = ["rank-1", "rank-2", "rank-3", "rank-5"]  # rank 0 and 4 lost; 2 ranks per node
    nodes = ["b", "b", "c", "d"]  # rank-1 and rank-2 on b, ...
    world = WorldInfo(rank=5, world_size=6, local_rank=1, node_rank=2)
    assert reform.next_world(world, survivors, "rank-5", nodes) == WorldInfo(rank=3, world_size=4, local_rank=1, node_rank=2)
    assert reform.next_world(world, survivors, "rank-2", nodes).rank == 1
    assert [reform.rank_of(m) for m in survivors] == [1, 2, 3, 5]
    with pytest.raises(Exception, match="not a trainer rank"):
        reform.rank_of("node-3")


class ScriptedClient:
    """A coordinator client whose watch yields the views a test puts in ``views``."""

    def __init__(self):
        self.views: queue.Queue = queue.Queue()

    def watch(self, run_id, *, stop):
        while not stop.is_set():
            try:
                yield self.views.get(timeout=0.05)
            except queue.Empty:
                continue


def view(*members: str) -> RunView:
    return RunView("r.workers", 1, False, members, RoundView(0, (), (), (), 0))


class PendingWork:
    """A collective that completes when the test says so."""

    def __init__(self):
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self):
        return self.future


def waiting(watch: reform.WorldWatch, work) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            watch.wait(work)
            out["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_lost_member_fails_a_pending_wait_and_a_finished_one_returns():
    client = ScriptedClient()
    lost = []
    watch = reform.WorldWatch(client, "r.workers", ["rank-0", "rank-1", "rank-2"], on_loss=lost.append)
    try:
        done = PendingWork()
        t, out = waiting(watch, done)
        done.future.set_result([torch.ones(1)])
        t.join(5)
        assert out == {"ok": True}
        client.views.put(view("rank-0", "rank-1", "rank-2", "engine-0"))  # nobody lost
        stuck = PendingWork()
        t, out = waiting(watch, stuck)
        t.join(0.3)
        assert t.is_alive()  # still waiting: gloo has not answered, nobody is lost
        client.views.put(view("rank-0", "rank-2"))
        t.join(5)
        assert isinstance(out["error"], reform.WorldChangedError) and "rank-1" in str(out["error"])
        assert watch.lost == ("rank-1",)
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:  # on_loss runs on the watch thread, right after
            time.sleep(0.01)
        assert lost == [("rank-1",)]
        assert watch.await_loss(0) == ("rank-1",)
        with pytest.raises(reform.WorldChangedError, match=r"peer\(s\) rank-1 left"):
            watch.check()  # between coordinator waits (a barrier, the seal)
        # The new world: nothing lost, and the same loss seen again fails nothing.
        watch.expect(["rank-0", "rank-2"])
        assert watch.await_loss(0.05) == ()
        client.views.put(view("rank-0", "rank-2"))
        later = PendingWork()
        t, out = waiting(watch, later)
        t.join(0.3)
        assert t.is_alive()
        later.future.set_result([torch.ones(1)])
        t.join(5)
        assert out == {"ok": True}
    finally:
        watch.close()


def test_a_member_gone_before_the_new_world_is_named_is_lost_at_once():
    """A survivor that dies right after the re-form barrier: the last view already lacks it."""
    client = ScriptedClient()
    watch = reform.WorldWatch(client, "r.workers", ["rank-0", "rank-1", "rank-2"])
    try:
        client.views.put(view("rank-0", "rank-1"))
        assert watch.await_loss(5) == ("rank-2",)
        client.views.put(view("rank-0"))  # rank-1 died too, before the survivors' expect()
        deadline = time.monotonic() + 5
        while watch._live != frozenset({"rank-0"}) and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.expect(["rank-0", "rank-1"])
        assert watch.lost == ("rank-1",)
        watch.expect(["rank-0"])
        assert watch.lost == ()
    finally:
        watch.close()


def test_a_collective_error_reaches_the_waiter():
    watch = reform.WorldWatch(ScriptedClient(), "r.workers", ["rank-0", "rank-1"])
    try:
        work = PendingWork()
        t, out = waiting(watch, work)
        work.future.set_exception(RuntimeError("Connection reset by peer"))
        t.join(5)
        assert "Connection reset by peer" in str(out["error"])
    finally:
        watch.close()


def test_the_ddp_future_fails_at_a_loss_and_otherwise_carries_the_result():
    client = ScriptedClient()
    watch = reform.WorldWatch(client, "r.workers", ["rank-0", "rank-1"])
    try:
        inner = torch.futures.Future()
        out = watch.abortable(inner)
        inner.set_result(torch.full((2,), 3.0))
        assert out.wait().tolist() == [3.0, 3.0]
        pending = watch.abortable(torch.futures.Future())
        client.views.put(view("rank-0"))
        with pytest.raises(reform.WorldChangedError, match="rank-1"):
            pending.wait()
        with pytest.raises(reform.WorldChangedError):  # after the loss, a new one fails at once
            watch.abortable(torch.futures.Future()).wait()
    finally:
        watch.close()


def test_a_closed_watch_fails_nothing():
    client = ScriptedClient()
    lost = []
    watch = reform.WorldWatch(client, "r.workers", ["rank-0", "rank-1"], on_loss=lost.append)
    watch.close()
    client.views.put(view("rank-0"))  # the other rank left at the end of the run
    assert watch.await_loss(0.3) == () and lost == []


def test_a_regroup_takes_the_old_ddp_off_the_gradients():
    """After a re-form, DDP is built again on the new group. The old DDP may live on (a traceback,
    an autograd graph); its reducer must take none of the new world's gradients, and what a failed
    backward left in the gradients must not be added to the next one. One process, gloo."""
    import torch.distributed as dist

    from elasticrl.train.strategy import StrategyConfig, make_strategy

    def group():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    calls = {"old": 0, "new": 0}

    def counting(name):
        def hook(_state, bucket):
            calls[name] += 1
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        return hook

    group()
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        strategy = make_strategy(StrategyConfig(name="ddp"))
        strategy.wrap(model, lambda params: torch.optim.SGD(params, lr=0.1))
        strategy.module.register_comm_hook(None, counting("old"))
        strategy.module(torch.ones(2, 4)).sum().backward()
        assert calls == {"old": 1, "new": 0}
        old = strategy.module  # kept alive
        model.weight.grad.fill_(123.0)  # what a failed backward left
        reform.abandon_groups()
        group()
        strategy.regroup()
        assert all(p.grad is None for p in model.parameters())
        strategy.module.register_comm_hook(None, counting("new"))
        strategy.module(torch.ones(2, 4)).sum().backward()
        assert calls == {"old": 1, "new": 1}, calls
        assert torch.equal(model.weight.grad, torch.ones(4, 4) * 2)  # d(sum(W x + b))/dW, x = ones, batch 2
        assert old is not strategy.module
    finally:
        dist.destroy_process_group()
