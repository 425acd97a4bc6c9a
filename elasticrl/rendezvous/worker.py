"""Worker-side help for the elasticrl torchrun backend: let membership-driven restarts win the race.

When a node dies, the survivors' collectives usually fail at once (gloo and NCCL see the peer's
sockets close), long before the coordinator evicts the dead node when its lease lapses. If the
worker then exits with an error, torchrun restarts the group through its ``--max-restarts`` budget,
so a long run that loses a node now and then eventually runs out of restarts. Parking the failed
worker instead (``restart_grace``) keeps it "healthy" in torchrun's eyes until the eviction shows
up in ``num_nodes_waiting()``; the agent then stops it (SIGTERM) and re-forms the group without
counting a restart. A failure that is not followed by a restart within the grace period (a real
bug, or a peer that is merely slow) is re-raised unchanged, only later.

::

    from elasticrl.rendezvous.worker import restart_grace

    with restart_grace():
        train()          # all-reduces, broadcasts, ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time

from elasticrl.config import IN_PLACE_ENV

log = logging.getLogger(__name__)

LEASE_TTL_ENV = "ELASTICRL_RDZV_LEASE_TTL_S"  # set by the agent's handler, inherited by workers
ROUND_ENV = "ELASTICRL_RDZV_ROUND"  # the rendezvous round the agent started its workers in
STOP_FILE_ENV = "ELASTICRL_RDZV_STOP_FILE"  # where a worker asks its agent not to restart it (request_stop)


def armed_key(round_no: int) -> bytes:
    """The key (in the agents' run) that says every worker of round ``round_no`` watches its world
    (in_place): from then on its agents leave a lost node to the workers."""
    return f"torchrun/round-{round_no}/elasticrl/in-place-armed".encode()
# Beyond the lease TTL: the coordinator's tick, the watch push and torchrun's monitor interval.
GRACE_SLACK_S = 2.0
DEFAULT_GRACE_S = 10.0


def default_grace_s() -> float:
    """Lease TTL + slack when the agent uses the elasticrl backend, else a fixed default; 0 with
    ``--rdzv-conf in_place=true``, where the agent restarts no worker for a lost node."""
    if os.environ.get(IN_PLACE_ENV) == "1":
        return 0.0
    try:
        return float(os.environ[LEASE_TTL_ENV]) * 1.5 + GRACE_SLACK_S
    except (KeyError, ValueError):
        return DEFAULT_GRACE_S


def is_peer_failure(exc: BaseException) -> bool:
    """Errors that a dead peer causes in a collective or in the workers' store."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection", "peer", "socket", "timed out", "timeout")
    )


@contextlib.contextmanager
def restart_grace(grace_s: float | None = None):
    """On a peer failure inside the block, wait up to ``grace_s`` for torchrun to restart this
    worker (it sends SIGTERM), then re-raise. Other exceptions pass through at once."""
    try:
        yield
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        wait_s = default_grace_s() if grace_s is None else grace_s
        log.warning(
            "rank %s: collective failed (%s: %s); waiting up to %.1fs for the agent to re-form the group",
            os.environ.get("RANK", "?"), type(exc).__name__, str(exc).splitlines()[0][:200], wait_s,
        )
        time.sleep(wait_s)
        raise


@dataclasses.dataclass(frozen=True)
class StopRequest:
    """What a failing worker tells its agent (``request_stop``): ``kind`` names the failure (an
    exception class), ``reason`` says it in full; ``at_once`` for a failure no restart can fix
    (a bad config), else the agent stops only when the same kind of failure comes back after one
    restart (a reward function or env that raises may have met a service that was down)."""

    kind: str
    reason: str
    at_once: bool


def request_stop(kind: str, reason: str, *, at_once: bool) -> str | None:
    """Ask this node's torchrun agent not to restart its workers (or to restart them once more,
    see ``StopRequest``) after this one fails in a way a restart does not fix. The agent then
    leaves the run at its next rendezvous, with ``reason``, instead of spending ``--max-restarts``
    on restarts (each reloading the model) that fail the same way; the other nodes go on without
    it or stop for their own failure. Returns the file written (the agent's, ``STOP_FILE_ENV``),
    or None under an agent that is not elasticrl's backend, which restarts the workers as before."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path:
        return None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"kind": kind, "reason": reason, "at_once": at_once}, f)
    os.replace(tmp, path)  # the agent reads a whole request or none
    return path


def take_stop_request(path: str) -> StopRequest | None:
    """The agent's side of ``request_stop``: the request a worker left in ``path`` (the file is
    removed), or None when no worker asked (or what it left cannot be read: then restarts go on
    as usual)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the workers' stop request %s (%s); restarting them as usual", path, exc)
        return None
    with contextlib.suppress(OSError):
        os.remove(path)
    try:
        doc = json.loads(text)
        return StopRequest(str(doc["kind"]), str(doc["reason"]).strip() or "no reason given", bool(doc["at_once"]))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("the workers' stop request %s is malformed (%s); restarting them as usual", path, exc)
        return None
