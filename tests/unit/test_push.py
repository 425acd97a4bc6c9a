"""``push_full_tensors``: the engine push walks the strategy's collective stream to its end, even
when the engine refuses a tensor (the other ranks would otherwise wait in a gather), and keeps CPU
copies for the publisher that do not alias the live tensors."""

import pytest
import torch

from elasticrl.rollout.engine import WeightUpdateError
from elasticrl.train.push import push_full_tensors

pytestmark = pytest.mark.timeout(60)


class Strategy:
    def __init__(self, tensors):
        self.tensors = tensors
        self.gathered = []

    def full_tensors(self):
        for name, t in self.tensors.items():
            self.gathered.append(name)  # a collective per tensor on a real strategy
            yield name, t


class Engine:
    def __init__(self, refuse=None):
        self.refuse = refuse
        self.loaded = {}

    def update_weights(self, named, *, version):
        for name, t in named:
            if name == self.refuse:
                raise WeightUpdateError(f"update_weights: {name!r} is not a parameter")
            self.loaded[name] = t.clone()
        self.version = version


def tensors():
    return {"a": torch.ones(2), "b": torch.arange(3.0), "c": torch.zeros(1, 2)}


def test_every_tensor_reaches_the_engine_and_the_kept_copies_are_their_own():
    live = tensors()
    strategy, engine, keep = Strategy(live), Engine(), {}
    push_full_tensors(strategy, engine, 7, keep=keep)
    assert engine.version == 7 and list(engine.loaded) == ["a", "b", "c"]
    assert list(keep) == ["a", "b", "c"]
    for name, t in live.items():
        assert torch.equal(keep[name], t) and keep[name].data_ptr() != t.data_ptr()
    live["a"].add_(1)  # the optimizer's next step changes the live tensor, not the copy
    assert torch.equal(keep["a"], torch.ones(2))


@pytest.mark.parametrize("refuse", ["a", "b", "c"])
def test_an_engine_that_refuses_a_tensor_still_lets_the_stream_finish(refuse):
    strategy, engine = Strategy(tensors()), Engine(refuse=refuse)
    with pytest.raises(WeightUpdateError, match=repr(refuse)):
        push_full_tensors(strategy, engine, 1)
    assert strategy.gathered == ["a", "b", "c"]


def test_without_a_publisher_nothing_is_kept():
    strategy, engine = Strategy(tensors()), Engine()
    push_full_tensors(strategy, engine, 0, keep=None)
    assert strategy.gathered == ["a", "b", "c"] and engine.version == 0


def test_the_kept_copies_are_in_the_publish_dtype_where_floating_point():
    live = {"w": torch.randn(3, 2), "steps": torch.arange(4), "b": torch.randn(2, dtype=torch.float64)}
    keep = {}
    push_full_tensors(Strategy(live), Engine(), 2, keep=keep, keep_dtype=torch.bfloat16)
    assert keep["w"].dtype == torch.bfloat16 and keep["b"].dtype == torch.bfloat16 and keep["steps"].dtype == torch.int64
    assert torch.equal(keep["w"], live["w"].to(torch.bfloat16)) and torch.equal(keep["steps"], live["steps"])


def test_a_process_that_is_stopping_does_not_go_on_gathering():
    """SystemExit (torchrun's SIGTERM, train/stop.py) passes through: the peers are stopping too,
    and more gathers would only hold the exit up."""
    class Stopping(Engine):
        def update_weights(self, named, *, version):
            next(iter(named))
            raise SystemExit(143)

    strategy = Strategy(tensors())
    with pytest.raises(SystemExit):
        push_full_tensors(strategy, Stopping(), 1)
    assert strategy.gathered == ["a"]


def test_a_gather_that_fails_is_raised_as_it_is():
    class Broken(Strategy):
        def full_tensors(self):
            yield "a", torch.ones(1)
            raise RuntimeError("a peer is gone")

    engine = Engine()
    with pytest.raises(RuntimeError, match="a peer is gone"):
        push_full_tensors(Broken({}), engine, 1)
    assert list(engine.loaded) == ["a"]


def free_elsewhere(lock) -> bool:
    """Whether another thread could take ``lock`` now (an engine worker about to draw)."""
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.2) and (lock.release() or True)))
    t.start()
    t.join()
    return got == [True]


@pytest.mark.parametrize("others", ["hold", "draw", "lost"])
def test_every_engine_is_held_or_none_and_a_lost_peer_leaves_it_free(monkeypatch, others):
    """``hold_every_engine``: streamed only when every rank got its engine lock; a rank whose
    peer is drawing lets its own go; a failed all-reduce (a peer lost) does not keep it."""
    import threading

    from elasticrl.train import push
    from elasticrl.train.reform import WorldChangedError

    def all_reduce_int(value, op):
        if others == "lost":
            raise WorldChangedError("rank 1 is gone")
        return min(value, int(others == "hold"))

    monkeypatch.setattr(push, "all_reduce_int", all_reduce_int)
    lock = threading.RLock()
    if others == "lost":
        with pytest.raises(WorldChangedError):
            push.hold_every_engine(lock)
        assert free_elsewhere(lock)
    elif others == "draw":
        assert push.hold_every_engine(lock) is False and free_elsewhere(lock)
    else:
        assert push.hold_every_engine(lock) is True and not free_elsewhere(lock)
        lock.release()
        assert free_elsewhere(lock)
