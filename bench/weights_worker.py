"""One rollout worker's weight fetching, without an engine: for ``bench/weights.py`` and the relay's
integration tests.

It fetches every new version of ``--run`` (``--mode relay``: from peers, serving what it has on;
``coordinator``: from the coordinator) and prints one JSON line per event on stdout:
``{"event": "ready", "address"}`` once it waits for weights, ``{"event": "got", "version", "t",
"bytes", "sha256", "sources"}`` per verified version (``t``: ``time.time()``), and with
``--progress-mb N`` ``{"event": "bytes", "version", "n"}`` every N MB received. It runs until
SIGTERM (or ``--versions`` versions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import signal
import sys
import threading
import time


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--member", required=True)
    p.add_argument("--mode", choices=("relay", "coordinator"), default="relay")
    p.add_argument("--versions", type=int, default=0, help="exit after this many versions (0: run until SIGTERM)")
    p.add_argument("--stall-timeout", type=float, default=10.0)
    p.add_argument("--progress-mb", type=float, default=0.0)
    p.add_argument("--token", default="")
    p.add_argument("--reannounce-s", type=float, default=0.0, help="override peer.REANNOUNCE_S (tests)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from elasticrl.scheduler.client import SchedulerClient
    from elasticrl.weights import peer as relay

    if args.reannounce_s:
        relay.REANNOUNCE_S = args.reannounce_s
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    step = int(args.progress_mb * 1e6)
    state = {"next": step}

    def on_bytes(n: int) -> None:
        if step and n >= state["next"]:
            state["next"] = (n // step + 1) * step
            emit(event="bytes", n=n)

    with SchedulerClient(args.address, token=args.token or None, call_timeout_s=10, reconnect_timeout_s=30) as client:
        peer = relay.WeightPeer(token=args.token or None, stall_timeout_s=args.stall_timeout) if args.mode == "relay" else None
        emit(event="ready", address=peer.address if peer else "")
        have, count = -1, 0
        while not stop.is_set() and (not args.versions or count < args.versions):
            state["next"] = step
            if peer is None:
                got = client.fetch_weights(args.run, have_version=have, wait_s=1.0)
                if got is None:
                    continue
                t = time.time()
                version, blob, sources = got[0], got[1], [["coordinator", 0, len(got[1])]]
                digest = hashlib.sha256(blob).hexdigest()  # fetch_weights verified it already; reported for the caller
            else:
                held = relay.fetch(client, args.run, args.member, peer, have_version=have, wait_s=1.0, token=args.token or None,
                                   stop=stop, stall_timeout_s=args.stall_timeout, on_bytes=on_bytes)
                if held is None:
                    continue
                t = time.time()
                version, blob, sources, digest = held.version, held.buf, [list(s) for s in held.sources], held.digest
            emit(event="got", version=version, t=t, bytes=len(blob), sha256=digest, sources=sources)
            have, count = version, count + 1
        if peer is not None:
            peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
