"""Shared math of the objectives: masked reductions, group advantages, chunked log-probs, KL estimators.

Everything here is a pure function of tensors so that each objective class stays a short recipe and every
formula is tested once. Shapes: ``N`` rollouts (prompts x group size), ``C`` completion tokens, ``V`` vocabulary.
"""

from __future__ import annotations

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


def group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale = "group") -> Tensor:
    """GRPO advantages: reward minus its group mean, divided by a standard deviation.

    ``rewards`` is ``[N]`` with the ``group_size`` rollouts of a prompt next to each other.
    ``scale="group"`` divides by the group's std (DeepSeekMath), ``"batch"`` by the std of the whole batch
    (as in "A Minimalist Approach", 2504.11343), ``"none"`` not at all (Dr. GRPO). The std is the unbiased
    one, as TRL and verl compute it.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    if rewards.numel() == 0:
        return rewards.clone()
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
            if want_entropy:
                probs = logits.sub(logz[rows].unsqueeze(-1)).exp_()  # [n, V]
                entropy[rows] = logz[rows] - (probs * logits).sum(-1)
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


Divergence = Literal["forward_kl", "reverse_kl", "jsd", "sampled"]
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "sampled")


def divergence_from_logprobs(teacher: Tensor, student: Tensor, targets: Tensor, kind: Divergence = "forward_kl") -> Tensor:
    """Per-token divergence between two ``[..., V]`` log-distributions (fp32), reduced over the vocabulary.

    forward_kl = KL(p_T || p_S), reverse_kl = KL(p_S || p_T), jsd = Jensen-Shannon with the mixture
    (natural log), sampled = |log p_T(y_t) - log p_S(y_t)| at the sampled token ``targets``.
    """
    if kind == "forward_kl":
        return (teacher.exp() * (teacher - student)).sum(-1)
    if kind == "reverse_kl":
        return (student.exp() * (student - teacher)).sum(-1)
    if kind == "jsd":
        mixture = torch.logaddexp(teacher, student) - math.log(2.0)
        return 0.5 * (teacher.exp() * (teacher - mixture)).sum(-1) + 0.5 * (student.exp() * (student - mixture)).sum(-1)
    if kind == "sampled":
        index = targets.unsqueeze(-1)
        return (teacher.gather(-1, index) - student.gather(-1, index)).squeeze(-1).abs()
    raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")


@torch.no_grad()
def chunked_divergence(
    teacher_hidden: Tensor,
    student_hidden: Tensor,
    lm_head: Callable[[Tensor], Tensor],
    targets: Tensor,
    kind: Divergence = "forward_kl",
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """``[N, C]`` divergence between the teacher's and the student's next-token distributions, exact over the
    full vocabulary in fp32, computed ``chunk_size`` tokens at a time (no ``N x C x V`` tensor), no gradient."""
    n, c, h = student_hidden.shape
    t_flat, s_flat, y_flat = teacher_hidden.reshape(n * c, h), student_hidden.reshape(n * c, h), targets.reshape(n * c)
    out = torch.empty(n * c, dtype=torch.float32, device=student_hidden.device)
    for start in range(0, n * c, chunk_size):
        rows = slice(start, start + chunk_size)
        teacher = torch.log_softmax(lm_head(t_flat[rows]).float() / temperature, dim=-1)  # [n, V]
        student = torch.log_softmax(lm_head(s_flat[rows]).float() / temperature, dim=-1)  # [n, V]
        out[rows] = divergence_from_logprobs(teacher, student, y_flat[rows], kind)
    return out.view(n, c)


def credit_weights(divergence: Tensor, mask: Tensor, w_max: float = 5.0, lam: float = 1.0, eps: float = 1e-8) -> Tensor:
    """SC-GRPO token weights: w_t = min(d_t / (mean of d over the sequence + eps), w_max), then
    (1 - lam) + lam * w_t. ``divergence`` and ``mask`` are ``[N, C]``; padding gets weight 0 (it is masked
    anyway). Detached."""
    divergence = divergence.detach().float()
    mean = masked_mean(divergence, mask, dim=1).unsqueeze(1)  # [N, 1]
    weights = torch.clamp(divergence / (mean + eps), max=w_max)
    return ((1.0 - lam) + lam * weights) * mask


class _LinearDistillKL(torch.autograd.Function):
    """Per-token KL between a fixed teacher and the student, both ``softmax(h W^T / T)``, chunk by chunk, with
    the gradient through the student's hidden states only."""

    @staticmethod
    def forward(ctx, student_hidden, weight, bias, teacher_hidden, temperature, chunk_size, kind):
        m = student_hidden.shape[0]
        out = student_hidden.new_empty(m, dtype=torch.float32)
        for start in range(0, m, chunk_size):
            rows = slice(start, start + chunk_size)
            student = torch.log_softmax(F.linear(student_hidden[rows], weight, bias).float() / temperature, -1)
            teacher = torch.log_softmax(F.linear(teacher_hidden[rows], weight, bias).float() / temperature, -1)
            out[rows] = divergence_from_logprobs(teacher, student, None, kind)  # type: ignore[arg-type]
        ctx.save_for_backward(student_hidden, weight, bias, teacher_hidden)
        ctx.temperature, ctx.chunk_size, ctx.kind = temperature, chunk_size, kind
        return out

    @staticmethod
    def backward(ctx, grad_out):
        student_hidden, weight, bias, teacher_hidden = ctx.saved_tensors
        grad_hidden = torch.empty_like(student_hidden)
        for start in range(0, student_hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            student = torch.log_softmax(F.linear(student_hidden[rows], weight, bias).float() / ctx.temperature, -1)
            teacher = torch.log_softmax(F.linear(teacher_hidden[rows], weight, bias).float() / ctx.temperature, -1)
            g = grad_out[rows].float().unsqueeze(-1)  # [n, 1]
            p_s = student.exp()
            if ctx.kind == "forward_kl":  # d/dz_s sum p_T (log p_T - log p_S) = p_S - p_T
                grad_logits = (p_s - teacher.exp()) * g
            else:  # reverse: d/dz_s sum p_S (log p_S - log p_T) = p_S * ((log p_S - log p_T) - KL)
                diff = student - teacher
                kl = (p_s * diff).sum(-1, keepdim=True)
                grad_logits = p_s * (diff - kl) * g
            grad_hidden[rows] = (grad_logits / ctx.temperature).to(student_hidden.dtype) @ weight
        return grad_hidden, None, None, None, None, None, None


def chunked_distill_kl(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head: torch.nn.Linear,
    kind: Divergence = "forward_kl",
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """``[N, C]`` KL between the teacher (no gradient) and the student, differentiable in the student's hidden
    states; the lm_head weights get no gradient (they are frozen under LoRA)."""
    if kind not in ("forward_kl", "reverse_kl"):
        raise ValueError(f"distillation supports forward_kl and reverse_kl, got {kind!r}")
    n, c, h = student_hidden.shape
    out = _LinearDistillKL.apply(
        student_hidden.reshape(n * c, h), lm_head.weight, lm_head.bias, teacher_hidden.detach().reshape(n * c, h),
        float(temperature), chunk_size, kind,
    )
    return out.view(n, c)
