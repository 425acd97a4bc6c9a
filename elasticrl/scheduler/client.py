"""Blocking client of the scheduler, for the driver (submit, wait for the seal) and for trainer
ranks (fetch their shard of a sealed iteration).

A ``CoordinatorClient`` with the Scheduler calls added: same channel, token, TLS, deadlines,
retries on UNAVAILABLE, and errors mapped once by ``codes``. Waiting for a seal is a chain of
short server-side waits, so a coordinator restart in the middle costs one retried call; a fetch
that breaks is retried from the start (it is a read). Policy weights go up and come back as
streams of 4 MiB chunks; a publish that breaks is sent again whole (re-publishing the same
version and bytes is an idempotent success).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

import grpc
import tenacity

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl._proto import scheduler_pb2_grpc as spb_grpc
from elasticrl.coordinator import codes, wire
from elasticrl.coordinator.client import CoordinatorClient
from elasticrl.coordinator.wire import DEADLINE_SLACK_S, MAX_WAIT_CHUNK_S
from elasticrl.errors import CoordinatorTimeoutError, InternalError, InvalidRequestError, ResourceLimitError
from elasticrl.scheduler.convert import POLICY_TO_PB, SPLIT_TO_PB, fetched_from_pb, manifest_from_pb, task_to_pb
from elasticrl.scheduler.state import FetchedGroup, Policy, Split, TaskSpec
from elasticrl.scheduler.weights import CHUNK_BYTES, FORMAT

# Default deadline for moving one weights blob either way, on top of any wait (pass timeout_s for
# blobs that take longer on a slow link: 16 GiB at 100 MB/s is about 170 s).
WEIGHTS_TRANSFER_TIMEOUT_S = 300.0

log = logging.getLogger(__name__)


class SchedulerClient(CoordinatorClient):
    """Thread-safe, like ``CoordinatorClient``; one per process is plenty."""

    def __init__(self, address: str, **kwargs):
        super().__init__(address, **kwargs)
        self._sched = spb_grpc.SchedulerStub(self._channel)

    def submit_iteration(
        self,
        run_id: str,
        iteration: int,
        tasks: list[TaskSpec],
        *,
        policy: str = "dynamic",
        deadline_s: float = 0.0,
        min_fraction: float = 1.0,
        task_lease_s: float = 0.0,
        backup_tasks: int = 0,
        max_task_failures: int = 2,
        writer: tuple[str, int] | None = None,
    ) -> bool:
        """Queue an iteration's tasks; False if it was already submitted with the same tasks.

        ``deadline_s`` (0: none): after it, the iteration seals once ``min_fraction`` of its groups
        are done. ``task_lease_s`` (0: 600 s): a task unfinished this long after its assignment, or
        after its worker's last renewal (``RenewTasks``, sent while its engine advances), is
        requeued. ``backup_tasks``: dynamic policy only, how many backup copies of the last
        straggling tasks idle workers may run. ``max_task_failures``: failed attempts (environment
        errors) after which a task is given up. ``writer`` (member id, incarnation): refused once
        that incarnation is fenced.
        """
        try:
            pol = Policy(policy)
        except ValueError:
            raise InvalidRequestError(f"policy: {policy!r} is not one of {', '.join(p.value for p in Policy)}") from None
        request = spb.SubmitIterationRequest(
            run_id=run_id,
            iteration=iteration,
            tasks=[task_to_pb(t) for t in tasks],
            policy=POLICY_TO_PB[pol],
            deadline_ms=round(deadline_s * 1000),
            min_fraction=min_fraction,
            task_lease_ms=round(task_lease_s * 1000),
            backup_tasks=backup_tasks,
            max_task_failures=max_task_failures,
            **wire.writer_ref(writer),
        )
        size = request.ByteSize()
        if size > self.max_message_bytes:  # gRPC would refuse it as RESOURCE_EXHAUSTED, every time
            raise ResourceLimitError(
                f"tasks: iteration {iteration}'s {len(tasks)} tasks are {size / 2**20:.1f} MiB in one SubmitIteration, over "
                f"the {self.max_message_bytes / 2**20:.0f} MiB a message may carry: fewer prompts per iteration "
                "(task.prompts_per_iteration) or shorter rows; or raise the limit on both sides (the coordinator's "
                "--max-message-mb and the nodes' coordinator.max_message_mb)")
        return self._call("SubmitIteration", request, stub=self._sched).created

    def iteration_status(self, run_id: str, iteration: int | None = None) -> dict | None:
        """The manifest so far of ``iteration`` (default: the run's newest), or None."""
        request = spb.IterationStatusRequest(run_id=run_id, iteration=iteration or 0, latest=iteration is None)
        resp = self._call("IterationStatus", request, stub=self._sched)
        return manifest_from_pb(resp.manifest) if resp.found else None

    def wait_sealed(
        self, run_id: str, iteration: int, timeout_s: float, *, check: Callable[[], None] | None = None,
        check_every_s: float = 1.0, while_progressing: bool = False,
    ) -> dict:
        """Block until ``iteration`` seals; returns its manifest. ``CoordinatorTimeoutError`` after
        ``timeout_s`` (the message says how far it got); with ``while_progressing``, after
        ``timeout_s`` in which none of its groups finished (done or given up), so that a big
        iteration that advances is waited for however long it takes, and a stalled one is not.
        ``check``, when given, runs every ``check_every_s`` while waiting and may raise to stop the
        wait (a local engine that died)."""
        give_up = time.monotonic() + timeout_s
        finished = -1
        chunk_s = MAX_WAIT_CHUNK_S if check is None else max(0.05, min(MAX_WAIT_CHUNK_S, check_every_s))
        while True:
            if check is not None:
                check()
            wait_s = max(0.0, min(chunk_s, give_up - time.monotonic()))
            request = spb.WaitSealedRequest(run_id=run_id, iteration=iteration, wait_ms=round(wait_s * 1000))
            resp = self._call("WaitSealed", request, stub=self._sched, timeout_s=wait_s + DEADLINE_SLACK_S)
            manifest = manifest_from_pb(resp.manifest)
            if manifest["sealed"]:
                return manifest
            now_finished = manifest["tasks_done"] + manifest["tasks_failed"]
            if while_progressing and now_finished > finished:  # since the last reply (groups found lost count down)
                give_up = time.monotonic() + timeout_s
            finished = now_finished
            if time.monotonic() >= give_up:
                progress = (
                    f"{manifest['tasks_done']}/{manifest['tasks_total']} done, {manifest['tasks_running']} running"
                    if manifest["tasks_total"] else "it was never submitted"
                )
                within = f"with no group finished for {timeout_s:.1f}s" if while_progressing else f"within {timeout_s:.1f}s"
                raise CoordinatorTimeoutError(f"iteration {iteration} of run {run_id!r} did not seal {within}: {progress}")

    def fetch_shard(
        self,
        run_id: str,
        iteration: int,
        *,
        rank: int,
        world_size: int,
        split: str = "train",
        timeout_s: float | None = None,
    ) -> list[FetchedGroup]:
        """This rank's groups of a sealed iteration, balanced by tokens across ``world_size`` ranks
        (the same split for every caller with the same world size)."""
        request = spb.FetchShardRequest(
            run_id=run_id, iteration=iteration, rank=rank, world_size=world_size, split=SPLIT_TO_PB[Split(split)]
        )
        deadline = timeout_s or max(self.call_timeout_s, 60.0)

        def once() -> list[FetchedGroup]:
            groups: list[FetchedGroup] = []
            for resp in self._sched.FetchShard(request, timeout=deadline, metadata=self._metadata):
                groups.extend(fetched_from_pb(g) for g in resp.groups)
            return groups

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(codes.is_retryable),
            wait=wire.retry_wait(),
            stop=tenacity.stop_after_delay(self.reconnect_timeout_s),
            reraise=True,
        )
        try:
            return retrying(once)
        except grpc.RpcError as err:
            raise codes.error_from_rpc(err, self.address) from None

    # -- policy weights ------------------------------------------------------------------------

    def _retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(codes.is_retryable),
            wait=wire.retry_wait(),
            stop=tenacity.stop_after_delay(self.reconnect_timeout_s),
            reraise=True,
        )

    def publish_weights(
        self,
        run_id: str,
        version: int,
        blob: bytes | bytearray | memoryview,
        *,
        timeout_s: float | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        """Publish ``blob`` (a safetensors file, e.g. ``weights.pack_state_dict(model.state_dict())``)
        as ``version`` of the run's policy; returns once the coordinator has verified and stored it.

        ``FencedError`` if the coordinator already holds ``version`` or a newer one (the same
        version with the same bytes is fine: a retry). ``InvalidRequestError`` if the upload was
        refused as malformed, ``ResourceLimitError`` if it is over the coordinator's size limit.
        ``timeout_s`` bounds one attempt (default ``WEIGHTS_TRANSFER_TIMEOUT_S``); an unreachable
        coordinator is retried, sending everything again, for ``reconnect_timeout_s``.
        """
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise TypeError(f"blob: {type(blob).__name__} is not bytes; pass pack_state_dict(state)")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes: {chunk_bytes} must be >= 1")
        view = memoryview(blob).cast("B")
        digest = hashlib.sha256(view).hexdigest()
        deadline = timeout_s or max(self.call_timeout_s, WEIGHTS_TRANSFER_TIMEOUT_S)

        def chunks():
            for offset in range(0, max(view.nbytes, 1), chunk_bytes):
                yield spb.WeightChunk(
                    run_id=run_id, version=version, total_bytes=view.nbytes, offset=offset,
                    data=bytes(view[offset:offset + chunk_bytes]), sha256=digest, format=FORMAT,
                )

        def once() -> spb.PublishWeightsReply:
            return self._sched.PublishWeights(chunks(), timeout=deadline, metadata=self._metadata)

        try:
            reply = self._retrying()(once)
        except grpc.RpcError as err:
            raise codes.error_from_rpc(err, self.address) from None
        log.debug("weights of run %s: version %d published (%d bytes, new=%s)", run_id, version, view.nbytes, reply.created)

    def fetch_weights(
        self,
        run_id: str,
        have_version: int = -1,
        wait_s: float = 0.0,
        *,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes] | None:
        """The run's newest weights as ``(version, blob)`` if newer than ``have_version`` (-1:
        none held), waiting up to ``wait_s`` seconds for one to be published; None if none comes.

        The wait is a chain of server-side waits of at most ``MAX_WAIT_CHUNK_S`` each, so a
        coordinator restart costs one retried call; every call's deadline is its wait plus
        ``DEADLINE_SLACK_S`` plus ``timeout_s`` for the transfer (default
        ``WEIGHTS_TRANSFER_TIMEOUT_S``). The blob is checked against its size and sha256.
        """
        if not 0 <= wait_s < float("inf"):
            raise ValueError(f"wait_s: {wait_s!r} must be a finite number of seconds >= 0")
        transfer_s = timeout_s or max(self.call_timeout_s, WEIGHTS_TRANSFER_TIMEOUT_S)
        give_up = time.monotonic() + wait_s

        def once() -> tuple[int, bytes] | None:
            chunk_wait = max(0.0, min(MAX_WAIT_CHUNK_S, give_up - time.monotonic()))
            request = spb.FetchWeightsRequest(run_id=run_id, have_version=have_version, wait_s=chunk_wait)
            stream = self._sched.FetchWeights(
                request, timeout=chunk_wait + DEADLINE_SLACK_S + transfer_s, metadata=self._metadata
            )
            return _assemble(run_id, stream)

        while True:
            try:
                result = self._retrying()(once)
            except grpc.RpcError as err:
                raise codes.error_from_rpc(err, self.address) from None
            if result is not None or time.monotonic() >= give_up:
                return result

    # -- weights relay (metadata only; elasticrl.weights.peer moves the bytes) ------------------

    def announce_weights(self, run_id: str, version: int, *, total_bytes: int, sha256: str, member_id: str,
                         address: str, complete: bool) -> int:
        """Say that ``member_id`` serves ``version`` at ``address``; returns the run's newest version."""
        request = spb.AnnounceWeightsRequest(
            run_id=run_id, version=version, total_bytes=total_bytes, sha256=sha256, format=FORMAT,
            member_id=member_id, address=address, complete=complete,
        )
        return self._call("AnnounceWeights", request, stub=self._sched).newest_version

    def locate_weights(self, run_id: str, *, member_id: str, address: str, have_version: int, wait_s: float = 0.0,
                       unreachable: list[str] | tuple[str, ...] = ()) -> spb.LocateWeightsReply | None:
        """Whom to fetch the run's newest weights from, if newer than ``have_version``: one
        server-side wait of at most ``MAX_WAIT_CHUNK_S`` (call again to wait longer). The caller
        is registered as a holder still receiving it at ``address``."""
        wait_s = max(0.0, min(MAX_WAIT_CHUNK_S, wait_s))
        request = spb.LocateWeightsRequest(run_id=run_id, member_id=member_id, address=address, have_version=have_version,
                                           wait_s=wait_s, unreachable=list(unreachable))
        reply = self._call("LocateWeights", request, stub=self._sched, timeout_s=wait_s + DEADLINE_SLACK_S)
        return reply if reply.found else None


def _assemble(run_id: str, stream) -> tuple[int, bytes] | None:
    """Join a FetchWeights stream into ``(version, blob)``; None for an empty stream."""
    first, parts, received = None, [], 0
    for chunk in stream:
        if first is None:
            first = chunk
        elif (chunk.version, chunk.total_bytes, chunk.sha256) != (first.version, first.total_bytes, first.sha256):
            raise InternalError(f"weights of run {run_id!r}: the coordinator switched blobs mid-stream (a bug)")
        if chunk.offset != received:
            raise InternalError(f"weights of run {run_id!r}: chunk at offset {chunk.offset}, expected {received}")
        parts.append(chunk.data)
        received += len(chunk.data)
    if first is None:
        return None
    blob = b"".join(parts)
    if received != first.total_bytes or hashlib.sha256(blob).hexdigest() != first.sha256:
        raise InternalError(
            f"weights of run {run_id!r} version {first.version}: received {received} of {first.total_bytes} "
            "bytes or a wrong sha256; fetch again"
        )
    return first.version, blob
