"""Training-strategy registry and config, and the pieces the backends share, in one process with no
process group: names and options checked with fixes in the message, no torch import for the
config, DeepSpeed config merging, block discovery, and gradient checkpointing that changes
neither results nor checkpoint names."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from elasticrl.config import ConfigError, ModelConfig
from elasticrl.policy.tiny import TinyCausalLM
from elasticrl.train import checkpoint as ckpt
from elasticrl.train.strategy import STRATEGY_NAMES, StrategyConfig, TrainStrategy, adamw_factory, make_strategy
from elasticrl.train.strategy_base import (
    check_precision,
    check_state_keys,
    common_step,
    cpu_state_dict,
    enable_gradient_checkpointing,
    load_optimizer_copy,
    transformer_blocks,
)
from elasticrl.train.strategy_deepspeed import deepspeed_config, merge_config


def _tiny() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, max_seq_len=8), vocab_size=11)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"'zero'.*ddp, deepspeed, fsdp2"):
        make_strategy("zero")
    assert STRATEGY_NAMES == ("ddp", "deepspeed", "fsdp2")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"zero_stage": 1}, r"zero_stage: 1 must be 2 or 3"),
        ({"grad_clip_norm": -1.0}, r"grad_clip_norm: -1.0 must be >= 0"),
        ({"deepspeed_config": [1]}, r"deepspeed_config"),
    ],
)
def test_bad_values_are_refused_with_the_fix(options, message):
    with pytest.raises(ConfigError, match=message):
        StrategyConfig(name="deepspeed", **options)


def test_make_strategy_options():
    with pytest.raises(ConfigError, match=r"unknown option\(s\) stage; valid: bf16, deepspeed_config"):
        make_strategy("deepspeed", stage=3)
    with pytest.raises(ConfigError, match="not both"):
        make_strategy(StrategyConfig(), bf16=True)
    config = StrategyConfig(name="fsdp2")
    config.name = "ddp2"  # edited after it was built: checked again
    with pytest.raises(ConfigError, match="ddp2"):
        make_strategy(config)


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_backend_builds_without_a_process_group(name):
    # deepspeed is imported by wrap(), not by the constructor: CI without the extra still gets here.
    strategy = make_strategy(name, zero_stage=3)
    members = [m for m in vars(TrainStrategy) if not m.startswith("_")] + ["config"]
    assert {"wrap", "module", "step", "full_optimizer_state_dict", "close"} <= set(members)
    assert all(hasattr(type(strategy), m) or m in vars(strategy) for m in members), members
    assert strategy.config.name == name and strategy.config.zero_stage == 3


def test_the_config_module_does_not_import_torch():
    code = "import sys, elasticrl.train.strategy as s; s.StrategyConfig(name='fsdp2'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    from elasticrl.train import strategy_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'elasticrl\[deepspeed\]'"):
        strategy_deepspeed._import_deepspeed()


def test_deepspeed_config_merges_user_tables_key_by_key():
    config = StrategyConfig(
        name="deepspeed", zero_stage=3, grad_clip_norm=0.5,
        deepspeed_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}, "steps_per_print": 10},
    )
    ds = deepspeed_config(config)
    assert ds["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert ds["gradient_clipping"] == 0.5 and ds["steps_per_print"] == 10
    assert ds["managed_gradient_accumulation"] is False and ds["bf16"] == {"enabled": False}
    assert merge_config({"a": {"b": 1}}, {"a": 2}) == {"a": 2}


def test_bf16_on_cpu_is_refused():
    with pytest.raises(ConfigError, match=r"bf16: true needs a GPU.*set strategy.bf16=false"):
        check_precision(StrategyConfig(bf16=True), torch.device("cpu"))
    check_precision(StrategyConfig(bf16=False), torch.device("cpu"))


def test_transformer_blocks_are_the_largest_uniform_module_list():
    model = _tiny()
    assert transformer_blocks(model) == list(model.blocks)
    assert transformer_blocks(nn.Sequential(nn.Linear(2, 2))) == []


def _loss_and_grads(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    valid[0, :2] = False
    loss = model(tokens, valid).logsumexp(-1).mean()
    loss.backward()
    # named_parameters carries the checkpoint wrapper's prefix; state_dict names do not.
    return loss.item(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_checkpointing_keeps_results_and_checkpoint_names():
    plain, checkpointed = _tiny(), _tiny()
    enable_gradient_checkpointing(checkpointed)
    assert all(type(b).__name__ == "CheckpointWrapper" for b in checkpointed.blocks)
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    loss_a, grads_a = _loss_and_grads(plain)
    loss_b, grads_b = _loss_and_grads(checkpointed)
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0)


def test_gradient_checkpointing_prefers_the_models_own_switch_and_refuses_blockless_models():
    calls = []

    class HasSwitch(nn.Linear):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    enable_gradient_checkpointing(HasSwitch(2, 2))
    assert calls == [{"use_reentrant": False}]
    with pytest.raises(ConfigError, match="gradient_checkpointing=false"):
        enable_gradient_checkpointing(nn.Linear(2, 2))


def test_optimizer_state_copies_survive_the_checkpoint_format(tmp_path):
    model = _tiny()
    opt = adamw_factory(lr=1e-2, weight_decay=0.1)(model.parameters())
    _loss_and_grads(model)
    opt.step()
    state = cpu_state_dict(opt.state_dict())
    ckpt.save_checkpoint(str(tmp_path), 1, model.state_dict(), state, {}, keep_last=1)
    loaded = ckpt.load_checkpoint(ckpt.checkpoint_dir(str(tmp_path), 1)).optimizer
    fresh = adamw_factory(lr=1.0)(model.parameters())
    fresh.load_state_dict(load_optimizer_copy(loaded))
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.param_groups[0]["betas"] == (0.9, 0.999)
    for index, slots in opt.state_dict()["state"].items():
        for name, value in slots.items():
            torch.testing.assert_close(fresh.state_dict()["state"][index][name], value)
    assert float(common_step(loaded["state"].values())) == 1.0


def test_common_step_and_state_keys_refuse_mismatches():
    assert common_step([{}]) is None
    with pytest.raises(ValueError, match=r"different step counts"):
        common_step([{"step": torch.tensor(1.0)}, {"step": torch.tensor(2.0)}])
    with pytest.raises(KeyError, match=r"missing \['b'\], unexpected \['c'\]"):
        check_state_keys(["a", "b"], ["a", "c"])


def test_a_replicated_strategy_refuses_a_zero_snapshot_so_the_resume_falls_back_to_a_checkpoint():
    """DDP cannot load ZeRO partitions: ShardError (which ``Recovery`` answers with the newest
    checkpoint), not a KeyError that ends the resume."""
    from elasticrl.train.shards import ShardError
    from elasticrl.train.strategy_base import load_replicated_state

    def read(chunks):
        raise AssertionError("nothing is read")

    saved = {"zero.param.0": ((4,), torch.float32), "model.buf": ((2,), torch.float32)}
    with pytest.raises(ShardError, match="ZeRO partitions, which only a ZeRO run loads"):
        load_replicated_state(None, read, saved, {"zero": {}})
