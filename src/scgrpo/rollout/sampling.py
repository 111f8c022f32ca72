"""Drawing tokens from logits: temperature, top-k / top-p, the sampled token's log-probability and the
distribution's entropy. Shared by both decode loops; nothing here reads GPU values on the host, so a CUDA
graph can record it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def sampling_distribution(logits: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """softmax(logits / temperature) ``[N, V]`` fp32, its log-normaliser ``[N]`` and its entropy ``[N]``."""
    logits = logits.float() / temperature  # [N, V]
    lse = torch.logsumexp(logits, dim=-1)  # [N]
    logp = logits - lse.unsqueeze(1)
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1)  # 0 log 0 = 0 at banned tokens
    return probs, lse, entropy


def draw(logits: Tensor, probs: Tensor, lse: Tensor, uniform: Tensor, temperature: float = 1.0, top_p: float = 1.0,
         top_k: int = 0) -> tuple[Tensor, Tensor]:
    """A token per row from ``probs`` after top-k / top-p filtering, by inverting the CDF at ``uniform`` ``[N, 1]``
    (exact; one number per row), and its log-probability under the distribution it was drawn from (the
    filtered one, renormalised; ``logits`` and ``lse`` give it exactly when nothing is filtered)."""
    filtered = bool(top_k and top_k < probs.shape[-1]) or top_p < 1.0
    if top_k and top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        total = probs.sum(-1, keepdim=True)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p * total  # mass before this token exceeds top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    token, total = invert_cdf(probs, uniform)
    if filtered:  # renormalised over the tokens kept
        logprob = probs.gather(1, token.unsqueeze(1)).squeeze(1).log() - total.log()
    else:
        logprob = logits.gather(1, token.unsqueeze(1)).squeeze(1).float() / temperature - lse
    return token, logprob


def invert_cdf(probs: Tensor, uniform: Tensor, block: int = 1024) -> tuple[Tensor, Tensor]:
    """The first index per row of ``probs`` ``[N, V]`` (unnormalised, >= 0) whose cumulative mass reaches
    ``uniform * total``, and the total ``[N]``: the inverse-CDF draw, in two levels (block sums, then one block's
    cumulative sum) instead of a scan over the whole vocabulary. The token drawn always has mass > 0: a draw
    of exactly 0 aims at the smallest mass, one past a block's rounded sum at the block's last token with mass."""
    n, vocab = probs.shape
    pad = (-vocab) % block
    blocks = F.pad(probs, (0, pad)).view(n, -1, block) if pad else probs.view(n, -1, block)  # [N, B, block]
    sums = blocks.sum(-1)  # [N, B]
    ends = sums.cumsum(-1)  # [N, B]
    total = ends[:, -1]
    target = (uniform.to(probs.dtype).view(n, 1) * total.unsqueeze(1)).clamp(min=torch.finfo(probs.dtype).tiny)
    which = torch.searchsorted(ends, target).clamp(max=ends.shape[1] - 1)  # [N, 1]: first block reaching it
    before = torch.where(which > 0, ends.gather(1, (which - 1).clamp(min=0)), torch.zeros_like(target))
    inside = blocks.gather(1, which.unsqueeze(2).expand(n, 1, block)).squeeze(1).cumsum(-1)  # [N, block]
    rest = torch.minimum((target - before).clamp(min=torch.finfo(probs.dtype).tiny), inside[:, -1:])
    token = which.squeeze(1) * block + torch.searchsorted(inside, rest).squeeze(1).clamp(max=block - 1)
    return token.clamp(max=vocab - 1), total


def sample_tokens(
    logits: Tensor, uniform: Optional[Tensor], temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row of ``[N, V]`` logits, with its log-probability and the distribution's entropy.

    ``uniform`` ``[N, 1]`` in [0, 1) draws from softmax(logits / temperature) after top-k / top-p filtering by
    inverting the CDF (exact, one number per row, cheap; no host sync, so a CUDA graph can record it); None
    takes the argmax. The log-probability is the token's under the distribution it was drawn from (after
    filtering; without filtering the trainer computes the same number); the entropy is the unfiltered
    softmax's at ``temperature`` (0 when greedy)."""
    if uniform is None:
        token = logits.argmax(dim=-1)
        zero = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        return token, zero, zero
    probs, lse, entropy = sampling_distribution(logits, temperature)
    token, logprob = draw(logits, probs, lse, uniform, temperature, top_p, top_k)
    return token, logprob, entropy


def sample_from_logits(
    logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, greedy: bool = False,
    entropy: Optional[Tensor] = None,
) -> Tensor:
    """One token per row of ``[N, V]`` logits (:func:`sample_tokens` with a fresh uniform draw per row); when
    ``entropy`` (``[N]``) is given, the sampling distribution's entropy is written into it."""
    uniform = None if greedy else torch.rand(logits.shape[0], 1, device=logits.device)
    token, _, ent = sample_tokens(logits, uniform, temperature, top_p, top_k)
    if entropy is not None and not greedy:
        entropy.copy_(ent)
    return token
