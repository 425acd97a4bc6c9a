"""Re-forming the trainer ranks' world inside the surviving worker processes when a node dies.

torchrun's answer to a dead node is to stop every surviving worker, meet again and start new
worker processes: a new interpreter, torch imported again, the model and the engine built again,
seconds per failure before training resumes. With ``--rdzv-conf in_place=true`` the elasticrl
rendezvous leaves the survivors' workers running when a node is lost (a node that *joins* still
restarts everyone, into a larger world), and each worker re-forms its world itself:

1. ``WorldWatch`` follows ``<run>.workers`` on the coordinator. A dead rank is evicted within the
   coordinator's stream grace (its Session stream broke) or its lease TTL (a silent host), and the
   watch then fails every collective wait of this rank at once (``train.dist.wait`` and the DDP
   gradient all-reduce, ``abortable_ddp``), however gloo is stuck: a rank whose peer merely gave
   up on a collective, or whose peer is SIGSTOPped, would otherwise wait out the group's timeout.
2. The old process group is left alone, not destroyed by its threads: ``abandon_groups`` keeps
   every handle to it (a gloo thread may still sit in a receive that fails only at its timeout,
   and joining it would block), and unregisters it so a new default group can form.
3. The survivors meet at one leased barrier of ``<run>.workers`` (``Reformer.agree``); the dead
   ranks were evicted, so the barrier completes with exactly the survivors and every survivor learns
   the same list. Ranks keep their order (the lowest surviving rank becomes rank 0), and a new group
   forms over a store in the coordinator's KV (the old store may have lived on the dead node).
4. The trainer wraps its model in DDP again on the new group and resumes from the newest complete
   snapshot (``train.recovery``; each rank's snapshot of the last iteration is in its host memory,
   and a lost node's shard on its buddy): no finished iteration is lost, and the engine, its
   rollouts and the process stay.

In place needs DDP on gloo: every collective of an iteration then goes through the two waits above.
Under other strategies (DeepSpeed and FSDP2 issue collectives this module cannot reach) or NCCL
(whose communicator must be aborted, not left), the watch ends the worker process at once instead,
so torchrun restarts it as it would without ``in_place``. A failure this cannot handle (the barrier
times out, this rank itself was evicted, the group does not form) raises, and torchrun restarts
the worker as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from elasticrl.config import IN_PLACE_ENV
from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.errors import ElasticRLError
from elasticrl.train import stop
from elasticrl.train.dist import WorldInfo

log = logging.getLogger(__name__)


class WorldChangedError(ElasticRLError, dist.DistError):
    """A rank of the current world was evicted; the worker group must re-form (in place, or by a
    torchrun restart). A ``DistError`` like the collective failures a dead peer causes, so
    ``restart_grace`` treats it as one."""


def enabled(environ=os.environ) -> bool:
    """Whether the agent asked its workers to re-form in place (``--rdzv-conf in_place=true``)."""
    return environ.get(IN_PLACE_ENV) == "1"


def rank_of(member: str) -> int:
    """The rank in a trainer member id ``rank-<N>`` (``train.names.member_id``)."""
    prefix, _, number = member.rpartition("-")
    if prefix != "rank" or not number.isdigit():
        raise ElasticRLError(f"{member!r} is not a trainer rank's member id (rank-<N>)")
    return int(number)


class WorldWatch:
    """Follows the trainer ranks' run and fails this rank's collective waits once a member of the
    current world is gone. One per worker process; ``expect`` names the world after a re-form.

    ``on_loss(lost)`` runs on the watch thread at the first loss of a world (the worker's exit
    where it cannot re-form in place).
    """

    def __init__(self, client: CoordinatorClient, run_id: str, members: Iterable[str], *,
                 on_loss: Callable[[tuple[str, ...]], None] | None = None):
        from elasticrl.rendezvous.handler import RunViewCache

        self._cond = threading.Condition()
        self._members = frozenset(members)
        self._live: frozenset[str] | None = None  # the members of the last view
        self._pending: set[torch.futures.Future] = set()
        self._on_loss = on_loss
        self.lost: tuple[str, ...] = ()
        self._closed = False
        # Its thread re-subscribes after a coordinator outage (meanwhile the collectives' own
        # timeouts are left) and calls _view with every view.
        self._views = RunViewCache(client, run_id, self._view)

    def _view(self, view) -> None:
        with self._cond:
            self._live = frozenset(view.members)
            lost = self._losing()
        if lost:
            self._lose(lost)

    def _losing(self) -> tuple[str, ...]:
        """Under the lock: the members of the current world that the last view lacks, recorded as
        lost if they are the first loss of this world (else ())."""
        if self.lost or self._closed or self._live is None:
            return ()
        self.lost = tuple(sorted(self._members - self._live))
        if self.lost:
            self._cond.notify_all()
        return self.lost

    def _lose(self, lost: tuple[str, ...]) -> None:
        """After ``_losing`` recorded ``lost``: fail the pending gradient futures, tell ``on_loss``."""
        with self._cond:
            pending, self._pending = self._pending, set()
        log.warning("rank(s) %s of the world are gone: failing this rank's collective waits", ", ".join(lost))
        for fut in pending:
            _settle(fut, error=self._error("the gradient all-reduce"))
        if self._on_loss is not None:
            self._on_loss(lost)

    def _error(self, what: str) -> WorldChangedError:
        return WorldChangedError(f"{what} abandoned: peer(s) {', '.join(self.lost)} left the world; re-forming")

    def expect(self, members: Iterable[str]) -> None:
        """The current world is ``members`` (after a re-form). One of them the last view already
        lacks (it died right after the survivors met) is lost at once."""
        with self._cond:
            self._members = frozenset(members)
            self.lost = ()
            self._pending.clear()
            lost = self._losing()
        if lost:
            self._lose(lost)

    def check(self) -> None:
        """Raise ``WorldChangedError`` if a rank of the world is lost (between coordinator waits)."""
        if self.lost:
            raise self._error("a wait")

    def await_loss(self, timeout_s: float) -> tuple[str, ...]:
        """The lost members, waiting up to ``timeout_s`` for the coordinator to evict one (a dead
        peer fails a collective before its stream grace or lease runs out); () if none was."""
        with self._cond:
            self._cond.wait_for(lambda: self.lost, timeout_s)
            return self.lost

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work``; raises ``WorldChangedError`` at once when a rank is lost meanwhile
        (the work is abandoned with its group)."""
        fut = work.get_future()
        fut.add_done_callback(lambda _: self._notify())
        with self._cond:
            self._cond.wait_for(lambda: fut.done() or self.lost)
            if self.lost and not fut.done():
                raise self._error("a collective")
        fut.wait()  # done: returns at once, or raises the collective's own error

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def abortable(self, fut: torch.futures.Future) -> torch.futures.Future:
        """A future with ``fut``'s result that fails when a rank is lost first (the DDP hook's)."""
        out: torch.futures.Future = torch.futures.Future()
        with self._cond:
            if self.lost:
                _settle(out, error=self._error("the gradient all-reduce"))
                return out
            self._pending.add(out)

        def done(f: torch.futures.Future) -> None:
            with self._cond:
                self._pending.discard(out)
            try:
                _settle(out, value=f.value())
            except Exception as exc:  # noqa: BLE001 - handed to the waiter
                _settle(out, error=exc)

        fut.add_done_callback(done)
        return out

    def close(self) -> None:
        self._views.stop()
        with self._cond:
            self._closed = True
            self._on_loss = None


def _settle(fut: torch.futures.Future, *, value=None, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless it already is (the watch and the collective race)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except RuntimeError:
        pass  # completed by the other side first


def abortable_ddp(ddp: torch.nn.parallel.DistributedDataParallel, watch: WorldWatch) -> None:
    """Route DDP's gradient all-reduce through ``watch``: the averaged bucket as torch's default
    hook computes it, in a future that a lost rank fails (backward then raises)."""
    group = ddp.process_group

    def hook(_state, bucket):  # no annotations: torch checks them, and this module's are strings
        buffer = bucket.buffer().div_(group.size())
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return watch.abortable(work.get_future().then(lambda f: f.value()[0]))

    ddp.register_comm_hook(None, hook)


FORM_TIMEOUT_S = 60.0
"""How long the survivors wait for each other while their new group forms, seconds."""

_abandoned: list = []
"""Every process group this process left behind: kept referenced, so no destructor ever joins a
gloo thread that still waits for a dead peer (it ends at the group's timeout)."""


def abandon_groups() -> None:
    """Unregister every process group (a new default group may then form) without shutting any
    down; a peer waiting on one of them is failed by its own watch."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    _abandoned.extend(world.pg_map)
    # What destroy_process_group() clears, less the backends' shutdown.
    world.pg_map.clear()
    world.pg_names.clear()
    world.pg_group_ranks.clear()
    world.pg_backend_config.clear()
    world.pg_to_tag.clear()
    world.tags_to_pg.clear()
    world.pg_coalesce_state.clear()
    world.group_count = 0
    c10d._update_default_pg(None)
    c10d._unregister_all_process_groups()  # the names (our list keeps the groups themselves)


def exit_if_abandoned(code: int) -> None:
    """End the process now (output flushed) if it left a process group behind: the interpreter's
    exit would destroy it, and a gloo group destroyed while a thread still waits in it aborts the
    process (``std::terminate``), turning a finished run into a failed worker."""
    if _abandoned:
        stop.exit_now(code, flush_s=0.0)  # the snapshot flush is unregistered by then


@dataclasses.dataclass(kw_only=True)
class Reformer:
    """Agrees on the survivors and forms their process group; one per worker process."""

    address: str
    """The coordinator, whose KV holds the new group's store."""
    token: str | None = None
    tls_ca: str | None = None
    backend: str = "gloo"
    timeout_s: float = 600.0
    """How long the survivors wait for each other at the barrier."""
    group_timeout_s: float = 660.0
    """The new group's collective timeout (the first group's, ``train.dist.init_process_group``)."""
    attempts: int = 0
    _client: CoordinatorClient | None = dataclasses.field(default=None, repr=False)
    _store: object = dataclasses.field(default=None, repr=False)

    def reform(self, membership: Membership, watch: WorldWatch, generation: int, world: WorldInfo,
               node: str) -> tuple[list[str], WorldInfo]:
        """Leave the old group behind, meet the other survivors, form their group, and return them
        (member ids in rank order) with this rank's place among them."""
        from elasticrl.train.dist import all_gather_json

        me = membership.member_id
        abandon_groups()
        survivors, name = self.agree(membership, generation, me)
        watch.expect(survivors)
        self.form(membership.run_id, name, survivors.index(me), len(survivors))
        return survivors, next_world(world, survivors, me, [str(n) for n in all_gather_json(node)])

    def agree(self, membership: Membership, generation: int, me: str) -> tuple[list[str], str]:
        """Meet the other survivors; returns them (member ids, in rank order) and the barrier's
        name. Raises ``ElasticRLError`` when it cannot (this rank fenced, the barrier timed out)."""
        self.attempts += 1
        name = f"g{generation}/reform-{self.attempts}"
        result = membership.arrive(name, timeout_s=self.timeout_s)
        survivors = sorted((m for m in result.arrived if m.startswith("rank-")), key=rank_of)
        if me not in survivors:
            raise ElasticRLError(f"{me} is not among the survivors {survivors} of re-form {name}")
        return survivors, name

    def form(self, run_id: str, name: str, rank: int, world_size: int) -> None:
        """Form the default process group over a store in the coordinator's KV: every survivor
        uses the same prefix, named after the barrier they met at."""
        from elasticrl.rendezvous.store import CoordinatorStore

        if self._client is None:
            self._client = CoordinatorClient(self.address, token=self.token, tls_ca=self.tls_ca)
        # Held: torch keeps only the C++ side of a Python store, whose methods vanish with it.
        if self._store is not None:
            _abandoned.append(self._store)
        # A survivor that dies between the barrier and here fails the group's forming within
        # FORM_TIMEOUT_S (then torchrun restarts the workers), not the collectives' long timeout.
        self._store = CoordinatorStore(self._client, run_id, f"reform/{name}/", timeout_s=min(self.timeout_s, FORM_TIMEOUT_S))
        # gloo's interface stays the one the first group chose ($GLOO_SOCKET_IFNAME, train.dist)
        dist.init_process_group(self.backend, store=self._store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=self.group_timeout_s))


def next_world(world: WorldInfo, survivors: list[str], me: str, nodes: list[str]) -> WorldInfo:
    """This rank's place among ``survivors`` (member ids in rank order), given every survivor's
    node name in that order: ranks keep their order, and nodes are numbered by their first rank."""
    order = list(dict.fromkeys(nodes))
    rank = survivors.index(me)
    return WorldInfo(rank=rank, world_size=len(survivors), local_rank=world.local_rank, node_rank=order.index(nodes[rank]))

