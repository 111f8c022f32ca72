"""The decode loop over the Hugging Face forward (``generation.decode_forward: hf``, and every model the compact
forward does not run): a static KV cache, LoRA folded into fp32 weights, the decode step replayed from a CUDA graph
on a GPU."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

from scgrpo.rollout.backends.base import Draw, Sampler
from scgrpo.rollout.graphs import warmup_stream
from scgrpo.rollout.modes import generation_mode
from scgrpo.rollout.sampling import sample_tokens
from scgrpo.rollout.settings import GenerationSettings

log = logging.getLogger(__name__)


class LoopSampler(Sampler):
    """:func:`decode_loop` on the model's own forward."""

    def draw(self, model, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, eos_ids: Sequence[int],
             pad_id: int, temperature: float, greedy: bool, cuda_graphs: bool = True,
             reserve: Optional[tuple[int, int]] = None, states: bool = False) -> Draw:
        with generation_mode(model, settings.merge_lora):
            ids, entropy_sum, logprobs = decode_loop(
                model, prompt_ids, prompt_mask, settings.max_new_tokens, eos_ids, pad_id, temperature, settings.top_p,
                settings.top_k, greedy, settings.min_new_tokens, cuda_graphs=settings.cuda_graphs and cuda_graphs)
        return Draw(completion_ids=ids, entropy_sum=entropy_sum, logprobs=logprobs)


def _cache_counters(cache) -> list[Tensor]:
    """Integer tensors a static cache keeps to know where the next token goes (``cumulative_length`` in recent
    transformers, which ignores ``cache_position``)."""
    counters = []
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, Tensor) and not value.is_floating_point() and value.numel() <= 16:
                counters.append(value)
    return counters


def _cache_kwarg(causal_lm) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(causal_lm.forward).parameters else "past_key_values"


class _GraphedStep:
    """The decode step (one new token for every row) recorded as a CUDA graph over fixed input buffers."""

    def __init__(self, step, ids: Tensor, positions: Tensor, cache_position: Tensor, counters: list[Tensor]) -> None:
        self.ids, self.positions, self.cache_position = ids.clone(), positions.clone(), cache_position.clone()
        saved = [c.clone() for c in counters]
        stream = warmup_stream(ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (it writes the same cache slot again later)
            for _ in range(2):
                step(self.ids, self.positions, self.cache_position)
        torch.cuda.current_stream().wait_stream(stream)
        for counter, value in zip(counters, saved):  # the cache's own write positions, as before the warm-up
            counter.copy_(value)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.ids, self.positions, self.cache_position)

    def __call__(self, ids: Tensor, positions: Tensor, cache_position: Tensor) -> Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.cache_position.copy_(cache_position)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def decode_loop(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    min_new_tokens: int = 0,
    cuda_graphs: bool = False,
) -> tuple[Tensor, Tensor]:
    """Autoregressive sampling with a preallocated (static) KV cache; stops when every row has ended.

    ``prompt_ids`` ``[N, Tp]`` are left-padded; positions count real tokens only, as ``generate`` does.
    Returns ``[N, C]`` new tokens, ``C <= max_new_tokens``, pad after a row's end-of-sequence token, ``[N]``
    the entropy of the sampling distribution (at ``temperature``) summed over each row's tokens and ``[N, C]``
    each sampled token's log-probability under that distribution. With
    ``cuda_graphs`` on a GPU the per-token step (after the prompt's forward) is replayed from a CUDA graph.
    """
    from transformers import StaticCache

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone, lm_head = getattr(causal_lm, causal_lm.base_model_prefix), causal_lm.get_output_embeddings()
    n, tp = prompt_ids.shape
    device = prompt_ids.device
    cache = StaticCache(config=causal_lm.config, max_cache_len=tp + max_new_tokens)
    cache_arg = _cache_kwarg(backbone)
    attention = torch.cat([prompt_mask, prompt_mask.new_zeros(n, max_new_tokens)], dim=1).bool()  # [N, Tp + max_new]
    # With SDPA the decode steps get the mask ready-made ([N, 1, 1, L] view, True = attend): no mask building
    # per token, nothing that reads GPU values on the host (a CUDA graph can record the step)
    ready_mask = getattr(causal_lm.config, "_attn_implementation", None) == "sdpa"
    attention_4d = attention.view(n, 1, 1, -1) if ready_mask else attention
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [N, Tp]

    def step(input_ids: Tensor, position_ids: Tensor, cache_position: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_4d if mask is None else mask,
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=True,
            **{cache_arg: cache},
        ).last_hidden_state[:, -1].contiguous()  # [N, H]
        return lm_head(hidden).float()  # [N, V]

    logits = step(prompt_ids, positions, torch.arange(tp, device=device), attention.long())
    next_position = positions[:, -1:] + 1  # [N, 1]
    eos = torch.tensor(list(eos_ids), device=device, dtype=torch.long)
    tokens = torch.full((n, max_new_tokens), pad_id, device=device, dtype=torch.long)  # [N, max_new]
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    entropy_sum = torch.zeros(n, dtype=torch.float32, device=device)  # [N]
    ended_at = torch.full((n,), max_new_tokens - 1, dtype=torch.long, device=device)  # last step each row needs
    cache_positions = torch.arange(tp, tp + max_new_tokens, device=device)
    decode = step
    if cuda_graphs and ready_mask and device.type == "cuda" and max_new_tokens > 1:
        try:
            attention[:, tp] = True
            decode = _GraphedStep(step, tokens[:, :1], next_position, cache_positions[:1], _cache_counters(cache))
        except Exception as err:  # noqa: BLE001 - any failure to record: plain launches still work
            log.warning("CUDA graph recording of the decode step failed (%s); decoding without graphs", err)
            decode = step
        attention[:, tp] = False
    # on a GPU, asking "has every row ended?" waits for the GPU: ask every few steps, trim afterwards
    check_every = 8 if device.type == "cuda" else 1
    steps = 0
    logprobs = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)  # [N, max_new]
    for t in range(max_new_tokens):
        if t < min_new_tokens and eos.numel():
            logits[:, eos] = float("-inf")
        uniform = None if greedy else torch.rand(n, 1, device=device)
        token, logprob, entropy = sample_tokens(logits, uniform, temperature, top_p, top_k)  # [N] x 3
        entropy_sum += torch.where(finished, torch.zeros_like(entropy), entropy)  # where it sampled (rows going)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens[:, t] = token
        logprobs[:, t] = torch.where(finished, torch.zeros_like(logprob), logprob)
        steps = t + 1
        if eos.numel():
            newly = torch.isin(token, eos) & ~finished
            ended_at = torch.where(newly, torch.full_like(ended_at, t), ended_at)
            finished |= newly
        if t == max_new_tokens - 1 or (steps % check_every == 0 and bool(finished.all())):
            break
        attention[:, tp + t] = True
        logits = decode(token.unsqueeze(1), next_position, cache_positions[t : t + 1])
        next_position = next_position + 1
    if eos.numel() and bool(finished.all()):
        steps = min(steps, int(ended_at.max()) + 1)
    return tokens[:, :steps], entropy_sum, logprobs[:, :steps]
