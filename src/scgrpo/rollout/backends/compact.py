"""The compact engine (``generation.engine: loop``, ``decode_forward: auto``): the compact decode forward
(:mod:`scgrpo.rollout.compact`: fused projections, LoRA as low-rank adds, 4-bit bases) driving slots with compaction
and refill (:mod:`scgrpo.rollout.slots`), CUDA graphs on a GPU. A model it does not run (another architecture, a
length past its support) samples through the decode loop over the Hugging Face forward instead (logged once)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import weakref
from typing import Iterator, Optional, Sequence

from torch import Tensor

from scgrpo.rollout.backends.base import Draw, Sampler
from scgrpo.rollout.backends.loop import LoopSampler
from scgrpo.rollout.modes import generation_mode
from scgrpo.rollout.settings import GenerationSettings, budget_bytes

log = logging.getLogger(__name__)


class CompactSampler(Sampler):
    """The compact engine, keeping each model's decoder (weight copies, adapters refreshed at each rollout) and its
    slot samplers (KV caches, CUDA graphs) between rollouts, unless ``generation.keep_workspace`` is off."""

    def __init__(self) -> None:
        self.decoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its entry (see decoder)
        self.fallback = LoopSampler()
        self._checked: Optional[dict] = None  # inside one_model_state: id(model) -> (longest length checked, releases)

    def draw(self, model, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, eos_ids: Sequence[int],
             pad_id: int, temperature: float, greedy: bool, cuda_graphs: bool = True,
             reserve: Optional[tuple[int, int]] = None, states: bool = False) -> Draw:
        max_length = max(prompt_ids.shape[1] + settings.max_new_tokens, reserve[1] if reserve is not None else 0)
        entry = self.decoder(model, settings, max_length)
        if entry is None:
            return self.fallback.draw(model, prompt_ids, prompt_mask, settings, eos_ids, pad_id, temperature, greedy,
                                      cuda_graphs, reserve, states)
        sampler = self._slot_decoder(entry, settings, eos_ids, pad_id, temperature, greedy,
                                     settings.cuda_graphs and cuda_graphs, states)
        with generation_mode(model, "never"):
            ids, logprobs, entropy_sum = sampler(prompt_ids, prompt_mask, reserve)  # [N, C] x 2, [N]
        stats, hidden = dict(sampler.stats), sampler.states
        sampler.states = None
        if not settings.keep_workspace:
            entry["decoder"].release()  # the fused weight copies too
        return Draw(completion_ids=ids, entropy_sum=entropy_sum, logprobs=logprobs, stats=stats, states=hidden)

    def decoder(self, model, settings: GenerationSettings, max_length: int) -> Optional[dict]:
        """The model's :class:`~scgrpo.rollout.compact.CompactDecoder` entry (``{"decoder", "options", "samplers"}``,
        kept between rollouts, adapters refreshed), or None when the settings or the model rule it out (the reason is
        logged once per model)."""
        from scgrpo.rollout.compact import CompactDecoder
        from scgrpo.rollout.model_parts import model_structure, unsupported_reason

        if settings.decode_forward != "auto":
            return None
        entry = self.decoders.get(model)
        # (the check walks every module and parameter: inside one episode batch, whose turns call again, done once up
        # to the longest length asked, a check that passes at a length passing at every shorter one; outside, every
        # call, as the model may have changed in between)
        checked = self._checked if entry is not None and "decoder" in entry else None
        seen = checked.get(id(model)) if checked is not None else None  # (longest length checked, decoder releases)
        # (a decoder released since, keep_workspace off, has no weight copies left: it is refreshed again)
        same = seen is not None and seen[0] >= max_length and seen[1] == entry["decoder"].releases
        reason = None if same else unsupported_reason(model, max_length)
        if reason is not None:
            if entry is None or entry.get("reason") != reason:
                log.info("compact decode forward not used (%s); decoding with the Hugging Face forward", reason)
                self.decoders[model] = {"reason": reason}
            return None
        device = next(model.parameters()).device
        compile_layers = settings.compile == "on" or (
            settings.compile == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None)
        options = (compile_layers, settings.four_bit, settings.memory_budget_gib, settings.keep_workspace)
        # (a decoder holds the modules and parameters it was built on: a model rebuilt around them, an adapter added
        # or unloaded, weights moved or cast, needs a new one)
        structure = entry["structure"] if same else model_structure(model)
        if entry is None or "decoder" not in entry or entry["options"] != options or entry["structure"] != structure:
            if entry is not None:  # the old workspaces and weight copies go before the new decoder takes its own
                _release_entry(entry)
                self.decoders.pop(model, None)
            decoder = CompactDecoder(model, compile_layers=compile_layers, four_bit=settings.four_bit,
                                     memory_budget=budget_bytes(settings.memory_budget_gib),
                                     keep_workspace=settings.keep_workspace)
            entry = self.decoders[model] = {"decoder": decoder, "options": options, "samplers": {},
                                            "structure": structure}
            same = False
        if not same:  # (inside one model state the adapters read at its first call stay)
            entry["decoder"].refresh()
        if self._checked is not None:
            lengths = self._checked
            longest = max(lengths[id(model)][0], max_length) if id(model) in lengths else max_length
            lengths[id(model)] = (longest, entry["decoder"].releases)
        return entry

    @contextlib.contextmanager
    def one_model_state(self) -> Iterator[None]:
        """Inside the block the sampled model does not change (the turns of one episode batch): the compact forward's
        support check and its adapters' refresh run at the first call (and at a call longer than any before, for
        the check), not at every call."""
        outer, self._checked = self._checked, {}
        try:
            yield
        finally:
            self._checked = outer

    def release(self) -> None:
        """Frees every kept workspace (KV caches, CUDA graphs, weight copies) and forgets the decoders."""
        for entry in list(self.decoders.values()):
            _release_entry(entry)
        self.decoders.clear()

    @staticmethod
    def _slot_decoder(entry: dict, settings: GenerationSettings, eos_ids, pad_id: int, temperature: float,
                      greedy: bool, cuda_graphs: bool, states: bool = False):
        from scgrpo.rollout.slots import SlotDecoder

        key = (tuple(eos_ids), pad_id, settings.max_new_tokens, temperature, settings.top_p, settings.top_k, greedy,
               settings.min_new_tokens, cuda_graphs, settings.max_slots, settings.memory_budget_gib)
        samplers = entry["samplers"]
        if states and key in samplers and not samplers[key].keep_states:  # rebuilt once, with a stage (graphs write it)
            samplers.pop(key).release()
        if key not in samplers:
            if len(samplers) >= 2:  # training and evaluation settings; drop the oldest other
                samplers.pop(next(iter(samplers))).release()
            samplers[key] = SlotDecoder(
                entry["decoder"], eos_ids, pad_id, settings.max_new_tokens, temperature, settings.top_p, settings.top_k,
                greedy, settings.min_new_tokens, cuda_graphs=cuda_graphs, max_slots=settings.max_slots,
                memory_budget=budget_bytes(settings.memory_budget_gib), keep_states=states)
        sampler = samplers[key]
        sampler.keep_workspace = settings.keep_workspace
        sampler.want_states = states  # (a sampler with a stage serves calls without states too: evaluation at T)
        return sampler


def _release_entry(entry: dict) -> None:
    """Frees an entry's samplers' workspaces and its decoder's weight copies (whatever still refers to them)."""
    for sampler in entry.get("samplers", {}).values():
        sampler.release()
    if "decoder" in entry:
        entry["decoder"].release()
