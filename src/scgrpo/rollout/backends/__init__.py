"""Rollout backends, one file each, chosen by ``generation.engine``: the compact engine (``compact.py``, "loop" with
``decode_forward: auto``), the decode loop over the Hugging Face forward (``loop.py``, "loop" with
``decode_forward: hf``), Hugging Face ``generate`` (``hf.py``, "hf"), or a :class:`Sampler` class of your own by
import path."""

from __future__ import annotations

from scgrpo.rollout.backends.base import Draw, Sampler
from scgrpo.rollout.backends.compact import CompactSampler
from scgrpo.rollout.backends.hf import HFGenerateSampler
from scgrpo.rollout.backends.loop import LoopSampler
from scgrpo.rollout.settings import GenerationSettings, engine_class

__all__ = ["CompactSampler", "Draw", "HFGenerateSampler", "LoopSampler", "Sampler", "make_sampler", "sampler_class"]


def sampler_class(engine: str, decode_forward: str = "auto") -> type:
    """The backend class ``generation.engine`` (and, for "loop", ``decode_forward``) names."""
    if engine == "loop":
        return CompactSampler if decode_forward == "auto" else LoopSampler
    return HFGenerateSampler if engine == "hf" else engine_class(engine)


def make_sampler(settings: GenerationSettings) -> Sampler:
    """A new backend for ``settings`` (its own caches, empty)."""
    return sampler_class(settings.engine, settings.decode_forward)()
