"""Every rank of a world trains with the same settings.

A node started with another config (another learning rate, model shape or iteration count) would
otherwise join and then fail in torch (shapes that do not match), stall the others at a barrier it
never reaches, or train silently with its own hyper-parameters. So each new world compares the
settings its ranks must share (``config.run_settings``: all but the per-node ones, such as paths,
the engine's hardware and the coordinator's address) once, right after the process group forms:
the settings the run trained with before (their digest is kept in the coordinator's KV) are the
run's if any rank holds them, else those most ranks hold (on a tie, the lowest rank's). A rank whose
settings differ stops its node at once with a ``ConfigError`` naming the keys; the others go on
without it, as after any lost node. So a late node with another config stops, whatever rank it
drew, and a whole run started again with a new config (every rank agreeing) takes it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging

from elasticrl.config import ConfigError, NodeConfig
from elasticrl.config.node import PER_NODE_KEYS, PER_NODE_SECTIONS, rollout_settings, run_settings, setting_differences
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.train.dist import all_gather_json, broadcast_json
from elasticrl.train.names import workers_run

log = logging.getLogger(__name__)


SETTINGS_KEY = b"elasticrl/settings-digest"
"""The digest of the settings the run's last world agreed on, in the workers' run's KV."""
ROLLOUT_SETTINGS_KEY = b"elasticrl/rollout-settings"
"""Those of them a rollout-only worker must share (``config.rollout_settings``, JSON), beside it."""


def reference(digests: list[str], known: str | None = None) -> int:
    """The rank whose settings are the run's: the lowest holding ``known`` (the run's so far) if any
    does, else the lowest holding the most common digest."""
    if known in digests:
        return digests.index(known)
    counts = collections.Counter(digests)
    most = max(counts.values())
    return next(rank for rank, d in enumerate(digests) if counts[d] == most)


def check_same_settings(cfg: NodeConfig, rank: int, client: SchedulerClient) -> None:
    """*Collective.* Raises ``ConfigError`` on a rank whose settings differ from the run's (see the
    module's docstring); the other ranks log which ranks differ and return. Rank 0 reads and keeps
    the run's digest in the coordinator's KV."""
    mine = run_settings(cfg)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    digests = all_gather_json(digest)
    run = workers_run(cfg.run.run_id)
    known = None
    if rank == 0:
        (raw,) = client.kv_get(run, [SETTINGS_KEY])
        known = raw.decode() if raw else None
    if len(set(digests)) == 1:
        if rank == 0 and known != digest:  # a new run, or all of it started again with new settings
            _keep(client, run, digest, mine)
        return
    known = broadcast_json(known, src=0)
    src = reference(digests, known)
    theirs = broadcast_json(mine if rank == src else None, src=src)
    odd = [r for r, d in enumerate(digests) if d != digests[src]]
    shared = len(digests) - len(odd)
    if rank == 0 and known != digests[src]:
        _keep(client, run, digests[src], theirs)
    whose = "those it ran with so far" if known == digests[src] else f"{shared} of {len(digests)} ranks'"
    if rank in odd:
        raise ConfigError(
            f"this node's config differs from the run's (rank {src}'s: {whose}): "
            f"{'; '.join(setting_differences(mine, theirs))}. Every node of a run must have the same settings, but for "
            f"the per-node ones ([{'], ['.join(sorted(PER_NODE_SECTIONS))}], {', '.join(sorted(PER_NODE_KEYS))}); "
            "this node stops"
        )
    log.error("rank(s) %s of this world run another config and stop (their nodes log which settings differ); "
              "the others go on without them", ", ".join(map(str, odd)))


def _keep(client: SchedulerClient, run: str, digest: str, settings: dict) -> None:
    """The run's settings, as the world agreed on them: their digest, and what of them a rollout
    worker must share."""
    rollout = json.dumps(rollout_settings(settings), sort_keys=True).encode()
    client.kv_set(run, {SETTINGS_KEY: digest.encode(), ROLLOUT_SETTINGS_KEY: rollout})


def check_rollout_worker(cfg: NodeConfig, client: SchedulerClient) -> None:
    """A rollout-only worker plays and scores episodes for the trainer: ``ConfigError`` naming the
    settings where its config differs from what the trainer keeps in the KV (``ROLLOUT_SETTINGS_KEY``,
    written once the trainer's world agreed; nothing to compare against before that, or from an
    older trainer)."""
    (raw,) = client.kv_get(workers_run(cfg.run.run_id), [ROLLOUT_SETTINGS_KEY])
    if raw is None:
        return
    theirs, mine = json.loads(raw), rollout_settings(run_settings(cfg))
    if mine != theirs:
        raise ConfigError(
            f"this rollout worker's config differs from the trainer's of run {cfg.run.run_id!r}: "
            f"{'; '.join(setting_differences(mine, theirs))}. A rollout worker plays and scores episodes the trainer "
            "learns from: give it the trainer's [task], [env], [model] and algorithm.rewards"
        )
