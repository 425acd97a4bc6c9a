"""How a run names and numbers things: member ids of workers and engines, the scheduler's run,
published weight versions and per-iteration seeds (shared by the trainer and rollout-only workers)."""

from __future__ import annotations

import os
import socket

from elasticrl.train.logcontext import NODE_NAME_ENV


def member_id(rank: int) -> str:
    return f"rank-{rank}"


def engine_member_id(local_rank: int) -> str:
    """The member id of this worker's engine in ``<run>.rollout``: stable across worker restarts
    under the same torchrun agent (a restarted engine fences its dead predecessor at once), and
    unique per agent even where hosts share a name: $ELASTICRL_NODE_NAME when set, else the
    hostname plus the agent's pid (the rendezvous plugin's node id)."""
    base = os.environ.get(NODE_NAME_ENV) or f"{socket.gethostname()}-{os.getppid()}"
    return f"{base}-{local_rank}"


def weights_version(generation: int, policy_version: int) -> int:
    """The coordinator's version of a published policy: increasing across restarts of the worker
    group (a resumed group re-publishes older iterations under a newer generation)."""
    return (generation << 32) | policy_version


def iteration_seed(seed: int, iteration: int, rank: int) -> int:
    """The seed of torch's and Python's global RNGs on ``rank`` for ``iteration``'s update
    (dropout, anything else that draws from them). Reseeding at every iteration makes the RNG a
    function of (run.seed, iteration, rank), so a checkpoint needs no RNG state: resumed in a world
    of the same size, the next iteration draws what it would have drawn (in another size the ranks
    differ, and so do their streams). The iteration number is the data position and the RNG
    position at once."""
    return (seed * 1_000_003 + iteration * 7_919 + rank) % (2**63)


def rollout_run(run_id: str) -> str:
    """The scheduler's run: every node's engine and every rollout-only worker is a member of it."""
    return f"{run_id}.rollout"


def workers_run(run_id: str) -> str:
    """The trainer workers' run: their membership, barriers, generation and progress record."""
    return f"{run_id}.workers"
