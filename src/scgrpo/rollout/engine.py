"""Sampling completions: prompts in, padded and masked completions out (:func:`generate`, :func:`generate_ids`), drawn
by a rollout backend (:mod:`scgrpo.rollout.backends`, one file each). The settings, the masks and the sampling mode
live in :mod:`scgrpo.rollout.settings` and :mod:`scgrpo.rollout.modes`; their names are re-exported here."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from scgrpo.rollout.backends import Sampler, kept_sampler
from scgrpo.rollout.backends.loop import decode_loop
from scgrpo.rollout.modes import completion_mask_from_eos, eos_token_ids, generation_mode, merged_adapters
from scgrpo.rollout.sampling import sample_from_logits, sample_tokens
from scgrpo.rollout.settings import Generated, GenerationSettings, budget_bytes

__all__ = ["Generated", "GenerationSettings", "budget_bytes", "completion_mask_from_eos", "decode_loop",
           "eos_token_ids", "generate", "generate_ids", "generation_mode", "merged_adapters", "sample_from_logits",
           "sample_tokens"]


def generate(
    model,
    tokenizer,
    prompts: list[str],
    num_samples: int,
    settings: GenerationSettings,
    device: torch.device,
    greedy: bool = False,
    temperature: Optional[float] = None,
    cuda_graphs: bool = True,
    states: bool = False,
    sampler: Optional[Sampler] = None,
) -> Generated:
    """Sample ``num_samples`` completions of each prompt (rows ``[p0 x num_samples, p1 x num_samples, ...]``) with
    ``sampler`` (None: the one kept on ``model`` for ``settings.engine``, :func:`~scgrpo.rollout.backends.kept_sampler`:
    its workspace, the engine's weight copies, KV cache and CUDA graphs, stays allocated between calls until
    ``release_kept(model)``, or ``settings.keep_workspace`` is off)."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = encoded["input_ids"].repeat_interleave(num_samples, dim=0)  # [N, Tp]
    prompt_mask = encoded["attention_mask"].repeat_interleave(num_samples, dim=0)  # [N, Tp]
    return generate_ids(model, tokenizer, prompt_ids, prompt_mask, settings, greedy, temperature, cuda_graphs,
                        states=states, sampler=sampler)


def generate_ids(
    model,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: GenerationSettings,
    greedy: bool = False,
    temperature: Optional[float] = None,
    cuda_graphs: bool = True,
    reserve: Optional[tuple[int, int]] = None,
    texts: bool = True,
    states: bool = False,
    sampler: Optional[Sampler] = None,
) -> Generated:
    """One completion of each left-padded prompt ``[N, Tp]`` (token ids, as they are: nothing is re-tokenized).
    ``reserve`` ``(rows, length)``: size the compact engine's workspace for up to that many rows of that many
    positions, so that calls that grow (the turns of episodes) reuse one KV cache and its CUDA graphs (and the
    compact forward's support is checked for that length). ``texts``: decode the completions to text (False:
    ``completions`` is empty, for callers that read the ids only). ``states``: also keep the final hidden state
    before each sampled token (:attr:`Generated.states`), where the compact forward samples. ``sampler``: the rollout
    backend that draws them (:mod:`scgrpo.rollout.backends`; None: the one of ``settings.engine`` kept on the model
    between calls, :func:`~scgrpo.rollout.backends.kept_sampler`); this function masks and pads after each row's end
    and decodes the text."""
    eos_ids = eos_token_ids(model, tokenizer)
    temperature = temperature if temperature is not None else settings.temperature
    if settings.memory_budget_gib is not None and not settings.keep_workspace and prompt_ids.is_cuda:
        # a budget sizes the rollout's copies and KV cache by what is allocated; the blocks the allocator keeps
        # cached from the last update would count on top of it against a per-process cap (a 20 GiB card's second
        # 8B step ran out of memory in its rollout with 7.1 GiB allocated and 16.6 GiB reserved)
        torch.cuda.empty_cache()
    sampler = sampler if sampler is not None else kept_sampler(model, settings)
    drawn = sampler.draw(model, prompt_ids, prompt_mask, settings, eos_ids, tokenizer.pad_token_id, temperature, greedy,
                         cuda_graphs, reserve, states)
    completion_ids, entropy_sum, sampler_logprobs = drawn.completion_ids, drawn.entropy_sum, drawn.logprobs
    completion_mask, truncated = completion_mask_from_eos(completion_ids, eos_ids)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, tokenizer.pad_token_id))
    if sampler_logprobs is not None:
        sampler_logprobs = sampler_logprobs * completion_mask
    decoded = tokenizer.batch_decode(completion_ids, skip_special_tokens=True) if texts else []
    return Generated(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, decoded,
                     None if greedy else entropy_sum, None if greedy else sampler_logprobs, drawn.stats, drawn.states)
