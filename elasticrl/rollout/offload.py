"""An engine's weights parked in pinned host memory while the trainer has the GPU (``sleep``), and
brought back (``wake``) or replaced by new ones without being brought back (``update_weights``).

``module.to("cpu")`` and back allocates pageable host memory at every sleep and copies through
it both ways (~0.9 s per GB of fp32 weights on an H200 host). Here the host buffers are allocated
once, at the first sleep, and pinned, so both copies run at the link's speed; and a wake that an
update follows allocates the device memory without filling it: the update writes each tensor, and
only what it did not write (a partial update, a non-persistent buffer, an update that failed
halfway) is restored from the host copy. The pinned copy (the model's bytes) is kept while the
engine is awake too, until it closes.
"""

from __future__ import annotations

import torch
from torch import nn


class HostOffload:
    """Moves every parameter and buffer of ``module`` between ``device`` and host buffers (pinned
    when ``device`` is CUDA) by swapping each tensor's ``.data``: the ``Parameter`` objects, and so
    every alias a tied weight has, stay the module's own."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.module = module
        self.tensors: list[torch.Tensor] = []
        self.device = device
        self.host: list[torch.Tensor] | None = None
        self.unfilled: set[int] = set()
        """ids of the tensors ``allocate`` gave device memory whose contents are not written yet."""

    def offload(self) -> None:
        """Device -> host, then free the device memory."""
        tensors = [*self.module.parameters(), *self.module.buffers()]  # each once
        if self.host is None or len(tensors) != len(self.tensors) or any(a is not b for a, b in zip(tensors, self.tensors)):
            # First sleep, or a tensor was replaced since (a buffer registered again, a resize):
            # a host buffer per tensor, the old one where the same tensor still fits it.
            kept = {id(t): h for t, h in zip(self.tensors, self.host or ())}
            pin = self.device.type == "cuda"
            self.host = [h if (h := kept.get(id(t))) is not None and h.shape == t.shape and h.dtype == t.dtype
                         else torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
            self.tensors = tensors
        for host, t in zip(self.host, self.tensors):
            host.copy_(t.data, non_blocking=True)
        self._synchronize()
        for host, t in zip(self.host, self.tensors):
            t.data = host
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def allocate(self) -> None:
        """Device memory for every tensor, not filled: ``filled`` marks each one written, and
        ``restore`` copies the host copy into the rest."""
        assert self.host is not None, "allocate before any offload"
        try:
            for host, t in zip(self.host, self.tensors):
                t.data = torch.empty_like(host, device=self.device)
        except BaseException:  # out of memory, say: back to the host copies, still asleep
            for host, t in zip(self.host, self.tensors):
                t.data = host
            raise
        self.unfilled = {id(t) for t in self.tensors}

    def filled(self, tensor: torch.Tensor) -> None:
        self.unfilled.discard(id(tensor))

    def restore(self) -> int:
        """Host -> device for what was not written since ``allocate``; returns how many tensors."""
        assert self.host is not None
        count = 0
        for host, t in zip(self.host, self.tensors):
            if id(t) in self.unfilled:
                t.data.copy_(host, non_blocking=True)
                count += 1
        self._synchronize()
        self.unfilled = set()
        return count

    def wake(self) -> None:
        self.allocate()
        self.restore()

    def close(self) -> None:
        """Drop the host copy and give its pinned pages back (torch's host allocator keeps freed
        pinned blocks for reuse otherwise)."""
        self.host, self.tensors, self.module = None, [], None
        if self.device.type == "cuda" and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
