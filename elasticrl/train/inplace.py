"""The trainer's in-place re-forming (``train/reform.py``), a part of ``NodeTrainer`` (``train/loop.py``).

With ``--rdzv-conf in_place=true`` every worker watches the trainer ranks' run. Under DDP on gloo,
a lost rank fails this rank's collective waits, and the survivors re-form their world in the same
processes: the old groups left behind, a leased barrier, a new group over the coordinator's KV,
DDP again on it, and the newest complete snapshot loaded (the engine, its rollouts and the process
stay). Elsewhere the watch ends the worker at once, so that torchrun restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch.distributed as dist

from elasticrl.config import RUN_ID_ENV, in_place_unsupported
from elasticrl.rendezvous.worker import ROUND_ENV, armed_key, is_peer_failure
from elasticrl.train import reform, stop
from elasticrl.train.dist import set_waiter
from elasticrl.train.recovery import Recovery

log = logging.getLogger(__name__)

LOST_RANK_EXIT = 75
"""A worker that cannot re-form in place ends with this code when a rank is lost (torchrun restarts it)."""


class InPlace:
    """``NodeTrainer``'s re-forming; uses its cfg, client, membership, world, strategy, recovery."""

    def _watch_world(self, members_run: str, token: str | None) -> None:
        """With ``--rdzv-conf in_place=true``: watch the world, and re-form in place when a rank is
        lost (DDP on gloo) or else end this worker at once so that torchrun restarts it."""
        if not reform.enabled():
            return
        t = self.cfg.trainer
        why_not = in_place_unsupported(t.strategy, t.backend)
        on_loss = None if why_not is None else self._exit_for_restart
        self.watch = reform.WorldWatch(self.client, members_run, self.members, on_loss=on_loss)
        self._arm()
        if why_not is not None:
            if self.world.rank == 0:
                log.info("in_place: the world cannot re-form in place (%s); a lost rank restarts the workers", why_not)
            return
        c = self.cfg.coordinator
        self.reformer = reform.Reformer(address=c.address, token=token, tls_ca=c.tls_ca or None, backend=t.backend,
                                        timeout_s=c.barrier_timeout_s, group_timeout_s=c.barrier_timeout_s + 60)
        set_waiter(self.watch.wait)

    def _arm(self) -> None:
        """*Collective.* Every rank watches its world: rank 0 tells the agents (a key of their round,
        ``rendezvous.worker.armed_key``), which from then on leave a lost node to the workers."""
        round_no, run_id = os.environ.get(ROUND_ENV), os.environ.get(RUN_ID_ENV)
        if not round_no or not run_id:
            return  # not under the elasticrl rendezvous
        dist.barrier()
        if self.world.rank == 0:
            self.client.kv_set(run_id, {armed_key(int(round_no)): b"1"})

    def _exit_for_restart(self, lost: tuple[str, ...]) -> None:
        """The watch thread, where the world cannot re-form in place: exit now (the last snapshot
        written), as torchrun's own restart would stop this worker."""
        log.error("rank(s) %s lost; exiting so that torchrun restarts this worker into the new world", ", ".join(lost))
        stop.exit_now(LOST_RANK_EXIT, flush_s=self.cfg.checkpoint.snapshot_timeout_s)

    def _reform(self, failure: BaseException) -> int:
        """Re-form the world of the survivors in this process after ``failure`` (raised again when
        no rank was lost: a failure of its own); returns the iteration to go on from."""
        if self.reformer is None or not is_peer_failure(failure):
            raise failure  # a failure of this rank's own (bad data, say): not for a re-form to hide
        # A rank lost already, or soon: a dead peer fails a collective before its stream grace or
        # lease has run out.
        lost = self.watch.await_loss(self.membership.lease_ttl_s + 2.0)
        if not lost:
            raise failure
        seen = time.monotonic()
        log.warning("%s of the world gone (this rank saw %s: %s); re-forming in place without it", ", ".join(lost),
                    type(failure).__name__, str(failure).splitlines()[0][:200])
        cfg = self.cfg
        self.recovery.close()  # the last finished iteration's snapshot, written if still pending
        self.members, self.world = self.reformer.reform(self.membership, self.watch, self.generation, self.world, self.logctx.node)
        self.logctx.rank = self.world.rank
        self.generation = self._next_generation()
        self._lead(self._token)  # a new rank 0: its publisher before the push below publishes
        self.recovery = Recovery(cfg, self.world, self.logctx.node)
        self.recovery.setup(self.generation)
        self.strategy.regroup()
        reform.abortable_ddp(self.strategy.module, self.watch)
        # The engine shares the module (DDP): it draws nothing while the snapshot is loaded into it.
        with self.engine_lock if self.shares_module else contextlib.nullcontext():
            start = self._resume()
            # The lost world may have released newer versions than the one resumed: the engine
            # holds this one only now, and tasks that name newer ones wait for them again.
            self.gate.reset(0)
            self._push(start)
        if self.world.rank == 0:
            self._open_records()
        log.warning("re-formed in place: rank %d of %d (generation %d), %.2fs after the loss was seen",
                    self.world.rank, self.world.world_size, self.generation, time.monotonic() - seen)
        return start + 1
