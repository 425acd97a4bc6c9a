"""The RL node's iteration loop: rollout through the scheduler -> seal -> barrier -> fetch -> update -> push.

One ``NodeTrainer`` per torchrun worker. Every worker holds a coordinator ``Membership`` (member
``rank-<r>`` in run ``<run id>.workers``, kept apart from the agents' rendezvous members so a
barrier waits for workers only) and runs a rollout engine that is a member of ``<run id>.rollout``,
the scheduler's run. Rank 0 submits each iteration's prompts as tasks, each naming the oldest
policy version it may be drawn from (``train/submit.py``; ``rollout.max_staleness`` iterations
ahead with asynchronous RL, ``train/staleness.py``); every node's engine (and any rollout-only worker that joined) pulls
and generates them; once the iteration seals, the workers meet at a leased barrier, fetch their
token-balanced shard of the batch from the coordinator, update the policy with the configured
strategy (DDP, DeepSpeed ZeRO, FSDP2) and push the new weights into their engines; rank 0 also
publishes them to the coordinator for rollout-only workers. Barrier names carry a *generation*
that rank 0 draws from the coordinator's KV each time the worker group starts, so a restarted
group never meets a barrier its previous incarnation decided.

If the barrier reports that a rank of the current world was evicted (its lease lapsed: the process
or its node died), the worker exits with ``WorldChangedError`` instead of entering a collective
that would hang; torchrun then re-forms the group and every worker resumes from the newest
complete snapshot (every rank's shard of every iteration, in host memory and on a buddy node) or
checkpoint that survives (``train/recovery.py``; no shared filesystem needed). Iterations the
scheduler already sealed are reused, not rolled out again. With ``--rdzv-conf in_place=true`` and
DDP on gloo, the surviving workers re-form the world themselves instead, in the same processes
(``train/reform.py``), and resume from the same snapshots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time

import torch
import torch.distributed as dist

from elasticrl.config import ConfigError, NodeConfig, to_dict, write_json
from elasticrl.coordinator.client import Membership, resolve_token
from elasticrl.errors import CoordinatorTimeoutError, ElasticRLError, NotFoundError
from elasticrl.rl import overlong
from elasticrl.rl.rewards import RewardError, reward_function
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.rl.workload import context_tokens, max_new_tokens, row_source, toy_task, workload_name
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.scheduler.weights import pack_state_dict
from elasticrl.train import checkpoint as ckpt
from elasticrl.train.names import engine_member_id, iteration_seed, member_id, rollout_run, weights_version, workers_run
from elasticrl.train import reform
from elasticrl.train.background import BackgroundCall, run_together
from elasticrl.train.dist import WorldInfo, all_gather_json, all_reduce_sum, broadcast_json, init_process_group, set_waiter
from elasticrl.train.logcontext import WorkerLogContext, node_name
from elasticrl.train.metric_sinks import JsonLines, ProgressTable, open_sinks
from elasticrl.train.push import hold_every_engine, host_copy, publish_dtype, push_full_tensors
from elasticrl.train.model import build_engine, build_policy, build_renderer, build_runner
from elasticrl.train.inplace import InPlace
from elasticrl.train.recovery import Recovery
from elasticrl.train.same_config import check_same_settings
from elasticrl.train.reform import WorldChangedError
from elasticrl.train.rollout_link import EngineWorker, VersionGate, batch_from_groups, check_failures
from elasticrl.train.staleness import keep_fresh, lag_summary, merge_lags
from elasticrl.train.submit import Submitter, is_eval
from elasticrl.train.strategy import StrategyConfig, adamw_factory, make_strategy
from elasticrl.train.update import UPDATE_STATS, update
from elasticrl.train.warmup import supervised_warmup
from elasticrl.weights.transfer import WeightPublisher

log = logging.getLogger(__name__)

GENERATION_KEY = b"elasticrl/worker-generation"
# The newest iteration the run finished (rank 0 sets it as each is reported): a world that resumes
# from less says what it does again, and one that finds nothing to resume from says what it lost.
PROGRESS_KEY = b"elasticrl/last-iteration"
PROGRESS_HEAD_START_S = 0.5


class NodeTrainer(InPlace):
    def __init__(self, config: NodeConfig, world: WorldInfo, logctx: WorkerLogContext | None = None):
        self.cfg = config
        self.world = world
        self.logctx = logctx or WorkerLogContext(node_name(), world.rank)
        self.run_dir = config.run.run_dir
        self.recovery = Recovery(config, world, self.logctx.node)  # snapshots, checkpoints, resume
        self.ckpt_dir = self.recovery.ckpt_dir
        self.task = toy_task(config)
        self.max_new_tokens = max_new_tokens(config, self.task)
        try:
            self.reward = reward_function(config.algorithm.rewards, config.algorithm.reward_weights, self.task)
        except RewardError as exc:
            raise ConfigError(f"algorithm.rewards: {exc}") from None
        # Every rank reads (and checks) the rows before anything starts: a bad file fails all of
        # them alike, and each can say where the data stands in its checkpoints.
        self.rows = row_source(config, self.reward)
        self.runner = None
        if config.task.prompts_per_iteration < world.world_size:
            raise ConfigError(
                f"task.prompts_per_iteration: {config.task.prompts_per_iteration} is fewer than the "
                f"{world.world_size} ranks; raise it to at least {world.world_size}"
            )
        self.client: SchedulerClient | None = None
        self.membership: Membership | None = None
        self.members: list[str] = []  # the member id of each rank of the current world, in rank order
        self.watch: reform.WorldWatch | None = None  # in-place re-forming (train/reform.py)
        self.reformer: reform.Reformer | None = None
        self.rollout: EngineWorker | None = None
        self.engine = None
        self.strategy = None
        self.sinks: list = []
        self.engine_lock = threading.RLock()
        self.gate = VersionGate()
        self.generation = 0
        self.version = 0
        self.shares_module = False
        self.reference: torch.nn.Module | None = None
        self.device = torch.device("cpu")
        self.submitter: Submitter | None = None  # rank 0
        self._publishing: BackgroundCall | None = None
        self.publisher: WeightPublisher | None = None
        self._unrecorded: dict | None = None
        self._progress: BackgroundCall | None = None  # rank 0's last record of the run's progress
        self._token: str | None = None

    # -- set-up ------------------------------------------------------------------------------

    def _setup(self) -> int:
        """Join the process group and the coordinator, build the model, resume; returns the first iteration."""
        cfg, world = self.cfg, self.world
        torch.set_num_threads(cfg.run.num_threads)
        if cfg.trainer.backend == "nccl":
            torch.cuda.set_device(world.local_rank)
            self.device = torch.device("cuda", world.local_rank)
        init_process_group(cfg.trainer.backend, world, timeout_s=cfg.coordinator.barrier_timeout_s + 60)
        c = cfg.coordinator
        token = self._token = resolve_token(None, c.token_file or None)
        self.client = SchedulerClient(
            c.address, token=token, tls_ca=c.tls_ca or None,
            call_timeout_s=c.call_timeout_s, reconnect_timeout_s=c.reconnect_timeout_s,
            max_message_bytes=int(c.max_message_mb * (1 << 20)),
        )
        check_same_settings(cfg, world.rank, self.client)  # a node with another config stops here, before it joins
        members_run = workers_run(cfg.run.run_id)
        self.generation = self._next_generation()
        self._lead(token)
        self.membership = Membership(
            self.client,
            members_run,
            member_id(world.rank),
            capabilities={"node": self.logctx.node, "group_rank": str(world.node_rank), "generation": str(self.generation)},
        )
        self.members = [member_id(r) for r in range(world.world_size)]
        # Every rank holds its new incarnation before anyone opens a barrier, so no barrier expects
        # an old incarnation of a current rank (which would then show up as "evicted").
        dist.barrier()
        self._watch_world(members_run, token)
        log.info(
            "joined %s as %s (incarnation %d), generation %d, world %d",
            members_run, self.membership.member_id, self.membership.incarnation, self.generation, world.world_size,
        )
        self.recovery.setup(self.generation)

        self.parts = build_policy(cfg)
        t = cfg.trainer
        self.strategy = make_strategy(StrategyConfig(
            name=t.strategy, zero_stage=t.zero_stage, bf16=t.bf16, gradient_checkpointing=t.gradient_checkpointing,
            grad_clip_norm=t.grad_clip_norm, deepspeed_config=dict(t.deepspeed_config),
        ))
        self.strategy.wrap(self.parts.model, adamw_factory(lr=t.lr, weight_decay=t.weight_decay))
        if self.reformer is not None:
            reform.abortable_ddp(self.strategy.module, self.watch)
        self.device = self.strategy.device
        if not cfg.checkpoint.resume and (old := ckpt.latest_iteration(self.recovery.ckpt_dir)):
            # Its checkpoints would outrank this run's: pruned by them, or resumed instead of them.
            raise ConfigError(
                f"checkpoint.resume: false, but {self.recovery.ckpt_dir} already holds checkpoints (the newest of "
                f"iteration {old}); give this run another checkpoint.dir (or run.run_dir), delete them, or resume"
            )
        # Before the rows resume: a prompt that leaves no room to generate would fail at rollout, every time.
        overlong.leave_out(cfg, self.rows, build_renderer(cfg, self.parts).first, context_tokens(cfg), rank=world.rank,
                           world_size=world.world_size, gather=all_gather_json,
                           run=lambda scan: run_together(scan, "checking the prompts' lengths", reduce=world.world_size > 1))
        start = self._resume() if cfg.checkpoint.resume else 0
        if start == 0 and t.warmup_steps and self.task is not None:
            supervised_warmup(self.parts, self.strategy, self.task, steps=t.warmup_steps, batch_size=t.warmup_batch_size,
                              seed=cfg.run.seed, world=world, device=self.device)
        if cfg.algorithm.kl_coef > 0 and self.reference is None:
            # The reference is the policy RL starts from (after the warm-up), kept in every checkpoint.
            self._set_reference(self.strategy.full_model_state_dict(all_ranks=True))
        self.version = start
        shared = self.strategy.unwrap() if t.strategy == "ddp" else None
        self.engine, self.shares_module = build_engine(
            cfg, self.parts, device=self.device, lock=self.engine_lock, version=start, shared_module=shared,
            seed=cfg.run.seed * 1000 + world.rank,
        )
        self._push(start)
        if cfg.run.rl_phase != "update":  # an update-only run trains on sealed iterations: no engine work
            self._start_engine_worker(token)
        if world.rank == 0:
            self._open_records()
            n = sum(p.numel() for p in self.strategy.unwrap().parameters())
            log.info(
                "policy %s: %d parameters; strategy %s; engine %s; task %s; run dir %s",
                cfg.model.kind, n, t.strategy, cfg.engine_name, workload_name(cfg), self.run_dir,
            )
        return start + 1

    def _next_generation(self) -> int:
        """*Collective.* A new generation of the worker group, drawn by rank 0 from the coordinator's KV."""
        members_run = workers_run(self.cfg.run.run_id)
        generation = self.client.kv_add(members_run, GENERATION_KEY, 1) if self.world.rank == 0 else None
        return int(broadcast_json(generation, src=0))

    def _lead(self, token: str | None) -> None:
        """Rank 0's parts (also a rank that became rank 0 in a re-form): the weight publisher and
        the submitter of this generation."""
        cfg, c, r = self.cfg, self.cfg.coordinator, self.cfg.rollout
        if self.world.rank != 0:
            return
        if r.publish_weights and self.publisher is None:
            self.publisher = WeightPublisher(self.client, rollout_run(cfg.run.run_id), member_id(0), mode=r.weights_transfer, token=token,
                                             coordinator_address=c.address, relay_host=r.relay_host, relay_port=r.relay_port)
        self.submitter = Submitter(cfg, self.rows, self.client, generation=self.generation, max_new_tokens=self.max_new_tokens)

    def _open_records(self) -> None:
        """Rank 0: the progress table, metrics.jsonl and the other sinks; adds the record of an
        iteration the resumed snapshot finished but nobody reported."""
        cfg = self.cfg
        if not self.sinks:
            os.makedirs(self.run_dir, exist_ok=True)
            write_json(cfg, os.path.join(self.run_dir, "config.json"))
            self.sinks = [ProgressTable(cfg.run.iterations), JsonLines(self.run_dir), *open_sinks(cfg)]
        records = next(s for s in self.sinks if isinstance(s, JsonLines))
        if self._unrecorded is not None and records.last_iteration() < self._unrecorded["iteration"]:
            log.info("iteration %d finished before the failure but was not on record; recording it now",
                     self._unrecorded["iteration"])
            self._report(self._unrecorded)

    def _start_engine_worker(self, token: str | None) -> None:
        cfg, c = self.cfg, self.cfg.coordinator
        self.runner = build_runner(cfg, self.parts, self.engine, lock=self.engine_lock, reward=self.reward)
        self.rollout = EngineWorker(
            self.runner, gate=self.gate, transcript_with_prompt=bool(cfg.env.name),
            address=c.address, run_id=rollout_run(cfg.run.run_id), member_id=engine_member_id(self.world.local_rank),
            slots=cfg.rollout.slots, token=token, tls_ca=c.tls_ca or None,
            call_timeout_s=c.call_timeout_s, reconnect_timeout_s=c.reconnect_timeout_s,
            version_timeout_s=cfg.rollout.seal_timeout_s,
        )

    def _set_reference(self, state: dict[str, torch.Tensor]) -> None:
        import copy

        ref = copy.deepcopy(self.parts.model) if self.cfg.trainer.strategy == "ddp" else build_policy(self.cfg).model
        ref.load_state_dict(state)
        self.reference = ref.to(self.device).eval().requires_grad_(False)

    def _resume(self) -> int:
        """Load the newest complete snapshot or checkpoint (``Recovery.resume``); returns its iteration."""
        resumed = self.recovery.resume(self.strategy)
        if self.world.rank == 0 and self.cfg.run.rl_phase != "rollout":
            self._say_what_is_done_again(resumed.iteration if resumed else 0)
        if resumed is None:
            return 0
        self.rows.resume(resumed.iteration, resumed.meta.get("data_position", {}))
        if resumed.reference is not None:
            self._set_reference(resumed.reference)
        self._unrecorded = resumed.metrics  # a snapshot's record, added in _setup if it is missing
        return resumed.iteration

    def _say_what_is_done_again(self, start: int) -> None:
        """Rank 0: iterations the run had finished (the coordinator's record) after ``start``, the
        iteration it resumes from, are done again; from 0 they are lost, which is a warning."""
        try:
            (raw,) = self.client.kv_get(workers_run(self.cfg.run.run_id), [PROGRESS_KEY])
        except ElasticRLError as exc:
            log.debug("the run's progress could not be read from the coordinator: %s", exc)
            return
        reached = int(raw) if raw else 0
        if reached <= start:
            return
        if start == 0:
            log.warning(
                "starting over from iteration 1: the run had finished iteration %d on this coordinator (run id %s), "
                "but no rank holds a snapshot or checkpoint of it (expected only for a new run under the same run id). "
                "To keep progress when nodes go, put checkpoint.dir on storage a new node can read, or keep snapshots "
                "with buddy copies (checkpoint.snapshots, checkpoint.snapshot_buddies)", reached, self.cfg.run.run_id,
            )
        else:
            log.info("the run had finished iteration %d; iterations %d-%d are done again from the one resumed",
                     reached, start + 1, reached)

    def _record_progress(self, iteration: int) -> None:
        """Rank 0, before an iteration is reported: the run's progress on the coordinator (see
        ``_say_what_is_done_again``), on a thread of its own given ``PROGRESS_HEAD_START_S`` to
        finish (a millisecond or two) before the report: the node may be killed as soon as the
        iteration's line is out, and a record still in flight then was lost. A coordinator
        restarting meanwhile holds up no collective for longer. Best effort: while the last one is
        still trying, this one is skipped (the next iteration's records the progress)."""
        if self._progress is not None and self._progress.running:
            return

        def record() -> None:
            try:
                self.client.kv_set(workers_run(self.cfg.run.run_id), {PROGRESS_KEY: str(iteration).encode()})
            except ElasticRLError as exc:
                log.debug("the run's progress was not recorded on the coordinator: %s", exc)

        self._progress = BackgroundCall(record, "elasticrl-progress")
        self._progress.settle(PROGRESS_HEAD_START_S)

    # -- weights -------------------------------------------------------------------------------

    def _push(self, version: int) -> float:
        """Policy ``version`` into this node's engine, then released (``_release``)."""
        return self._release(version, self._load_engine(version))

    def _load_engine(self, version: int) -> dict | None:
        """Put policy ``version`` into this node's engine; nothing is drawn from it until
        ``_release``. Returns the CPU copy of the weights it made, if any."""
        state = None
        if self.shares_module:
            with self.engine_lock:
                self.engine.set_version(version)
        elif hold_every_engine(self.engine_lock):
            # Streamed: every rank holds its engine, so no gather waits for another rank's generate.
            try:
                state = {} if self.publisher is not None else None  # rank 0 keeps a CPU copy to publish
                push_full_tensors(self.strategy, self.engine, version, keep=state, keep_dtype=publish_dtype(self.cfg))  # collective
            finally:
                self.engine_lock.release()
        else:
            # Some engine is drawing (rollout.max_staleness >= 1): gather first, with no lock, so that
            # no rank's gather waits for another's generate; then load under this rank's own lock.
            state = self.strategy.full_model_state_dict(all_ranks=True)  # collective; CPU copies
            with self.engine_lock:
                self.engine.update_weights(state.items(), version=version)
            if self.publisher is None:
                state = None  # not kept through the snapshot: only rank 0 publishes
            elif (dtype := publish_dtype(self.cfg)) is not None:
                state = {k: host_copy(v, dtype) for k, v in state.items()}
        self.version = version
        return state

    def _release(self, version: int, state: dict | None) -> float:
        """Open the gate for tasks that need policy ``version`` and (rank 0) publish it for
        rollout-only workers (``rollout.weights_transfer``). The publish runs in the background (a
        rollout-only worker waits for the version its task names anyway); returns the seconds spent
        waiting for the previous one."""
        self.gate.advance(version)
        if self.publisher is None:
            return 0.0
        if state is None:  # a copy: the optimizer changes the shared module while the upload runs
            with self.engine_lock:
                state = {k: host_copy(v, publish_dtype(self.cfg)) for k, v in self.strategy.unwrap().state_dict().items()}
        waited = self._wait_published()
        wversion = weights_version(self.generation, version)
        self._publishing = BackgroundCall(
            lambda: self.publisher.publish(wversion, pack_state_dict(state)),
            f"publishing policy version {version} ({self.publisher.mode})",
        )
        return waited

    def _wait_published(self) -> float:
        """Wait for the previous weight upload; re-raise its failure. Returns the seconds waited."""
        pending, self._publishing = self._publishing, None
        return 0.0 if pending is None else pending.wait(self.cfg.coordinator.reconnect_timeout_s + 300)

    @contextlib.contextmanager
    def _engine_asleep(self):
        """engine.sleep_during_update on a GPU: the engine sleeps from here to the push that wakes
        it, and the engine lock is held all along, so an engine worker still drawing (with
        rollout.max_staleness >= 1) waits instead of calling a sleeping engine."""
        if self.shares_module or not self.cfg.engine.sleep_during_update or self.device.type != "cuda":
            yield
            return
        with self.engine_lock:
            self.engine.sleep()
            yield

    # -- one iteration -----------------------------------------------------------------------

    def _barrier(self, iteration: int, phase: str) -> None:
        name, timeout_s = f"g{self.generation}/iter-{iteration}/{phase}", self.cfg.coordinator.barrier_timeout_s
        if self.reformer is None:
            result = self.membership.arrive(name, timeout_s=timeout_s)
        else:
            # In place: a survivor that finished the collective the lost rank broke (the others did
            # not) must not wait here for them while they wait at the re-form barrier: the watch
            # ends this wait. And the barrier evicts nobody at its deadline (it may be left
            # undecided, its ranks re-formed and alive): a straggler is reported instead.
            result = self.membership.arrive(name, timeout_s=timeout_s, policy="report", check=self.watch.check)
        lost = sorted(set(self.members) & set(result.evicted))
        if lost:
            raise WorldChangedError(f"iteration {iteration} ({phase}): {', '.join(lost)} evicted ({result.reason}); re-forming")

    def _rollout(self, iteration: int) -> dict:
        """Wait for the iteration to seal (every node's engine works on it meanwhile); fails at
        once if this node's engine worker stopped (a broken reward, a dead engine)."""
        checks = [c for c in (self.rollout.check if self.rollout is not None else None,
                              self.watch.check if self.reformer is not None else None) if c is not None]
        check = (lambda: [c() for c in checks]) if checks else None
        timeout = self.cfg.rollout.seal_timeout_s
        if self.cfg.run.rl_phase == "update":
            status = self.client.iteration_status(rollout_run(self.cfg.run.run_id), iteration)
            if not status or not status.get("tasks_total"):
                raise ConfigError(
                    f"run.rl_phase = update: iteration {iteration} of run {self.cfg.run.run_id!r} was never rolled out; "
                    "roll it out first with run.rl_phase = rollout (against a coordinator with --state-dir, which keeps "
                    "every sealed iteration)"
                )
        try:
            return self.client.wait_sealed(rollout_run(self.cfg.run.run_id), iteration, timeout_s=timeout, check=check,
                                           while_progressing=True)
        except CoordinatorTimeoutError as exc:
            raise CoordinatorTimeoutError(f"{exc} (rollout.seal_timeout_s = {timeout:g}: raise it where one group can take "
                                          "longer: long episodes, slow engines)") from exc

    def _fetch(self, iteration: int, split: str = "train", *, rank: int | None = None,
               world_size: int | None = None) -> tuple[RolloutBatch, int, dict[int, int]]:
        """This rank's shard as a batch, the number of samples dropped as stale, {lag: samples} of
        the rest: a train group drawn more than ``rollout.max_staleness`` versions before the policy
        it would train (``self.version``, also after a restart from an older checkpoint) is never
        trained on."""
        groups = self.client.fetch_shard(
            rollout_run(self.cfg.run.run_id), iteration, split=split,
            rank=self.world.rank if rank is None else rank, world_size=world_size or self.world.world_size,
        )
        both = split == "train" and self.cfg.run.rl_phase == "both"  # else evaluation, or off-policy by design (update phase)
        k = self.cfg.rollout.max_staleness if both else 1 << 62
        groups, dropped, lags = keep_fresh(groups, self.version, k)
        if dropped:
            log.warning("iteration %d: dropped %d sample(s) drawn more than rollout.max_staleness = %d versions before "
                        "policy version %d", iteration, dropped, k, self.version)
        return batch_from_groups(groups, self.parts.pad_id, self.device), dropped, lags

    def _update(self, batch: RolloutBatch, num_tokens: float, num_samples: float) -> dict[str, float]:
        """``updates_per_iteration`` optimizer steps on ``batch`` (``train.update``). *Collective.*"""
        return update(self.cfg, self.strategy, self.parts, self.reference, batch, num_tokens=num_tokens,
                      num_samples=num_samples, world=self.world.world_size, pad_id=self.parts.pad_id)

    def _iteration(self, iteration: int, extra: dict) -> dict:
        """submit (rank 0) -> rollout until sealed -> barrier -> fetch -> update -> push -> snapshot
        -> release the new policy. Returns the iteration's metrics, ``extra`` added.

        Every phase is timed on this rank (``t_*`` seconds). The barrier is where a trainer node
        that died during the rollout is noticed, before any collective could hang on it. No
        barrier is needed before the submit: ranks that are not there yet wait for the seal on
        the coordinator, and an engine draws a task only once its node holds at least the policy
        version the task names (``VersionGate``; ``rollout.max_staleness`` versions behind at most).
        """
        cfg = self.cfg
        phase = cfg.run.rl_phase
        t: dict[str, float] = {}
        start = mark = time.monotonic()
        s = iteration_seed(cfg.run.seed, iteration, self.world.rank)
        torch.manual_seed(s)  # every device's generator
        random.seed(s)

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            t[name] = now - mark
            mark = now

        if self.submitter is not None and phase != "update":
            self.submitter.submit_due(iteration, self.version)
        lap("t_submit")
        self.recovery.write_pending()  # the last iteration's snapshot, while this thread waits for the seal
        manifest = self._rollout(iteration)
        check_failures(iteration, manifest, min_fraction=cfg.rollout.min_fraction, max_task_failures=cfg.rollout.max_task_failures)
        lap("t_rollout")
        # The seal's share of that wait: from the coordinator's seal decision to its reply (a rank
        # that arrives after the seal waited only for its own call, hence the min).
        t["t_seal"] = min(manifest["sealed_ago_s"], t["t_rollout"])
        self._barrier(iteration, "update")
        lap("t_barrier")
        batch, stale, lags = self._fetch(iteration)
        # Waits for every rank's fetch, so it is part of the fetch phase.
        ep = batch.episodes
        tokens, reward_sum, exact, samples, turns, env_s, truncated, stale = all_reduce_sum([
            float(batch.completion_mask.sum()), float(batch.rewards.sum()), float((batch.rewards == 1).sum()),
            len(batch.rewards), ep.get("turns", 0.0), ep.get("env_s", 0.0), ep.get("truncated", 0.0), stale,
        ])
        every_lag = all_gather_json(lags)
        lap("t_fetch")
        if self.submitter is not None:
            self.submitter.presubmit(iteration)
        if samples == 0:
            raise RuntimeError(f"iteration {iteration} has no groups to train on ({manifest['seal_reason']}; {stale:.0f} stale samples dropped)")
        metrics: dict = {}
        if self.world.rank == 0 and is_eval(cfg, iteration) and phase != "update":
            held_out, _, _ = self._fetch(iteration, "eval", rank=0, world_size=1)
            if held_out.rewards.numel():
                metrics["eval_reward"] = float(held_out.rewards.mean())
                metrics["eval_exact"] = float((held_out.rewards == 1).float().mean())
        lap("t_eval")
        sums = dict.fromkeys(UPDATE_STATS, 0.0)
        if phase != "rollout":
            with self._engine_asleep():
                with self.engine_lock if self.shares_module else contextlib.nullcontext():
                    sums = dict(zip(sums, all_reduce_sum(list(self._update(batch, tokens, samples).values()))))
                    if self.shares_module:  # stamped with the weights it draws from (the gate opens at the push)
                        self.engine.set_version(iteration)
                lap("t_update")
                pushed = self._load_engine(iteration)  # released after the snapshot, below
                lap("t_push")
        updates = cfg.trainer.updates_per_iteration
        metrics.update({
            "iteration": iteration,
            "policy_version": self.version,
            "reward_mean": reward_sum / samples,
            "exact_fraction": exact / samples,
            "loss": sums["loss"] / updates,
            "clip_fraction": sums["clip_fraction"] / updates,
            "kl": sums["kl"] / updates,
            "grad_norm": sums["grad_norm"] / updates,
            "tis_weight_mean": sums["tis_weight_mean"] / updates,
            "tis_capped_fraction": sums["tis_capped_fraction"] / updates,
            "world_size": self.world.world_size,
            "generation": self.generation,
            "turns_mean": turns / samples,
            "env_s_mean": env_s / samples,
            "truncated_fraction": truncated / samples,
            "trained_tokens": tokens,
            # Training groups; an evaluation's held-out groups apart (0 from a coordinator that does not count them).
            "groups": manifest["tasks_done"] - manifest["eval_done"],
            "groups_total": manifest["tasks_total"] - manifest["eval_total"],
            "groups_failed": manifest["tasks_failed"] - manifest["eval_failed"],
            "eval_groups": manifest["eval_done"],
            "eval_groups_failed": manifest["eval_failed"],
            "env_errors": manifest["env_errors"],
            "requeued": manifest["requeued"],
            "refused": manifest["refused_duplicate"] + manifest["refused_fenced"] + manifest["refused_sealed"],
            "rollout_nodes": {n["node"]: n["done"] for n in manifest["nodes"]},
            "evicted": manifest["evicted"],
            "seal_s": manifest["elapsed_s"],
            "seconds": time.monotonic() - start,
            "stale_dropped": int(stale),
            **lag_summary(merge_lags(every_lag)),
            # The engine of this node (rank 0's): no task in hand or waiting at the gate; the trainer: waiting for rollouts.
            "engine_idle_fraction": self.rollout.idle.take() if self.rollout is not None else 1.0,
            "trainer_idle_fraction": min(1.0, (t["t_rollout"] + t["t_barrier"]) / max(time.monotonic() - start, 1e-9)),
            "example": (f"{batch.examples[0].prompt}{batch.completions[0]}" if batch.examples else "").replace("\n", " | "),
        })
        metrics.update(t)
        metrics.update(extra)
        if phase != "rollout":
            # Before the engines may draw from the new policy (and before the iteration is
            # reported): every rank's shard of the state, with this record, in two nodes' memory.
            taking = time.monotonic()
            meta = self._state_meta(iteration, metrics["reward_mean"])
            metrics["t_snapshot_exchange"] = self.recovery.snapshot(self.strategy, iteration, meta, self.reference, metrics)
            metrics["t_snapshot"] = time.monotonic() - taking  # the exchange included; not in the snapshot's copy
            metrics["t_publish"] = self._release(iteration, pushed)
            metrics["seconds"] = time.monotonic() - start
        return metrics

    def _state_meta(self, iteration: int, reward_mean: float) -> dict:
        """What a checkpoint or snapshot keeps besides the tensors (JSON)."""
        cfg, world = self.cfg, self.world
        return {
            "world_size": world.world_size,
            "generation": self.generation,
            # Where the data and the RNGs stand: the row source's position after this iteration (a
            # dataset's next row; toy and generated rows follow from the iteration number), and the
            # global RNGs are reseeded with iteration_seed() every iteration.
            "data_position": {**self.rows.position(iteration),
                              "rng": "iteration_seed(run.seed, iteration, rank), reseeded every iteration "
                                     "(the same draws when resumed in a world of the same size)"},
            "reward_mean": reward_mean,
            "config": {"model": to_dict(cfg)["model"], "task": to_dict(cfg)["task"]},
            "strategy": cfg.trainer.strategy,
            "node": self.logctx.node,
            "saved_at_unix_s": time.time(),
        }

    def _export(self) -> None:
        """Rank 0: the final policy as an HF model directory (checkpoint.export_hf)."""
        state = self.strategy.full_model_state_dict()  # collective
        if self.world.rank != 0:
            return
        from elasticrl.policy.hf_policy import export_hf

        out = self.cfg.checkpoint.export_hf
        out = out if os.path.isabs(out) else os.path.join(self.run_dir, out)
        export_hf(state, self.cfg.model.path, out, overwrite=True)
        print(f"exported the policy as an HF model directory: {out}", flush=True)

    def _report(self, metrics: dict) -> None:
        """Rank 0: the progress table, metrics.jsonl and the optional TensorBoard / W&B sinks."""
        for sink in self.sinks:
            sink.log(metrics, step=metrics["iteration"])

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            first = self._setup()
            if first > self.cfg.run.iterations:
                log.info("nothing to do: checkpoint %d already covers run.iterations=%d", first - 1, self.cfg.run.iterations)
            while True:
                try:
                    self._train(first)
                    break
                except Exception as exc:  # noqa: BLE001 - raised again unless a rank was lost (_reform)
                    first = self._reform(exc)
            updating = self.cfg.run.rl_phase != "rollout"
            self.recovery.wait_checkpoint()  # the last one, written in the background
            if self.cfg.checkpoint.export_hf and updating:
                self._export()
            if self.world.rank == 0 and self.recovery.last_checkpoint:
                log.info("finished %d iterations; last checkpoint %s", self.cfg.run.iterations, self.recovery.last_checkpoint)
            self._wait_published()
            self._finish()
        finally:
            self.close()

    def _train(self, first: int) -> None:
        """Iterations ``first`` .. ``run.iterations``, each reported, with the periodic checkpoints."""
        every = self.cfg.checkpoint.every_iterations
        updating = self.cfg.run.rl_phase != "rollout"
        saving_s = 0.0
        for iteration in range(first, self.cfg.run.iterations + 1):
            self.logctx.iteration = iteration
            saving = updating and (iteration == self.cfg.run.iterations or (every and iteration % every == 0))
            # The save after the previous iteration, on this thread: its gather, and the wait for the
            # write before it (the write itself runs in the background).
            extra = {"t_checkpoint": saving_s}
            if saving:
                extra["checkpoint"] = ckpt.checkpoint_dir(self.ckpt_dir, iteration)
            # The snapshot (taken in _iteration) holds the record, and a world resumed from it
            # adds the record if nobody wrote it (see _setup), so every finished iteration is on
            # record once. A checkpoint comes after the record (and holds it too).
            metrics = self._iteration(iteration, extra)
            if self.world.rank == 0 and updating:  # a rollout phase's iterations stay sealed on the coordinator
                self._record_progress(iteration)
            self._report(metrics)
            saving_s = 0.0
            if saving:
                t0 = time.monotonic()
                meta = self._state_meta(iteration, metrics["reward_mean"])
                self.recovery.save_checkpoint(self.strategy, iteration, meta, self.reference, metrics)
                saving_s = time.monotonic() - t0

    def _finish(self) -> None:
        """Every rank is done: close the scheduler's run, so rollout-only workers exit (not after
        a rollout-only phase: an update phase will read its iterations), and free the host memory
        of this run's snapshots (the disk checkpoints stay)."""
        self.recovery.before_finish()
        if self.watch is not None:  # the ranks leave from here on: no more a loss
            self.watch.close()
        dist.barrier()
        self.recovery.finish()
        if self.world.rank == 0 and self.cfg.run.rl_phase != "rollout":
            try:
                self.client.close_run(rollout_run(self.cfg.run.run_id), "training finished")
            except NotFoundError:
                pass

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            set_waiter(None)
        self.recovery.close()
        if self.rollout is not None:
            self.rollout.stop()
            self.rollout = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        if self.engine is not None and not self.shares_module:
            self.engine.close()
        self.engine = None
        if self.membership is not None:
            try:
                self.membership.leave("worker exited")
            except ElasticRLError as exc:
                log.warning("could not leave the run cleanly: %s", exc)
            self.membership = None
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if dist.is_initialized():
            dist.destroy_process_group()
