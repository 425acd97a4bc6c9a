"""The trainer's weights into its node's engine, one gathered tensor at a time, and the CPU copies
rank 0 publishes for rollout-only workers (``NodeTrainer._load_engine`` decides when to stream)."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from elasticrl.train.dist import all_reduce_int


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A CPU copy of ``tensor`` that nothing else shares; a floating-point one cast to ``dtype``
    first (on its own device: a bf16 copy crosses PCIe at half the bytes)."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.detach().to("cpu", copy=True)


def push_full_tensors(strategy, engine, version: int, *, keep: dict | None = None, keep_dtype: torch.dtype | None = None) -> None:
    """Put the strategy's full weights into ``engine`` one tensor at a time (``full_tensors``):
    the peak is one gathered tensor on the training device, not the model, and a GPU engine copies
    it device to device. ``keep``, when given, gets a CPU copy of each (for the publisher), its
    floating-point tensors in ``keep_dtype``. Every rank walks the whole collective even when its
    engine refuses a tensor: the rest is gathered and dropped, then the engine's error is raised,
    so the other ranks do not wait in a gather."""
    tensors = strategy.full_tensors()

    def feed():
        for name, tensor in tensors:
            if keep is not None:
                keep[name] = host_copy(tensor, keep_dtype)
            yield name, tensor

    try:
        engine.update_weights(feed(), version=version)
    except Exception:
        for _ in tensors:  # what the engine did not take (not on SystemExit: the process is stopping)
            pass
        raise


def hold_every_engine(lock: threading.RLock) -> bool:
    """Take this rank's engine lock if it is free (held already while the engine sleeps for the
    update: the lock is re-entrant), and whether every rank got its own. *Collective.* True: the
    caller releases it once. False: no rank holds one more than before."""
    got = lock.acquire(blocking=False)
    try:
        everyone = all_reduce_int(int(got), dist.ReduceOp.MIN) == 1
    except BaseException:  # a peer lost (the world re-forms): the engine must not stay locked
        if got:
            lock.release()
        raise
    if got and not everyone:
        lock.release()
    return everyone


def publish_dtype(cfg) -> torch.dtype | None:
    """bfloat16 where this node's engine is (``engine.dtype``): the weights' dtype on the wire to
    rollout-only workers, which would cast an fp32 copy anyway, at twice the bytes to pack, send
    and hold (a worker whose engine is another dtype says so when it loads them). None (as
    trained) otherwise: float32 and auto, float16 (an fp32 value past its range would reach every
    worker as inf), the tiny engine (which has no dtype)."""
    if cfg.engine_name == "tiny" or cfg.engine.dtype != "bfloat16":
        return None
    return torch.bfloat16
