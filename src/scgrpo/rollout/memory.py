"""GPU memory that the rollout's workspaces (weight copies, KV caches) are sized by."""

from __future__ import annotations

import torch


def memory_free(device: torch.device) -> int:
    """Bytes that new tensors on the GPU ``device`` can take: the card's free memory plus what PyTorch's caching
    allocator holds reserved but unused (after an update that peaked high, most of what the card lacks). An
    upper bound: a large tensor fits in the cache only where whole cached segments are free (else the allocator
    returns them to the card and allocates anew), and a ``set_per_process_memory_fraction`` cap is not read;
    its callers take a half or a quarter of it."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
