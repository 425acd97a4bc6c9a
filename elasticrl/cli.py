"""``elasticrl`` command line: ``coordinator``, ``run``, ``rollout``, ``session-relay``, ``status``, ``close-run``, ``plot``.

Arguments are parsed before anything heavy is imported, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from elasticrl import __version__
from elasticrl.config.base import check_address, seconds_arg

WAIT_NOTE_S = 2.0  # a client command still waiting for the coordinator says so after this long


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default="127.0.0.1:50051", metavar="HOST:PORT", help="coordinator address (default: %(default)s)")
    p.add_argument("--token-file", help="file holding the shared token (default: $ELASTICRL_TOKEN_FILE; without either, "
                   "the token itself from $ELASTICRL_TOKEN, if set)")
    p.add_argument("--tls-ca", default=os.environ.get("ELASTICRL_TLS_CA") or None,
                   help="PEM CA bundle to verify a TLS coordinator (default: $ELASTICRL_TLS_CA, as the workers read it)")
    p.add_argument("--timeout", type=seconds_arg, default=10.0, metavar="S", help="per-call deadline, seconds (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticrl", description="Elastic RL post-training over torch.distributed.")
    parser.add_argument("--version", action="version", version=f"elasticrl {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log verbosity (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="run the coordinator (gRPC control plane)")
    c.add_argument("--host", default="127.0.0.1", help="interface to bind; 0.0.0.0 for all (default: %(default)s)")
    c.add_argument("--port", type=int, default=50051, help="TCP port; 0 picks a free one (default: %(default)s)")
    c.add_argument("--state-dir", help="directory for durable state (SQLite, WAL); omit to keep state in memory only")
    c.add_argument("--lease-ttl", type=float, default=5.0, metavar="S", help="member lease, seconds: silent members are evicted after this (default: %(default)s)")
    c.add_argument("--tick", type=float, default=0.05, metavar="S", help="how often leases and deadlines are checked, seconds (default: %(default)s)")
    c.add_argument("--token-file", help="require this shared token (first line of the file) on every call")
    c.add_argument("--tls-cert", help="PEM certificate chain: serve TLS (needs --tls-key)")
    c.add_argument("--tls-key", help="PEM private key for --tls-cert")
    c.add_argument("--fsync", action="store_true", help="fsync every state change (survives power loss; slower)")
    c.add_argument("--port-file", help="write the bound port to this file once serving (useful with --port 0)")
    c.add_argument("--max-message-mb", type=float, default=64, metavar="MIB", help="largest gRPC message accepted or sent, MiB; workers batch trajectories below it (default: %(default)s)")
    c.add_argument("--max-kv-value-bytes", type=int, default=1 << 20, metavar="BYTES", help="largest KV value (and torch Store value) accepted, bytes; the KV store is for control data (default: %(default)s, 1 MiB)")
    c.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics (GET /metrics, GET /healthz) over HTTP on this TCP port; 0 picks a free one (default: off). No token check: bind it to an internal interface")
    c.add_argument("--metrics-host", metavar="HOST", help="interface of the metrics endpoint (default: the same as --host)")
    c.add_argument("--metrics-port-file", metavar="FILE", help="write the bound metrics port to this file once serving (useful with --metrics-port 0)")
    c.add_argument("--stream-grace", type=float, default=0.5, metavar="SECONDS", help="a member whose Session or Work stream broke (its process died) is evicted unless it reopens one within this long; a silent host is left to --lease-ttl (default: %(default)s)")
    c.add_argument("--keep-iterations", type=int, default=8, metavar="N", help="sealed iterations kept per run (the ones that sealed last); older ones leave memory and SQLite and their shards are deleted (up to 2 GiB of their files are kept to be overwritten by new shards), manifests stay (default: %(default)s)")
    c.add_argument("--keep-barriers", type=int, default=1000, metavar="N", help="decided barriers kept per run; older ones are forgotten (default: %(default)s)")
    c.add_argument("--keep-request-ids", type=int, default=100_000, metavar="N", help="request ids whose results are kept to answer retried calls exactly once (default: %(default)s)")
    c.add_argument("--max-runs", type=int, default=1000, metavar="N", help="runs held at once; at the limit a new run replaces the oldest closed run with no live member, or is refused (default: %(default)s)")
    c.add_argument("--max-weights-gb", type=float, default=16, metavar="GIB", help="largest policy-weights blob a trainer may publish through the coordinator (rollout.weights_transfer = coordinator), GiB; the relay transfer does not pass through it (default: %(default)s)")
    c.add_argument("--max-weight-uploads", type=int, default=4, metavar="N", help="weight uploads received at once (each spools to a temp file); one more is refused with RESOURCE_EXHAUSTED (default: %(default)s)")

    sub.add_parser(
        "run", add_help=False, prefix_chars="\0",
        help="run a node config on this machine: a local coordinator plus N torchrun nodes (elasticrl run CONFIG --help)",
    ).add_argument("rest", nargs=argparse.REMAINDER)

    r = sub.add_parser(
        "rollout", help="a rollout-only worker: join a running run's scheduler, draw rollouts with the published weights",
        description="Join run RUN (--run-id, else the config's run.run_id) at the coordinator as one more rollout "
        "engine, with weights the trainer publishes; leave at any time (Ctrl-C). Exits 0 when training finishes.",
        epilog="Config overrides after the flags, e.g. --engine.device=cuda:0 --rollout.slots=32",
    )
    r.add_argument("--coordinator", metavar="HOST:PORT", help="coordinator address (default: the config's coordinator.address, else $ELASTICRL_COORDINATOR)")
    r.add_argument("--config", required=True, metavar="FILE", help="the run's node config (TOML): model, engine, task, rewards")
    r.add_argument("--run-id", help="the run to join (default: the config's run.run_id)")
    r.add_argument("--member-id", help="this worker's member id (default: rollout-<host>-<pid>)")
    r.add_argument("--slots", type=int, default=0, help="tasks drawn at once (default: the config's rollout.slots)")
    r.add_argument("--weight", type=float, default=1.0, help="static-policy share weight (default: %(default)s)")

    s = sub.add_parser("status", help="show members, epochs, rounds, open barriers and each run's current iteration")
    _add_client_args(s)
    s.add_argument("--run", default="", help="only this run id (default: every run)")
    s.add_argument("--all", action="store_true", help="also list members that left or were evicted")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")

    y = sub.add_parser(
        "session-relay", help="a node's session relay: its members' Session streams as one stream to the coordinator",
        description="Serve this node's members on a Unix socket and carry their keep-alives and barrier arrivals "
        "on one batched Session stream to the coordinator. Point members at it with $ELASTICRL_SESSION_RELAY=PATH "
        "(a torchrun agent with --rdzv-backend=elasticrl runs one by itself).",
    )
    _add_client_args(y)
    y.add_argument("--socket", required=True, metavar="PATH", help="Unix socket to serve on (created mode 0600; a stale one is replaced)")

    x = sub.add_parser("close-run", help="close a run: no node can join or rendezvous in it again")
    _add_client_args(x)
    x.add_argument("run", help="run id to close")
    x.add_argument("--reason", default="closed by operator", help="reason recorded with the close")

    p = sub.add_parser("plot", help="draw a run's reward per iteration (reward.png) from its metrics.jsonl")
    p.add_argument("metrics", metavar="METRICS_JSONL", help="the run's metrics.jsonl (runs/<run id>/metrics.jsonl)")
    p.add_argument("out", nargs="?", metavar="OUT.png", help="where to write it (default: reward.png beside METRICS_JSONL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "run":
        return _run([*args.rest, *rest])
    if args.command == "rollout":
        return _rollout(args, rest)
    if rest:
        build_parser().parse_args(argv)  # the usual "unrecognized arguments" error
    if args.command == "coordinator":
        return _coordinator(args)
    if args.command == "session-relay":
        return _relay(args)
    if args.command == "plot":
        from elasticrl.plot import main as plot

        return plot([args.metrics, *([args.out] if args.out else [])])
    from elasticrl.errors import ElasticRLError
    from elasticrl.scheduler.client import SchedulerClient

    token = _token(args)
    try:
        check_address(args.coordinator, "--coordinator")
        client = SchedulerClient(args.coordinator, token=token, tls_ca=args.tls_ca, call_timeout_s=args.timeout,
                                 reconnect_timeout_s=args.timeout)
    except ValueError as exc:  # the address or the CA bundle; the message names the field
        print(f"elasticrl {args.command}: {exc}", file=sys.stderr)
        return 2
    # Unreachable, the client keeps trying for --timeout (a coordinator restarting is back in seconds):
    # say so, rather than sit silent for 10 s (a short --timeout, a health check's, says nothing more).
    import contextlib

    from elasticrl.repeats import still_waiting

    note = still_waiting(WAIT_NOTE_S, lambda: print(
        f"elasticrl {args.command}: waiting for the coordinator at {args.coordinator} (gives up after --timeout "
        f"{args.timeout:g}s)", file=sys.stderr, flush=True)) if args.timeout > WAIT_NOTE_S else contextlib.nullcontext()
    try:
        with note, client:
            if args.command == "status":
                data = client.status(args.run, include_departed=args.all)
                for run in data.get("runs") or []:  # the scheduler's newest iteration, if any
                    run["iteration"] = client.iteration_status(run["snapshot"]["run_id"])
                if args.json:
                    print(json.dumps(data, indent=2, sort_keys=True))
                else:
                    from elasticrl.status_table import render

                    print(render(data))
            elif args.command == "close-run":
                client.close_run(args.run, args.reason)
                print(f"run {args.run} closed")
    except ElasticRLError as exc:
        print(f"elasticrl {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


def _token(args: argparse.Namespace) -> str | None:
    """The client token (``--token-file``, else $ELASTICRL_TOKEN_FILE as the workers read it, else the
    token in $ELASTICRL_TOKEN); an unreadable file exits 2."""
    from elasticrl.config.node import TOKEN_FILE_ENV
    from elasticrl.coordinator.client import resolve_token

    path, source = args.token_file, "--token-file"
    if not path and os.environ.get(TOKEN_FILE_ENV):
        path, source = os.environ[TOKEN_FILE_ENV], f"${TOKEN_FILE_ENV}"
    try:
        return resolve_token(None, path)
    except OSError as exc:
        print(f"elasticrl {args.command}: {source}: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(2)


def _relay(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import socket
    import stat

    from elasticrl.coordinator.session_relay import SessionRelay

    problem = None
    if not args.socket:
        problem = "must be a path"
    elif not os.path.isdir(os.path.dirname(os.path.abspath(args.socket))):
        problem = f"the directory of {args.socket} does not exist"
    elif os.path.lexists(args.socket) and not stat.S_ISSOCK(os.lstat(args.socket).st_mode):
        problem = f"{args.socket} exists and is not a socket (left alone: remove it, or pick another path)"
    if problem:
        print(f"elasticrl session-relay: --socket: {problem}", file=sys.stderr)
        return 2
    if os.path.lexists(args.socket):  # a socket nobody serves any more (a killed relay's) is replaced
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(args.socket)
        except ConnectionRefusedError:
            os.unlink(args.socket)
        except OSError:
            pass  # not a socket: start_unix_server says so below
        else:
            print(f"elasticrl session-relay: --socket: {args.socket} is served by another process", file=sys.stderr)
            return 2
        finally:
            probe.close()

    token = _token(args)
    try:
        check_address(args.coordinator, "--coordinator")
    except ValueError as exc:
        print(f"elasticrl session-relay: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        relay = SessionRelay(args.coordinator, token=token, tls_ca=args.tls_ca, call_timeout_s=args.timeout)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await relay.start(args.socket)
        logging.getLogger("elasticrl.session_relay").info("session relay for %s serving on %s", args.coordinator, args.socket)
        try:
            await stop.wait()
        finally:
            await relay.close()
            os.unlink(args.socket)

    try:
        asyncio.run(serve())
    except ValueError as exc:  # the address or the CA bundle; the message names the field
        print(f"elasticrl session-relay: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"elasticrl session-relay: --socket {args.socket}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def _run(rest: list[str]) -> int:
    """``elasticrl run CONFIG [flags] [-- overrides]``: the demo launcher on any node config."""
    from elasticrl.demo import main as launch

    if rest and not rest[0].startswith("-"):
        flags = rest[1:rest.index("--")] if "--" in rest else rest[1:]
        if any(a == "--config" or a.startswith("--config=") for a in flags):
            print(f"elasticrl run: the config is given twice ({rest[0]} and --config); give one of them", file=sys.stderr)
            return 2
        rest = ["--config", rest[0], *rest[1:]]
    return launch(rest, prog="elasticrl run")


def _rollout(args: argparse.Namespace, overrides: list[str]) -> int:
    import dataclasses

    from elasticrl import config as cfgmod

    try:
        if args.slots < 0:
            raise cfgmod.ConfigError(f"--slots: {args.slots} must be >= 1 (or 0: the config's rollout.slots)")
        if not 0 < args.weight < float("inf"):
            raise cfgmod.ConfigError(f"--weight: {args.weight} must be a finite number > 0 (a share of the static policy)")
        cfg = cfgmod.load_config(args.config, cfgmod.parse_overrides(overrides))
        if args.coordinator:
            cfg = dataclasses.replace(cfg, coordinator=dataclasses.replace(cfg.coordinator, address=args.coordinator))
        if args.run_id:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_id=args.run_id))
        cfg = cfg.resolved()
    except cfgmod.ConfigError as exc:
        print(f"elasticrl rollout: {exc}", file=sys.stderr)
        return 2
    from elasticrl.errors import ElasticRLError
    from elasticrl.train import rollout_only

    try:
        return rollout_only.run(cfg, member_id=args.member_id or "", slots=args.slots, weight=args.weight)
    except cfgmod.ConfigError as exc:  # what the config names does not exist here (model.path, ...)
        print(f"elasticrl rollout: {exc}", file=sys.stderr)
        return 2
    except ElasticRLError as exc:
        print(f"elasticrl rollout: {exc}", file=sys.stderr)
        return 1


def _coordinator(args: argparse.Namespace) -> int:
    import asyncio
    import math

    from elasticrl.coordinator import malloc
    from elasticrl.coordinator.persist import StateDBError
    from elasticrl.coordinator.server import CoordinatorConfig, serve

    try:
        if not (math.isfinite(args.max_message_mb) and 1 <= args.max_message_mb < 2048):
            raise ValueError(f"--max-message-mb: {args.max_message_mb} must be a number of MiB in [1, 2048) (max_message_bytes)")
        if not (math.isfinite(args.max_weights_gb) and 1 / 1024 <= args.max_weights_gb <= 1 << 20):
            raise ValueError(f"--max-weights-gb: {args.max_weights_gb} must be a number of GiB in [1/1024, 2**20] (max_weights_bytes)")
        config = CoordinatorConfig(
            host=args.host,
            port=args.port,
            state_dir=args.state_dir,
            lease_ttl_s=args.lease_ttl,
            tick_s=args.tick,
            stream_grace_s=args.stream_grace,
            token_file=args.token_file,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            fsync=args.fsync,
            port_file=args.port_file,
            max_message_bytes=int(args.max_message_mb * (1 << 20)),
            max_kv_value_bytes=args.max_kv_value_bytes,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            metrics_port_file=args.metrics_port_file,
            max_weight_uploads=args.max_weight_uploads,
            max_weights_bytes=int(args.max_weights_gb * (1 << 30)),
            keep_iterations=args.keep_iterations,
            keep_barriers=args.keep_barriers,
            keep_request_ids=args.keep_request_ids,
            max_runs=args.max_runs,
        )
        malloc.tune()
        malloc.tune_gc()
        asyncio.run(serve(config))
    except (ValueError, OSError, StateDBError) as exc:
        print(f"elasticrl coordinator: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
