"""Shared math of the objectives: masked reductions, group advantages, chunked log-probs, KL estimators.

Everything here is a pure function of tensors so that each objective class stays a short recipe and every
formula is tested once. Shapes: ``N`` rollouts (prompts x group size), ``C`` completion tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

AdvantageScale = Literal["group", "batch", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ADVANTAGE_EPS = 1e-4


def masked_sum(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is 1; 0 where the mask is empty (never NaN)."""
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale = "group",
                     valid: Optional[Tensor] = None) -> Tensor:
    """GRPO advantages: reward minus its group mean, divided by a standard deviation.

    ``rewards`` is ``[N]`` with the ``group_size`` rollouts of a prompt next to each other.
    ``scale="group"`` divides by the group's std (DeepSeekMath), ``"batch"`` by the std of the whole batch
    (as in "A Minimalist Approach", 2504.11343), ``"none"`` not at all (Dr. GRPO). The std is the unbiased
    one, as TRL and verl compute it. ``valid`` (``[N]`` bool; None: every row) leaves the other rows out of every
    mean and std: they get advantage 0, and so does every row of a group with fewer than 2 valid rows.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if rewards.numel() == 0:
        return rewards.clone()
    if valid is not None:
        return _valid_group_advantages(rewards, group_size, scale, valid)
    grouped = rewards.view(-1, group_size)  # [P, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # [N]
    if scale == "none":
        return centred
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)  # [N]
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected 'group', 'batch' or 'none'")
    return centred / (std + ADVANTAGE_EPS)


def group_counts(valid: Tensor, group_size: int) -> Tensor:
    """``[N]`` the number of valid rows in each row's group (``valid`` ``[N]`` bool, groups adjacent)."""
    return valid.view(-1, group_size).sum(1).repeat_interleave(group_size)


def group_mean_std(values: Tensor, group_size: int, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``[N]`` mean and unbiased std of each row's group over its ``valid`` rows (0 where fewer than 1 and 2)."""
    keep = valid.view(-1, group_size).to(values.dtype)  # [P, G]
    grouped = torch.where(keep.bool(), values.view(-1, group_size), torch.zeros_like(keep))
    count = keep.sum(1, keepdim=True)
    mean = grouped.sum(1, keepdim=True) / count.clamp(min=1)
    var = (((grouped - mean) * keep) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    return mean.expand_as(keep).reshape(-1), var.sqrt().expand_as(keep).reshape(-1)


def group_mixed(rewards: Tensor, group_size: int, valid: Optional[Tensor] = None) -> Tensor:
    """``[P]`` bool: the groups whose rewards are not all equal, over their ``valid`` rows (None: all)."""
    grouped = rewards.view(-1, group_size)
    if valid is None:
        return grouped.max(1).values != grouped.min(1).values
    held = valid.view(-1, group_size).bool()
    inf = torch.tensor(float("inf"), device=grouped.device, dtype=grouped.dtype)
    top, bottom = torch.where(held, grouped, -inf).max(1).values, torch.where(held, grouped, inf).min(1).values
    return held.any(1) & (top != bottom)


def _valid_group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale, valid: Tensor) -> Tensor:
    keep = valid.bool() & (group_counts(valid.bool(), group_size) >= 2)  # [N] rows in a group of 2 or more
    mean, std = group_mean_std(rewards, group_size, keep)
    centred = torch.where(keep, rewards - mean, torch.zeros_like(rewards))
    if scale == "none":
        return centred
    if scale == "group":
        pass
    elif scale == "batch":
        std = rewards[keep].std().expand_as(rewards) if int(keep.sum()) > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; expected 'group', 'batch' or 'none'")
    return centred / (std + ADVANTAGE_EPS)


def clipped_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped objective, per token, as a loss (negated).

    ``advantages`` broadcasts against ``logprobs`` (``[N, 1]`` for sequence advantages, ``[N, C]`` for
    per-token ones). Returns the per-token loss ``[N, C]`` and a 0/1 tensor of the tokens where the clip is
    active (the clipped branch is the minimum and differs from the unclipped one).
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [N, C]
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = (clipped < unclipped).to(logprobs.dtype)
    return loss, is_clipped


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(r) - r - 1 with r = log pi_ref - log pi."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


KLEstimator = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs: k1 = log pi - log pi_ref,
    k2 = (log pi - log pi_ref)^2 / 2, k3 as :func:`k3_kl` (Schulman, "Approximating KL divergence")."""
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if kind == "k3":
        return k3_kl(logprobs, ref_logprobs)
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``[N, C]`` returns G_t = r_t + gamma * G_t' of each model token t, t' the row's next model token.

    Positions where ``mask`` is 0 (padding, an episode's environment tokens) get no reward and no discount: the
    return passes through them, and they hold the return of the next model token. With gamma = 1 this is the
    reverse cumulative sum of the masked rewards.
    """
    rewards = torch.where(mask.bool(), token_rewards, torch.zeros_like(token_rewards))  # (a NaN outside stays out)
    mask = mask.to(token_rewards.dtype)
    if gamma == 1.0:
        return rewards.flip(1).cumsum(1).flip(1)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # [N]
    discount = mask * gamma + (1.0 - mask)  # gamma at model tokens, 1 elsewhere
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, t] + discount[:, t] * running
        returns[:, t] = running
    return returns


def turn_returns(turn_rewards: Tensor, gamma: float = 1.0) -> Tensor:
    """``[N, T]`` the return of each model turn k of an episode, sum over j >= k of gamma^(j - k) r_j, from the
    ``[N, T]`` rewards r_j of the environment's step after each turn (0 for turns that did not happen)."""
    returns = torch.zeros_like(turn_rewards, dtype=torch.float32)
    running = returns.new_zeros(turn_rewards.shape[0])
    for k in range(turn_rewards.shape[1] - 1, -1, -1):
        running = turn_rewards[:, k].float() + gamma * running
        returns[:, k] = running
    return returns


def whiten(values: Tensor, mask: Tensor, sums: Optional[Callable[[list[float]], list[float]]] = None,
           eps: float = 1e-8) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` over the entries where ``mask`` is 1, the variance unbiased; 0
    elsewhere. ``sums`` adds [sum, sum of squares, count] over data-parallel ranks (default: this tensor's
    alone), so that every rank whitens with the whole batch's statistics."""
    keep = mask.bool()
    mask = mask.to(torch.float64)
    v = torch.where(keep, values.to(torch.float64), torch.zeros((), dtype=torch.float64, device=values.device))
    totals = [float(v.sum()), float((v * v).sum()), float(mask.sum())]
    total, squares, count = sums(totals) if sums is not None else totals
    if count < 1:
        return torch.zeros_like(values)
    mean = total / count
    var = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return torch.where(keep, (v - mean) / math.sqrt(var + eps), torch.zeros_like(v)).to(values.dtype)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation = "token-mean",
    max_len: Optional[int] = None,
    num_tokens: Optional[float] = None,
    num_sequences: Optional[float] = None,
) -> Tensor:
    """Reduce a ``[N, C]`` per-token loss to a scalar.

    token-mean: sum over all tokens / number of tokens (DAPO); seq-mean-token-mean: mean over each sequence,
    then over sequences (original GRPO); seq-mean-token-sum-norm: sum over each sequence divided by a constant
    (``max_len``, default ``C``), then mean over sequences (Dr. GRPO).

    ``num_tokens`` / ``num_sequences`` override the denominators, so that a loss computed on a slice of a batch
    (a micro-batch, or only the rows whose advantage is non-zero) adds up to the loss of the whole batch.
    """
    mask = mask.to(per_token.dtype)
    n_seq = float(num_sequences) if num_sequences is not None else float(per_token.shape[0])
    if mode == "token-mean":
        n_tok = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
        return masked_sum(per_token, mask) / n_tok
    if mode == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=1).sum() / max(n_seq, 1.0)
    if mode == "seq-mean-token-sum-norm":
        norm = float(max_len if max_len is not None else per_token.shape[1])
        return (masked_sum(per_token, mask, dim=1) / norm).sum() / max(n_seq, 1.0)
    raise ValueError(
        f"unknown loss aggregation {mode!r}; expected 'token-mean', 'seq-mean-token-mean' or 'seq-mean-token-sum-norm'"
    )


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] over row chunks, with a hand-written backward that recomputes each
    chunk's logits: d logp / d logits = (onehot(target) - softmax) / T. No [rows, V] tensor outlives a chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, want_entropy):
        m = hidden.shape[0]
        logprobs = hidden.new_empty(m, dtype=torch.float32)  # [M]
        entropy = hidden.new_zeros(m, dtype=torch.float32)  # [M]
        logz = hidden.new_empty(m, dtype=torch.float32)  # [M]
        for start in range(0, m, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight, bias).float()  # [n, V]
            if temperature != 1.0:
                logits.div_(temperature)
            logz[rows] = torch.logsumexp(logits, dim=-1)
            logprobs[rows] = logits.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - logz[rows]
            if want_entropy:  # in place: two [n, V] fp32 blocks at most
                entropy[rows] = logz[rows] - logits.sub(logz[rows].unsqueeze(-1)).exp_().mul_(logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits = F.linear(hidden[rows], weight, bias).float()  # [n, V]
            if ctx.temperature != 1.0:
                logits.div_(ctx.temperature)
            g = grad_logprobs[rows].float().unsqueeze(-1)  # [n, 1]
            grad_logits = logits.sub_(logz[rows].unsqueeze(-1)).exp_().mul_(-g)  # -softmax * g
            grad_logits.scatter_add_(-1, targets[rows].unsqueeze(-1), g)  # + onehot * g
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_h:
                grad_hidden[rows] = grad_logits @ weight
            if need_w:
                grad_weight += grad_logits.t().float() @ hidden[rows].float()
            if need_b:
                grad_bias += grad_logits.float().sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_w else None,
            grad_bias.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
        )


def _chunk_logprobs(lm_head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float,
                    want_entropy: bool = True):
    logits = lm_head(hidden).float() / temperature  # [n, V] fp32, one chunk only
    logz = torch.logsumexp(logits, dim=-1)
    logprobs = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if not want_entropy:
        return logprobs, torch.zeros_like(logz).detach()
    with torch.no_grad():
        probs = torch.softmax(logits.detach(), dim=-1)
        entropy = logz.detach() - (probs * logits.detach()).sum(-1)
    return logprobs, entropy


def chunked_token_logprobs(
    hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    entropy: bool = True,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of ``targets`` and the entropy of each distribution, chunk by chunk over tokens.

    ``hidden`` is ``[N, C, H]`` (the state that predicts each target), ``targets`` ``[N, C]``. Only a
    ``[chunk_size, V]`` block of fp32 logits exists at a time, in forward and in backward (which recomputes
    each chunk's logits rather than keeping ``N x C x V`` of them). A plain ``nn.Linear`` head takes a fused
    path with a hand-written backward; any other head (adapters, quantised layers) runs chunk by chunk under
    activation checkpointing. Returns fp32 ``[N, C]`` log-probs (differentiable) and ``[N, C]`` entropies
    (detached; zeros when ``entropy=False``).
    """
    n, c, h = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(n * c, h), targets.reshape(n * c)
    if type(lm_head) is torch.nn.Linear:
        logprobs, entropies = _LinearLogprobs.apply(
            flat_hidden, lm_head.weight, lm_head.bias, flat_targets, float(temperature), chunk_size, entropy
        )
        return logprobs.view(n, c), entropies.view(n, c)
    logprob_chunks, entropy_chunks = [], []
    use_checkpoint = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, n * c, chunk_size):
        args = (lm_head, flat_hidden[start : start + chunk_size], flat_targets[start : start + chunk_size], temperature,
                entropy)
        lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if use_checkpoint else _chunk_logprobs(*args)
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    return torch.cat(logprob_chunks).view(n, c), torch.cat(entropy_chunks).view(n, c)


def naive_token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Reference implementation for tests: full fp32 log-softmax, then gather."""
    return torch.gather(F.log_softmax(logits.float() / temperature, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


Divergence = Literal["forward_kl", "reverse_kl", "jsd"]
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def quantile(values: Tensor, q: float) -> Tensor:
    """The ``q`` quantile of a 1-D tensor with linear interpolation (``torch.quantile``'s default), by sorting:
    no limit on the number of elements (``torch.quantile`` refuses more than 2^24)."""
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"quantile needs a non-empty 1-D tensor, got shape {tuple(values.shape)}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    ordered = values.float().sort().values  # [M]
    position = q * (ordered.numel() - 1)
    lo = int(math.floor(position))
    hi = min(lo + 1, ordered.numel() - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def divergence_from_logprobs(teacher: Tensor, student: Tensor, kind: Divergence = "forward_kl",
                             mix: float = 0.5) -> Tensor:
    """Per-token divergence between two ``[..., V]`` log-distributions (fp32), reduced over the vocabulary.

    forward_kl = KL(p_T || p_S) (teacher first, the paper's D_i,t), reverse_kl = KL(p_S || p_T),
    jsd = Jensen-Shannon with the equal mixture (natural log), bidirectional = ``mix`` * forward +
    (1 - ``mix``) * reverse.
    """
    if kind == "forward_kl":
        return (teacher.exp() * (teacher - student)).sum(-1)
    if kind == "reverse_kl":
        return (student.exp() * (student - teacher)).sum(-1)
    if kind == "jsd":
        mixture = torch.logaddexp(teacher, student) - math.log(2.0)
        return 0.5 * (teacher.exp() * (teacher - mixture)).sum(-1) + 0.5 * (student.exp() * (student - mixture)).sum(-1)
    if kind == "bidirectional":
        return mix * divergence_from_logprobs(teacher, student, "forward_kl") + (1.0 - mix) * divergence_from_logprobs(
            teacher, student, "reverse_kl")
    raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES} or 'bidirectional'")


def fp32_output_mm_works(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` takes bf16 operands on ``device`` (CUDA builds of recent
    PyTorch; checked once per device: :func:`_fp32_output_mm_works`)."""
    return _fp32_output_mm_works(str(device))


@functools.cache
def _fp32_output_mm_works(device: str) -> bool:
    try:
        probe = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        out = torch.mm(probe, probe, out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool((out == 2).all())
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def fp32_head(lm_head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """The head as a function that returns fp32 logits computed in fp32 (not bf16 logits upcast, whose
    rounding alone puts a floor of ~1e-4 under a KL): a plain ``nn.Linear`` head is applied with its weight
    upcast once; any other head (a quantised or adapted one) runs as it is and its output is upcast.

    On a GPU a bf16/fp16 head and hidden states of its dtype are multiplied as they are, with fp32 output: the
    products of two 16-bit values are exact in fp32 and the sums are fp32, so the logits equal the upcast matmul's
    up to summation order, from tensor cores instead of fp32 arithmetic (several times slower) and without an fp32
    copy of the head (2.5 GB for a 152k x 4096 head)."""
    if type(lm_head) is torch.nn.Linear:
        weight, bias = lm_head.weight, lm_head.bias
        if (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
                and fp32_output_mm_works(weight.device)):
            bias32 = bias.float() if bias is not None else None
            upcast: list = []  # (hidden states of another dtype: the upcast weight, made once)

            def apply(hidden: Tensor) -> Tensor:
                if hidden.dtype != weight.dtype:
                    if not upcast:
                        upcast.append(weight.float())
                    return F.linear(hidden.float(), upcast[0], bias32)
                out = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
                out = out.view(*hidden.shape[:-1], -1)
                return out + bias32 if bias32 is not None else out

            return apply
        weight = weight.float()  # [V, H], one copy per call (a no-op for fp32 weights)
        bias = bias.float() if bias is not None else None
        return lambda hidden: F.linear(hidden.float(), weight, bias)
    return lambda hidden: lm_head(hidden).float()


@torch.no_grad()
def chunked_divergence(
    teacher_hidden: Tensor,
    student_hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    kind: Divergence = "forward_kl",
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """``[N, C]`` divergence between the teacher's and the student's next-token distributions, exact over the
    full vocabulary with fp32 logits, ``chunk_size`` tokens at a time (no ``N x C x V`` tensor), no gradient,
    clamped at 0 (rounding can leave a KL of two near-equal distributions slightly negative)."""
    n, c, h = student_hidden.shape
    t_flat, s_flat = teacher_hidden.reshape(n * c, h), student_hidden.reshape(n * c, h)
    out = torch.empty(n * c, dtype=torch.float32, device=student_hidden.device)
    head = fp32_head(lm_head)
    for start in range(0, n * c, chunk_size):
        rows = slice(start, start + chunk_size)
        teacher = torch.log_softmax(head(t_flat[rows]) / temperature, dim=-1)  # [n, V] fp32
        student = torch.log_softmax(head(s_flat[rows]) / temperature, dim=-1)  # [n, V] fp32
        out[rows] = divergence_from_logprobs(teacher, student, kind)
    return out.clamp_(min=0.0).view(n, c)


def kl_weights(divergence: Tensor, c: Tensor | float) -> Tensor:
    """SC-GRPO's token weight f(D) = D / (D + c), in [0, 1): it only ever shrinks a token's gradient.
    ``c`` is a scalar or broadcasts against ``divergence`` (``[N, 1]`` for one c per row). Detached."""
    divergence = divergence.detach().float().clamp(min=0.0)
    return divergence / (divergence + c)


def permute_within_rows(values: Tensor, mask: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """``[N, C]`` ``values`` with each row's entries at its ``mask`` positions shuffled among those positions
    (a uniform permutation per row, drawn on the CPU from ``generator``, else torch's default CPU generator);
    0 elsewhere. Each row keeps its multiset of values: its sum and mean over the mask are unchanged."""
    held = mask.bool()
    n, c = values.shape
    keys = torch.rand(n, c, generator=generator).to(values.device)  # [N, C] random order of the held positions
    keys = torch.where(held, keys, torch.full_like(keys, 2.0))  # held positions first, the rest after
    shuffled = torch.argsort(keys, dim=1)  # [N, C] the held positions in random order, then the others
    natural = torch.argsort(torch.where(held, 0, 1).to(torch.int8), dim=1, stable=True)  # held positions in order
    out = torch.zeros_like(values)
    out.scatter_(1, natural, values.masked_fill(~held, 0).gather(1, shuffled))
    return out


def credit_threshold(active: Tensor, q: float = 0.75, c_min: float = 1e-4, c_fixed: Optional[float] = None) -> Tensor:
    """SC-GRPO's c = max(P_q(D_act), c_min) over the active tokens' divergences ``active`` (1-D), or
    ``c_fixed`` when given. With no active token c is ``c_min`` (no weight is ever computed from it)."""
    if c_fixed is not None:
        return torch.tensor(float(c_fixed))
    if active.numel() == 0:
        return torch.tensor(float(c_min))
    return torch.clamp(quantile(active.detach().float(), q), min=c_min).cpu()


def _chunk_distill(weight: Optional[Tensor], bias: Optional[Tensor], head, student: Tensor, teacher: Tensor,
                   temperature: float, kind: str, mix: float) -> Tensor:
    if weight is not None:  # a plain linear head (fp32), passed as tensors so that recomputation reuses them
        logits = lambda h: F.linear(h.float(), weight, bias)  # noqa: E731
    else:
        logits = lambda h: head(h).float()  # noqa: E731
    log_student = torch.log_softmax(logits(student) / temperature, dim=-1)  # [n, V] fp32
    with torch.no_grad():
        log_teacher = torch.log_softmax(logits(teacher) / temperature, dim=-1)  # [n, V] fp32
    return divergence_from_logprobs(log_teacher, log_student, kind, mix)


def chunked_distill_divergence(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    kind: str = "forward_kl",
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mix: float = 0.5,
) -> Tensor:
    """``[N, C]`` divergence between a fixed teacher (``teacher_hidden``, no gradient) and the student,
    differentiable in the student's hidden states and in the head's weights (full fine-tuning trains the
    head). fp32 logits; each chunk's logits are recomputed in backward (activation checkpointing), so no
    ``N x C x V`` tensor is kept. ``kind``: forward_kl, reverse_kl, jsd or bidirectional (``mix`` x forward +
    (1 - ``mix``) x reverse)."""
    if kind not in (*DIVERGENCES, "bidirectional"):
        raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES} or 'bidirectional'")
    n, c, h = student_hidden.shape
    s_flat, t_flat = student_hidden.reshape(n * c, h), teacher_hidden.detach().reshape(n * c, h)
    linear = type(lm_head) is torch.nn.Linear
    # upcast once for all chunks (differentiable: the head's gradient flows back through the cast)
    weight = lm_head.weight.float() if linear else None
    bias = lm_head.bias.float() if linear and lm_head.bias is not None else None
    use_checkpoint = torch.is_grad_enabled()
    parts = []
    for start in range(0, n * c, chunk_size):
        args = (weight, bias, None if linear else lm_head, s_flat[start : start + chunk_size],
                t_flat[start : start + chunk_size], float(temperature), kind, mix)
        parts.append(checkpoint(_chunk_distill, *args, use_reentrant=False) if use_checkpoint else _chunk_distill(*args))
    return torch.cat(parts).view(n, c) if parts else s_flat.new_zeros(n, c, dtype=torch.float32)


def distillation_loss(inputs, kind: str, mix: float = 0.5, token_clip: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """The self-distillation term of a micro-batch: per token the divergence between the self-teacher and
    the student (``token_clip`` caps it, as OPSD's per-token clip), each sequence's token mean, summed over
    the rows that have a teacher and divided by the number of such rows in the whole batch (all ranks), so
    micro-batches add up to the batch's mean (Eq. 2). Reads ``inputs.distill`` (:class:`~scgrpo.objectives.DistillInputs`).
    Returns (loss, detached mean divergence per token)."""
    distill = inputs.distill
    rows = torch.nonzero(distill.has_teacher).squeeze(1) if distill is not None else None
    if rows is None or rows.numel() == 0 or distill.teacher_hidden is None:
        zero = inputs.completion_mask.new_zeros(())
        anchor = distill.hidden.sum() * 0.0 if distill is not None else zero  # keeps the graph connected
        return anchor, zero.new_tensor(float("nan"))
    per_token = chunked_distill_divergence(
        distill.hidden[rows], distill.teacher_hidden[rows], distill.lm_head, kind, inputs.temperature,
        inputs.chunk_size, mix)  # [k, C]
    if token_clip is not None:
        per_token = per_token.clamp(max=token_clip)
    mask = inputs.completion_mask[rows]  # [k, C]
    denominator = float(distill.num_teacher_rows) if distill.num_teacher_rows else float(rows.numel())
    loss = masked_mean(per_token, mask, dim=1).sum() / max(denominator, 1.0)
    return loss, masked_mean(per_token.detach(), mask)
