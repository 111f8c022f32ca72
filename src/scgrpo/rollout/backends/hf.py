"""The Hugging Face ``generate`` backend (``generation.engine: hf``): any model ``generate`` samples, its options
passed through ``generation.extra``; no sampler log-probabilities or entropies."""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from scgrpo.rollout.backends.base import Draw, Sampler
from scgrpo.rollout.modes import generation_mode
from scgrpo.rollout.settings import GenerationSettings


class HFGenerateSampler(Sampler):
    """Samples with ``model.generate`` (KV cache on, LoRA merged as ``generation.merge_lora`` says)."""

    def draw(self, model, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, eos_ids: Sequence[int],
             pad_id: int, temperature: float, greedy: bool, cuda_graphs: bool = True,
             reserve: Optional[tuple[int, int]] = None, states: bool = False) -> Draw:
        kwargs = dict(max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens or None,
                      pad_token_id=pad_id, eos_token_id=list(eos_ids) or None, use_cache=True)
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_p=settings.top_p, top_k=settings.top_k or None)
        kwargs.update(settings.extra)
        with generation_mode(model, settings.merge_lora):
            output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)  # [N, Tp + C]
        return Draw(completion_ids=output[:, prompt_ids.shape[1] :])
