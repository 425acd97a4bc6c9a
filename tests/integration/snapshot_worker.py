"""A torchrun worker for ``test_snapshot_reshard.py``: a sharded snapshot saved by one world and
loaded, through ``Recovery.resume``, by a world of another size.

``--phase save``: every rank trains the seeded tiny policy of ``strategy_worker.py`` for
``--steps`` steps under ``--strategy``, takes a snapshot (``Recovery.snapshot``, the buddy
exchange included, then ``write_pending``) and writes it to ``--root/<its node>``; rank 0 also writes
the full state (model and optimizer, ``checkpoint.save_checkpoint``) to ``--expect`` for comparison.
``--phase load``: a new model with other initial weights resumes from whatever the nodes' directories
hold and compares its full state with ``--expect``; rank 0 writes ``--out`` (JSON: the iteration,
the largest differences, what the resume logged).

Rank r plays node ``--nodes[r]`` (so one host can stand for several nodes, each with its own
directory, as the demo does).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys

from strategy_worker import VOCAB, train_steps  # the same data and loss as the strategy tests

VARIANTS = {"ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}), "zero2": ("deepspeed", {"zero_stage": 2}), "zero3": ("deepspeed", {"zero_stage": 3})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--strategy", choices=sorted(VARIANTS), required=True)
    p.add_argument("--nodes", required=True, help="comma-separated node name of each rank")
    p.add_argument("--root", required=True, help="directory of the nodes' snapshot directories")
    p.add_argument("--expect", required=True, help="directory of the saved world's full state (rank 0 writes it on save)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps before the snapshot (default: %(default)s)")
    p.add_argument("--out", default="", help="JSON result of the load phase (rank 0)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from elasticrl.config import ModelConfig, load_config, to_dict
    from elasticrl.policy.tiny import TinyCausalLM
    from elasticrl.train import checkpoint as ckpt
    from elasticrl.train.dist import WorldInfo, init_process_group
    from elasticrl.train.recovery import Recovery
    from elasticrl.train.strategy import adamw_factory, make_strategy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(name)s: %(message)s")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    world = WorldInfo.from_env()
    nodes = args.nodes.split(",")
    assert len(nodes) == world.world_size, f"--nodes names {len(nodes)} nodes for a world of {world.world_size}"
    node = nodes[world.rank]
    init_process_group("gloo", world, timeout_s=120)
    root = pathlib.Path(args.root)
    config = load_config(None, [
        ("run.run_id", "reshard"), ("run.run_dir", str(root / "run")), ("checkpoint.dir", str(root / "no-checkpoints")),
        ("checkpoint.snapshot_dir", str(root / node)), ("checkpoint.snapshot_timeout_s", "60"),
    ])
    name, options = VARIANTS[args.strategy]
    torch.manual_seed(0 if args.phase == "save" else 1)  # the loaded world starts from other weights
    model = TinyCausalLM(ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16), VOCAB)
    strategy = make_strategy(name, grad_clip_norm=1.0, **options)
    strategy.wrap(model, adamw_factory(lr=1e-2, weight_decay=0.01))
    recovery = Recovery(config, world, node)
    recovery.setup(generation=1 if args.phase == "save" else 2)
    try:
        if args.phase == "save":
            train_steps(strategy, range(1, args.steps + 1), world)
            meta = {"config": {"model": to_dict(config)["model"]}, "data_position": {"next_iteration": args.steps + 1}}
            recovery.snapshot(strategy, args.steps, meta, None, {"iteration": args.steps, "loss": 0.5})
            assert recovery.snapshots._taken.confirmed, "take returns once every buddy holds its copy"
            recovery.write_pending()
            recovery.snapshots.wait()  # own shard and buddy copies on disk
            model_state = strategy.full_model_state_dict()
            optimizer_state = strategy.full_optimizer_state_dict()
            if world.rank == 0:
                ckpt.save_checkpoint(args.expect, args.steps, model_state, optimizer_state, {}, keep_last=1)
        else:
            resumed = recovery.resume(strategy)
            model_state = strategy.full_model_state_dict()
            optimizer_state = strategy.full_optimizer_state_dict()
            if world.rank == 0:
                expect = ckpt.load_checkpoint(ckpt.list_checkpoints(args.expect)[-1][1])
                opt = ckpt.flatten_optimizer(optimizer_state)[0]
                result = {
                    "iteration": resumed.iteration if resumed else 0,
                    "record": resumed.metrics if resumed else None,
                    "model_keys": sorted(model_state) == sorted(expect.model),
                    "optimizer_keys": sorted(opt) == sorted(expect.optimizer_tensors),
                    "model_diff": max(float((model_state[k] - v).abs().max()) for k, v in expect.model.items()),
                    "optimizer_diff": max(float((opt[k] - v).abs().max()) for k, v in expect.optimizer_tensors.items()),
                    "steps": sorted({float(s["step"]) for s in optimizer_state["state"].values()}),
                }
                pathlib.Path(args.out).write_text(json.dumps(result, indent=1, default=float))
    finally:
        recovery.close()
        strategy.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
