"""``elasticrl run CONFIG`` / ``python -m elasticrl.demo`` (``make demo``): a local coordinator and
N torchrun nodes train the policy of a node config; with the bundled ``elasticrl/configs/demo.toml``
(the default) a tiny policy learns a toy task on CPU in about a minute, offline.

It starts ``elasticrl coordinator`` on a free port, then one torchrun agent per simulated node
(``--nproc-per-node=1``), each running ``python -m elasticrl.node --config CONFIG``; streams rank
0's progress lines; and ends with a summary (reward before and after, checkpoint path, plot). Every process it
starts runs in its own session and is stopped by pid on exit, on failure and on Ctrl-C; workers
that torchrun started in sessions of their own are found through /proc and stopped too.

Rendezvous: the ``elasticrl`` torchrun backend when it is installed (``--rdzv-backend=elasticrl``
against the same coordinator), otherwise torchrun's ``c10d`` backend with node 0 hosting the store.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from elasticrl import config as cfgmod  # pure Python: the demo process never imports torch
from elasticrl.config.base import seconds_arg
from elasticrl.coordinator.launch import coordinator_command, wait_for_port
from elasticrl.rl.tasks import TASKS
from elasticrl.rl.workload import workload_name
from elasticrl.run_summary import leftover_snapshots, summarize

BUNDLED_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "demo.toml")

# Rank 0's progress table (elasticrl.train.loop NodeTrainer._report): a header, then one row per iteration.
PROGRESS_RE = re.compile(r"^\[[#-]+\]\s+(\d+)/\d+ ")
HEADER_RE = re.compile(r"^progress\s+iter\s")
# Rank 0's own lines shown as they are: the warm-up's progress and the HF export.
PLAIN_RE = re.compile(r"^(warm-up |exported )")
# Worker log lines worth showing on the console (the rest goes to the node's log file).
NOTABLE_RE = re.compile(r" (WARNING|ERROR|CRITICAL) node=| resumed from iteration ")
NOTABLE_WIDTH = 200
COORDINATOR_START_S = 30
# Local nodes at most: each is a torchrun agent and a worker process on this machine (a typo such
# as --nodes 100000 would start that many).
MAX_NODES = 256
STOP_GRACE_S = 10


def build_parser(prog: str = "python -m elasticrl.demo") -> argparse.ArgumentParser:
    positional = prog == "elasticrl run"  # it takes the config as its first argument too (cli._run)
    p = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} [CONFIG] [options] [-- overrides]" if positional else None,
        description="Run a node config on this machine: a local coordinator plus N torchrun nodes "
        "(default: the bundled demo, a tiny policy trained with GRPO on CPU).",
        epilog="Node config overrides go after --, e.g. -- --trainer.lr=1e-3 --run.eval_interval=5",
    )
    p.add_argument("--config", default=BUNDLED_CONFIG, metavar="FILE",
                   help=("node config, TOML" + (" (or CONFIG, the first argument)" if positional else "")
                         + "; default: the bundled demo.toml"))
    p.add_argument("--nodes", type=int, default=2, help="torchrun agents (simulated nodes), one worker each (default: %(default)s)")
    p.add_argument(
        "--rollout-workers", type=int, default=0, metavar="N",
        help="also start N rollout-only workers (elasticrl rollout) that draw groups with the weights the trainer "
        "publishes, e.g. with -- --rollout.max_staleness=1 (default: %(default)s)",
    )
    p.add_argument("--iterations", type=int, help="RL iterations (default: the config's run.iterations)")
    p.add_argument("--task", choices=sorted(TASKS), help="toy task (default: the config's task.name)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="save a checkpoint every N iterations (default: the config's)")
    p.add_argument("--out", metavar="DIR", help="run directory (default: the config's run.run_dir, else runs/<run id>)")
    p.add_argument(
        "--rdzv-backend", choices=["auto", "elasticrl", "c10d"], default="auto",
        help="torchrun rendezvous: auto picks elasticrl when its plugin is installed, else c10d (default: %(default)s)",
    )
    p.add_argument("--timeout", type=seconds_arg, default=600.0, metavar="S", help="give up after this many seconds (default: %(default)s)")
    p.add_argument("--lease-ttl", type=seconds_arg, default=3.0, metavar="S", help="coordinator lease, seconds (default: %(default)s)")
    p.add_argument(
        "--metrics-port", type=int, metavar="PORT",
        help="the coordinator also serves Prometheus metrics on 127.0.0.1:PORT (curl it during the run; default: off)",
    )
    p.add_argument(
        "--kill-at", type=int, default=0, metavar="ITER",
        help="SIGKILL the last node (agent and worker) once iteration ITER is reported, to watch the "
        "others re-form and resume from the newest snapshot (or checkpoint); 0 never (default: %(default)s)",
    )
    p.add_argument(
        "--kill-phase", choices=["boundary", "rollout", "update", "checkpoint"], default="boundary",
        help="when --kill-at strikes: after iteration ITER is reported (boundary), during the rollout of "
        "ITER (or the first later one) once the node has delivered some of its groups (rollout), right "
        "after ITER seals, during its policy update (update), or while a checkpoint of ITER or later is "
        "being written (checkpoint: the node's own with --own-checkpoints, else RUN_DIR/checkpoints) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--kill-signal", choices=["KILL", "STOP"], default="KILL",
        help="how the node dies: SIGKILL (its sockets close at once), or SIGSTOP of all its processes, a "
        "silent host whose sockets stay open until its lease runs out (SIGKILLed once the others are done) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--lose-host", action="store_true",
        help="with --kill-at: the node's host is lost with its memory too: its snapshot directory (in /dev/shm) is "
        "deleted right after the kill, so the others must resume from the copies their buddies keep",
    )
    p.add_argument(
        "--own-checkpoints", action="store_true",
        help="every node keeps its checkpoints in RUN_DIR/node-K/checkpoints (checkpoint.every_node), as hosts "
        "without a shared filesystem do; a re-formed world resumes from the newest any node holds",
    )
    p.add_argument(
        "--restart-workers", action="store_true",
        help="on a lost node, let torchrun restart the survivors' workers (the elasticrl backend's behaviour without "
        "--rdzv-conf in_place=true) instead of their re-forming the world in place; the default for every strategy "
        "but DDP on gloo, the one that re-forms in place",
    )
    p.add_argument("--no-plot", action="store_true", help="do not draw RUN_DIR/reward.png at the end (no matplotlib)")
    p.add_argument("node_args", nargs=argparse.REMAINDER, help="extra --section.key=value overrides for every node, after --")
    return p


# -- processes ---------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat): with the pid, names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int, started: str) -> bool:
    """Whether process ``pid`` (with that start time) can still run: alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == started and fields[0] not in ("Z", "X")


def _descendants(root: int) -> list[tuple[int, str]]:
    """(pid, start time) of every live descendant of ``root``; empty where /proc is missing."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            started = _start_time(child)
            if started is not None:
                out.append((child, started))
                stack.append(child)
    return out


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    seen: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    """Descendants observed while it ran: torchrun's workers live in sessions of their own."""

    def remember_descendants(self) -> None:
        known = set(self.seen)
        self.seen += [d for d in _descendants(self.proc.pid) if d not in known]

    def kill(self) -> None:
        """SIGKILL the process group and every descendant seen, at once (a node dying)."""
        self.remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._kill_seen()

    def stop(self) -> None:
        """SIGSTOP the process group and every descendant seen (a host gone silent: no socket closes)."""
        self.remember_descendants()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)
        self._kill_seen(signal.SIGSTOP)

    def _kill_seen(self, sig: int = signal.SIGKILL) -> None:
        for pid, started in self.seen:
            if _start_time(pid) == started:  # still the same process, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def terminate(self) -> None:
        """SIGTERM the process group: torchrun then stops its workers, the coordinator shuts down."""
        if self.proc.poll() is None:
            self.remember_descendants()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait until ``deadline`` (monotonic) for the process to exit, then SIGKILL whatever is left."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._kill_seen()


def stop_all(children: list[Child], grace_s: float) -> None:
    """Stop the nodes together (one by one, a survivor would try to re-form), then the coordinator
    (the agents' last calls go to it)."""
    for group in ([c for c in children if c.name != "coordinator"], [c for c in children if c.name == "coordinator"]):
        for child in group:
            child.terminate()
        deadline = time.monotonic() + grace_s
        for child in group:
            child.reap(deadline)

def _spawn(name: str, cmd: list[str], log_path: str, env: dict[str, str], *, pipe: bool) -> Child:
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if pipe else log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: Ctrl-C reaches only us, we stop it by pid
    )
    log.close()
    return Child(name, proc, log_path)


def _stream(child: Child, demo: "Demo") -> None:
    """Copy a node's output into its log file; show progress and notable lines on the console
    (until the demo is stopping); record each iteration rank 0 reports."""
    with open(child.log_path, "a") as log:
        for raw in child.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            log.write(line + "\n")
            log.flush()
            progress = PROGRESS_RE.match(line)
            if HEADER_RE.match(line):
                if not demo.header_shown:  # a restarted rank 0 prints it again
                    demo.header_shown = True
                    demo.say(line)
            elif progress:
                demo.reported.append(int(progress.group(1)))
                demo.say(line)
            elif PLAIN_RE.match(line):
                demo.say(line)
            elif NOTABLE_RE.search(line) and not demo.stopping.is_set():
                shown = line if len(line) <= NOTABLE_WIDTH else line[: NOTABLE_WIDTH - 3] + "..."
                demo.say(f"  [{child.name}] {shown}")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plugin_available() -> bool:
    """True when torchrun can load the elasticrl rendezvous backend (entry point and module both present)."""
    import importlib.util
    from importlib.metadata import entry_points

    if not any(ep.name == "elasticrl" for ep in entry_points(group="torchrun.handlers")):
        return False
    return importlib.util.find_spec("elasticrl.rendezvous") is not None


# -- the demo ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Demo:
    """The processes of one demo run and what the console has been told."""

    args: argparse.Namespace
    run_dir: str
    run_id: str
    backend: str
    env: dict[str, str]
    children: list[Child] = dataclasses.field(default_factory=list)
    reported: list[int] = dataclasses.field(default_factory=list)
    """Iterations rank 0 has reported, in order (appended by the reader threads)."""
    echo: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)
    scheduler: object = None
    """SchedulerClient, opened when --kill-phase needs to watch an iteration."""
    header_shown: bool = False
    kill_iteration: int = 0
    """--kill-phase rollout: the iteration watched now when the victim delivered no group of
    --kill-at's before it sealed (0: --kill-at itself)."""

    @property
    def logs(self) -> str:
        return os.path.join(self.run_dir, "logs")

    def start_coordinator(self) -> str:
        """Start the coordinator on a free port with its state under the run dir; returns HOST:PORT."""
        port_file = os.path.join(self.run_dir, "coordinator.port")
        with contextlib.suppress(FileNotFoundError):
            os.remove(port_file)  # a previous run's port (same --out) would be read as ours
        extra = [] if self.args.metrics_port is None else ["--metrics-port", str(self.args.metrics_port)]
        cmd = coordinator_command(
            port_file, lease_ttl_s=self.args.lease_ttl, state_dir=os.path.join(self.run_dir, "coordinator"), extra_args=extra,
        )
        child = _spawn("coordinator", cmd, os.path.join(self.logs, "coordinator.log"), self.env, pipe=False)
        self.children.append(child)
        port = wait_for_port(child.proc, port_file, timeout_s=COORDINATOR_START_S, log_path=child.log_path)
        return f"127.0.0.1:{port}"

    def node_dir(self, k: int) -> str:
        """Node k's own directory (--own-checkpoints)."""
        return os.path.join(self.run_dir, f"node-{k}")

    def start_node(self, k: int, rdzv_endpoint: str, node_args: list[str]) -> Child:
        """One torchrun agent with one elasticrl.node worker, its output streamed by a thread."""
        a = self.args
        cmd = [
            sys.executable, "-m", "torch.distributed.run",  # = torchrun
            f"--nnodes=1:{a.nodes}", "--nproc-per-node=1", "--max-restarts=3",
            f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={self.run_id}",
        ]
        if self.backend == "c10d":
            cmd.append(f"--rdzv-conf=is_host={'true' if k == 0 else 'false'}")
        elif not a.restart_workers:
            cmd.append("--rdzv-conf=in_place=true")
        own = [f"--checkpoint.dir={self.node_dir(k)}/checkpoints", "--checkpoint.every_node=true"] if a.own_checkpoints else []
        cmd += [
            "-m", "elasticrl.node", "--config", os.path.abspath(a.config),
            f"--run.run_id={self.run_id}", f"--run.run_dir={self.run_dir}", *own, *node_args,
        ]
        env = dict(self.env, ELASTICRL_NODE_NAME=f"node-{k}")  # all "nodes" share this host's name
        if a.kill_at and a.kill_phase == "checkpoint" and k == a.nodes - 1:
            # The victim holds each checkpoint in its temporary directory a while: a toy model's
            # write takes milliseconds, which a poll every 10 ms on a loaded host can miss.
            env[cfgmod.CHECKPOINT_HOLD_ENV] = "1.5"
        child = _spawn(f"node-{k}", cmd, os.path.join(self.logs, f"node-{k}.log"), env, pipe=True)
        self.children.append(child)
        reader = threading.Thread(target=_stream, args=(child, self), daemon=True)
        reader.start()
        self.readers.append(reader)
        return child

    def start_rollout_worker(self, k: int, address: str, node_args: list[str]) -> Child:
        """One ``elasticrl rollout`` worker in the run (it exits 0 when training closes the run)."""
        cmd = [
            sys.executable, "-m", "elasticrl.cli", "rollout", "--coordinator", address, "--config", os.path.abspath(self.args.config),
            "--run-id", self.run_id, "--member-id", f"rollout-{k}", f"--run.run_dir={self.run_dir}", *node_args,
        ]
        child = _spawn(f"rollout-{k}", cmd, os.path.join(self.logs, f"rollout-{k}.log"), self.env, pipe=False)
        self.children.append(child)
        return child

    def record_event(self, event: str, **fields) -> None:
        """One line of LOGS/events.jsonl with the wall-clock time (bench/recovery.py reads it)."""
        with open(os.path.join(self.logs, "events.jsonl"), "a") as f:
            f.write(json.dumps({"event": event, "time_unix_s": time.time(), **fields}) + "\n")

    def say(self, text: str) -> None:
        with self.echo:
            print(text, flush=True)

    def _kill_moment(self, victim: Child) -> str | None:
        """Why now is the moment --kill-at/--kill-phase asked for, or None if it is not yet."""
        a = self.args
        if a.kill_phase == "boundary":
            if self.reported and self.reported[-1] >= a.kill_at:
                return f"after iteration {self.reported[-1]}"
            return None
        if a.kill_phase == "checkpoint":
            return self._writing_checkpoint(victim)
        if self.scheduler is None:
            from elasticrl.scheduler.client import SchedulerClient

            self.scheduler = SchedulerClient(self.env["ELASTICRL_COORDINATOR"], call_timeout_s=5)
        target = self.kill_iteration or a.kill_at
        try:
            m = self.scheduler.iteration_status(f"{self.run_id}.rollout", target)
        except Exception:  # noqa: BLE001 - the coordinator may be busy; look again next time
            return None
        if m is None:
            return None
        if a.kill_phase == "update":
            return f"right after iteration {target} sealed, during its update" if m["sealed"] else None
        # Its engine joins the scheduler as <node name>-<local rank>.
        by_victim = sum(n["done"] for n in m["nodes"] if n["node"].startswith(f"{victim.name}-"))
        if m["sealed"]:  # it sealed before the victim delivered a group: strike in the next one
            self.kill_iteration = target + 1
            return None
        if by_victim > 0 and m["tasks_done"] < m["tasks_total"]:
            return (f"during the rollout of iteration {target} ({m['tasks_done']}/{m['tasks_total']} groups done, "
                    f"{by_victim} by {victim.name})")
        return None

    def _writing_checkpoint(self, victim: Child) -> str | None:
        """A checkpoint of iteration >= --kill-at is being written (its temporary directory exists)."""
        k = int(victim.name.rsplit("-", 1)[1])
        where = os.path.join(self.node_dir(k) if self.args.own_checkpoints else self.run_dir, "checkpoints")
        try:
            names = os.listdir(where)
        except OSError:
            return None
        for name in names:
            m = re.match(r"\.tmp-iter-(\d+)-", name)
            if m and int(m.group(1)) >= self.args.kill_at:
                return f"while the checkpoint of iteration {int(m.group(1))} was being written"
        return None

    def lose_memory(self, victim: Child) -> None:
        """--lose-host: delete the node's snapshots in host memory, as if its host were gone."""
        import shutil

        from elasticrl.train.snapshot_plan import default_dir  # pure Python, like this module

        where = default_dir(self.run_dir, self.run_id, victim.name)
        deadline = time.monotonic() + 5  # SIGKILL is delivered at once, but no write may land after the delete
        while time.monotonic() < deadline and any(_running(pid, started) for pid, started in victim.seen):
            time.sleep(0.01)
        shutil.rmtree(where, ignore_errors=True)
        self.say(f"  -- {victim.name}'s host is lost with its memory: deleted its snapshots {where}")
        self.record_event("lose_host", node=victim.name, path=where)

    def watch(self, coordinator: Child, nodes: list[Child], deadline: float) -> None:
        """Wait for every node to exit; kill one at --kill-at; raise RuntimeError on a timeout or a
        dead coordinator."""
        victim = nodes[-1] if self.args.kill_at and len(nodes) > 1 else None
        silent: Child | None = None  # SIGSTOPped: it never exits on its own
        while any(n.proc.poll() is None for n in nodes if n is not silent):
            for n in nodes:
                if n is not silent:
                    n.remember_descendants()
            when = self._kill_moment(victim) if victim is not None else None
            if when is not None:
                how = "SIGKILL" if self.args.kill_signal == "KILL" else "SIGSTOP, a silent host"
                self.say(
                    f"  -- killing {victim.name} ({how}, agent and worker) {when}; "
                    "the others should re-form without it and resume from the newest snapshot (or checkpoint)"
                )
                self.record_event("kill", node=victim.name, signal=f"SIG{self.args.kill_signal}", when=when)
                if self.args.kill_signal == "STOP":
                    victim.stop()
                    silent = victim
                else:
                    victim.kill()
                if self.args.lose_host:
                    self.lose_memory(victim)
                victim = None
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up after {self.args.timeout:.0f}s (--timeout)")
            if coordinator.proc.poll() is not None:
                raise RuntimeError(f"the coordinator exited ({coordinator.proc.returncode}); see {coordinator.log_path}")
            time.sleep(0.1 if victim is None or self.args.kill_phase == "boundary" else 0.01)
        if silent is not None:
            silent.kill()  # the others are done: the silent host goes for good
        for reader in self.readers:  # print every last line before the summary
            reader.join(timeout=5)


def run_id_for(config_path: str) -> str:
    """A fresh run id named after the config: ``demo-<time>`` for the bundled demo, else
    ``<config file stem>-<time>`` (``agent-demo-20261125-101500``)."""
    stem = "demo" if os.path.abspath(config_path) == BUNDLED_CONFIG else os.path.splitext(os.path.basename(config_path))[0]
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", stem)[:80].strip("-.") or "run"  # (run.run_id takes 112 characters)
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def node_overrides(args: argparse.Namespace) -> list[str]:
    """The shortcut flags as config overrides, then the user's own (later ones win)."""
    shortcuts = [("run.iterations", args.iterations), ("task.name", args.task), ("checkpoint.every_iterations", args.checkpoint_every)]
    return [f"--{key}={value}" for key, value in shortcuts if value is not None] + [a for a in args.node_args if a != "--"]


def main(argv: list[str] | None = None, prog: str = "python -m elasticrl.demo") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    label = "elasticrl run" if prog == "elasticrl run" else "elasticrl demo"
    if not 1 <= args.nodes <= MAX_NODES:
        parser.error(f"--nodes: {args.nodes} must be between 1 and {MAX_NODES} (each is a torchrun agent and a worker on this machine)")
    if args.rollout_workers < 0:
        parser.error(f"--rollout-workers: {args.rollout_workers} must be >= 0")
    node_args = node_overrides(args)
    try:  # checked here, before any process starts, with the same parser the nodes use
        config = cfgmod.load_config(args.config, cfgmod.parse_overrides(node_args))
    except cfgmod.ConfigError as exc:
        parser.error(str(exc))
    args.iterations = config.run.iterations
    if cfgmod.in_place_unsupported(config.trainer.strategy, config.trainer.backend):
        args.restart_workers = True  # elsewhere a lost node would spend one of torchrun's --max-restarts
    try:  # the rows, the reward functions and the env too: a bad file or row must stop us here
        from elasticrl.rl.rewards import RewardError, reward_function
        from elasticrl.rl.workload import check_model, episode_env, row_source, toy_task
        from elasticrl.train.metric_sinks import check_sinks

        check_model(config)
        check_sinks(config)
        reward = reward_function(config.algorithm.rewards, config.algorithm.reward_weights, toy_task(config))
        row_source(config, reward)
        episode_env(config, reward)
    except RewardError as exc:
        parser.error(f"algorithm.rewards: {exc}")
    except cfgmod.ConfigError as exc:
        parser.error(str(exc))
    backend = args.rdzv_backend
    if backend == "auto":
        backend = "elasticrl" if plugin_available() else "c10d"
    elif backend == "elasticrl" and not plugin_available():
        parser.error("--rdzv-backend=elasticrl: the elasticrl.rendezvous plugin is not installed; use c10d")
    run_id = config.run.run_id or run_id_for(args.config)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    # torch warns at import when numpy is absent; nothing here needs numpy.
    env["PYTHONWARNINGS"] = ",".join(filter(None, [env.get("PYTHONWARNINGS"), "ignore:Failed to initialize NumPy"]))
    # One run id per invocation: a rerun in the same --out reuses the coordinator's durable state,
    # where the previous run keeps its own --nnodes; the checkpoints carry over all the same.
    run_dir = args.out or config.run.run_dir or os.path.join("runs", run_id)
    demo = Demo(args, run_dir=run_dir, run_id=run_id, backend=backend, env=env)
    try:
        os.makedirs(demo.logs, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out: cannot create the run directory {run_dir} ({exc.strerror or exc}: {exc.filename or demo.logs})")
    started = time.monotonic()

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where a parent shell ignored it
    try:
        address = demo.start_coordinator()
        env["ELASTICRL_COORDINATOR"] = address
        coordinator = demo.children[0]
        rdzv_endpoint = address if backend == "elasticrl" else f"127.0.0.1:{_free_port()}"
        fell_back = args.rdzv_backend == "auto" and backend == "c10d"
        note = "  (the elasticrl plugin is not installed; using torchrun's own)" if fell_back else ""
        print(
            f"elasticrl: {args.nodes} node(s) train a {config.model.kind} policy on {workload_name(config)} with "
            f"{config.algorithm.loss} ({args.iterations} iterations, {config.trainer.strategy}, engine {config.engine_name})"
        )
        print(f"  config       {args.config}")
        print(f"  run dir      {demo.run_dir}")
        print(f"  coordinator  {address}  (pid {coordinator.proc.pid}, log {coordinator.log_path})")
        if args.metrics_port is not None:
            print(f"  metrics      curl http://127.0.0.1:{args.metrics_port}/metrics")
        print(f"  rendezvous   {backend} at {rdzv_endpoint}{note}")
        nodes = []
        for k in range(args.nodes):
            nodes.append(demo.start_node(k, rdzv_endpoint, node_args))
            print(f"  node-{k}       torchrun pid {nodes[-1].proc.pid}, log {nodes[-1].log_path}")
        for k in range(args.rollout_workers):
            worker = demo.start_rollout_worker(k, address, node_args)
            print(f"  rollout-{k}    elasticrl rollout pid {worker.proc.pid}, log {worker.log_path}")
        demo.say("starting (the first iteration waits for every node to import torch and meet) ...")
        demo.watch(coordinator, nodes, deadline=started + args.timeout)
        return summarize(
            demo.run_dir, nodes, args.iterations, time.monotonic() - started, killed=args.kill_at > 0,
            checkpointed=config.run.rl_phase != "rollout", no_plot=args.no_plot, label=label,
        )
    except KeyboardInterrupt:
        print(f"\n{label}: interrupted; stopping every process it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"{label}: {exc}", file=sys.stderr)
        return 1
    finally:
        demo.stopping.set()  # the nodes' complaints about each other's exit are expected now
        stop_all(demo.children, grace_s=STOP_GRACE_S)
        if not config.checkpoint.snapshot_dir:
            leftover_snapshots(run_dir, run_id, kept=bool(config.run.run_id))
        print(f"run dir: {demo.run_dir}")


if __name__ == "__main__":
    sys.exit(main())
