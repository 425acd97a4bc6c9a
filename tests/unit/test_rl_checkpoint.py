"""Checkpoints: safetensors files the official reader loads, optimizer state round trip, pruning,
atomic directories, and no pickle anywhere."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
from safetensors import safe_open

from elasticrl.config import ModelConfig
from elasticrl.policy.tiny import TinyCausalLM
from elasticrl.train import checkpoint as ckpt

DEAD_PID = 4194305  # past the largest pid_max: no process has it


def _trained_model_and_optimizer():
    torch.manual_seed(0)
    model = TinyCausalLM(ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=8), vocab_size=11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 11, (4, 6))
    for _ in range(2):
        opt.zero_grad()
        model(tokens, torch.ones_like(tokens, dtype=torch.bool)).logsumexp(-1).mean().backward()
        opt.step()
    return model, opt


def test_save_file_writes_what_safetensors_reads(tmp_path):
    tensors = {
        "w": torch.randn(3, 5),
        "step": torch.tensor(7.0),
        "ids": torch.arange(4),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False, True]),
        "view": torch.randn(4, 4)[:, 1],  # non-contiguous input is packed
    }
    path = tmp_path / "t.safetensors"
    ckpt.save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, expected in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == expected.dtype and torch.equal(got, expected), name


def test_round_trip_restores_model_and_optimizer(tmp_path):
    model, opt = _trained_model_and_optimizer()
    path = ckpt.save_checkpoint(str(tmp_path), 3, model.state_dict(), opt.state_dict(), {"world_size": 2}, keep_last=2)
    assert os.path.basename(path) == "iter-000003"
    loaded = ckpt.load_checkpoint(path)
    assert loaded.iteration == 3 and loaded.meta["world_size"] == 2

    fresh = TinyCausalLM(model.config, vocab_size=11)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded.model)
    fresh_opt.load_state_dict(loaded.optimizer)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for index, slots in want["state"].items():
        for name, value in slots.items():
            assert torch.equal(got["state"][index][name], value), (index, name)


def test_only_complete_checkpoints_count_and_old_ones_are_pruned(tmp_path):
    model, opt = _trained_model_and_optimizer()
    root = str(tmp_path)
    assert ckpt.latest_iteration(root) == 0
    for it in (5, 10, 15):
        ckpt.save_checkpoint(root, it, model.state_dict(), opt.state_dict(), {}, keep_last=2)
    assert [i for i, _ in ckpt.list_checkpoints(root)] == [10, 15]
    # A crashed save leaves a temporary directory
    # (its writer gone: a pid past any pid_max), and an iter-* directory without meta.json.
    crashed = tmp_path / f".tmp-iter-000020-{socket.gethostname()}-{DEAD_PID}-0badf00d"
    os.makedirs(crashed)
    os.makedirs(tmp_path / "iter-000020")
    # Other writers still at work on an older iteration: a live process of this host (pid 1), and
    # another host's fresh one.
    running = [tmp_path / f".tmp-iter-000012-{socket.gethostname()}-1-12345678",
               tmp_path / ".tmp-iter-000012-other-host-77-87654321"]
    for path in running:
        os.makedirs(path)
    assert ckpt.latest_iteration(root) == 15
    ckpt.save_checkpoint(root, 25, model.state_dict(), opt.state_dict(), {}, keep_last=2)
    assert not crashed.exists() and all(path.exists() for path in running)
    assert [i for i, _ in ckpt.list_checkpoints(root)] == [15, 25]
    stale = time.time() - ckpt.STALE_TEMP_S - 60
    os.utime(running[1], (stale, stale))  # another host's, untouched for over an hour: gone
    ckpt.save_checkpoint(root, 30, model.state_dict(), opt.state_dict(), {}, keep_last=2)
    assert running[0].exists() and not running[1].exists()


def test_a_second_writer_of_the_same_iteration_keeps_the_first(tmp_path):
    model, opt = _trained_model_and_optimizer()
    root = str(tmp_path)
    first = ckpt.save_checkpoint(root, 4, model.state_dict(), opt.state_dict(), {"writer": "a"}, keep_last=3)
    again = ckpt.save_checkpoint(root, 4, model.state_dict(), opt.state_dict(), {"writer": "b"}, keep_last=3)
    assert first == again
    assert json.loads(open(os.path.join(first, ckpt.META_FILE)).read())["writer"] == "a"
    assert [n for n in os.listdir(root) if n.startswith(".tmp")] == []


def test_unknown_format_is_refused(tmp_path):
    model, opt = _trained_model_and_optimizer()
    path = ckpt.save_checkpoint(str(tmp_path), 1, model.state_dict(), opt.state_dict(), {}, keep_last=1)
    meta_path = os.path.join(path, ckpt.META_FILE)
    meta = json.load(open(meta_path))
    meta["format_version"] = 99
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(ValueError, match="checkpoint format 99"):
        ckpt.load_checkpoint(path)


def test_a_saved_model_is_matched_by_what_it_is_not_where_it_lies():
    # Found by a user: a checkpoint of model.path = "ckpt" was refused with the same directory
    # written as an absolute path (and model.path may differ per node).
    from elasticrl.config.node import model_identity

    hf = {"kind": "hf", "path": "ckpt", "dtype": "float32", "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}
    assert model_identity(hf) == model_identity({**hf, "path": "/abs/ckpt", "d_model": 32}) == {"kind": "hf", "dtype": "float32"}
    assert model_identity(hf) != model_identity({**hf, "dtype": "bfloat16"})
    tiny = {**hf, "kind": "tiny", "path": ""}
    assert model_identity(tiny) != model_identity({**tiny, "d_model": 32})  # the tiny policy's sizes are its identity


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")
def test_read_now_leaves_no_tensor_mapping_the_checkpoint_files(tmp_path):
    """The resume's reader thread reads every byte (``read_now``): safetensors' default maps the
    files, and the disk would be read later, inside the ranks' broadcast."""
    import gc

    path = ckpt.save_checkpoint(str(tmp_path), 3, {"w": torch.arange(4096.0)}, {"state": {}, "param_groups": []}, {"k": 1},
                                keep_last=1)
    model_file = os.path.join(path, ckpt.MODEL_FILE)

    def mapped() -> bool:
        gc.collect()
        with open("/proc/self/maps") as f:
            return model_file in f.read()

    lazy = ckpt.load_checkpoint(path)
    assert mapped()  # (what this test tells apart)
    del lazy
    read = ckpt.load_checkpoint(path, read_now=True)
    assert not mapped() and torch.equal(read.model["w"], torch.arange(4096.0))
