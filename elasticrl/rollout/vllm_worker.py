"""Code that runs inside vLLM's GPU worker processes, mixed into the worker class.

``VLLMEngine`` passes ``worker_extension_cls="elasticrl.rollout.vllm_worker.WeightLoaderExtension"``
to ``vllm.LLM``; vLLM adds this class's methods to its worker, and
``LLM.collective_rpc("elasticrl_load_weights", args=(...))`` runs them on every worker (every
tensor-parallel rank). This follows vLLM's own RLHF example
(``examples/offline_inference/rlhf_utils.py``: ``WorkerExtension.update_weight`` ends in
``self.model_runner.model.load_weights(weights=[(name, weight)])``). Calling by method name, not by
pickled function, avoids needing ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in multiprocess mode.

Tensors cross as ``(name, dtype, shape, raw bytes)`` records (``to_wire`` / ``from_wire``), never as
``torch.Tensor``: by default ``vllm.LLM`` runs its engine core in another process and sends
``collective_rpc`` arguments through msgpack, whose untyped decoder on the engine-core side
(``vllm/v1/engine/core.py``, ``MsgpackDecoder()``) turns a tensor into a bare ``[dtype, shape,
buffer index]`` list in the vLLM versions we target. Strings, ints, lists and bytes survive intact.

This module must stay importable without elasticrl's heavy dependencies: vLLM imports it by name in
each worker process. It imports torch only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from elasticrl.tensorfile import flat_bytes

WORKER_EXTENSION = f"{__name__}.WeightLoaderExtension"

WireTensor = tuple[str, str, list[int], bytes]
"""(name, dtype name as in ``torch.<dtype>``, shape, the tensor's bytes in C order)."""


def to_wire(name: str, tensor: torch.Tensor) -> WireTensor:
    """A tensor as msgpack-native values (one CPU copy of its bytes)."""
    data = flat_bytes(tensor).cpu().numpy().tobytes()
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data


def from_wire(record: Any) -> tuple[str, torch.Tensor]:
    """The (name, tensor) ``to_wire`` encoded; ``ValueError`` naming the record if it is malformed."""
    try:
        name, dtype_name, shape, data = record
    except (TypeError, ValueError):
        raise ValueError(f"a weight record must be (name, dtype, shape, bytes), got {type(record).__name__}") from None
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r}: unknown dtype {dtype_name!r}")
    shape = [int(d) for d in shape]
    if not data:
        if math.prod(shape):
            raise ValueError(f"{name!r}: no bytes for a {dtype_name} tensor of shape {shape}")
        return name, torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        return name, flat.view(dtype).view(shape)
    except RuntimeError as exc:
        raise ValueError(f"{name!r}: {len(data)} bytes do not make a {dtype_name} tensor of shape {shape}: {exc}") from None


class WeightLoaderExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``model_runner``, ``device``)."""

    model_runner: Any
    device: Any

    def elasticrl_load_weights(self, records: list[WireTensor], update: int) -> int:
        """Load HF-named tensors (``to_wire`` records of full, unsharded tensors) into the running
        model, in place, as part of weight update number ``update`` (the engine counts its calls
        of ``update_weights``; a retried update is a new number).

        ``load_weights`` maps HF names onto vLLM's fused parameters (q/k/v -> qkv_proj, gate/up ->
        gate_up_proj) and cuts this rank's tensor-parallel shard, so every rank gets the full
        tensor. One tensor at a time, so an error names the tensor that caused it. The parameter
        names ``load_weights`` reports are collected per update for ``elasticrl_missing_params``.
        Returns the number of tensors loaded.
        """
        model = self.model_runner.model
        device = getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device())
        if self.__dict__.get("_elasticrl_update") != update:
            self._elasticrl_update = update
            self._elasticrl_loaded: set[str] | None = set()
        for record in records:
            name, tensor = from_wire(record)
            try:
                loaded = model.load_weights(weights=[(name, tensor.to(device, non_blocking=True))])
            except Exception as exc:  # re-raised with the name; vLLM says KeyError/ValueError/AssertionError
                raise ValueError(f"{name!r} (shape {tuple(tensor.shape)}, {tensor.dtype}): {type(exc).__name__}: {exc}") from exc
            if loaded is None:  # a model whose load_weights reports nothing: completeness is unknowable
                self._elasticrl_loaded = None
            elif self._elasticrl_loaded is not None:
                self._elasticrl_loaded |= set(loaded)
        torch.cuda.synchronize()
        return len(records)

    def elasticrl_missing_params(self, update: int) -> list[str] | None:
        """This rank's parameters that no ``elasticrl_load_weights`` of ``update`` has loaded, by
        what ``load_weights`` reports (vLLM's own loader makes the same check after loading a
        checkpoint; a fused parameter such as ``qkv_proj`` counts as loaded once any of its parts
        is); None when the model's ``load_weights`` does not report what it loaded."""
        if self.__dict__.get("_elasticrl_update") != update:
            loaded: set[str] | None = set()
        else:
            loaded = self._elasticrl_loaded
        if loaded is None:
            return None
        return sorted(name for name, _ in self.model_runner.model.named_parameters() if name not in loaded)

    def elasticrl_weight_checksum(self) -> float:
        """Sum of every parameter of this rank's shard, as float64 (tests use it to see an update land)."""
        return float(sum(param.detach().double().sum().item() for _, param in self.model_runner.model.named_parameters()))
