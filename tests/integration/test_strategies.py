"""Training strategies on CPU with gloo, two ranks under torchrun: DeepSpeed ZeRO-2/3, FSDP2 and DDP
with gradient checkpointing follow DDP's loss trajectory, and full-state checkpoints round-trip
and move between strategies.

Two torchrun launches of ``strategy_worker.py`` (module-scoped, each under a hard timeout and
killed by process group on expiry): ``ddp,ddp-gc,fsdp2,fsdp2-gc``, then, when DeepSpeed is
installed, ``zero2,zero3,zero3-gc`` resuming from the DDP checkpoint (``-gc``: gradient
checkpointing). Every variant trains the same seeded tiny
policy on the same data for 5 steps (2 micro-batches each), checkpoints after step 3, and replays
steps 4-5 from it.

Tolerances are what float rounding honestly allows: gradients are averaged the same way, but
ZeRO flattens and reduces them in another order, so losses agree to ~1e-7 relative and weights
to ~1e-6 (except the attention key bias, whose gradient is pure rounding noise that AdamW
amplifies: see ``assert_matches_ddp``). DDP with gradient checkpointing and FSDP2 have matched
DDP bit for bit.
Timing on two cores: ~8 s for the first launch; ~14 s for the second once DeepSpeed's
shared-memory all-reduce op is built, ~43 s the first time on a machine (it JIT-compiles, then
caches under ~/.cache/torch_extensions): the whole file takes ~25 s warm, ~55 s cold.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

WORKER = REPO / "tests" / "integration" / "strategy_worker.py"
STEPS, SAVE_AT = 5, 3
TORCH_LAUNCH_TIMEOUT_S = 120
DEEPSPEED_LAUNCH_TIMEOUT_S = 300  # includes DeepSpeed's first-use op build on a fresh machine
LOSS_TOL = {"rel": 1e-5, "abs": 1e-6}  # measured: ZeRO-2/3 within 2e-7 of DDP
WEIGHT_ATOL = 1e-5  # measured: within 6e-7 of DDP (key biases aside, see assert_matches_ddp)
STATE_ATOL = 1e-5  # optimizer state after step 3; measured within 4e-9


def launch(out_dir: pathlib.Path, variants: list[str], timeout_s: float, cross_ckpt: str = "") -> dict:
    """One ``torchrun --standalone --nproc-per-node=2`` of the worker; its JSON results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out, log_path = out_dir / "results.json", out_dir / "torchrun.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
        "--variants", ",".join(variants), "--steps", str(STEPS), "--save-at", str(SAVE_AT),
        "--out", str(out), "--ckpt-root", str(out_dir / "ckpt"),
    ]
    if cross_ckpt:
        cmd += ["--cross-ckpt", cross_ckpt]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        # A session of its own: on a timeout the agent and both workers die by one process-group id.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            pytest.fail(f"torchrun {variants} ran past {timeout_s}s\n{log_path.read_text()[-6000:]}")
    assert rc == 0, f"torchrun {variants} exited {rc}\n{log_path.read_text()[-6000:]}"
    return {"results": json.loads(out.read_text()), "dir": out_dir}


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("torch"), ["ddp", "ddp-gc", "fsdp2", "fsdp2-gc"], TORCH_LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory, torch_runs) -> dict:
    if importlib.util.find_spec("deepspeed") is None:  # not importorskip: keep DeepSpeed out of the test process
        pytest.skip("DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    ddp_ckpt = str(torch_runs["dir"] / "ckpt" / "ddp")
    return launch(tmp_path_factory.mktemp("deepspeed"), ["zero2", "zero3", "zero3-gc"], DEEPSPEED_LAUNCH_TIMEOUT_S, cross_ckpt=ddp_ckpt)


def run_of(request, variant: str) -> dict:
    runs = request.getfixturevalue("deepspeed_runs" if variant.startswith("zero") else "torch_runs")
    return {"dir": runs["dir"], **runs["results"][variant]}


def final_weights(run: dict, variant: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run["dir"] / f"{variant}-final.safetensors"))


def assert_matches_ddp(request, variant: str) -> None:
    ddp, other = run_of(request, "ddp"), run_of(request, variant)
    assert len(other["loss"]) == STEPS
    assert other["loss"] == pytest.approx(ddp["loss"], **LOSS_TOL), f"{variant} loss {other['loss']} vs ddp {ddp['loss']}"
    assert other["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-5), f"{variant} grad norms vs ddp"
    mine, theirs = final_weights(other, variant), final_weights(ddp, "ddp")
    assert mine.keys() == theirs.keys()
    for tensors in (mine, theirs):
        for name in [n for n in tensors if n.endswith("qkv.bias")]:
            # The key bias shifts every score of a query equally, so softmax cancels it: its true
            # gradient is 0 and it holds rounding noise, which AdamW normalizes into updates of up
            # to ~1e-4 that differ between any two reduction orders. Compare q and v biases only.
            q, _, v = tensors[name].chunk(3)
            tensors[name] = torch.cat([q, v])
    worst = max(float((mine[k] - theirs[k]).abs().max()) for k in mine)
    assert worst < WEIGHT_ATOL, f"{variant}: final weights differ from ddp's by up to {worst:.3g}"


def test_ddp_trains(torch_runs):
    ddp = torch_runs["results"]["ddp"]
    assert ddp["loss"][-1] < ddp["loss"][0], f"loss did not fall: {ddp['loss']}"


@pytest.mark.parametrize("variant", ["ddp-gc", "fsdp2", "fsdp2-gc", "zero2", "zero3", "zero3-gc"])
def test_matches_ddp_loss_trajectory(request, variant):
    assert_matches_ddp(request, variant)


@pytest.mark.parametrize("variant", ["ddp", "ddp-gc", "fsdp2", "fsdp2-gc", "zero2", "zero3", "zero3-gc"])
def test_checkpoint_round_trip_replays_the_same_steps(request, variant):
    run = run_of(request, variant)
    # Weights and optimizer state saved after step 3 and loaded back reproduce steps 4-5.
    assert run["replay_loss"] == pytest.approx(run["loss"][SAVE_AT:], rel=1e-6, abs=1e-7)
    if run["replay_checksum"]:  # rank 0's view; fsdp2 gathers onto rank 0 only
        assert run["replay_checksum"] == pytest.approx(run["checksum"], rel=1e-6)


@pytest.mark.parametrize("variant", ["fsdp2", "zero2", "zero3"])
def test_checkpoints_move_between_strategies(request, variant):
    from elasticrl.train import checkpoint as ckpt

    ddp, run = run_of(request, "ddp"), run_of(request, variant)
    mine = ckpt.load_checkpoint(ckpt.checkpoint_dir(str(run["dir"] / "ckpt" / variant), SAVE_AT))
    theirs = ckpt.load_checkpoint(ckpt.checkpoint_dir(str(ddp["dir"] / "ckpt" / "ddp"), SAVE_AT))
    # The same layout as DDP's torch optimizer state_dict: names, shapes, param groups.
    assert {k: tuple(v.shape) for k, v in mine.model.items()} == {k: tuple(v.shape) for k, v in theirs.model.items()}
    assert {k: tuple(v.shape) for k, v in mine.optimizer_tensors.items()} == {
        k: tuple(v.shape) for k, v in theirs.optimizer_tensors.items()
    }
    assert mine.meta["optimizer"] == theirs.meta["optimizer"]
    for name, value in mine.optimizer_tensors.items():
        assert float((value - theirs.optimizer_tensors[name]).abs().max()) < STATE_ATOL, name
    # Loaded from DDP's checkpoint, this strategy replays DDP's steps 4-5.
    assert run["cross_from"].endswith("ddp")
    assert run["cross_loss"] == pytest.approx(ddp["loss"][SAVE_AT:], **LOSS_TOL)
