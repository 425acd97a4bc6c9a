"""Every rank of a world trains with the same settings.

A node started with another config (another learning rate, model shape or iteration count) would
otherwise join and then fail in torch (shapes that do not match), stall the others at a barrier it
never reaches, or train silently with its own hyper-parameters. So each new world compares the
settings its ranks must share (``config.run_settings``: all but the per-node ones, such as paths,
the engine's hardware and the coordinator's address) once, right after the process group forms:
the settings most ranks hold are the run's (on a tie, those of the lowest rank), and a rank whose
settings differ stops its node at once with a ``ConfigError`` naming the keys. The others go on
without it, as after any lost node.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging

from elasticrl.config import ConfigError, NodeConfig
from elasticrl.config.node import PER_NODE_KEYS, PER_NODE_SECTIONS, run_settings, setting_differences
from elasticrl.train.dist import all_gather_json, broadcast_json

log = logging.getLogger(__name__)


def reference(digests: list[str]) -> int:
    """The rank whose settings are the run's: the lowest holding the most common digest."""
    counts = collections.Counter(digests)
    most = max(counts.values())
    return next(rank for rank, d in enumerate(digests) if counts[d] == most)


def check_same_settings(cfg: NodeConfig, rank: int) -> None:
    """*Collective.* Raises ``ConfigError`` on a rank whose settings differ from the run's (see the
    module's docstring); the other ranks log which ranks differ and return."""
    mine = run_settings(cfg)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    digests = all_gather_json(digest)
    if len(set(digests)) == 1:
        return
    src = reference(digests)
    theirs = broadcast_json(mine if rank == src else None, src=src)
    odd = [r for r, d in enumerate(digests) if d != digests[src]]
    shared = len(digests) - len(odd)
    if rank in odd:
        raise ConfigError(
            f"this node's config differs from the run's (rank {src}'s, which {shared} of {len(digests)} ranks share): "
            f"{'; '.join(setting_differences(mine, theirs))}. Every node of a run must have the same settings, but for "
            f"the per-node ones ([{'], ['.join(sorted(PER_NODE_SECTIONS))}], {', '.join(sorted(PER_NODE_KEYS))}); "
            "this node stops"
        )
    log.error("rank(s) %s of this world run another config and stop (their nodes log which settings differ); "
              "the others go on without them", ", ".join(map(str, odd)))
