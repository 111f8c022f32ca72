"""Rollout backends, one file each, chosen by ``generation.engine``: the compact engine (``compact.py``, "loop" with
``decode_forward: auto``), the decode loop over the Hugging Face forward (``loop.py``, "loop" with
``decode_forward: hf``), Hugging Face ``generate`` (``hf.py``, "hf"), or a :class:`Sampler` class of your own by
import path."""

from __future__ import annotations

import weakref

from scgrpo.rollout.backends.base import Draw, Sampler
from scgrpo.rollout.backends.compact import CompactSampler
from scgrpo.rollout.backends.hf import HFGenerateSampler
from scgrpo.rollout.backends.loop import LoopSampler
from scgrpo.rollout.settings import GenerationSettings, engine_class

__all__ = ["CompactSampler", "Draw", "HFGenerateSampler", "LoopSampler", "Sampler", "kept_sampler", "make_sampler",
           "release_kept", "sampler_class"]

KEPT = "_scgrpo_samplers"
"""The attribute of a model that holds the samplers :func:`kept_sampler` keeps on it"""


def sampler_class(engine: str, decode_forward: str = "auto") -> type:
    """The backend class ``generation.engine`` (and, for "loop", ``decode_forward``) names."""
    if engine == "loop":
        return CompactSampler if decode_forward == "auto" else LoopSampler
    return HFGenerateSampler if engine == "hf" else engine_class(engine)


def make_sampler(settings: GenerationSettings) -> Sampler:
    """A new backend for ``settings`` (its own caches, empty)."""
    return sampler_class(settings.engine, settings.decode_forward)()


class KeptSamplers(dict):
    """A model's kept samplers, by engine. A copy or a pickle of the model starts without them: their caches hold
    the weights of the model they were made for."""

    def __deepcopy__(self, memo) -> "KeptSamplers":
        return KeptSamplers()

    def __reduce__(self):
        return KeptSamplers, ()


def kept_sampler(model, settings: GenerationSettings) -> Sampler:
    """The sampler of ``model`` for ``settings``' engine that ``generate`` draws with when it is given none: made at
    the first call and kept on the model, so that the next call reuses its workspace (the compact engine's weight
    copies, KV cache and CUDA graphs, with the adapters refreshed; a new one where the model was rebuilt, moved or
    cast since) instead of building it again. That GPU memory stays allocated after the call, until the model goes,
    :func:`release_kept`, or with ``generation.keep_workspace: false``, after each call. One model's calls share it:
    call from one thread at a time."""
    kept = vars(model).get(KEPT)
    if kept is None:
        kept = KeptSamplers()
        object.__setattr__(model, KEPT, kept)  # (a plain attribute: not a module, parameter or buffer)
        weakref.finalize(model, _release, kept)  # (freed with the model, not at the next garbage collection)
    key = (settings.engine, settings.decode_forward)
    if key not in kept:
        kept[key] = make_sampler(settings)
    return kept[key]


def release_kept(model) -> None:
    """Frees the workspaces of the samplers :func:`kept_sampler` keeps on ``model`` and forgets them."""
    _release(vars(model).pop(KEPT, {}))


def _release(kept: dict) -> None:
    for sampler in kept.values():
        sampler.release()
    kept.clear()
