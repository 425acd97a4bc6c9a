"""Checkpoints, shards and the resume from a checkpoint at random (seeded; CPU only, one process).

``ELASTICRL_RANDOM_SEEDS=N`` runs seeds 0..N-1 (default 10). What is checked, against the modules'
own words:

* ``checkpoint.save_checkpoint`` -> ``load_checkpoint`` of random state: tensors of random shapes
  (0-dim and empty included), dtypes float32/bfloat16/float16/int64/bool, NaN/inf/-0.0 payloads,
  non-contiguous views, slices of one storage, odd and unicode names; AdamW-like optimizer state
  (step counters as tensors or numbers, odd slot names, several param groups, tuple betas); a meta of
  random JSON (huge ints, extreme floats, unicode). Bit-exact, or -- tensors that alias each other
  (tied embeddings) -- refused with safetensors' clear error, leaving no complete checkpoint.
* A real AdamW with tied and frozen parameters: saved, loaded into a fresh model and optimizer,
  and the next steps are bit-identical to the uninterrupted ones.
* Crash consistency: a writer killed at random points (part of a file written, meta.json half
  written, before the rename, during the prune's deletions), other writers' leftovers (``.tmp-*``
  directories, ``iter-*`` directories without meta.json). After every crash, the resume's choice
  (``latest_iteration``) is the newest checkpoint a save completed, and it loads exactly what was
  saved; keep_last never removes the newest complete one; the leftovers of crashed saves go ("a
  crash mid-save leaves only a ``.tmp-*`` directory that a later save removes"). A damaged file of
  a complete checkpoint is an error, never silently different state.
* ``shards``: random cuts (dim-0 with empty pieces, any dim, 2-D grids, ZeRO's flat slices,
  replicated tensors saved by one owner) in a random world size, saved per rank with
  ``write_shard(own_part(...))`` and read into another world's random cut (again, twice): values,
  dtypes and shapes identical; a lost shard, an unknown name or another shape is a ``ShardError``.
* ``Recovery`` (what ``NodeTrainer._resume`` calls) resuming a real DDP strategy (gloo, world of 1)
  from the newest complete checkpoint after a save killed midway: iteration, meta (data position),
  reference policy, model and optimizer state, and the following steps bit-identical.

The bugs it found are each reduced to a test at the end of the file (each failed before its fix).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import pathlib
import random
import shutil
import socket
import struct

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from elasticrl.train import checkpoint as ckpt
from elasticrl.train.shards import (
    Chunk,
    ShardError,
    own_part,
    owners,
    read_shards,
    saved_tensors,
    write_shard,
)
from elasticrl.train.strategy_base import cpu_state_dict

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10")))

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]


# -- exact comparison -------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))  # strides of size-1 dims too
    return flat.view(torch.uint8)


def assert_tensor_same(got, want, where: str) -> None:
    assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, expected a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, saved {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {tuple(got.shape)}, saved {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{where}: the bytes differ"


def assert_same(got, want, where: str = "") -> None:
    """Deep equality with exact types: tensors bit for bit, floats bit for bit (NaN, -0.0), a tuple
    is not a list, 1 is not 1.0 nor True."""
    if isinstance(want, torch.Tensor):
        assert_tensor_same(got, want, where)
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__} {got!r}, saved {type(want).__name__} {want!r}"
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), f"{where}: keys {sorted(map(repr, got))} != {sorted(map(repr, want))}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def shares_storage(tensors) -> bool:
    """Two of ``tensors`` overlap in memory (what safetensors refuses)."""
    spans = []
    for t in tensors:
        if t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + ((torch.tensor(t.shape) - 1) * torch.tensor(t.stride())).clamp(min=0).sum().item() * t.element_size() + t.element_size()
        spans.append((start, end))
    spans.sort()
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def same_storage(tensors) -> bool:
    ptrs = [t.untyped_storage().data_ptr() for t in tensors if t.numel() > 0]
    return len(ptrs) != len(set(ptrs))


# -- random values ------------------------------------------------------------------------------------

# "__metadata__" is excluded: safetensors reserves it for its header (a tensor of that name writes a
# file its own reader refuses: safetensors' limit, and no model has such a parameter).
KEY_PARTS = ["w", "layers.0.weight", "émbed", "лм_head", "键", "a b", "x/y", "k:v", "🙂", "tab\t", 'quote"', "back\\slash",
             "0", "-1", "state", "__x__", "", "model.embed_tokens", "lm_head.weight"]


def random_key(rng: random.Random, taken: set) -> str:
    while True:
        key = ".".join(rng.choice(KEY_PARTS) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.1:
            key += str(rng.getrandbits(64))
        if key not in taken and key != "__metadata__":
            taken.add(key)
            return key


def random_shape(rng: random.Random, max_dims: int = 3, max_size: int = 5) -> tuple[int, ...]:
    dims = rng.choice([0, 1, 1, 2, 2, 3][: max_dims * 2])
    return tuple(0 if rng.random() < 0.1 else rng.randint(1, max_size) for _ in range(dims))


SPECIAL = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, 65504.0, -3.0e38]


def random_tensor(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.getrandbits(31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64)
        if t.numel():
            t.view(-1)[0] = rng.choice([2**63 - 1, -(2**63), 0, -1])
        return t
    t = torch.randn(shape, generator=g) * 10 ** rng.randint(-3, 3)
    if t.numel():
        flat = t.view(-1)
        for _ in range(rng.randint(0, 3)):
            flat[rng.randrange(flat.numel())] = rng.choice(SPECIAL)
    return t.to(dtype)


def random_layout(rng: random.Random, value: torch.Tensor) -> torch.Tensor:
    """``value`` as a plain tensor, a non-contiguous view, or a transposed one (same values)."""
    kind = rng.choice(["plain", "plain", "strided", "transposed"])
    if kind == "strided" and value.dim() >= 1:
        base = torch.zeros(*value.shape, 2, dtype=value.dtype)
        base[..., 1] = value
        return base[..., 1]
    if kind == "transposed" and value.dim() >= 2:
        return value.transpose(0, 1).contiguous().transpose(0, 1)
    return value


def random_state(rng: random.Random, n: int, taken: set | None = None) -> dict[str, torch.Tensor]:
    taken = set() if taken is None else taken
    state = {}
    for _ in range(n):
        value = random_tensor(rng, random_shape(rng), rng.choice(DTYPES))
        state[random_key(rng, taken)] = random_layout(rng, value)
    # Slices of one storage that do not overlap (a flat buffer cut into parameters).
    if rng.random() < 0.3:
        pool = random_tensor(rng, (24,), rng.choice(DTYPES))
        start = 0
        for _ in range(rng.randint(2, 3)):
            size = rng.randint(1, 6)
            state[random_key(rng, taken)] = pool[start:start + size].view(size)
            start += size
    return state


FLOATS = [-0.0, 0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, float("inf"), float("-inf"), float("nan"), 0.1, 1 / 3, 1e16 + 1]
STRINGS = ["", "ascii", "ünïcödé", "日本語", "🙂👍🏽", "nul\x00byte", "quote\"back\\slash\n\t", "\ud800", "\u2028", "iter-000001"]


def random_scalar(rng: random.Random):
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice([1, -1]) * rng.getrandbits(rng.choice([1, 31, 53, 54, 64, 65, 200]))
    if kind == 1:
        return rng.choice(FLOATS) if rng.random() < 0.6 else rng.uniform(-1e9, 1e9)
    if kind == 2:
        return rng.choice(STRINGS)
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    return rng.randint(-5, 5)


def random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth >= 3 or r < 0.5:
        return random_scalar(rng)
    if r < 0.75:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    taken: set = set()
    return {random_key(rng, taken): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


RESERVED_META = {"iteration", "format_version", "optimizer"}  # save_checkpoint's own keys (see the report)


def random_meta(rng: random.Random) -> dict:
    taken = set(RESERVED_META)
    meta = {random_key(rng, taken): random_json(rng) for _ in range(rng.randint(0, 6))}
    meta["data_position"] = {"next_iteration": rng.getrandbits(40), "next_row": rng.getrandbits(70), "epoch": rng.randint(0, 9)}
    return meta


def random_optimizer(rng: random.Random) -> dict:
    """An optimizer ``state_dict`` like AdamW's (plus odd slots), several param groups."""
    n_params = rng.randint(0, 7)
    cuts = sorted(rng.sample(range(1, n_params), rng.randint(0, min(2, max(0, n_params - 1))))) if n_params > 1 else []
    bounds = [0, *cuts, n_params]
    groups = []
    for a, b in itertools.pairwise(bounds):
        group = {"lr": rng.choice([1e-3, 3e-4, 0.1 + 0.2, 1e-30]), "betas": (rng.choice([0.9, 0.95]), rng.choice([0.999, 0.98])),
                 "eps": 1e-8, "weight_decay": rng.choice([0.0, 0.01]), "amsgrad": rng.random() < 0.3, "foreach": None,
                 "maximize": False, "capturable": False, "differentiable": False, "fused": None, "params": list(range(a, b))}
        if rng.random() < 0.3:
            group["initial_lr"] = rng.random()
        if rng.random() < 0.3:
            group["name"] = rng.choice(STRINGS)
        if rng.random() < 0.2:
            group["big"] = 2**80 + rng.getrandbits(8)
        groups.append(group)
    state = {}
    for index in range(n_params):
        if rng.random() < 0.25:
            continue  # a frozen parameter: no state
        shape = random_shape(rng)
        dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])
        slots = {"step": rng.choice([torch.tensor(float(rng.randint(0, 10**6))), rng.randint(0, 2**40), float(rng.randint(0, 99))]),
                 "exp_avg": random_layout(rng, random_tensor(rng, shape, dtype)), "exp_avg_sq": random_tensor(rng, shape, dtype)}
        if rng.random() < 0.3:
            slots["max_exp_avg_sq"] = random_tensor(rng, shape, dtype)
        if rng.random() < 0.2:
            slots[rng.choice(["mu.ν", "a.b.c", "🙂", ""])] = random_tensor(rng, random_shape(rng), rng.choice(DTYPES))
        if rng.random() < 0.2:
            slots["note"] = random_scalar(rng)
        state[index] = slots
    return {"state": state, "param_groups": groups}


def check_loaded(got: ckpt.Checkpoint, iteration: int, model, optimizer, meta, reference) -> None:
    assert got.iteration == iteration
    assert_same(dict(got.model), dict(model), "model")
    assert_same(got.optimizer, optimizer, "optimizer")
    for k, v in meta.items():
        assert_same(got.meta[k], v, f"meta[{k!r}]")
    assert got.meta["format_version"] == ckpt.FORMAT_VERSION and got.meta["iteration"] == iteration
    if reference is None:
        assert got.reference is None
    else:
        assert_same(dict(got.reference), dict(reference), "reference")


def complete_dirs(root: str) -> list[int]:
    return [i for i, _ in ckpt.list_checkpoints(root)]


# -- 1. round trips of random state ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_state_round_trips_bit_exact_or_is_refused(seed, tmp_path):
    rng = random.Random(seed)
    root = str(tmp_path / "ck")
    saved: dict[int, tuple] = {}
    iteration = 0
    for _ in range(6):
        iteration += rng.randint(1, 3)
        taken: set = set()
        model = random_state(rng, rng.randint(0, 8), taken)
        alias = rng.random() < 0.25 and model
        if alias:  # tied embeddings: one tensor under two names
            model[random_key(rng, taken)] = model[rng.choice(sorted(model))]
        optimizer = random_optimizer(rng)
        meta = random_meta(rng)
        reference = random_state(rng, rng.randint(1, 4)) if rng.random() < 0.4 else None
        keep_last = rng.randint(1, 3)
        want_model = {k: v.clone() for k, v in model.items()}
        want_opt = copy.deepcopy(optimizer)
        tensors = [*model.values(), *(reference or {}).values()]
        overlap = shares_storage(list(model.values())) or shares_storage(list((reference or {}).values()))
        opt_overlap = shares_storage([v for s in optimizer["state"].values() for v in s.values() if isinstance(v, torch.Tensor)])
        assert not opt_overlap
        before = complete_dirs(root)
        try:
            path = ckpt.save_checkpoint(root, iteration, model, optimizer, meta, keep_last=keep_last, reference=reference)
        except RuntimeError as exc:
            # Refused: only tensors that share memory, with safetensors' message saying so, and
            # nothing half-saved under a complete name.
            assert overlap or same_storage(tensors), f"seed {seed}: refused without aliasing: {exc}"
            assert "share memory" in str(exc)
            assert complete_dirs(root) == before
            continue
        # Saved (aliases of a non-contiguous view are packed into copies of their own): exactly.
        assert path == ckpt.checkpoint_dir(root, iteration) and os.path.isfile(os.path.join(path, ckpt.META_FILE))
        # The layout the module docstring gives: the reference only when there is one; optimizer
        # tensors keyed "state.<param index>.<name>".
        files = {ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, ckpt.META_FILE} | ({ckpt.REFERENCE_FILE} if reference is not None else set())
        assert set(os.listdir(path)) == files
        with safe_open(os.path.join(path, ckpt.OPTIMIZER_FILE), framework="pt") as f:
            assert set(f.keys()) == {f"state.{i}.{k}" for i, slots in optimizer["state"].items()
                                     for k, v in slots.items() if isinstance(v, torch.Tensor)}
        # The caller's tensors are untouched by the save.
        assert_same(model, want_model, "model after save")
        assert_same(optimizer, want_opt, "optimizer after save")
        saved[iteration] = (want_model, want_opt, copy.deepcopy(meta), reference)
        listed = complete_dirs(root)
        assert listed == sorted(saved)[-keep_last:], (listed, sorted(saved), keep_last)
        saved = {i: saved[i] for i in listed}
        assert ckpt.latest_iteration(root) == iteration
        for it in listed:  # every kept checkpoint loads exactly as saved
            check_loaded(ckpt.load_checkpoint(ckpt.checkpoint_dir(root, it)), it, *saved[it])
        assert not [n for n in os.listdir(root) if n.startswith(".tmp")] or not listed


@pytest.mark.parametrize("seed", SEEDS)
def test_a_real_adamw_with_tied_and_frozen_parameters_resumes_bit_exact(seed, tmp_path):
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def build(init_seed: int):
        torch.manual_seed(init_seed)
        d, vocab = rng_dims
        emb = torch.nn.Embedding(vocab, d)
        head = torch.nn.Linear(d, vocab, bias=False)
        head.weight = emb.weight  # tied
        frozen = torch.nn.Linear(d, d)
        frozen.requires_grad_(False)
        mid = torch.nn.Linear(d, d)
        model = torch.nn.ModuleDict({"emb": emb, "mid": mid, "frozen": frozen, "head": head})
        model.register_buffer("count", torch.tensor(7, dtype=torch.int64))
        model.register_buffer("mask", torch.rand(vocab) > 0.5)
        groups = [{"params": [emb.weight], "lr": 1e-2, "betas": (0.8, 0.99)},
                  {"params": [mid.weight, mid.bias], "lr": 3e-3, "weight_decay": 0.1}]
        opt = torch.optim.AdamW(groups, amsgrad=amsgrad)
        return model, opt

    def step(model, opt, data_seed: int):
        g = torch.Generator().manual_seed(data_seed)
        tokens = torch.randint(0, rng_dims[1], (3,), generator=g)
        opt.zero_grad()
        h = torch.tanh(model["mid"](model["emb"](tokens)) + model["frozen"](model["emb"](tokens)))
        logits = model["head"](h)
        logits.logsumexp(-1).sum().backward()
        opt.step()

    rng_dims = (rng.randint(2, 6), rng.randint(2, 9))
    amsgrad = rng.random() < 0.5
    model, opt = build(seed)
    before = rng.randint(1, 4)
    for i in range(before):
        step(model, opt, 1000 * seed + i)
    root = str(tmp_path)
    # The module's own state_dict holds the tied weight twice, one tensor: refused, clearly.
    with pytest.raises(RuntimeError, match="share memory"):
        ckpt.save_checkpoint(root, before, model.state_dict(), opt.state_dict(), {}, keep_last=1)
    assert complete_dirs(root) == []
    # What the strategies hand over (full_model_state_dict: one clone per name).
    full_model = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    path = ckpt.save_checkpoint(root, before, full_model, cpu_state_dict(opt.state_dict()), {"world_size": 1}, keep_last=1)
    after = rng.randint(1, 3)
    for i in range(before, before + after):
        step(model, opt, 1000 * seed + i)

    loaded = ckpt.load_checkpoint(path)
    fresh, fresh_opt = build(seed + 12345)
    fresh.load_state_dict(loaded.model)
    fresh_opt.load_state_dict(loaded.optimizer)  # "The optimizer state_dict(), ready for load_state_dict"
    assert fresh["head"].weight is fresh["emb"].weight  # still tied
    for i in range(before, before + after):
        step(fresh, fresh_opt, 1000 * seed + i)
    assert_same(dict(fresh.state_dict()), dict(model.state_dict()), "model after the replayed steps")
    assert_same(fresh_opt.state_dict()["state"], opt.state_dict()["state"], "optimizer state after the replayed steps")
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


# -- 2. crash consistency -------------------------------------------------------------------------------


class Killed(BaseException):
    """The writer's SIGKILL: nothing after it runs (a BaseException, so no ``except Exception`` of the
    code under test takes it for an error it handles)."""


class Forward:
    """A module stand-in: ``overrides`` first, everything else from ``module``."""

    def __init__(self, module, **overrides):
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._module, name)


class Writer:
    """``checkpoint`` with crash points: each file write, the meta.json dump, the rename, each
    ``rmtree``. ``kill_at = k`` kills the k-th crash point: the file half written, the rename not
    done, the directory half deleted."""

    def __init__(self, rng: random.Random, monkeypatch):
        self.rng = rng
        self.kill_at = 0
        self.points = 0
        self.killed = ""
        self.renamed = False
        self.half_pruned: list[str] = []
        real_save, real_dump, real_rmtree = ckpt.save_file, json.dump, shutil.rmtree

        def save_file(tensors, path):
            if self._hit():
                tmp = path + ".whole"
                real_save(tensors, tmp)
                data = pathlib.Path(tmp).read_bytes()
                os.remove(tmp)
                with open(path, "wb") as f:
                    f.write(data[: self.rng.randrange(len(data) + 1)])
                self._die(f"writing {os.path.basename(path)}")
            real_save(tensors, path)

        def dump(obj, f, **kw):
            if self._hit():
                text = json.dumps(obj, **kw)
                f.write(text[: self.rng.randrange(len(text))])
                f.flush()
                self._die("writing meta.json")
            real_dump(obj, f, **kw)

        def rename(src, dst):
            if self._hit():
                self._die("before the rename")
            os.rename(src, dst)
            self.renamed = True

        def rmtree(path, ignore_errors=False, **kw):
            if self._hit() and os.path.isdir(path):
                names = sorted(os.listdir(path))
                for name in self.rng.sample(names, self.rng.randint(0, len(names))):
                    os.remove(os.path.join(path, name))
                if os.path.basename(path).startswith("iter-"):
                    self.half_pruned.append(path)
                self._die(f"deleting {os.path.basename(path)}")
            real_rmtree(path, ignore_errors=ignore_errors, **kw)

        monkeypatch.setattr(ckpt, "save_file", save_file)
        monkeypatch.setattr(ckpt, "json", Forward(json, dump=dump))
        monkeypatch.setattr(ckpt, "os", Forward(os, rename=rename))
        monkeypatch.setattr(ckpt, "shutil", Forward(shutil, rmtree=rmtree))

    def _hit(self) -> bool:
        self.points += 1
        return self.points == self.kill_at

    def _die(self, where: str):
        self.killed = where
        raise Killed(where)

    def save(self, *args, kill_at: int, **kw) -> str | None:
        self.kill_at, self.points, self.killed, self.renamed = kill_at, 0, "", False
        try:
            return ckpt.save_checkpoint(*args, **kw)
        except Killed:
            return None
        finally:
            self.kill_at = 0


def debris(rng: random.Random, root: str, every: int, newest: int, state) -> list[str]:
    """Leftovers of other writers' crashes (and stray names) that no resume may take for a
    checkpoint. ``iter-*`` directories without meta.json, some where a save lands (one swallowed
    that save: test_an_incomplete_iter_dir_does_not_swallow_the_save_of_its_iteration)."""
    made = []
    os.makedirs(root, exist_ok=True)
    for _ in range(rng.randint(0, 3)):
        kind = rng.randrange(4)
        it = max(1, newest + rng.randint(-2 * every, 3 * every))
        if kind == 0:  # another process's half-written save
            # (its writer gone: this host, a pid past any pid_max)
            path = os.path.join(root, f".tmp-iter-{it:06d}-{socket.gethostname()}-{4194305 + rng.randint(0, 999)}-{rng.getrandbits(32):08x}")
            os.makedirs(path, exist_ok=True)
            if rng.random() < 0.7:
                ckpt.save_file(state, os.path.join(path, ckpt.MODEL_FILE))
            if rng.random() < 0.5:
                with open(os.path.join(path, ckpt.META_FILE), "w") as f:
                    f.write('{"format_version": 1, "iterat')
        elif kind == 1:
            path = ckpt.checkpoint_dir(root, it)
            if os.path.exists(path):
                continue
            os.makedirs(path)
            if rng.random() < 0.6:
                ckpt.save_file(state, os.path.join(path, ckpt.MODEL_FILE))
        elif kind == 2:  # an empty directory where a later save lands: the rename replaces it
            path = ckpt.checkpoint_dir(root, (newest // every + rng.randint(1, 3)) * every)
            if os.path.exists(path):
                continue
            os.makedirs(path)
        else:  # names that are no checkpoint
            path = os.path.join(root, rng.choice(["iter-abc", "iter-000003.bak", "iter-", "notes.txt", "iter-1x"]))
            if os.path.exists(path):
                continue
            if rng.random() < 0.5:
                os.makedirs(path)
                with open(os.path.join(path, ckpt.META_FILE), "w") as f:
                    json.dump({"format_version": 1, "iteration": 10**9}, f)
            else:
                with open(path, "w") as f:
                    f.write("x")
        made.append(path)
    return made


@pytest.mark.parametrize("seed", SEEDS)
def test_a_writer_killed_at_random_points_never_leaves_a_partial_checkpoint_to_resume(seed, tmp_path, monkeypatch):
    rng = random.Random(seed)
    writer = Writer(rng, monkeypatch)
    root = str(tmp_path / "ck")
    keep_last = rng.randint(1, 3)
    every = rng.randint(2, 4)
    complete: dict[int, tuple] = {}  # intact complete checkpoints: iteration -> what was saved
    broken: set[int] = set()  # listed (meta.json there) but half deleted by a killed prune
    newest = 0
    for op in range(14):
        debris(rng, root, every, newest, random_state(rng, 1))
        # The resume: the newest complete checkpoint, exactly as saved.
        assert ckpt.latest_iteration(root) == newest, (seed, op, ckpt.list_checkpoints(root), sorted(complete))
        listed = set(complete_dirs(root))
        assert listed <= set(complete) | broken, (listed, sorted(complete), broken)
        assert newest == 0 or newest in complete
        if newest:
            check_loaded(ckpt.load_checkpoint(ckpt.checkpoint_dir(root, newest)), newest, *complete[newest])
        # The next save of the resumed run (a multiple of every after the resumed iteration).
        iteration = (newest // every + rng.randint(1, 2)) * every
        model = random_state(rng, rng.randint(1, 4))
        if not model or shares_storage(list(model.values())):
            model = {"w": random_tensor(rng, (3,), torch.float32)}
        optimizer = random_optimizer(rng)
        meta = random_meta(rng)
        reference = random_state(rng, 1) if rng.random() < 0.3 else None
        if shares_storage(list((reference or {}).values())):
            reference = None
        kill_at = rng.randint(1, 9) if rng.random() < 0.6 else 0
        writer.half_pruned.clear()
        path = writer.save(root, iteration, model, optimizer, meta, keep_last=keep_last, reference=reference, kill_at=kill_at)
        record = ({k: v.clone() for k, v in model.items()}, copy.deepcopy(optimizer), copy.deepcopy(meta), reference)
        final = ckpt.checkpoint_dir(root, iteration)
        if path is None:
            where = writer.killed
            if writer.renamed and os.path.isfile(os.path.join(final, ckpt.META_FILE)) and final not in writer.half_pruned:
                complete[iteration] = record  # killed in the prune, after the rename: complete
            else:
                assert not os.path.isfile(os.path.join(final, ckpt.META_FILE)), f"seed {seed}: killed {where}, yet {final} counts as complete"
            for half in writer.half_pruned:
                it = int(os.path.basename(half)[5:])
                complete.pop(it, None)
                if os.path.isfile(os.path.join(half, ckpt.META_FILE)):
                    broken.add(it)
        else:
            assert path == final
            complete[iteration] = record
            listed = complete_dirs(root)
            # keep_last: the newest keep_last complete ones, the one just written always among them.
            assert iteration in listed and len(listed) == min(keep_last, len(listed))
            assert listed == sorted(set(complete) | broken)[-keep_last:], (listed, sorted(complete), broken)
            assert all(i in complete for i in listed)
            # "a crash mid-save leaves only a .tmp-* directory that a later save removes"
            stale = [n for n in os.listdir(root) if n.startswith(".tmp-iter-") and int(n.split("-")[2]) < iteration]
            assert stale == [], stale
        present = set(complete_dirs(root))
        complete = {i: v for i, v in complete.items() if i in present}
        broken &= present
        newest = max(complete, default=0)
        assert not (broken and newest and max(broken) > newest)


CORRUPTIONS = ["truncate", "empty", "header length", "delete"]


def corrupt(rng: random.Random, path: str, how: str) -> None:
    if how == "delete":
        os.remove(path)
        return
    data = pathlib.Path(path).read_bytes()
    if how == "truncate":
        data = data[: rng.randrange(1, len(data))]
    elif how == "empty":
        data = b""
    elif path.endswith(".json"):
        data = b"\x00" + data[1:]
    else:
        data = struct.pack("<Q", rng.choice([0, 2**40, len(data) + 1])) + data[8:]
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_damaged_file_of_a_complete_checkpoint_is_an_error_never_other_state(seed, tmp_path):
    rng = random.Random(seed)
    root = str(tmp_path)
    saved = {}
    for it in (1, 2):
        model = {"w": random_tensor(rng, random_shape(rng), rng.choice(DTYPES)), "b": random_tensor(rng, (2,), torch.float32)}
        opt = random_optimizer(rng)
        ref = {"r": random_tensor(rng, (3,), torch.float32)} if rng.random() < 0.5 else None
        ckpt.save_checkpoint(root, it, model, opt, {"it": it}, keep_last=2, reference=ref)
        saved[it] = (model, copy.deepcopy(opt), {"it": it}, ref)
    names = [ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, ckpt.META_FILE]
    name, how = rng.choice(names), rng.choice(CORRUPTIONS)
    corrupt(rng, os.path.join(ckpt.checkpoint_dir(root, 2), name), how)
    if name == ckpt.META_FILE and how == "delete":  # no longer complete: the resume takes the one before
        assert ckpt.latest_iteration(root) == 1
    else:
        assert ckpt.latest_iteration(root) == 2
        with pytest.raises(Exception) as info:
            ckpt.load_checkpoint(ckpt.checkpoint_dir(root, 2))
        assert not isinstance(info.value, AssertionError)
    check_loaded(ckpt.load_checkpoint(ckpt.checkpoint_dir(root, 1)), 1, *saved[1])


# -- 3. shards: random cuts, saved in one world, read in another ------------------------------------------


def split(rng: random.Random, n: int, parts: int, even: bool) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering [0, n): torch.chunk's cut (empty ones at the end) or
    random cut points (empty ranges anywhere)."""
    if even:
        per = -(-n // parts) if n else 0
        out = []
        for p in range(parts):
            a = min(p * per, n)
            out.append((a, min(a + per, n)))
        return out
    points = sorted(rng.randint(0, n) for _ in range(parts - 1))
    bounds = [0, *points, n]
    return list(itertools.pairwise(bounds))


def factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(p, n // p) for p in range(1, n + 1) if n % p == 0]


def random_cut(rng: random.Random, shape: tuple[int, ...], world: int, *, allow_replicated: bool = True):
    """Per rank: (offsets, sizes) of its box of a tensor of ``shape``, or None when it holds none;
    and whether the tensor is replicated (every rank the whole)."""
    kinds = ["dim", "dim", "one"] + (["replicated"] if allow_replicated else []) + (["grid"] if len(shape) >= 2 else [])
    kind = rng.choice(kinds) if shape else rng.choice(["one", "replicated"] if allow_replicated else ["one"])
    whole = (tuple(0 for _ in shape), tuple(shape))
    if kind == "replicated":
        return [whole] * world, True
    if kind == "one":
        holder = rng.randrange(world)
        return [whole if r == holder else None for r in range(world)], False
    if kind == "dim":
        d = rng.randrange(len(shape))
        out = []
        for a, b in split(rng, shape[d], world, rng.random() < 0.5):
            offsets, sizes = list(whole[0]), list(shape)
            offsets[d], sizes[d] = a, b - a
            out.append((tuple(offsets), tuple(sizes)))
        return out, False
    p, q = rng.choice(factor_pairs(world))
    rows, cols = split(rng, shape[0], p, rng.random() < 0.5), split(rng, shape[1], q, rng.random() < 0.5)
    out = []
    for (a, b) in rows:
        for (c, e) in cols:
            out.append(((a, c, *whole[0][2:]), (b - a, e - c, *shape[2:])))
    rng.shuffle(out)
    return out, False


def box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def random_destination(rng: random.Random, sizes, dtype) -> torch.Tensor:
    """An uninitialised destination, sometimes non-contiguous (a transposed buffer)."""
    if len(sizes) >= 2 and rng.random() < 0.3:
        return torch.full(tuple(reversed(sizes)), 0, dtype=dtype).permute(*reversed(range(len(sizes))))
    if dtype.is_floating_point:
        return torch.full(tuple(sizes), float("nan"), dtype=dtype)
    return torch.full(tuple(sizes), 1, dtype=dtype)


def write_world(rng: random.Random, directory: str, whole: dict[str, torch.Tensor], world: int) -> dict[int, dict[str, int]]:
    """Every rank's cut of ``whole``, saved as it would be (``own_part``: each replicated tensor by
    its owner). Returns {rank: {name: elements of its piece}} of what each shard holds."""
    cuts = {name: random_cut(rng, tuple(t.shape), world) for name, t in whole.items()}
    holding: dict[int, dict[str, int]] = {}
    # What a write_shard killed midway leaves (its temporary directory): no shard of the set.
    stale = os.path.join(directory, f"shard-{world:05d}.safetensors.tmp-{rng.randint(2, 99999)}")
    os.makedirs(stale)
    write_shard({"stale": Chunk.whole(torch.ones(3))}, os.path.join(stale, "model-00001-of-00001.safetensors"))
    for r in range(world):
        chunks = {}
        for name, (boxes, replicated) in cuts.items():
            if boxes[r] is None:
                continue
            offsets, sizes = boxes[r]
            if 0 in sizes and rng.random() < 0.5:
                # Half the empty pieces at the tensor's end (where torch's uneven cut puts it), the
                # rest where another rank's piece starts (which hid that piece:
                # test_an_empty_chunk_where_another_rank_s_chunk_starts_reads).
                offsets = tuple(whole[name].shape[d] if s == 0 else o for d, (o, s) in enumerate(zip(offsets, sizes)))
            part = box(whole[name], offsets, sizes)
            if rng.random() < 0.5:
                part = part.clone()  # else a (maybe non-contiguous) view of the whole
            chunks[name] = Chunk(part, offsets, tuple(whole[name].shape), replicated)
        mine = own_part(chunks, r, world)
        path = os.path.join(directory, f"shard-{r:05d}.safetensors")
        # "written aside, then renamed into place ...; returns its size in bytes"
        assert write_shard(mine, path) == os.path.getsize(path)
        holding[r] = {n: c.tensor.numel() for n, c in mine.items()}
    return holding


def read_world(rng: random.Random, directory: str, whole: dict[str, torch.Tensor], world: int, where: str) -> None:
    """Every rank of a new world reads its own random cut (of a random subset of the names) and
    gets exactly its pieces of ``whole``."""
    cuts = {name: random_cut(rng, tuple(t.shape), world, allow_replicated=False) for name, t in whole.items()}
    for r in range(world):
        dest = {}
        for name, (boxes, _) in cuts.items():
            if boxes[r] is None or rng.random() < 0.15:
                continue
            offsets, sizes = boxes[r]
            dest[name] = Chunk(random_destination(rng, sizes, whole[name].dtype), offsets, tuple(whole[name].shape))
        read_shards(directory, dest)
        for name, c in dest.items():
            assert_tensor_same(c.tensor, box(whole[name], c.offsets, c.tensor.shape), f"{where}, rank {r} of {world}: {name!r} at {c.offsets}")


@pytest.mark.parametrize("seed", SEEDS)
def test_shards_of_random_cuts_reshard_into_any_world_exactly(seed, tmp_path):
    rng = random.Random(seed)
    taken: set = set()
    whole = {}
    for _ in range(rng.randint(1, 6)):
        shape = random_shape(rng, max_size=6)
        if rng.random() < 0.3:  # ZeRO's view: the flattened parameter
            shape = (math.prod(shape),)
        whole[random_key(rng, taken)] = random_tensor(rng, shape, rng.choice(DTYPES))
    # World after world: each saves its cut, the next reads its own.
    worlds = [rng.randint(1, 5) for _ in range(3)]
    trace = f"seed {seed}, worlds {worlds}, shapes { {n: tuple(t.shape) for n, t in whole.items()} }"
    for hop, (w_from, w_to) in enumerate(itertools.pairwise(worlds)):
        directory = str(tmp_path / f"hop{hop}")
        os.makedirs(directory)
        write_world(rng, directory, whole, w_from)
        assert saved_tensors(directory) == {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}, trace
        # Whole tensors, every name, in one rank (the full state a checkpoint gathers).
        dest = {n: Chunk.whole(random_destination(rng, tuple(t.shape), t.dtype)) for n, t in whole.items()}
        read_shards(directory, dest)
        for n, t in whole.items():
            assert_tensor_same(dest[n].tensor, t, f"{trace}: whole {n!r}")
        read_world(rng, directory, whole, w_to, trace)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_lost_shard_an_unknown_name_or_another_shape_is_a_shard_error(seed, tmp_path):
    rng = random.Random(seed)
    taken: set = set()
    whole = {random_key(rng, taken): random_tensor(rng, random_shape(rng, max_size=6), rng.choice(DTYPES)) for _ in range(rng.randint(1, 5))}
    world = rng.randint(2, 5)
    directory = str(tmp_path / "shards")
    os.makedirs(directory)
    holding = write_world(rng, directory, whole, world)
    name = rng.choice(sorted(whole))
    t = whole[name]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ShardError, match="no shards"):
        read_shards(str(empty), {name: Chunk.whole(torch.empty(t.shape, dtype=t.dtype))})
    read_shards(str(empty), {})  # nothing asked: nothing read
    with pytest.raises(ShardError, match="no tensor"):
        read_shards(directory, {name + "?": Chunk.whole(torch.empty(t.shape, dtype=t.dtype))})
    other = tuple(s + 1 for s in t.shape) if t.dim() else (1,)
    with pytest.raises(ShardError, match="shape"):
        read_shards(directory, {name: Chunk.whole(torch.empty(other, dtype=t.dtype))})
    lost = rng.randrange(world)
    os.remove(os.path.join(directory, f"shard-{lost:05d}.safetensors"))
    for n, t in whole.items():
        dest = {n: Chunk.whole(random_destination(rng, tuple(t.shape), t.dtype))}
        if holding[lost].get(n):
            with pytest.raises(ShardError):  # "no tensor", "a shard is missing" or (the tail lost) "shape"
                read_shards(directory, dest)
            continue
        try:
            read_shards(directory, dest)
        except ShardError:
            # The directory as a whole is incomplete (check_complete looks at every tensor), or
            # only an empty piece of this one was lost (the headers no longer tell its shape).
            assert n in holding[lost] or any(holding[lost].values()), f"seed {seed}: {n!r} unreadable, shard {lost} held nothing"
            continue
        assert_tensor_same(dest[n].tensor, t, f"seed {seed}: {n!r} after losing shard {lost}")


def test_owners_are_a_pure_function_of_the_names_and_sizes():
    rng = random.Random(0)
    for _ in range(200):
        sizes = {str(rng.getrandbits(16)): rng.choice([0, 1, 2, 8, 8, 100]) for _ in range(rng.randint(0, 9))}
        world = rng.randint(1, 6)
        got = owners(sizes, world)
        shuffled = list(sizes.items())
        rng.shuffle(shuffled)
        assert owners(dict(shuffled), world) == got
        assert set(got) == set(sizes) and all(0 <= r < world for r in got.values())
        load = [sum(s for n, s in sizes.items() if got[n] == r) for r in range(world)]
        assert max(load) - min(load) <= max(sizes.values(), default=0)  # greedy: within one tensor


# -- 4. Recovery: a real DDP strategy resumed from the newest complete checkpoint -------------------------


def recovery_config(tmp_path, *, snapshots: bool, kl: float, keep_last: int = 2):
    from elasticrl.config import load_config

    return load_config(None, [("run.run_id", "ckrandom"), ("run.run_dir", str(tmp_path / "run")),
                              ("checkpoint.dir", str(tmp_path / "ck")), ("checkpoint.snapshots", str(snapshots).lower()),
                              ("checkpoint.snapshot_dir", str(tmp_path / "snap")), ("checkpoint.keep_last", str(keep_last)),
                              ("algorithm.kl_coef", str(kl)), ("model.d_model", "8"), ("model.n_layers", "1"),
                              ("model.n_heads", "2"), ("model.max_seq_len", "8")])


class TinyTrainer:
    """NodeTrainer's parts the resume touches: a DDP strategy over a tiny policy, AdamW, the meta."""

    def __init__(self, cfg, init_seed: int, lr: float):
        from elasticrl.policy.tiny import TinyCausalLM
        from elasticrl.train.strategy import (
            StrategyConfig,
            adamw_factory,
            make_strategy,
        )

        torch.manual_seed(init_seed)
        self.cfg = cfg
        self.model = TinyCausalLM(cfg.model, vocab_size=7)
        self.strategy = make_strategy(StrategyConfig(name="ddp"))
        self.strategy.wrap(self.model, adamw_factory(lr=lr, weight_decay=0.01))

    def step(self, iteration: int) -> None:
        g = torch.Generator().manual_seed(iteration)
        tokens = torch.randint(0, 7, (2, 6), generator=g)
        self.strategy.optimizer.zero_grad()
        self.strategy.backward(self.strategy.module(tokens, torch.ones_like(tokens, dtype=torch.bool)).logsumexp(-1).mean())
        self.strategy.step()

    def meta(self, iteration: int) -> dict:
        from elasticrl.config import to_dict

        return {"world_size": 1, "generation": 1, "reward_mean": iteration / 7,
                "data_position": {"next_iteration": iteration + 1, "next_row": iteration * 2**40, "epoch": iteration // 3},
                "config": {"model": to_dict(self.cfg)["model"], "task": to_dict(self.cfg)["task"]}, "strategy": "ddp", "node": "n0"}


@pytest.mark.parametrize("seed", SEEDS)
def test_recovery_resumes_the_newest_complete_checkpoint_after_a_save_killed_midway(seed, tmp_path, monkeypatch, gloo_world_of_one):
    from elasticrl.train.dist import WorldInfo
    from elasticrl.train.recovery import Recovery

    rng = random.Random(seed)
    kl = rng.choice([0.0, 0.1])
    cfg = recovery_config(tmp_path, snapshots=False, kl=kl, keep_last=rng.randint(1, 2))
    world = WorldInfo(rank=0, world_size=1, local_rank=0, node_rank=0)
    lr = rng.choice([1e-2, 3e-3])
    run = TinyTrainer(cfg, seed, lr)
    rec = Recovery(cfg, world, "n0")
    rec.setup(1)
    assert rec.resume(run.strategy) is None  # nothing saved yet
    reference = copy.deepcopy(run.model).eval() if kl else None
    every = rng.randint(1, 3)
    last = rng.randint(every, 3 * every + 1)
    saved = {}
    for it in range(1, last + 1):
        run.step(it)
        if it % every == 0 or it == last:
            saved[it] = ({k: v.clone() for k, v in run.strategy.full_model_state_dict().items()}, run.strategy.full_optimizer_state_dict())
            rec.save_checkpoint(run.strategy, it, run.meta(it), reference, {"iteration": it})
    rec.wait_checkpoint()  # the last one is written (in the background) before the crash points go in
    # One more iteration, its save killed at a random point: its checkpoint never counts.
    writer = Writer(rng, monkeypatch)
    run.step(last + 1)
    # Crash points before the rename: the pre-clean rmtree (nothing to delete), model, optimizer,
    # [reference], meta.json, rename.
    writer.kill_at = rng.randint(2, 5 + (1 if kl else 0))
    rec.save_checkpoint(run.strategy, last + 1, run.meta(last + 1), reference, {"iteration": last + 1})
    with pytest.raises(Killed):  # written in the background: its failure comes at the wait
        rec.wait_checkpoint()
    writer.kill_at = 0
    for it in range(last + 2, last + 4):
        run.step(it)
    expected = {k: v.clone() for k, v in run.strategy.full_model_state_dict().items()}

    resumed_run = TinyTrainer(cfg, seed + 999, lr)
    rec2 = Recovery(cfg, world, "n0")
    rec2.setup(2)
    resumed = rec2.resume(resumed_run.strategy)
    assert resumed is not None and resumed.iteration == last, (seed, last, sorted(saved))
    assert_same(resumed.meta["data_position"], run.meta(last)["data_position"], "data_position")
    assert resumed.metrics == {"iteration": last}
    model, optimizer = saved[last]
    assert_same(resumed_run.strategy.full_model_state_dict(), model, "model")
    assert_same(resumed_run.strategy.full_optimizer_state_dict(), optimizer, "optimizer")
    if kl:
        assert_same(resumed.reference, {k: v.detach() for k, v in reference.state_dict().items()}, "reference")
    else:
        assert resumed.reference is None
    for it in range(last + 1, last + 4):  # the same iterations again, the same result
        resumed_run.step(it)
    assert_same(resumed_run.strategy.full_model_state_dict(), expected, "model after the replayed iterations")


# -- 5. bugs this file found (fixed), each reduced to one case ----------------------------------------------------------------

EMPTY_OPT = {"state": {}, "param_groups": []}


def test_a_save_below_the_newest_iteration_keeps_what_it_wrote(tmp_path):
    root = str(tmp_path)
    ckpt.save_checkpoint(root, 20, {"w": torch.zeros(2)}, EMPTY_OPT, {"run": "old"}, keep_last=1)
    path = ckpt.save_checkpoint(root, 10, {"w": torch.ones(2)}, EMPTY_OPT, {"run": "new"}, keep_last=1)
    assert os.path.isdir(path), f"save_checkpoint returned {path}, which its own prune deleted"


def test_an_incomplete_iter_dir_does_not_swallow_the_save_of_its_iteration(tmp_path):
    root = str(tmp_path)
    stale = ckpt.checkpoint_dir(root, 2)
    os.makedirs(stale)
    with open(os.path.join(stale, ckpt.MODEL_FILE), "wb") as f:
        f.write(b"half")  # e.g. a prune killed after deleting meta.json
    path = ckpt.save_checkpoint(root, 2, {"w": torch.ones(2)}, EMPTY_OPT, {}, keep_last=2)
    assert ckpt.latest_iteration(root) == 2, f"returned {path}, but no complete checkpoint 2: {os.listdir(path)}"


def test_two_writers_of_one_iteration_with_the_same_pid_both_succeed(tmp_path, monkeypatch):
    root = str(tmp_path)
    real = ckpt.save_file
    other_writer_ran = []

    def save_file(tensors, path):  # the other node's writer runs while this one is between two files
        real(tensors, path)
        if not other_writer_ran and path.endswith(ckpt.MODEL_FILE):
            other_writer_ran.append("b")
            ckpt.save_checkpoint(root, 5, {"w": torch.ones(2)}, EMPTY_OPT, {"node": "b"}, keep_last=2)

    monkeypatch.setattr(ckpt, "save_file", save_file)
    ckpt.save_checkpoint(root, 5, {"w": torch.ones(2)}, EMPTY_OPT, {"node": "a"}, keep_last=2)


def test_a_truncated_snapshot_shard_falls_back_to_the_checkpoint(tmp_path, gloo_world_of_one):
    from elasticrl.train.dist import WorldInfo
    from elasticrl.train.recovery import Recovery

    cfg = recovery_config(tmp_path, snapshots=True, kl=0.0)
    world = WorldInfo(rank=0, world_size=1, local_rank=0, node_rank=0)
    run = TinyTrainer(cfg, 0, 1e-2)
    rec = Recovery(cfg, world, "n0")
    rec.setup(1)
    try:
        run.step(1)
        rec.save_checkpoint(run.strategy, 1, run.meta(1), None, {"iteration": 1})
        run.step(2)
        rec.snapshot(run.strategy, 2, run.meta(2), None, {"iteration": 2})
        rec.write_pending()
        rec.snapshots.wait()
    finally:
        rec.close()
    (shard,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "snap") for f in fs if f.endswith(".safetensors")]
    data = pathlib.Path(shard).read_bytes()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])  # "a bad file makes every rank fall back to the checkpoint together"
    rec2 = Recovery(cfg, world, "n0")
    rec2.setup(2)
    try:
        resumed = rec2.resume(TinyTrainer(cfg, 1, 1e-2).strategy)
    finally:
        rec2.close()
    assert resumed is not None and resumed.iteration == 1


@pytest.mark.parametrize("name", [ckpt.MODEL_FILE, ckpt.META_FILE])
def test_a_damaged_checkpoint_file_is_refused_naming_it(tmp_path, name):
    path = ckpt.save_checkpoint(str(tmp_path), 3, {"w": torch.ones(4)}, EMPTY_OPT, {}, keep_last=1)
    target = os.path.join(path, name)
    data = pathlib.Path(target).read_bytes()
    with open(target, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(Exception) as info:
        ckpt.load_checkpoint(path)
    assert target in str(info.value) or path in str(info.value), f"{type(info.value).__name__}: {info.value}"


def test_an_empty_chunk_where_another_rank_s_chunk_starts_reads(tmp_path):
    whole = torch.arange(4.0)
    for empty_rank in (0, 1):  # both file orders: the reader keys saved chunks by (name, offset)
        directory = tmp_path / f"empty-is-rank-{empty_rank}"
        directory.mkdir()
        # A rank whose cut holds none of "v" (an empty piece at offset 0), the other rank all of it.
        write_shard({"v": Chunk.flat(whole[0:0], 0, 4)}, str(directory / f"shard-{empty_rank:05d}.safetensors"))
        write_shard({"v": Chunk.flat(whole.clone(), 0, 4)}, str(directory / f"shard-{1 - empty_rank:05d}.safetensors"))
        dest = {"v": Chunk.whole(torch.empty(4))}
        try:
            read_shards(str(directory), dest)
        except BaseException as exc:  # noqa: BLE001 - CheckpointException is no Exception
            pytest.fail(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
        assert torch.equal(dest["v"].tensor, whole)
