"""``elasticrl rollout``: a rollout-only worker that joins a running run, and leaves, at any time.

It builds the run's engine from the same node config (``[model]``, ``[engine]``, ``[task]``,
``[algorithm] rewards``), joins the scheduler's run ``<run id>.rollout`` as one more engine, and
takes tasks like the trainer nodes' own engines do. Rank 0 publishes every policy version
(``rollout.weights_transfer``: peer to peer through the relay, the coordinator only naming the
source; or through the coordinator), and before drawing a task this worker fetches the version the
task names (``CoordinatorWeights``), so no group is drawn from a stale policy; with the relay it
then serves that version on to the workers that fetch after it. Training never waits
for such a worker and never restarts for it: it adds throughput while it is there; killed, its
tasks go back to the queue when its lease lapses. It exits 0 when the trainer closes the run.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import torch

from elasticrl.config import NodeConfig
from elasticrl.coordinator.client import resolve_token
from elasticrl.errors import ElasticRLError, RunClosedError
from elasticrl.rl.rewards import reward_function
from elasticrl.rl.workload import toy_task
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.weights import unpack_state_dict
from elasticrl.train.names import rollout_run, workers_run
from elasticrl.train.model import build_engine, build_policy, build_runner
from elasticrl.train.rollout_link import EngineWorker, GateClosed, PolicyVersionTimeout
from elasticrl.train.same_config import check_rollout_worker
from elasticrl.weights.transfer import WeightFetcher

log = logging.getLogger(__name__)

FETCH_CHUNK_S = 2.0  # one server-side wait; the stop flag is checked between them
CLOSED_CHECK_S = 2.0
POLICY_MASK = 0xFFFFFFFF  # the policy version: the low 32 bits of a weights version
CATCH_UP_EVERY_S = 0.5
"""How often a worker whose weights are new enough for its tasks still looks for newer ones."""


class CoordinatorWeights:
    """The gate of a rollout-only worker: fetch published weights until the engine holds what a
    task names. Versions are the trainer's ``weights_version`` (generation << 32 | policy
    version). A task needs both at least its weights version and at least its policy version: a
    worker group that re-formed publishes again from the checkpoint it resumed, under a newer
    generation but an older policy, which must not pass for the policy an earlier generation's
    task asked for."""

    def __init__(self, fetcher: WeightFetcher, run_id: str, engine, lock: threading.RLock, stop: threading.Event | None = None,
                 *, engine_dtype: str = ""):
        self.fetcher = fetcher
        self.run_id = run_id
        self.engine = engine
        self.lock = lock
        self.stop = stop or threading.Event()
        self.engine_dtype = engine_dtype
        """This worker's ``engine.dtype``: published weights of another float dtype are warned about once."""
        self._dtype_warned = False
        self.weights_version = -1
        self.fetches = 0
        self._fetching = threading.Lock()  # the engine's batches wait here from several threads
        self._checked_at = -CATCH_UP_EVERY_S

    def close(self) -> None:
        """Wake every waiter with ``GateClosed`` (the worker is stopping)."""
        self.stop.set()

    def holds(self, weights_version: int, policy_version: int = 0) -> bool:
        have = self.weights_version
        return have >= 0 and have >= weights_version and (have & POLICY_MASK) >= policy_version

    def refresh(self, want: int, timeout_s: float, policy_version: int = 0) -> None:
        """Load published weights until they are of version ``want`` or newer (-1: any) and of
        policy version ``policy_version`` or newer. ``GateClosed`` once ``stop`` is set."""
        give_up = time.monotonic() + timeout_s
        while not self.holds(want, policy_version):
            if self.stop.is_set():
                raise GateClosed("the rollout worker is stopping")
            left = give_up - time.monotonic()
            if left <= 0:
                raise PolicyVersionTimeout(
                    f"run {self.run_id!r}: no published weights of version >= {max(want, 0):#x} with policy version >= "
                    f"{policy_version} after {timeout_s:.0f}s (this worker has {self.weights_version:#x}); is the trainer "
                    f"running with rollout.publish_weights = true and the same rollout.weights_transfer (this worker: "
                    f"{self.fetcher.mode!r})? With the relay: can this host reach the trainer's relay port (its log says "
                    "'serving policy weights to rollout workers at HOST:PORT')?"
                )
            with self._fetching:
                if not self.holds(want, policy_version):
                    self._load(self.fetcher.fetch(self.weights_version, min(left, FETCH_CHUNK_S)))

    def _load(self, got: tuple[int, bytes] | None) -> None:
        if got is None:
            return
        version, blob = got
        state = unpack_state_dict(blob)
        self._check_dtype(state)
        with self.lock:
            self.engine.update_weights(state.items(), version=version & POLICY_MASK)
        self.weights_version = version
        self.fetches += 1
        log.info("loaded published weights: generation %d, policy version %d (%.1f MB)",
                 version >> 32, version & POLICY_MASK, len(blob) / 1e6)

    def _check_dtype(self, state: dict) -> None:
        published = sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()})
        if self._dtype_warned or self.engine_dtype in ("", "auto") or published in ([], [self.engine_dtype]):
            return
        self._dtype_warned = True
        log.warning("the published weights are %s and this worker's engine.dtype is %s: they are cast on loading (a "
                    "trainer whose rank-0 node has engine.dtype = bfloat16 publishes bfloat16; give both the same "
                    "engine.dtype)", "/".join(published), self.engine_dtype)

    def catch_up(self, policy_version: int = 0) -> None:
        """Load a newer published version if there is one now, without waiting (at most every
        ``CATCH_UP_EVERY_S``): with ``rollout.max_staleness`` >= 1 a task accepts older weights,
        and drawing with the newest keeps the policy lag small. A newer generation's version of
        a policy older than ``policy_version`` (the task about to be drawn asks for that) is not
        loaded: it would not pass for that task."""
        now = time.monotonic()
        if now - self._checked_at < CATCH_UP_EVERY_S or not self._fetching.acquire(blocking=False):
            return
        try:
            self._checked_at = now
            got = self.fetcher.fetch(self.weights_version, 0.0)
            if got is None or (got[0] & POLICY_MASK) >= policy_version:
                self._load(got)
        finally:
            self._fetching.release()

    def wait(self, policy_version: int, weights_version: int, timeout_s: float) -> None:
        self.refresh(weights_version, timeout_s, policy_version)
        self.catch_up(policy_version)


def default_member_id() -> str:
    return f"rollout-{socket.gethostname()}-{os.getpid()}"


def _say_if_no_such_run(client: SchedulerClient, run_id: str, address: str) -> None:
    """A worker named for a run the coordinator has never seen (a mistyped ``--run-id``, or a trainer
    not started yet) waits all the same, but says so once, with the runs that are there."""
    try:
        runs = {r["snapshot"]["run_id"] for r in client.status().get("runs") or []}
    except ElasticRLError:
        return  # unreachable: the wait for the weights reports it
    if {run_id, workers_run(run_id), rollout_run(run_id)} & runs:
        return
    there = sorted({r.removesuffix(".workers").removesuffix(".rollout") for r in runs})
    print(f"elasticrl rollout: the coordinator at {address} has no run {run_id!r} (runs there: {', '.join(there) or 'none'}); "
          "check --run-id, or start its trainer: this worker waits for it", flush=True)


def run(cfg: NodeConfig, *, member_id: str = "", slots: int = 0, weight: float = 1.0) -> int:
    """Serve the run until it closes (exit 0), SIGTERM/SIGINT (exit 0), or a failure (raises)."""
    c = cfg.coordinator
    token = resolve_token(None, c.token_file or None)
    device = torch.device(cfg.engine.device) if cfg.engine.device else torch.device("cuda" if torch.cuda.is_available() and cfg.engine_name == "vllm" else "cpu")
    torch.set_num_threads(cfg.run.num_threads)
    parts = build_policy(cfg)
    lock = threading.RLock()
    engine, _ = build_engine(cfg, parts, device=device, lock=lock, version=0, shared_module=None, seed=os.getpid())
    run_id = rollout_run(cfg.run.run_id)
    member_id = member_id or default_member_id()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with SchedulerClient(c.address, token=token, tls_ca=c.tls_ca or None, call_timeout_s=c.call_timeout_s,
                         reconnect_timeout_s=c.reconnect_timeout_s, max_message_bytes=int(c.max_message_mb * (1 << 20))) as client:
        r = cfg.rollout
        fetcher = WeightFetcher(client, run_id, member_id, mode=r.weights_transfer, token=token, coordinator_address=c.address,
                                relay_host=r.relay_host, relay_port=r.relay_port, stop=stop)
        gate = CoordinatorWeights(fetcher, run_id, engine, lock, stop, engine_dtype=cfg.engine.dtype if cfg.engine_name != "tiny" else "")
        print(f"elasticrl rollout: waiting for the trainer's weights in run {run_id} at {c.address} ...", flush=True)
        _say_if_no_such_run(client, cfg.run.run_id, c.address)
        try:
            gate.refresh(-1, cfg.rollout.weights_wait_s)
        except GateClosed:
            print(f"elasticrl rollout: {member_id} stopped before any weights arrived", flush=True)
            engine.close()
            fetcher.close()
            return 0
        try:
            check_rollout_worker(cfg, client)  # the trainer's settings are in the KV once it publishes weights
        except Exception:
            engine.close()
            fetcher.close()
            raise
        reward = reward_function(cfg.algorithm.rewards, cfg.algorithm.reward_weights, toy_task(cfg))
        runner = build_runner(cfg, parts, engine, lock=lock, reward=reward)
        worker = EngineWorker(
            runner, transcript_with_prompt=bool(cfg.env.name),
            gate=gate, address=c.address, run_id=run_id, member_id=member_id,
            slots=slots or cfg.rollout.slots, weight=weight, token=token, tls_ca=c.tls_ca or None,
            call_timeout_s=c.call_timeout_s, reconnect_timeout_s=c.reconnect_timeout_s,
            version_timeout_s=cfg.rollout.weights_wait_s,
        )
        print(f"elasticrl rollout: {member_id} serving run {run_id} ({worker.worker.slots} slots, engine {cfg.engine_name})", flush=True)
        closed = False
        try:
            next_check = time.monotonic() + CLOSED_CHECK_S
            while worker.alive and not stop.is_set() and not closed:
                worker.join(0.5)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + CLOSED_CHECK_S
                    closed = _closed(client, run_id)
        finally:
            worker.stop()
            runner.close()
            engine.close()
            fetcher.close()
        print(f"elasticrl rollout: {member_id} stopping after {worker.groups_done} groups "
              f"({gate.fetches} weight versions loaded)", flush=True)
        if closed or isinstance(worker.error, RunClosedError):
            print(f"elasticrl rollout: run {run_id} is closed (training finished)", flush=True)
            return 0
        worker.check()
    return 0


def _closed(client: SchedulerClient, run_id: str) -> bool:
    """Whether the trainer closed the run (it does when it finishes); False while unsure."""
    try:
        runs = client.status(run_id).get("runs") or []
    except ElasticRLError as exc:
        log.warning("could not read run %s's state: %s", run_id, exc)
        return False
    return any(r["snapshot"].get("closed") for r in runs)
