"""A torchrun worker for ``test_strategies.py``: the same tiny policy on the same data under one or
more training strategies, reporting per-step global losses, a checkpoint round trip and the final
weights.

Every variant starts from the same seeded ``TinyCausalLM`` and trains ``--steps`` AdamW steps of a
REINFORCE-style token loss (``elasticrl.rl.loss.policy_loss``) on fixed random sequences. Each
step is two micro-batches per rank, the first inside ``no_sync()``, each loss scaled so that the
averaged gradient is the global token mean (as the trainer does). After ``--save-at`` steps the
variant writes a checkpoint with ``elasticrl.train.checkpoint`` (safetensors + JSON), trains on,
then loads it back and replays the remaining steps (``replay``). Last, like a trainer resuming, a
new model (other initial weights) under a new strategy loads a checkpoint of another strategy
(``--cross-ckpt``, else the first variant's of this run) and replays the same steps (``cross``).

Rank 0 writes ``--out`` (JSON, one entry per variant: ``loss``, ``grad_norm``, ``replay_loss``,
``cross_loss``, ``checksum``, ``seconds``) and ``<variant>-final.safetensors`` beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

# name -> (strategy, StrategyConfig options)
VARIANTS: dict[str, tuple[str, dict]] = {
    "ddp": ("ddp", {}),
    "ddp-gc": ("ddp", {"gradient_checkpointing": True}),
    "fsdp2": ("fsdp2", {}),
    "fsdp2-gc": ("fsdp2", {"gradient_checkpointing": True}),
    "zero2": ("deepspeed", {"zero_stage": 2}),
    # A persistence threshold of 0 partitions even this tiny model's parameters (default: 1e5 elements).
    "zero3": ("deepspeed", {"zero_stage": 3, "deepspeed_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}),
    "zero3-gc": ("deepspeed", {"zero_stage": 3, "gradient_checkpointing": True, "deepspeed_config": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}),
}
VOCAB = 20
SEQ = 12  # tokens per sequence
ROWS = 2  # sequences per micro-batch
MICRO_BATCHES = 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variants", required=True, help=f"comma-separated, run in order: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per variant (default: %(default)s)")
    p.add_argument("--save-at", type=int, default=3, help="checkpoint after this many steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip; 0 disables (default: %(default)s)")
    p.add_argument("--out", required=True, help="JSON results file (rank 0 writes it)")
    p.add_argument("--ckpt-root", required=True, help="directory for the <variant>/iter-* checkpoints")
    p.add_argument("--cross-ckpt", default="", help="a checkpoint directory of another strategy to replay from")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    assert 0 < args.save_at < args.steps, f"--save-at {args.save_at} must be in (0, --steps={args.steps})"

    import torch
    import torch.distributed as dist

    from elasticrl.train.dist import WorldInfo, init_process_group

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(name)s: %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    world = WorldInfo.from_env()
    init_process_group("gloo", world, timeout_s=120)
    results = {}
    cross = args.cross_ckpt
    try:
        for variant in variants:
            results[variant] = run_variant(variant, args, world, cross)
            cross = cross or str(pathlib.Path(args.ckpt_root) / variant)
    finally:
        dist.destroy_process_group()
    if world.rank == 0:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def batch(step: int, rank: int, micro: int):
    """Deterministic micro-batch: tokens [ROWS, SEQ] left-padded, valid, completion mask [ROWS, SEQ-1], advantages [ROWS]."""
    import torch

    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    pad = torch.randint(0, 4, (ROWS, 1), generator=g)
    valid = torch.arange(SEQ)[None, :] >= pad  # [ROWS, SEQ]
    mask = (valid[:, 1:] & (torch.arange(1, SEQ)[None, :] >= 6)).float()  # completion tokens
    advantages = 1.0 + 0.5 * torch.randn(ROWS, generator=g)
    return tokens, valid, mask, advantages


def train_steps(strategy, steps: range, world) -> tuple[list[float], list[float]]:
    import contextlib

    from elasticrl.policy.tiny import token_logprobs
    from elasticrl.rl.loss import policy_loss
    from elasticrl.train.dist import all_reduce_sum

    losses, norms = [], []
    for step in steps:
        micro = [batch(step, world.rank, m) for m in range(MICRO_BATCHES)]
        (num_tokens,) = all_reduce_sum([float(sum(b[2].sum() for b in micro))])
        local = 0.0
        for m, (tokens, valid, mask, adv) in enumerate(micro):
            sync = contextlib.nullcontext() if m == MICRO_BATCHES - 1 else strategy.no_sync()
            with sync:
                with strategy.autocast():
                    logprobs = token_logprobs(strategy.module, tokens.to(strategy.device), valid.to(strategy.device))
                loss, _ = policy_loss(
                    logprobs, logprobs.detach(), adv.to(strategy.device), mask.to(strategy.device),
                    num_tokens=num_tokens, kind="reinforce",
                )
                # Gradients are averaged over ranks; each rank's loss is its share of the global mean.
                strategy.backward(loss * world.world_size)
            local += loss.item()
        stats = strategy.step()
        (global_loss,) = all_reduce_sum([local])
        losses.append(global_loss)
        norms.append(stats["grad_norm"])
    return losses, norms


def checksum(state: dict) -> dict:
    total = sum(float(t.double().sum()) for t in state.values())
    absolute = sum(float(t.double().abs().sum()) for t in state.values())
    return {"sum": total, "abs_sum": absolute, "tensors": len(state), "numel": sum(int(t.numel()) for t in state.values())}


def replay(strategy, ckpt_dir: str, args, world) -> tuple[list[float], dict]:
    """Load the newest checkpoint under ``ckpt_dir`` (every rank reads it) and run the steps after it."""
    from elasticrl.train import checkpoint as ckpt

    found = ckpt.list_checkpoints(ckpt_dir)
    assert found, f"no checkpoint under {ckpt_dir}"
    loaded = ckpt.load_checkpoint(found[-1][1])
    strategy.load_full_model_state_dict(loaded.model)
    strategy.load_full_optimizer_state_dict(loaded.optimizer)
    losses, _ = train_steps(strategy, range(loaded.iteration + 1, args.steps + 1), world)
    return losses, checksum(strategy.full_model_state_dict())


def run_variant(variant: str, args, world, cross: str) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from elasticrl.config import ModelConfig
    from elasticrl.policy.tiny import TinyCausalLM
    from elasticrl.train import checkpoint as ckpt
    from elasticrl.train.strategy import adamw_factory, make_strategy

    name, options = VARIANTS[variant]

    def fresh_strategy(seed: int):
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = TinyCausalLM(ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16), VOCAB)
        strategy = make_strategy(name, grad_clip_norm=args.grad_clip, **options)
        strategy.wrap(model, adamw_factory(lr=args.lr, weight_decay=0.01))
        return strategy

    t0 = time.monotonic()
    strategy = fresh_strategy(seed=0)  # every variant starts from the same weights
    t1 = time.monotonic()

    losses, norms = train_steps(strategy, range(1, args.save_at + 1), world)
    model_state = strategy.full_model_state_dict()
    optimizer_state = strategy.full_optimizer_state_dict()
    own_ckpt = pathlib.Path(args.ckpt_root) / variant
    if world.rank == 0:
        ckpt.save_checkpoint(str(own_ckpt), args.save_at, model_state, optimizer_state, {"strategy": variant}, keep_last=1)
    dist.barrier()
    more_losses, more_norms = train_steps(strategy, range(args.save_at + 1, args.steps + 1), world)
    losses += more_losses
    norms += more_norms
    final = strategy.full_model_state_dict()
    t2 = time.monotonic()

    replay_loss, replay_sum = replay(strategy, str(own_ckpt), args, world)
    strategy.close()
    cross_loss = []
    if cross:  # a resume as the trainer does it: a new model and strategy that never stepped
        resumed = fresh_strategy(seed=1)
        cross_loss, _ = replay(resumed, cross, args, world)
        resumed.close()
    if world.rank == 0:
        save_file({k: v.contiguous() for k, v in final.items()}, str(pathlib.Path(args.out).parent / f"{variant}-final.safetensors"))
    return {
        "loss": losses,
        "grad_norm": norms,
        "checksum": checksum(final) if world.rank == 0 else {},
        "replay_loss": replay_loss,
        "replay_checksum": replay_sum if world.rank == 0 else {},
        "cross_from": cross,
        "cross_loss": cross_loss,
        "seconds": {"wrap": round(t1 - t0, 2), "train": round(t2 - t1, 2), "replays": round(time.monotonic() - t2, 2)},
    }


if __name__ == "__main__":
    sys.exit(main())
