"""The two ends of ``rollout.weights_transfer``: the trainer's publisher and a worker's fetcher.

``relay`` (the default) moves the bytes peer to peer (``peer``); ``coordinator`` uploads each
version to the coordinator and downloads it from there (``SchedulerClient.publish_weights`` /
``fetch_weights``). Both ends expose the same two calls, so the trainer loop and the rollout-only
worker do not care which is configured.
"""

from __future__ import annotations

import logging
import threading
import time

from elasticrl.config.sections import WEIGHTS_TRANSFERS
from elasticrl.weights import peer as relay

log = logging.getLogger(__name__)

MODES = WEIGHTS_TRANSFERS  # rollout.weights_transfer


class _Endpoint:
    """What both ends share: the mode, and with the relay this process's ``WeightPeer``."""

    def __init__(self, client, run_id: str, member_id: str, *, mode: str, token: str | None,
                 coordinator_address: str, relay_host: str, relay_port: int):
        if mode not in MODES:
            raise ValueError(f"rollout.weights_transfer: {mode!r} must be one of {', '.join(MODES)}")
        self.client, self.run_id, self.member_id, self.mode, self.token = client, run_id, member_id, mode, token
        self.peer = None
        if mode == "relay":
            host = relay.advertise_host(coordinator_address, relay_host)
            self.peer = relay.WeightPeer(token=token, port=relay_port, advertise_host=host)

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None


class WeightPublisher(_Endpoint):
    """Rank 0: ``publish(version, blob)`` makes a new version available to rollout-only workers.

    relay: the blob stays in this process, served by its ``WeightPeer`` (the newest two versions
    are kept for readers still on the older one); the coordinator gets the metadata only.
    """

    def __init__(self, client, run_id: str, member_id: str, *, mode: str = "relay", token: str | None = None,
                 coordinator_address: str = "", relay_host: str = "", relay_port: int = 0):
        super().__init__(client, run_id, member_id, mode=mode, token=token, coordinator_address=coordinator_address,
                         relay_host=relay_host, relay_port=relay_port)
        if self.peer is not None:
            log.info("serving policy weights to rollout workers at %s", self.peer.address)

    def publish(self, version: int, blob: bytes | bytearray | memoryview) -> None:
        if self.peer is None:
            self.client.publish_weights(self.run_id, version, blob)
        else:
            relay.publish(self.client, self.run_id, self.member_id, self.peer, version, blob)


class WeightFetcher(_Endpoint):
    """A rollout worker: ``fetch(have_version, wait_s)`` -> ``(version, blob)`` of a newer
    version, or None if none came within ``wait_s``.

    relay: the fetched version is served on to peers from this process until a newer one
    replaces it (``peer.KEEP_VERSIONS``), which is what makes the fan-out a pipeline.
    """

    def __init__(self, client, run_id: str, member_id: str, *, mode: str = "relay", token: str | None = None,
                 coordinator_address: str = "", relay_host: str = "", relay_port: int = 0,
                 stop: threading.Event | None = None):
        super().__init__(client, run_id, member_id, mode=mode, token=token, coordinator_address=coordinator_address,
                         relay_host=relay_host, relay_port=relay_port)
        self.stop = stop

    def fetch(self, have_version: int, wait_s: float) -> tuple[int, bytes | bytearray] | None:
        if self.peer is None:
            return self.client.fetch_weights(self.run_id, have_version=have_version, wait_s=wait_s)
        start = time.monotonic()
        held = relay.fetch(self.client, self.run_id, self.member_id, self.peer, have_version=have_version,
                           wait_s=wait_s, token=self.token, stop=self.stop)
        if held is None:
            return None
        sources = ", ".join(f"{m} [{a}, {b})" for m, a, b in held.sources if b > a)
        log.info("weights version %#x: %.1f MB from %s in %.2fs", held.version, held.total_bytes / 1e6, sources,
                 time.monotonic() - start)
        return held.version, held.buf
