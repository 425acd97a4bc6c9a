"""Checkpoints without pickle: safetensors for every tensor, JSON for everything else.

Layout of one checkpoint (``<dir>/iter-000010/``)::

    model.safetensors       policy weights (state_dict names)
    optimizer.safetensors   optimizer tensors, keyed "state.<param index>.<name>"
    meta.json               iteration, world size, config, optimizer param_groups and scalar state
    reference.safetensors   the frozen KL reference policy (only when algorithm.kl_coef > 0)

A checkpoint is written into a temporary sibling directory and renamed into place, so a directory
named ``iter-*`` is always complete: a crash mid-save leaves only a ``.tmp-*`` directory that a
later save removes. When several writers save the same iteration (``checkpoint.every_node`` on a
shared filesystem) the first rename wins and the others discard their copy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save_file as st_save_file

from elasticrl.config import CHECKPOINT_HOLD_ENV

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
REFERENCE_FILE = "reference.safetensors"
_DIR_RE = re.compile(r"iter-(\d+)")


@dataclasses.dataclass
class Checkpoint:
    iteration: int
    model: dict[str, torch.Tensor]
    optimizer_tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    """meta.json as written; ``meta["optimizer"]`` holds the optimizer's non-tensor state."""
    reference: dict[str, torch.Tensor] | None = None
    """The KL reference policy's weights, when the run keeps one."""

    @property
    def optimizer(self) -> dict[str, Any]:
        """The optimizer ``state_dict()``, ready for ``load_state_dict``."""
        return unflatten_optimizer(self.optimizer_tensors, self.meta["optimizer"])


def save_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    """``safetensors.torch.save_file``, then fsync: a checkpoint renamed into place is on disk."""
    st_save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter-{iteration:06d}")


def flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state_dict into safetensors-ready tensors and JSON-ready rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, slots in state_dict["state"].items():
        for name, value in slots.items():
            key = f"state.{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *rest["scalars"].items()]:
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    # JSON turned tuple hyper-parameters (AdamW's betas) into lists; torch's own are tuples.
    groups = [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in rest["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    root: str,
    iteration: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep_last: int,
    reference: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write checkpoint ``iteration`` under ``root`` and prune to the newest ``keep_last``; returns its path."""
    os.makedirs(root, exist_ok=True)
    final = checkpoint_dir(root, iteration)
    # Unique to this writer: every_node writers on one shared filesystem can have the same pid.
    tmp = os.path.join(root, f".tmp-iter-{iteration:06d}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        opt_tensors, opt_rest = flatten_optimizer(optimizer_state)
        save_file(model_state, os.path.join(tmp, MODEL_FILE))
        save_file(opt_tensors, os.path.join(tmp, OPTIMIZER_FILE))
        if reference is not None:
            save_file(reference, os.path.join(tmp, REFERENCE_FILE))
        full_meta = {"format_version": FORMAT_VERSION, "iteration": iteration, **meta, "optimizer": opt_rest}
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(full_meta, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
    except Exception:  # a full disk, say: this process's temp directory is not left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    hold_s = float(os.environ.get(CHECKPOINT_HOLD_ENV) or 0)
    if hold_s > 0:  # fault injection only (see CHECKPOINT_HOLD_ENV)
        time.sleep(hold_s)
    if os.path.isdir(final) and not os.path.isfile(os.path.join(final, META_FILE)):
        shutil.rmtree(final, ignore_errors=True)  # a crashed save's or prune's remains, not a checkpoint
    try:
        os.rename(tmp, final)
    except OSError:
        if not os.path.isfile(os.path.join(final, META_FILE)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another writer saved this iteration first
        log.debug("checkpoint %s already written by another rank", final)
    _prune(root, keep_last, keep=final)
    return final


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as (iteration, path), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _DIR_RE.fullmatch(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, META_FILE)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_iteration(root: str) -> int:
    """Iteration of the newest complete checkpoint under ``root``; 0 when there is none."""
    found = list_checkpoints(root)
    return found[-1][0] if found else 0


def load_checkpoint(path: str, *, read_now: bool = False) -> Checkpoint:
    """The checkpoint in ``path``. Raises ValueError naming the file that cannot be read.

    Its tensors map the files (safetensors' default): the disk is read as they are first used.
    ``read_now`` reads every byte here instead, into memory of their own (the resume's reader
    thread: the ranks' broadcast then waits for no disk)."""
    load = (lambda file: {k: v.clone() for k, v in load_file(file).items()}) if read_now else load_file
    name = os.path.join(path, META_FILE)
    try:
        with open(name) as f:
            meta = json.load(f)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"checkpoint format {meta.get('format_version')!r}, this build reads {FORMAT_VERSION}")
        iteration = int(meta["iteration"])
        name = os.path.join(path, MODEL_FILE)
        model = load(name)
        name = os.path.join(path, OPTIMIZER_FILE)
        optimizer = load(name)
        name = os.path.join(path, REFERENCE_FILE)
        reference = load(name) if os.path.exists(name) else None
    except Exception as exc:  # noqa: BLE001 - json's, safetensors' and OSError's messages name no file
        raise ValueError(f"checkpoint {path}: {os.path.basename(name)} cannot be read: {type(exc).__name__}: {exc}") from exc
    return Checkpoint(iteration=iteration, model=model, optimizer_tensors=optimizer, meta=meta, reference=reference)


def _prune(root: str, keep_last: int, keep: str = "") -> None:
    """The newest ``keep_last`` complete checkpoints stay, and ``keep`` (the one just written, even
    below an earlier run's newer ones: it is this run's)."""
    for _, path in list_checkpoints(root)[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    # Leftovers of crashed saves: a temporary directory of an iteration older than the newest
    # complete one whose writer is gone. Writers save in the background (every node's, with
    # every_node on a shared filesystem), so another one may still be writing an older iteration.
    # This process writes one at a time (this one is renamed already), another process of this
    # host is gone when its pid is, another host's once untouched for an hour.
    newest, host = latest_iteration(root), socket.gethostname()
    for name in os.listdir(root):
        m = re.fullmatch(r"\.tmp-iter-(\d+)-.+", name)
        if not m or int(m.group(1)) >= newest:
            continue
        path, writer = os.path.join(root, name), re.fullmatch(r"\.tmp-iter-\d+-(.+)-(\d+)-[0-9a-f]+", name)
        pid = int(writer.group(2)) if writer is not None and writer.group(1) == host else None
        gone = pid is not None and (pid == os.getpid() or not _alive(pid))
        if gone or _untouched_for(path, STALE_TEMP_S):
            shutil.rmtree(path, ignore_errors=True)


STALE_TEMP_S = 3600.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _untouched_for(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime > seconds
    except OSError:
        return False
