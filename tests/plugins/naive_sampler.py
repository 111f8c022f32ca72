"""A rollout backend in one file of its own: no KV cache, every token from a full forward over the sequence so far
(slow and simple: what a backend must hand back, and nothing else). A vLLM or server backend plugs in the same way."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from scgrpo.rollout.backends import Draw, Sampler
from scgrpo.rollout.modes import generation_mode
from scgrpo.rollout.settings import GenerationSettings

DRAWS: list[int] = []  # rows of each draw (the test reads it)


class NaiveSampler(Sampler):
    """Samples at the temperature from the full softmax (top-p/top-k not applied), or greedily."""

    def draw(self, model, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, eos_ids: Sequence[int],
             pad_id: int, temperature: float, greedy: bool, cuda_graphs: bool = True,
             reserve: Optional[tuple[int, int]] = None, states: bool = False) -> Draw:
        DRAWS.append(prompt_ids.shape[0])
        ids, mask = prompt_ids, prompt_mask
        tokens, logprobs, entropy = [], [], torch.zeros(ids.shape[0])
        done = torch.zeros(ids.shape[0], dtype=torch.bool)
        with generation_mode(model, settings.merge_lora):
            for _ in range(settings.max_new_tokens):
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
                logp = torch.log_softmax(logits / temperature, -1)
                token = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1).squeeze(1)
                token = torch.where(done, torch.full_like(token, pad_id), token)
                tokens.append(token)
                logprobs.append(torch.where(done, 0.0, logp.gather(1, token[:, None]).squeeze(1)))
                entropy += torch.where(done, 0.0, -(logp.exp() * logp).sum(-1))
                done |= torch.isin(token, torch.tensor(list(eos_ids)))
                ids, mask = torch.cat([ids, token[:, None]], 1), torch.cat([mask, (~done | torch.isin(
                    token, torch.tensor(list(eos_ids))))[:, None].to(mask.dtype)], 1)
                if bool(done.all()):
                    break
        return Draw(completion_ids=torch.stack(tokens, 1), entropy_sum=entropy, logprobs=torch.stack(logprobs, 1))
