"""What a Work stream's writer sends: the items ``core`` puts in a worker's outbox (``stream.Assign``,
``Cancel``, ``Ack``) as serialized ``WorkResponse`` messages, encoded by hand (a task spec is its
cached message, ``convert.task_wire``), with no protobuf object built per message.

A worker whose hello set ``combined_acks`` gets the acks and assignments that are waiting in its
outbox when the writer comes round as one message (``WorkResponse.acks`` beside ``assign``)
instead of one each. The worker reads a message's acks first, so an ack is never merged past an
assignment of a task of the batch it answers: handed out again on a reconnect before the re-sent
batch with its result was read, the worker would skip it while the batch is unacknowledged, but
run it a second time once the ack came first. Every message costs gRPC's send path on the
coordinator and its receive path on the worker; a trajectory stream's batch otherwise costs an
assignment (its freed slots) and an ack. Nothing waits for company: the writer takes what is there
(for such a worker a batch stored on arrival commits before the writer runs, so its ack and the
tasks it freed slots for leave together: ``results.ResultPipeline.submit``). A ``Cancel`` or
``End`` is never merged, and what follows it waits until it has gone, so the worker reads them in
the order the core sent them (a cancel never overtakes the assignment it cancels).
"""

from __future__ import annotations

from elasticrl.scheduler.convert import task_wire
from elasticrl.scheduler.framing import varint
from elasticrl.scheduler.stream import Ack, Assign, Cancel, End, WorkerConn

# Field keys (number << 3 | wire type) of scheduler.proto's messages.
_R_ASSIGN, _R_CANCEL, _R_ACK, _R_ACKS = b"\x0a", b"\x12", b"\x1a", b"\x22"  # WorkResponse
_A_TASKS = b"\x0a"  # Assignments.tasks
_T_ITERATION, _T_TASK, _T_LEASE_MS, _T_BACKUP = b"\x08", b"\x12", b"\x18", b"\x20\x01"  # TaskAssignment
_K_ACCEPTED, _K_REFUSED = b"\x08", b"\x12"  # ResultAck
_F_ITERATION, _F_TASK_ID, _F_REASON = b"\x08", b"\x12", b"\x1a"  # RefusedResult
_C_ITERATION, _C_TASK_IDS = b"\x08", b"\x12"  # CancelTasks


class Writer:
    """The messages of one stream's outbox, in order (``next``)."""

    def __init__(self, conn: WorkerConn):
        self.conn = conn
        self._held = None  # taken from the outbox while merging, to go next

    async def next(self) -> bytes | End:
        """The next serialized message, or the ``End`` the core put in the outbox."""
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await self.conn.outbox.get()
        if isinstance(item, End):
            return item
        if not self.conn.combined_acks or not isinstance(item, (Ack, Assign)):
            return message(item)
        outbox, acks, tasks = self.conn.outbox, [], []
        while True:
            if isinstance(item, Ack):
                acks.append(item)
            else:
                tasks += item.items
            if outbox.empty():
                break
            item = outbox.get_nowait()
            if not isinstance(item, (Ack, Assign)) or (isinstance(item, Ack) and _answers_one_of(item, tasks)):
                self._held = item
                break
        return combined(tasks, acks)


def _answers_one_of(ack: Ack, tasks: list[tuple[int, object, float, bool]]) -> bool:
    """``ack``'s batch holds a task of ``tasks`` (assignment items): merged with them, the ack would
    be read first."""
    return not ack.tasks.isdisjoint((iteration, spec.task_id) for iteration, spec, _, _ in tasks)


def message(item: Assign | Cancel | Ack) -> bytes:
    """One outbox item as its own ``WorkResponse`` (what any worker reads)."""
    if isinstance(item, Assign):
        return _field(_R_ASSIGN, _assignments(item.items))
    if isinstance(item, Ack):
        return _field(_R_ACK, _ack(item))
    if isinstance(item, Cancel):
        body = [_C_ITERATION, varint(item.iteration)] if item.iteration else []
        for task_id in item.task_ids:
            body.append(_field(_C_TASK_IDS, task_id.encode()))
        return _field(_R_CANCEL, b"".join(body))
    raise TypeError(f"no message for {item!r}")


def combined(tasks: list[tuple[int, object, float, bool]], acks: list[Ack]) -> bytes:
    """``WorkResponse(acks=acks, assign=Assignments(tasks))``, for a ``combined_acks`` worker."""
    parts = [_field(_R_ACKS, _ack(a)) for a in acks]
    if tasks:
        parts.append(_field(_R_ASSIGN, _assignments(tasks)))
    return b"".join(parts)


def _assignments(items) -> bytes:
    out = []
    for iteration, spec, lease_s, backup in items:
        task = task_wire(spec)
        lease_ms = int(lease_s * 1000)
        body = [_T_ITERATION, varint(iteration)] if iteration else []
        body += (_T_TASK, varint(len(task)), task)
        if lease_ms:
            body += (_T_LEASE_MS, varint(lease_ms))
        if backup:
            body.append(_T_BACKUP)
        out.append(_field(_A_TASKS, b"".join(body)))
    return b"".join(out)


def _ack(a: Ack) -> bytes:
    body = [_K_ACCEPTED, varint(a.accepted)] if a.accepted else []
    for iteration, task_id, reason in a.refused:
        r = [_F_ITERATION, varint(iteration)] if iteration else []
        if task_id:
            r.append(_field(_F_TASK_ID, task_id.encode()))
        if reason:
            r.append(_field(_F_REASON, reason.encode()))
        body.append(_field(_K_REFUSED, b"".join(r)))
    return b"".join(body)


def _field(key: bytes, body: bytes) -> bytes:
    return b"".join((key, varint(len(body)), body))
