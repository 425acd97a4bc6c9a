"""The sections of a node config that set up the machinery: run, coordinator, model, engine,
rollout, algorithm, trainer, checkpoint and logging (the workload's sections, ``[task]`` and
``[env]``, are in ``config.workload``). Each is a ``@dataclass(kw_only=True)`` whose fields carry a
docstring and units in their names, and which validates itself in ``__post_init__``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from elasticrl.config.base import _check, check_address
from elasticrl.coordinator import validate

RL_PHASES = ("both", "rollout", "update")


# run.run_id's longest: the coordinator's ids take 128 characters, and a run derives others from it.
MAX_RUN_ID_LEN = 112


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """What the run is: its id, length, seed, phases, and where its files go."""

    run_id: str = ""
    """Run id; empty means $TORCHELASTIC_RUN_ID (torchrun's --rdzv-id), else "local"."""
    run_dir: str = ""
    """Directory for config.json, metrics.jsonl and checkpoints; empty means runs/<run_id>."""
    iterations: int = 40
    """Number of RL iterations (rollout + update) in the whole run, counting resumed ones."""
    seed: int = 1234
    """Seed of prompts, sampling and initial weights; a run is reproducible for a given world size."""
    rl_phase: str = "both"
    """both: rollout then update every iteration; rollout: only collect trajectories (sealed and kept
    by the coordinator, which needs --state-dir to keep more than the last two); update: only train
    on iterations a rollout-phase run already sealed (as WebGym's rl_phase)."""
    eval_interval: int = 0
    """Every this many iterations also roll out task.eval_prompts held-out prompts (split "eval",
    never trained on) and report eval_reward; 0 disables evaluation."""
    num_threads: int = 1
    """torch intra-op threads per worker; 1 keeps several workers on a small machine from fighting."""

    def __post_init__(self) -> None:
        _check(self.iterations >= 1, f"run.iterations: {self.iterations} must be at least 1 (e.g. --run.iterations=30)")
        _check(self.rl_phase in RL_PHASES, f"run.rl_phase: {self.rl_phase!r} must be one of {', '.join(RL_PHASES)}")
        _check(self.eval_interval >= 0, f"run.eval_interval: {self.eval_interval} must be >= 0 (0 disables evaluation)")
        _check(self.num_threads >= 1, f"run.num_threads: {self.num_threads} must be at least 1")
        _check(-(1 << 63) <= self.seed < 1 << 64, f"run.seed: {self.seed} must be in -2**63..2**64-1 (what torch.manual_seed takes)")
        # The coordinator's id rule, with room for the runs derived from it ("<run_id>.workers",
        # "<run_id>.rollout"): refused here, not by the coordinator once every node started.
        _check(
            not self.run_id or (len(self.run_id) <= MAX_RUN_ID_LEN and validate.ID_RE.fullmatch(self.run_id) is not None),
            f"run.run_id: {self.run_id!r} is not a valid id; use 1-{MAX_RUN_ID_LEN} characters of letters, digits and "
            "._:@=+- starting with a letter or digit",
        )


@dataclasses.dataclass(kw_only=True)
class CoordinatorSection:
    """How the node reaches the coordinator, and how long it waits for it and for its peers."""

    address: str = ""
    """Coordinator HOST:PORT; empty means $ELASTICRL_COORDINATOR."""
    token_file: str = ""
    """File holding the coordinator's shared token; empty means $ELASTICRL_TOKEN_FILE (the torchrun
    plugin sets it from ``--rdzv-conf token_file``), else the token itself from $ELASTICRL_TOKEN."""
    tls_ca: str = ""
    """PEM CA bundle to verify a TLS coordinator; empty for plaintext."""
    barrier_timeout_s: float = 60.0
    """How long an iteration barrier waits for a member before evicting it, seconds."""
    call_timeout_s: float = 10.0
    """Deadline of one coordinator call, seconds."""
    reconnect_timeout_s: float = 60.0
    """How long to retry an unreachable coordinator (e.g. while it restarts), seconds."""
    max_message_mb: float = 64.0
    """Largest gRPC message this node sends or accepts, MiB: the coordinator's --max-message-mb
    (an iteration's tasks go in one message)."""

    def __post_init__(self) -> None:
        if self.address:
            check_address(self.address, "coordinator.address")
        _check(math.isfinite(self.max_message_mb) and 1 <= self.max_message_mb < 2048,
               f"coordinator.max_message_mb: {self.max_message_mb} must be a number of MiB in [1, 2048), like the "
               "coordinator's --max-message-mb")
        _check(self.barrier_timeout_s > 0, f"coordinator.barrier_timeout_s: {self.barrier_timeout_s} must be > 0 seconds")
        _check(self.call_timeout_s > 0, f"coordinator.call_timeout_s: {self.call_timeout_s} must be > 0 seconds")
        _check(
            self.reconnect_timeout_s >= 0,
            f"coordinator.reconnect_timeout_s: {self.reconnect_timeout_s} must be >= 0 seconds",
        )


MODEL_KINDS = ("tiny", "hf")
DTYPES = ("float32", "bfloat16", "float16", "auto")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The policy: the built-in tiny transformer (trained from scratch) or a local HF checkpoint."""

    kind: str = "tiny"
    """tiny: elasticrl.policy.tiny with a character vocabulary (the demo); hf: any causal LM in an
    HF directory (AutoModelForCausalLM + its tokenizer, loaded from local files only)."""
    path: str = ""
    """kind = hf: the HF model directory (config.json, weights, tokenizer). Nothing is downloaded."""
    dtype: str = "float32"
    """kind = hf: dtype the trainer loads the weights in (float32 keeps master weights exact;
    use trainer.bf16 for bf16 compute)."""
    d_model: int = 64
    """kind = tiny: width of the residual stream."""
    n_layers: int = 2
    """kind = tiny: transformer blocks."""
    n_heads: int = 4
    """kind = tiny: attention heads; must divide d_model."""
    max_seq_len: int = 64
    """kind = tiny: longest prompt + completion, tokens."""

    def __post_init__(self) -> None:
        _check(self.kind in MODEL_KINDS, f"model.kind: {self.kind!r} must be one of {', '.join(MODEL_KINDS)}")
        _check(
            self.kind != "hf" or bool(self.path),
            "model.path: model.kind = hf needs the HF model directory (e.g. --model.path=/models/Qwen2.5-0.5B)",
        )
        _check(self.dtype in DTYPES, f"model.dtype: {self.dtype!r} must be one of {', '.join(DTYPES)}")
        _check(self.d_model >= 8, f"model.d_model: {self.d_model} must be at least 8")
        _check(self.n_layers >= 1, f"model.n_layers: {self.n_layers} must be at least 1")
        _check(
            self.n_heads >= 1 and self.d_model % self.n_heads == 0,
            f"model.n_heads: {self.n_heads} must divide model.d_model={self.d_model} (e.g. 4 for 64)",
        )
        _check(self.max_seq_len >= 4, f"model.max_seq_len: {self.max_seq_len} must be at least 4 tokens")


ENGINES = ("auto", "tiny", "hf", "vllm")


@dataclasses.dataclass(kw_only=True)
class EngineConfig:
    """The inference engine that draws rollouts on every node (``elasticrl.rollout``)."""

    name: str = "auto"
    """auto: tiny for model.kind = tiny, hf for model.kind = hf; tiny: samples from the trainer's own
    module (no copy, no push); hf: transformers on CPU or GPU, its own copy of the weights, updated
    in place after each update; vllm: vLLM on GPU (sleeps during the update, load_weights after)."""
    device: str = ""
    """Device of the engine's model: empty means the trainer's (cuda:<local_rank> with nccl, else cpu)."""
    dtype: str = "float32"
    """hf/vllm: dtype of the engine's weights (float32 gives logprobs the trainer reproduces exactly).
    On rank 0's node, bfloat16 also publishes the weights to rollout-only workers in bfloat16 (half
    the bytes); give those workers the same dtype."""
    max_batch_rows: int = 64
    """hf: most sequences decoded together."""
    gpu_memory_utilization: float = 0.5
    """vllm: fraction of the whole GPU's memory vLLM may take, checked against what is free when it
    starts (the trainer shares the GPU and already holds part of it)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per engine. The engine of local rank r takes GPUs r*tp .. r*tp+tp-1 (with 1, the
    rank's own), so a node needs nproc-per-node * tp GPUs."""
    sleep_during_update: bool = True
    """vllm/hf on GPU: release the engine's memory while the trainer updates (sleep/wake). The hf
    engine keeps a pinned host copy of its weights (the model's bytes, per rank) from the first
    sleep until it closes."""

    def __post_init__(self) -> None:
        _check(self.name in ENGINES, f"engine.name: {self.name!r} must be one of {', '.join(ENGINES)}")
        _check(self.dtype in DTYPES, f"engine.dtype: {self.dtype!r} must be one of {', '.join(DTYPES)}")
        _check(self.max_batch_rows >= 1, f"engine.max_batch_rows: {self.max_batch_rows} must be at least 1")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"engine.gpu_memory_utilization: {self.gpu_memory_utilization} must be in (0, 1] (e.g. 0.5)",
        )
        _check(self.tensor_parallel_size >= 1, f"engine.tensor_parallel_size: {self.tensor_parallel_size} must be at least 1")


WEIGHTS_TRANSFERS = ("relay", "coordinator")


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """How completions are sampled, and how the coordinator's scheduler hands out the groups."""

    temperature: float = 1.0
    """Sampling temperature; 1.0 samples from the policy itself. The update recomputes logprobs at
    the same temperature, so the importance ratio compares the distributions the samples came from
    (and the KL to the reference, algorithm.kl_coef, is measured between the tempered policies)."""
    max_new_tokens: int = 0
    """Longest completion (one turn of an episode), tokens; 0 means the toy task's own limit, or 256."""
    policy: str = "dynamic"
    """Scheduler policy: dynamic (engines pull; fast nodes take more) or static (fixed shares by weight)."""
    slots: int = 16
    """Tasks (GRPO groups) each node's engine runs at once: its credits with the scheduler."""
    deadline_s: float = 0.0
    """Seal an iteration this long after submitting it once min_fraction of its groups are done; 0: wait for all."""
    min_fraction: float = 1.0
    """The fraction of an iteration's groups it needs, in (0, 1]: with deadline_s, before it may
    seal; and of groups whose env failed (see max_task_failures), how many may be dropped: when
    fewer than this fraction completed, the run stops with the env's error."""
    task_lease_s: float = 120.0
    """A task not finished this long after its assignment, or after its engine last reported
    progress on it (a turn of one of its episodes ended, or a decoding step of the hf and tiny
    engines), is handed to another engine, seconds."""
    backup_tasks: int = 0
    """Dynamic policy: backup copies of the last straggling tasks that idle engines may run."""
    max_task_failures: int = 2
    """A group whose env failed (raised, or passed env.step_timeout_s) is retried on another engine
    until it failed this many times, then given up (the iteration seals without it)."""
    seal_timeout_s: float = 600.0
    """How long the trainer waits for an iteration to seal with none of its groups finishing
    before failing, seconds: an iteration that advances is waited for however long it takes."""
    presubmit: bool = True
    """Submit the next iteration while this one updates (off the critical path; its tasks wait in
    the engines until the new policy is pushed). Their task leases run meanwhile, so keep
    task_lease_s above the update time, or turn this off; ignored with deadline_s."""
    publish_weights: bool = True
    """Rank 0 publishes every policy version for rollout-only workers (``elasticrl rollout``),
    so they can join at any time; off saves one transfer per iteration."""
    weights_transfer: str = "relay"
    """How published weights reach rollout-only workers. relay: peer to peer, the coordinator
    only says who holds which version (rank 0 serves each version, every worker serves the one it
    has on, a pipeline whose time barely grows with the number of workers); coordinator: uploaded
    to the coordinator and downloaded from it (one process carries every copy; for workers that
    cannot reach each other). Trainer and workers must use the same."""
    relay_host: str = ""
    """relay: the address peers reach this process at; empty: the local address of the interface
    that routes to the coordinator."""
    relay_port: int = 0
    """relay: the TCP port this process serves weights on; 0 picks a free one."""
    weights_wait_s: float = 300.0
    """Rollout-only workers: how long to wait for the policy version a task needs, seconds."""
    max_staleness: int = 0
    """Asynchronous RL: how many policy versions a trained sample may lag the policy it trains (k).
    0: on-policy (iteration i is drawn with version i - 1, engines idle during the update). k >= 1:
    the driver keeps k iterations submitted ahead, engines keep drawing with the newest version they
    hold while the trainer updates, and the loss corrects the lag (algorithm.off_policy_correction);
    a group more than k versions old is dropped at fetch (metric stale_dropped). With run.rl_phase
    rollout or update there is no overlap to gain: it must stay 0."""

    def __post_init__(self) -> None:
        _check(self.temperature > 0, f"rollout.temperature: {self.temperature} must be > 0 (use 1.0)")
        _check(self.max_new_tokens >= 0, f"rollout.max_new_tokens: {self.max_new_tokens} must be >= 0 (0: task default)")
        _check(self.policy in ("dynamic", "static"), f"rollout.policy: {self.policy!r} must be dynamic or static")
        _check(1 <= self.slots <= 4096, f"rollout.slots: {self.slots} must be in 1..4096")
        _check(self.deadline_s >= 0, f"rollout.deadline_s: {self.deadline_s} must be >= 0 (0: no deadline)")
        _check(0 < self.min_fraction <= 1, f"rollout.min_fraction: {self.min_fraction} must be in (0, 1]")
        _check(self.task_lease_s >= 0.001, f"rollout.task_lease_s: {self.task_lease_s} must be >= 0.001 seconds")
        _check(self.backup_tasks >= 0, f"rollout.backup_tasks: {self.backup_tasks} must be >= 0")
        _check(1 <= self.max_task_failures <= 100, f"rollout.max_task_failures: {self.max_task_failures} must be in 1..100")
        _check(self.seal_timeout_s > 0, f"rollout.seal_timeout_s: {self.seal_timeout_s} must be > 0 seconds")
        _check(self.weights_wait_s > 0, f"rollout.weights_wait_s: {self.weights_wait_s} must be > 0 seconds")
        _check(
            isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool) and 0 <= self.max_staleness <= 64,
            f"rollout.max_staleness: {self.max_staleness!r} must be an integer in 0..64 (0: on-policy; 1 or 2 overlap "
            "rollout with the update)",
        )
        _check(self.weights_transfer in WEIGHTS_TRANSFERS,
               f"rollout.weights_transfer: {self.weights_transfer!r} must be one of {', '.join(WEIGHTS_TRANSFERS)}")
        _check(0 <= self.relay_port < 65536, f"rollout.relay_port: {self.relay_port} must be in 0..65535 (0: any free port)")


LOSSES = ("grpo_clip", "reinforce")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")  # elasticrl.rl.advantages.ADVANTAGES (a unit test keeps them equal)
AGGREGATIONS = ("token", "sequence")
OFF_POLICY_CORRECTIONS = ("tis", "none")


@dataclasses.dataclass(kw_only=True)
class AlgorithmConfig:
    """The RL objective: advantages, policy loss, KL to the reference, rewards."""

    loss: str = "grpo_clip"
    """grpo_clip: clipped importance ratio against the rollout logprobs; reinforce: plain policy gradient."""
    advantage: str = "grpo"
    """grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: leave-one-out baseline."""
    clip_eps: float = 0.2
    """grpo_clip: the probability ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to a frozen copy of the initial policy; 0 keeps no reference."""
    aggregation: str = "token"
    """token: mean over every completion token of the global batch; sequence: mean per sample, then
    over samples."""
    rewards: list[str] = dataclasses.field(default_factory=list)
    """Reward functions summed into the reward: registry names (exact_match, positional, format)
    or a user's function as "package.module:function" or "path/to/file.py:function", called as
    fn(prompt, completion, **row) -> float (the row's columns it names as keywords; the older
    fn(prompt, completion, target) still works). Empty: the task's own reward."""
    reward_weights: list[float] = dataclasses.field(default_factory=list)
    """Weights of ``rewards`` (same length); empty means 1.0 each."""
    off_policy_correction: str = "tis"
    """With rollout.max_staleness >= 1, and in an update phase (run.rl_phase = update, whose groups
    were all drawn by older policies); k = 0 in one phase trains exactly as before: "tis", the decoupled
    objective: the ratio is clipped against the policy at the start of the update (the proximal
    policy) and each token is weighted by the truncated importance weight min(pi_prox / pi_behaviour,
    tis_cap) of the policy that drew it; "none": the plain loss against the behaviour logprobs."""
    tis_cap: float = 2.0
    """off_policy_correction = tis: the largest per-token importance weight pi_prox / pi_behaviour (>= 1)."""

    def __post_init__(self) -> None:
        _check(self.loss in LOSSES, f"algorithm.loss: {self.loss!r} is not one of {', '.join(LOSSES)}")
        _check(self.advantage in ADVANTAGES, f"algorithm.advantage: {self.advantage!r} is not one of {', '.join(ADVANTAGES)}")
        _check(0 < self.clip_eps < 1, f"algorithm.clip_eps: {self.clip_eps} must be in (0, 1) (e.g. 0.2)")
        _check(self.kl_coef >= 0, f"algorithm.kl_coef: {self.kl_coef} must be >= 0 (0 disables the KL term)")
        _check(
            self.aggregation in AGGREGATIONS,
            f"algorithm.aggregation: {self.aggregation!r} is not one of {', '.join(AGGREGATIONS)}",
        )
        _check(
            self.off_policy_correction in OFF_POLICY_CORRECTIONS,
            f"algorithm.off_policy_correction: {self.off_policy_correction!r} is not one of {', '.join(OFF_POLICY_CORRECTIONS)}",
        )
        _check(self.tis_cap >= 1.0, f"algorithm.tis_cap: {self.tis_cap} must be >= 1 (e.g. 2.0; it caps pi_prox / pi_behaviour)")
        _check(
            not self.reward_weights or len(self.reward_weights) == len(self.rewards),
            f"algorithm.reward_weights: {len(self.reward_weights)} weights for {len(self.rewards)} rewards; "
            "give one per reward or none",
        )


STRATEGIES = ("ddp", "deepspeed", "fsdp2")  # elasticrl.train.strategy.STRATEGY_NAMES


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The policy update: distributed strategy, optimizer, precision, and the supervised warm-up."""

    strategy: str = "ddp"
    """ddp: DistributedDataParallel; deepspeed: ZeRO (pip install 'elasticrl[deepspeed]'); fsdp2:
    torch fully_shard per transformer block."""
    zero_stage: int = 2
    """deepspeed: 2 shards optimizer state and gradients, 3 also the parameters."""
    bf16: bool = False
    """bf16 compute on GPU (master weights stay fp32); CPU runs refuse it."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about a third more compute."""
    deepspeed_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """deepspeed: extra DeepSpeed config keys merged over elasticrl's (a TOML table)."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (GPU)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    updates_per_iteration: int = 4
    """Optimizer steps on each iteration's rollouts (>1 reuses them; grpo_clip keeps that stable)."""
    micro_batch_rows: int = 0
    """Rows (samples) per forward/backward of an update step: a step sums the gradients of its
    micro-batches, the same step as one pass over the rank's rows. Bounds the activations and the
    fp32 logits [rows, tokens, vocab] (64 rows x 4096 tokens x 152k vocab is 160 GB); on GPUs set
    it (e.g. 4-16 for a 7B model at 4k tokens). 0: all of a rank's rows at once."""
    grad_clip_norm: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 0
    """Supervised steps on (prompt, target) pairs of the task before the first RL iteration of a
    fresh run (not after a resume); 0 skips the warm-up."""
    warmup_batch_size: int = 32
    """Examples per warm-up step across the world."""
    warmup_lr: float = 0.0
    """Learning rate of the warm-up; 0 means trainer.lr."""

    def __post_init__(self) -> None:
        _check(self.strategy in STRATEGIES, f"trainer.strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        _check(self.zero_stage in (2, 3), f"trainer.zero_stage: {self.zero_stage} must be 2 or 3")
        _check(self.lr > 0, f"trainer.lr: {self.lr} must be > 0 (e.g. 3e-3)")
        _check(self.weight_decay >= 0, f"trainer.weight_decay: {self.weight_decay} must be >= 0")
        _check(self.updates_per_iteration >= 1, f"trainer.updates_per_iteration: {self.updates_per_iteration} must be at least 1")
        _check(self.micro_batch_rows >= 0, f"trainer.micro_batch_rows: {self.micro_batch_rows} must be >= 0 (0: a rank's rows at once)")
        _check(self.grad_clip_norm >= 0, f"trainer.grad_clip_norm: {self.grad_clip_norm} must be >= 0 (0 disables)")
        _check(self.backend in ("gloo", "nccl"), f"trainer.backend: {self.backend!r} must be gloo or nccl")
        _check(
            not (self.bf16 and self.backend == "gloo"),
            "trainer.bf16: bf16 compute needs GPUs (trainer.backend = nccl); CPU runs train in fp32",
        )
        _check(self.warmup_steps >= 0, f"trainer.warmup_steps: {self.warmup_steps} must be >= 0 (0 skips the warm-up)")
        _check(self.warmup_batch_size >= 1, f"trainer.warmup_batch_size: {self.warmup_batch_size} must be at least 1")
        _check(self.warmup_lr >= 0, f"trainer.warmup_lr: {self.warmup_lr} must be >= 0 (0: trainer.lr)")


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and where checkpoints (safetensors + JSON) are written and read back."""

    every_iterations: int = 10
    """Save after every this many iterations (and always after the last); 0 saves only at the end.
    The state is gathered on the spot and its files are written in the background while training
    goes on; the next checkpoint waits for them before it gathers (one copy of the state per host),
    and a write not done 600 s after it started (more for a state past 4 GB: 20 MB/s) stops the
    run."""
    dir: str = ""
    """Checkpoint directory; empty means <run_dir>/checkpoints."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted after a save."""
    every_node: bool = False
    """Let local rank 0 of every node save (no shared filesystem), not only global rank 0."""
    resume: bool = True
    """Continue from the newest complete snapshot, or else the newest checkpoint any rank holds
    (broadcast from that rank)."""
    snapshots: bool = True
    """After every iteration, each rank writes its shard of the training state to host memory (off
    the critical path, through torch.distributed.checkpoint) and, with snapshot_buddies, keeps a
    copy on another node: a world re-formed after a node failure, of any size, resumes at the next
    iteration, losing no finished one. Disk checkpoints (every_iterations) are still what survives
    losing every node."""
    snapshot_buddies: bool = True
    """Send each rank's snapshot shard to the same rank of the next node (ring order) too, so the
    shards of a host lost with its memory survive; the new policy is released to the engines, and
    the iteration recorded, only once every copy arrived (on the critical path: milliseconds for a
    small model, the shard's size over the network for a large one). No effect with one node.
    false: a lost host's shards are gone, and the world resumes from an older snapshot or a disk
    checkpoint."""
    snapshot_timeout_s: float = 120.0
    """Longest wait, in seconds, for a snapshot's exchange with the buddies, its write, or the
    fetching of shards when resuming; past it the worker fails (and the world re-forms)."""
    snapshot_dir: str = ""
    """Where a node keeps its snapshots; empty means /dev/shm/elasticrl/<run_id>-<hash of run_dir>/<node>
    (host memory, kept when torchrun restarts the workers, freed when the run finishes; a run that
    stops before it finishes keeps them, to be resumed: delete the directory to free the memory),
    or <run_dir>/snapshots/<node> where there is no /dev/shm."""
    export_hf: str = ""
    """model.kind = hf: after the last iteration write the policy as an HF model directory here
    (relative paths are under run_dir); empty skips the export."""

    def __post_init__(self) -> None:
        _check(self.every_iterations >= 0, f"checkpoint.every_iterations: {self.every_iterations} must be >= 0")
        _check(self.keep_last >= 1, f"checkpoint.keep_last: {self.keep_last} must be at least 1")
        _check(self.snapshot_timeout_s > 0, f"checkpoint.snapshot_timeout_s: {self.snapshot_timeout_s} must be > 0 seconds (e.g. 120)")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclasses.dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go: the console table and metrics.jsonl always; TensorBoard and W&B optionally."""

    level: str = "INFO"
    """Worker log level: DEBUG, INFO, WARNING or ERROR."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to <run_dir>/tensorboard (needs the tensorboard package)."""
    wandb_project: str = ""
    """Also log to this Weights & Biases project (needs wandb and a login or WANDB_MODE=offline)."""
    wandb_mode: str = "online"
    """online, offline or disabled (wandb.init's mode)."""

    def __post_init__(self) -> None:
        _check(self.level.upper() in LOG_LEVELS, f"logging.level: {self.level!r} is not one of {', '.join(LOG_LEVELS)}")
        _check(
            self.wandb_mode in ("online", "offline", "disabled"),
            f"logging.wandb_mode: {self.wandb_mode!r} must be online, offline or disabled",
        )
