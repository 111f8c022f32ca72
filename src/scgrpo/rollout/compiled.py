"""``torch.compile`` with the eager function as its fallback."""

from __future__ import annotations

import logging

import torch

from scgrpo.errors import one_line

log = logging.getLogger(__name__)


class Compiled:
    """``torch.compile(fn)`` that falls back to ``fallback`` (default ``fn`` itself: the same computation, written
    for eager execution where that differs), for good and with one warning, when compilation fails (an
    unsupported pattern in this torch/Triton version): slower, never wrong. Shapes start static and only the
    dimensions seen to change (the slot count) become dynamic, so reductions over the hidden size compile to
    single kernels."""

    def __init__(self, fn, name: str, fallback=None) -> None:
        self.fn, self.name = fallback or fn, name
        self.compiled = torch.compile(fn, dynamic=None)
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact
                self.failed = True
                log.warning("torch.compile of the %s failed (%s: %s); running it uncompiled",
                            self.name, type(err).__name__, one_line(err))
        return self.fn(*args, **kwargs)
