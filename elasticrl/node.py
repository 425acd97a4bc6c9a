"""``python -m elasticrl.node``: the torchrun worker entry point of an RL node.

    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=elasticrl \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=RUN -m elasticrl.node \\
        [--config FILE.toml] [--section.key=value ...]

Arguments and config are parsed and validated before torch is imported, so ``--help`` and config
mistakes answer at once. The loop itself lives in ``elasticrl.train.loop``. Exit status: 0 when
the run is complete, 1 when training failed (torchrun may restart the worker group), 2 for a bad
config. After a failure restarts do not fix (a bad config at once; the user's env or reward code
failing the iteration again after one restart) the worker asks its agent (elasticrl's backend) to
leave the run instead of restarting it into the same failure ``--max-restarts`` times.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

from elasticrl import config as cfgmod

log = logging.getLogger("elasticrl.node")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elasticrl.node",
        description="RL node (one torchrun worker): rollout, rewards, GRPO update over torch.distributed.",
        epilog="Any config field can be overridden as --section.key=value, e.g. --run.iterations=40 "
        "--trainer.lr=1e-3 --task.name=reverse. Sections: " + ", ".join(f.name for f in dataclasses.fields(cfgmod.NodeConfig)) + ".",
    )
    p.add_argument("--config", metavar="FILE", help="TOML config file; --section.key=value overrides it")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    return p


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, cfgmod.NodeConfig]:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        config = cfgmod.load_config(args.config, cfgmod.parse_overrides(rest))
        config = config.resolved(require_address=not args.print_config)
    except cfgmod.ConfigError as exc:
        from elasticrl.rendezvous.worker import STOP_FILE_ENV

        if os.environ.get(STOP_FILE_ENV) and not args.print_config:  # under elasticrl's torchrun agent
            from elasticrl.train.logcontext import node_name

            stop_node(exc, node_name(), os.environ.get("RANK", "?"), at_once=True)
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return args, config


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the torchrun agent dies, so a killed agent never leaves a worker behind.

    torchrun starts workers in their own session, so killing the agent's process group misses them.
    The signal follows the *thread* that started us; torchrun starts workers from its main thread.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args, config = parse(argv)
    if args.print_config:
        import json

        print(json.dumps(cfgmod.to_dict(config), indent=2, sort_keys=True))
        return 0
    _die_with_parent()
    # torchrun stops workers with SIGTERM: SystemExit, so the loop leaves the run cleanly, and a
    # watchdog that exits anyway (the snapshot flushed) when a blocked collective keeps it in.
    from elasticrl.train import stop

    stop.install()

    import warnings

    # torch warns at import when numpy is absent; elasticrl never needs numpy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from elasticrl.rendezvous.worker import restart_grace
    from elasticrl.train.dist import WorldInfo
    from elasticrl.train.logcontext import FORMAT, WorkerLogContext, node_name
    from elasticrl.train.loop import NodeTrainer

    world = WorldInfo.from_env()
    logctx = WorkerLogContext(node=node_name(), rank=world.rank)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(logctx)
    logging.basicConfig(level=config.logging.level.upper(), handlers=[handler], force=True)
    from elasticrl.env.base import EnvError, EnvLoadError
    from elasticrl.rl.rewards import RewardError
    from elasticrl.rollout.engine import EngineUnavailableError, UnknownEngineError
    from elasticrl.train import reform

    # Failures a restart does not fix: ask the agent to stop (after one more try for those that
    # may have met a service that was down: the user's env or reward function, a GPU gone).
    at_once = (cfgmod.ConfigError, EnvLoadError, UnknownEngineError)
    after_a_retry = (EnvError, RewardError, EngineUnavailableError)

    rc = 0
    try:
        # A dead peer fails our collectives (or our barrier) before torchrun notices; park the
        # worker so the agent's membership-driven restart wins and --max-restarts is not spent.
        with restart_grace():
            NodeTrainer(config, world, logctx).run()
    except cfgmod.ConfigError as exc:
        log.error("%s", exc)
        rc = 2
        stop_node(exc, logctx.node, world.rank, at_once=True)
    except SystemExit as exc:  # torchrun's SIGTERM (train/stop.py)
        rc = exc.code if isinstance(exc.code, int) else 1
    except at_once + after_a_retry as exc:
        log.exception("training failed")
        rc = 1
        stop_node(exc, logctx.node, world.rank, at_once=isinstance(exc, at_once))
    except Exception:
        log.exception("training failed")
        rc = 1
    reform.exit_if_abandoned(rc)
    return rc


def stop_node(exc: BaseException, node: str, rank: int | str, *, at_once: bool) -> None:
    """A failure restarts do not fix (a bad config at once; an env or reward function that raises
    again after one restart) fails the same way after each, and a restart of a real node reloads
    its model first: ask this node's torchrun agent to leave the run instead
    (``rendezvous.worker.request_stop``). The other nodes go on without it, or stop for the same
    failure of their own."""
    from elasticrl.rendezvous.worker import request_stop

    reason = f"{node} rank {rank}: {type(exc).__name__}: {exc}"
    try:
        path = request_stop(type(exc).__name__, reason[:4096], at_once=at_once)
    except OSError as err:
        log.warning("could not ask the torchrun agent to stop (it may restart the workers): %s", err)
        return
    if path is None:
        log.warning("no elasticrl torchrun agent to ask to stop (another rendezvous backend, or no torchrun): "
                    "torchrun may restart this worker into the same failure")
    else:
        log.error("asked this node's torchrun agent not to restart its workers into the same failure%s",
                  "" if at_once else " (it tries once more, unless it did already)")


if __name__ == "__main__":
    sys.exit(main())
