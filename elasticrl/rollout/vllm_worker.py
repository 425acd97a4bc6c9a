"""Code that runs inside vLLM's GPU worker processes, mixed into the worker class.

``VLLMEngine`` passes ``worker_extension_cls="elasticrl.rollout.vllm_worker.WeightLoaderExtension"``
to ``vllm.LLM``; vLLM adds this class's methods to its worker, and
``LLM.collective_rpc("elasticrl_load_weights", args=(...))`` runs them on every worker (every
tensor-parallel rank). This follows vLLM's own RLHF example
(``examples/offline_inference/rlhf_utils.py``: ``WorkerExtension.update_weight`` ends in
``self.model_runner.model.load_weights(weights=[(name, weight)])``). Calling by method name, not by
pickled function, avoids needing ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in multiprocess mode.

This module must stay importable without elasticrl's heavy dependencies: vLLM imports it by name in
each worker process. It imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch

WORKER_EXTENSION = f"{__name__}.WeightLoaderExtension"


class WeightLoaderExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``model_runner``, ``device``)."""

    model_runner: Any
    device: Any

    def elasticrl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors (full, unsharded, any device) into the running model, in place.

        ``load_weights`` maps HF names onto vLLM's fused parameters (q/k/v -> qkv_proj, gate/up ->
        gate_up_proj) and cuts this rank's tensor-parallel shard, so every rank gets the full
        tensor. One tensor at a time, so an error names the tensor that caused it.
        Returns the number of tensors loaded.
        """
        model = self.model_runner.model
        device = getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device())
        for name, tensor in named_tensors:
            try:
                model.load_weights(weights=[(name, tensor.to(device, non_blocking=True))])
            except Exception as exc:  # re-raised with the name; vLLM says KeyError/ValueError/AssertionError
                raise ValueError(f"{name!r} (shape {tuple(tensor.shape)}, {tensor.dtype}): {type(exc).__name__}: {exc}") from exc
        torch.cuda.synchronize()
        return len(named_tensors)

    def elasticrl_weight_checksum(self) -> float:
        """Sum of every parameter of this rank's shard, as float64 (tests use it to see an update land)."""
        return float(sum(param.detach().double().sum().item() for _, param in self.model_runner.model.named_parameters()))
