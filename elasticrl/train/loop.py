"""The RL node's iteration loop: rollout through the scheduler -> seal -> barrier -> fetch -> update -> checkpoint.

One ``NodeTrainer`` per torchrun worker. Every worker holds a coordinator ``Membership`` (member
``rank-<r>`` in run ``<run id>.workers``, kept apart from the agents' rendezvous members so a
barrier waits for workers only) and runs a rollout engine that is a member of ``<run id>.rollout``,
the scheduler's run. Rank 0 submits each iteration's prompts as tasks; every node's engine pulls
and generates them; once the iteration seals, the workers meet at a leased barrier, fetch their
token-balanced shard of the batch from the coordinator and update the policy. Barrier names carry
a *generation* that rank 0 draws from the coordinator's KV each time the worker group starts, so a
restarted group never meets a barrier its previous incarnation decided.

If the barrier reports that a rank of the current world was evicted (its lease lapsed: the process
or its node died), the worker exits with ``WorldChangedError`` instead of entering a collective
that would hang; torchrun then re-forms the group and every worker resumes from the newest
checkpoint that any rank holds, broadcast from that rank (no shared filesystem needed). Iterations
the scheduler already sealed are reused, not rolled out again.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticrl.config import ConfigError, NodeConfig, to_dict, write_json
from elasticrl.coordinator.client import Membership, resolve_token
from elasticrl.errors import ElasticRLError
from elasticrl.policy.tiny import TinyCausalLM, token_logprobs
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.advantages import group_advantages
from elasticrl.rl.loss import policy_loss
from elasticrl.rl.rollout import RolloutBatch
from elasticrl.rl.tasks import make_task
from elasticrl.scheduler.client import SchedulerClient
from elasticrl.train import checkpoint as ckpt
from elasticrl.train.dist import (
    WorldInfo,
    all_reduce_int,
    all_reduce_sum,
    broadcast_json,
    broadcast_tensors,
    init_process_group,
)
from elasticrl.train.logcontext import WorkerLogContext, node_name
from elasticrl.train.rollout_link import NodeRolloutWorker, batch_from_groups, iteration_tasks

log = logging.getLogger(__name__)

GENERATION_KEY = b"elasticrl/worker-generation"
METRICS_FILE = "metrics.jsonl"


class WorldChangedError(ElasticRLError, dist.DistError):
    """A rank of the current world was evicted; the worker group must re-form (torchrun restarts it).

    A ``DistError`` like the collective failures a dead peer causes, so ``restart_grace`` treats
    it as one.
    """


def member_id(rank: int) -> str:
    return f"rank-{rank}"


class NodeTrainer:
    def __init__(self, config: NodeConfig, world: WorldInfo, logctx: WorkerLogContext | None = None):
        self.cfg = config
        self.world = world
        self.logctx = logctx or WorkerLogContext(node_name(), world.rank)
        self.run_dir = config.run.run_dir
        self.ckpt_dir = config.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")
        self.vocab = CharVocab()
        self.task = make_task(config.task.name, config.task.num_digits)
        self.max_new_tokens = config.rollout.max_new_tokens or self.task.max_new_tokens
        if config.task.prompts_per_iteration < world.world_size:
            raise ConfigError(
                f"task.prompts_per_iteration: {config.task.prompts_per_iteration} is fewer than the "
                f"{world.world_size} ranks; raise it to at least {world.world_size}"
            )
        self.client: SchedulerClient | None = None
        self.membership: Membership | None = None
        self.rollout: NodeRolloutWorker | None = None
        self._table_started = False
        self.model_lock = threading.Lock()
        self.generation = 0
        self.last_checkpoint = ""
        self.device = torch.device("cpu")

    # -- set-up ------------------------------------------------------------------------------

    def _setup(self) -> int:
        """Join the process group and the coordinator, build the model, resume; returns the first iteration."""
        cfg, world = self.cfg, self.world
        torch.set_num_threads(cfg.run.num_threads)
        if cfg.train.backend == "nccl":
            torch.cuda.set_device(world.local_rank)
            self.device = torch.device("cuda", world.local_rank)
        init_process_group(cfg.train.backend, world, timeout_s=cfg.run.barrier_timeout_s + 60)
        self.client = SchedulerClient(
            cfg.run.coordinator,
            token=resolve_token(None, cfg.run.token_file or None),
            tls_ca=cfg.run.tls_ca or None,
            call_timeout_s=cfg.run.call_timeout_s,
            reconnect_timeout_s=cfg.run.reconnect_timeout_s,
        )
        members_run = f"{cfg.run.run_id}.workers"
        generation = self.client.kv_add(members_run, GENERATION_KEY, 1) if world.rank == 0 else None
        self.generation = int(broadcast_json(generation, src=0))
        self.membership = Membership(
            self.client,
            members_run,
            member_id(world.rank),
            capabilities={"node": self.logctx.node, "group_rank": str(world.node_rank), "generation": str(self.generation)},
        )
        # Every rank holds its new incarnation before anyone opens a barrier, so no barrier expects
        # an old incarnation of a current rank (which would then show up as "evicted").
        dist.barrier()
        log.info(
            "joined %s as %s (incarnation %d), generation %d, world %d",
            members_run, self.membership.member_id, self.membership.incarnation, self.generation, world.world_size,
        )

        torch.manual_seed(cfg.run.seed)  # the same initial weights on every rank
        self.model = TinyCausalLM(cfg.policy, len(self.vocab)).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        start = self._resume() if cfg.checkpoint.resume else 0
        self.ddp = DistributedDataParallel(self.model, device_ids=[world.local_rank] if self.device.type == "cuda" else None)
        self.rollout = NodeRolloutWorker(
            self.model, self.vocab, self.task, self.model_lock,
            address=cfg.run.coordinator, run_id=self.rollout_run, member_id=f"{self.logctx.node}-{world.local_rank}",
            slots=cfg.rollout.slots, token=resolve_token(None, cfg.run.token_file or None), tls_ca=cfg.run.tls_ca or None,
            call_timeout_s=cfg.run.call_timeout_s, reconnect_timeout_s=cfg.run.reconnect_timeout_s,
        )
        self.rollout.policy_version = start
        if world.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            write_json(cfg, os.path.join(self.run_dir, "config.json"))
            log.info("policy: %d parameters; task %s; run dir %s", self.model.num_parameters(), self.task.name, self.run_dir)
        return start + 1

    @property
    def rollout_run(self) -> str:
        """The scheduler's run: every node's rollout engine is a member of it."""
        return f"{self.cfg.run.run_id}.rollout"

    def _resume(self) -> int:
        """Load the newest checkpoint any rank holds (broadcast from the lowest such rank); returns its iteration."""
        mine = ckpt.latest_iteration(self.ckpt_dir)
        newest = all_reduce_int(mine, dist.ReduceOp.MAX)
        if newest == 0:
            return 0
        src = all_reduce_int(self.world.rank if mine == newest else self.world.world_size, dist.ReduceOp.MIN)
        loaded = ckpt.load_checkpoint(ckpt.checkpoint_dir(self.ckpt_dir, newest)) if self.world.rank == src else None
        # The metadata first, so every rank refuses an incompatible checkpoint together.
        meta = broadcast_json(loaded.meta if loaded else None, src)
        saved, wanted = meta.get("config", {}).get("policy"), to_dict(self.cfg)["policy"]
        if saved is not None and saved != wanted:
            raise ConfigError(
                f"checkpoint {newest} in {self.ckpt_dir} has policy {saved}, the config asks for {wanted}; "
                "use the same [policy] or a new checkpoint.dir"
            )
        weights = broadcast_tensors(loaded.model if loaded else None, src)
        opt_tensors = broadcast_tensors(loaded.optimizer_tensors if loaded else None, src)
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(ckpt.unflatten_optimizer(opt_tensors, meta["optimizer"]))
        log.info("resumed from iteration %d (checkpoint of rank %d)", newest, src)
        return newest

    # -- one iteration -----------------------------------------------------------------------

    def _barrier(self, iteration: int, phase: str) -> None:
        result = self.membership.arrive(f"g{self.generation}/iter-{iteration}/{phase}", timeout_s=self.cfg.run.barrier_timeout_s)
        current = {member_id(r) for r in range(self.world.world_size)}
        lost = sorted(current & set(result.evicted))
        if lost:
            raise WorldChangedError(f"iteration {iteration} ({phase}): {', '.join(lost)} evicted ({result.reason}); re-forming")

    def _submit(self, iteration: int) -> None:
        """Rank 0: the iteration's prompts as scheduler tasks. A restarted group submits the same
        tasks again, which is a no-op (and an iteration that already sealed is reused)."""
        cfg = self.cfg
        # Prompts depend only on (seed, iteration): every world size trains on the same data.
        examples = self.task.sample(random.Random(f"{cfg.run.seed}/{iteration}"), cfg.task.prompts_per_iteration)
        tasks = iteration_tasks(
            examples, self.vocab, iteration=iteration, seed=cfg.run.seed, group_size=cfg.task.group_size,
            max_new_tokens=self.max_new_tokens, temperature=cfg.rollout.temperature,
        )
        r = cfg.rollout
        self.client.submit_iteration(
            self.rollout_run, iteration, tasks, policy=r.policy, deadline_s=r.deadline_s,
            min_fraction=r.min_fraction, task_lease_s=r.task_lease_s, backup_tasks=r.backup_tasks,
        )

    def _rollout(self, iteration: int) -> dict:
        """Wait for the iteration to seal (every node's engine works on it meanwhile), then fetch
        this rank's shard of it."""
        self.rollout.check()
        return self.client.wait_sealed(self.rollout_run, iteration, timeout_s=self.cfg.rollout.seal_timeout_s)

    def _fetch(self, iteration: int) -> RolloutBatch:
        groups = self.client.fetch_shard(self.rollout_run, iteration, rank=self.world.rank, world_size=self.world.world_size)
        return batch_from_groups(groups, self.vocab, self.device)

    def _update(self, batch: RolloutBatch, num_tokens: float) -> tuple[float, float]:
        """``updates_per_iteration`` DDP steps on ``batch``; returns this rank's summed loss and
        clip fraction (already scaled so that summing over ranks gives the global values)."""
        cfg = self.cfg
        advantages = group_advantages(batch.rewards, cfg.task.group_size)
        loss_sum = clip_sum = 0.0
        for _ in range(cfg.train.updates_per_iteration):
            if batch.tokens.shape[0] == 0:
                # No groups for this rank (an iteration sealed short): it still joins DDP's
                # gradient all-reduce, with a zero loss that touches every parameter.
                loss = sum(p.sum() for p in self.ddp.parameters()) * 0.0
                stats = {"clip_fraction": 0.0}
            else:
                logprobs = token_logprobs(self.ddp, batch.tokens, batch.valid)
                loss, stats = policy_loss(
                    logprobs, batch.old_logprobs, advantages, batch.completion_mask,
                    num_tokens=num_tokens, kind=cfg.train.loss, clip_eps=cfg.train.clip_eps,
                )
            self.optimizer.zero_grad(set_to_none=True)
            # DDP averages gradients over ranks; each rank's loss is its share of a global token mean.
            (loss * self.world.world_size).backward()
            if cfg.train.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.train.grad_clip_norm)
            self.optimizer.step()
            loss_sum += loss.detach().item()
            clip_sum += stats["clip_fraction"] / self.world.world_size
        return loss_sum, clip_sum

    def _iteration(self, iteration: int) -> dict:
        """submit (rank 0) -> rollout until sealed -> barrier -> fetch -> update -> push.

        Every phase is timed on this rank (``t_*`` seconds). The barrier is where a trainer node
        that died during the rollout is noticed, before any collective could hang on it. No
        barrier is needed before the submit: ranks that are not there yet wait for the seal on
        the coordinator, and a node's engine samples only after its own update released the
        policy (``model_lock``), so no group is drawn from a stale policy.
        """
        t: dict[str, float] = {}
        start = mark = time.monotonic()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            t[name] = now - mark
            mark = now

        if self.world.rank == 0:
            self._submit(iteration)
        lap("t_submit")
        manifest = self._rollout(iteration)
        lap("t_rollout")
        self._barrier(iteration, "update")
        lap("t_barrier")
        batch = self._fetch(iteration)
        lap("t_fetch")
        tokens, reward_sum, exact, samples = all_reduce_sum(
            [float(batch.completion_mask.sum()), float(batch.rewards.sum()), float((batch.rewards == 1).sum()), len(batch.rewards)]
        )
        if samples == 0:
            raise RuntimeError(f"iteration {iteration} sealed with no groups ({manifest['seal_reason']})")
        with self.model_lock:
            loss_sum, clip_sum = all_reduce_sum(list(self._update(batch, max(tokens, 1.0))))
            lap("t_update")
            # The engine samples from this very module: the push is the new version number.
            self.rollout.policy_version = iteration
        lap("t_push")
        updates = self.cfg.train.updates_per_iteration
        metrics = {
            "iteration": iteration,
            "reward_mean": reward_sum / samples,
            "exact_fraction": exact / samples,
            "loss": loss_sum / updates,
            "clip_fraction": clip_sum / updates,
            "world_size": self.world.world_size,
            "generation": self.generation,
            "groups": manifest["tasks_done"],
            "groups_total": manifest["tasks_total"],
            "requeued": manifest["requeued"],
            "refused": manifest["refused_duplicate"] + manifest["refused_fenced"] + manifest["refused_sealed"],
            "rollout_nodes": {n["node"]: n["done"] for n in manifest["nodes"]},
            "evicted": manifest["evicted"],
            "seal_s": manifest["elapsed_s"],
            "seconds": time.monotonic() - start,
            "example": f"{batch.examples[0].prompt}{batch.completions[0]}" if batch.examples else "",
        }
        metrics.update(t)
        return metrics

    def _save(self, iteration: int, metrics: dict) -> None:
        cfg, world = self.cfg, self.world
        writer = world.rank == 0 or (cfg.checkpoint.every_node and world.local_rank == 0)
        if not writer:
            return
        meta = {
            "world_size": world.world_size,
            "generation": self.generation,
            "reward_mean": metrics["reward_mean"],
            "config": {"policy": to_dict(cfg)["policy"], "task": to_dict(cfg)["task"]},
            "node": self.logctx.node,
            "saved_at_unix_s": time.time(),
        }
        self.last_checkpoint = ckpt.save_checkpoint(
            self.ckpt_dir, iteration, self.model.state_dict(), self.optimizer.state_dict(), meta,
            keep_last=cfg.checkpoint.keep_last,
        )
        log.info("saved checkpoint %s", self.last_checkpoint)

    def _report(self, metrics: dict) -> None:
        """Rank 0: one row of the progress table on stdout and one JSON line in metrics.jsonl."""
        if self.world.rank != 0:
            return
        n, i = self.cfg.run.iterations, metrics["iteration"]
        if not self._table_started:
            self._table_started = True
            print(f"{'progress':<22} {'iter':>7}  {'reward':>6}  {'exact':>5}  {'loss':>8}  {'world':>5}  "
                  f"{'time':>6}  {'rollout':>7}  {'update':>6}  {'coord':>6}  example", flush=True)
        filled = round(20 * i / n)
        coord = metrics["t_barrier"] + metrics["t_submit"] + metrics["t_fetch"]
        print(
            f"[{'#' * filled}{'-' * (20 - filled)}] {i:>3}/{n:<3}  {metrics['reward_mean']:>6.3f}  "
            f"{metrics['exact_fraction']:>5.2f}  {metrics['loss']:>+8.4f}  {metrics['world_size']:>5}  "
            f"{metrics['seconds']:>5.2f}s  {metrics['t_rollout']:>6.2f}s  {metrics['t_update']:>5.2f}s  "
            f"{coord:>5.3f}s  {metrics['example']}",
            flush=True,
        )
        with open(os.path.join(self.run_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps({**metrics, "time_unix_s": time.time()}) + "\n")

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            first = self._setup()
            if first > self.cfg.run.iterations:
                log.info("nothing to do: checkpoint %d already covers run.iterations=%d", first - 1, self.cfg.run.iterations)
            every = self.cfg.checkpoint.every_iterations
            for iteration in range(first, self.cfg.run.iterations + 1):
                self.logctx.iteration = iteration
                metrics = self._iteration(iteration)
                if iteration == self.cfg.run.iterations or (every and iteration % every == 0):
                    t0 = time.monotonic()
                    self._save(iteration, metrics)
                    metrics["checkpoint"] = self.last_checkpoint
                    metrics["t_checkpoint"] = time.monotonic() - t0
                self._report(metrics)
            if self.world.rank == 0 and self.last_checkpoint:
                log.info("finished %d iterations; last checkpoint %s", self.cfg.run.iterations, self.last_checkpoint)
        finally:
            self.close()

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.stop()
            self.rollout = None
        if self.membership is not None:
            try:
                self.membership.leave("worker exited")
            except ElasticRLError as exc:
                log.warning("could not leave the run cleanly: %s", exc)
            self.membership = None
        if self.client is not None:
            self.client.close()
            self.client = None
        if dist.is_initialized():
            dist.destroy_process_group()

