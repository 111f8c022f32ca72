"""GPU memory that the rollout's workspaces (weight copies, KV caches) are sized by."""

from __future__ import annotations

import torch


def memory_free(device: torch.device) -> int:
    """Bytes that new tensors on the GPU ``device`` can take: the card's free memory plus what PyTorch's caching
    allocator holds reserved but unused (after an update that peaked high, most of what the card lacks). An
    upper bound: a large tensor fits in the cache only where whole cached segments are free (else the allocator
    returns them to the card and allocates anew); its callers take a half or a quarter of it. Under a
    ``set_per_process_memory_fraction`` cap, at most what the cap leaves."""
    free, total = torch.cuda.mem_get_info(device)
    reachable = min(free + torch.cuda.memory_reserved(device), int(per_process_fraction(device) * total))
    return int(reachable - torch.cuda.memory_allocated(device))


def per_process_fraction(device: torch.device) -> float:
    """The ``set_per_process_memory_fraction`` cap of ``device`` (1.0 where PyTorch cannot say)."""
    read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    try:
        return float(read(device)) if read is not None else 1.0
    except (RuntimeError, AssertionError, TypeError, ValueError):
        return 1.0
