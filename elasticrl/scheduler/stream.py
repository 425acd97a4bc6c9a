"""What one engine's Work stream holds on the coordinator: the worker's connection (its state, the
outbox the stream's writer drains, its result batches in flight), the messages put in that outbox,
and a result batch between its decision and its commit (``Decided``).

Plain records, no I/O: ``core`` fills and applies them, ``intake`` moves a ``Decided`` through its
shard write and commit, ``service`` turns outbox items into messages.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools

from elasticrl.scheduler.state import GroupRecord, TaskSpec, Worker


@dataclasses.dataclass
class Assign:
    items: list[tuple[int, TaskSpec, float, bool]]
    """(iteration, task, lease seconds, is backup copy)."""


@dataclasses.dataclass
class Cancel:
    iteration: int
    task_ids: list[str]


@dataclasses.dataclass
class Ack:
    accepted: int
    refused: list[tuple[int, str, str]]
    """(iteration, task id, reason)."""
    tasks: frozenset[tuple[int, str]] = frozenset()
    """(iteration, task id) of the batch it answers: a merged message never puts it ahead of an
    assignment of one of them (``outbox.Writer``)."""


@dataclasses.dataclass
class End:
    """Close the stream; with an error, fail it with that error's status."""

    error: Exception | None = None


class WorkerConn:
    """One worker's open stream: its state plus the outbox the stream writer drains."""

    _opened = itertools.count()

    def __init__(self, run_id: str, worker: Worker):
        self.run_id = run_id
        self.worker = worker
        self.order = next(self._opened)
        """Streams opened before this one: the order a dispatch pass goes through workers in."""
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.fenced_at: float | None = None
        self.draining = False
        """The worker said it is stopping (``RELEASE_STOPPING``): nothing more is handed to it."""
        self.run_closed = False
        """The coordinator ended this stream itself (its run was closed): no broken stream."""
        self.combined_acks = False
        """Its hello said it reads acks merged with assignments (``outbox.Writer``)."""
        self.reports_running = False
        """Its hello named every task it still runs (``WorkerHello.reports_running``): such a worker
        also skips a task handed to it while it holds its result (``results._give_back_handed_again``)."""
        self.pending: collections.deque[Decided] = collections.deque()
        """Result batches decided and not yet committed, in arrival order (their acks go out in it)."""

    def send(self, message) -> None:
        if not self.closed:
            self.outbox.put_nowait(message)


@dataclasses.dataclass(eq=False)
class Decided:
    """A result batch as ``SchedulerCore.decide`` left it on arrival: what ``commit`` will store
    and refuse. Nothing of it is durable until the commit."""

    conn: WorkerConn
    groups: list[tuple[int, GroupRecord]]
    """(iteration, group) as received; a group is a ``GroupRecord`` or a ``framing.WireGroup``."""
    batch_id: str
    fenced: bool = False
    fresh: dict[int, list] = dataclasses.field(default_factory=dict)
    """iteration -> the groups to store: each the first result of its task (marked ``storing``)."""
    refused: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    """(iteration, task id, reason) decided on arrival."""
    writes: list[tuple[int, str, list[tuple[GroupRecord, list[int]]]]] = dataclasses.field(default_factory=list)
    """(iteration, shard name, [(group, prompt ids)]): the shard files to write before the commit."""
    released: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    """(iteration, task id) taken off the worker's slots on arrival (given back if it is abandoned)."""
    replay: Ack | None = None
    """A batch committed before (same batch id): its first ack, and nothing else to do."""
    follows: Decided | None = None
    """A re-sent batch whose first copy is still between decision and commit: it answers with
    that copy's ack once it committed."""
    invalid: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    """Groups the servicer refused before the core saw them (malformed), added to the ack."""
    done: asyncio.Future | None = None
    """Set once committed or abandoned (the next batch of the stream commits after it)."""
    committed: bool = False
    abandoned: bool = False
