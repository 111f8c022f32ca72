"""The side stream CUDA graph recordings warm up on.

A graph's first run happens on a side stream (kernels compile and allocate there, not inside the capture). It
must be one stream per device for the life of the process: cuBLAS keeps a workspace (32 MiB on Hopper) for
every stream it has run on and never frees it, so a new stream per recording costs one more workspace each
time, until PyTorch's pool of 32 streams per priority wraps around (about 1 GiB).
"""

from __future__ import annotations

import functools

import torch


def warmup_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream a CUDA graph's warm-up runs on: one per device (:func:`_stream`)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _stream(device)


@functools.cache
def _stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)
