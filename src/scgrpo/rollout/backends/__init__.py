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
    copies, KV cache and CUDA graphs, with the adapters refreshed) instead of building it again. ``generation.
    keep_workspace: false`` frees the workspace after each call; :func:`release_kept` frees it at once."""
    kept = vars(model).get(KEPT)
    if kept is None:
        kept = KeptSamplers()
        object.__setattr__(model, KEPT, kept)  # (a plain attribute: not a module, parameter or buffer)
    key = (settings.engine, settings.decode_forward)
    if key not in kept:
        kept[key] = make_sampler(settings)
    return kept[key]


def release_kept(model) -> None:
    """Frees the workspaces of the samplers :func:`kept_sampler` keeps on ``model`` and forgets them."""
    for sampler in vars(model).pop(KEPT, {}).values():
        sampler.release()
