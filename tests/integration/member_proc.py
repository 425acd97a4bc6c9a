"""A coordinator member in its own OS process, for integration tests that kill it by pid.

It joins, keeps its lease alive, optionally arrives at barriers, and prints one JSON line per
event on stdout (with CLOCK_MONOTONIC timestamps, comparable across processes on one host):

    python member_proc.py ADDRESS RUN MEMBER [--barrier NAME ...] [--wait-members N] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from elasticrl.coordinator.client import CoordinatorClient, Membership
from elasticrl.errors import ElasticRLError


def emit(**event) -> None:
    event["t"] = time.monotonic()
    print(json.dumps(event), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("run")
    p.add_argument("member")
    p.add_argument("--barrier", action="append", default=[], help="barrier names to arrive at, in order")
    p.add_argument("--timeout", type=float, default=30.0, help="barrier timeout, seconds")
    p.add_argument("--wait-members", type=int, default=0, help="before the barriers, wait until the run has this many live members")
    p.add_argument("--hold", type=float, default=60.0, help="seconds to stay a member after the barriers")
    args = p.parse_args()
    client = CoordinatorClient(args.address, call_timeout_s=5, reconnect_timeout_s=30)
    fenced = threading.Event()

    def on_fenced(exc):
        emit(event="fenced", error=type(exc).__name__, message=str(exc))
        fenced.set()

    m = Membership(client, args.run, args.member, on_fenced=on_fenced)
    emit(event="joined", incarnation=m.incarnation, epoch=m.epoch)
    deadline = time.monotonic() + 30
    while not (m.streaming.is_set() or fenced.is_set()) and time.monotonic() < deadline:
        m.streaming.wait(0.05)
    if m.streaming.is_set():
        emit(event="streaming")  # its keep-alives go over a Session stream now
    while args.wait_members and time.monotonic() < deadline:
        (run,) = client.status(args.run)["runs"]
        if len(run["snapshot"]["members"]) >= args.wait_members:
            break
        time.sleep(0.05)
    for name in args.barrier:
        try:
            r = m.arrive(name, timeout_s=args.timeout)
        except ElasticRLError as exc:
            emit(event="barrier_error", name=name, error=type(exc).__name__, message=str(exc))
            return 3
        emit(event="released", name=name, arrived=r.arrived, evicted=r.evicted, epoch=r.epoch)
    fenced.wait(args.hold)
    return 4 if fenced.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
