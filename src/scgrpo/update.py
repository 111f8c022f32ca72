"""The update: from a scored rollout batch and its credit, the micro-batch plan, gradient accumulation, the
sampler correction (truncated importance sampling) and gradient clipping.

One :class:`PolicyUpdate` per training step (it reads the settings the module holds at that moment). It
never steps the optimiser: the module does, after the divergence guard has seen the gradient norm. The
micro-batch plan (:meth:`PolicyUpdate.plan`) is where a memory budget sizes the passes.

Truncated importance sampling (``tis_cap``): each token's policy-gradient term is weighted by
min(pi_trainer(y) / pi_sampler(y), tis_cap), the ratio of the trainer's probability (at sampling time) to the
sampler's, correcting for the gap between the two (numerics, and top-k / top-p filtering, whose
log-probabilities the sampler reports renormalised). It acts through the objective's token weights, so
objectives without a policy-gradient term (OPSD) are unchanged. With ``num_iterations`` 1 the trainer's side is
the training forward itself (LoRA dropout included).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.profiler import record_function

from scgrpo.budget import Span, active, measuring, row_extents, run_passes, whole_rows
from scgrpo.distributed import all_reduce, mean_over_ranks, world_size
from scgrpo.objectives import Credit, CreditInputs, DistillInputs, LossInputs, LossOutput, Objective
from scgrpo.objectives.functional import masked_mean, turn_returns
from scgrpo.policy import Policy, attention_backends
from scgrpo.rollout.types import RolloutBatch, TeacherSignal

NONFINITE = "nonfinite"
"""Key of ``StepSums``' counter of micro-batches whose loss was NaN or infinite"""
CHECKPOINTED_PASS = 1.5
"""A pass under gradient checkpointing costs about this many plain passes (it runs the forward twice). With a memory
budget the update checkpoints when that takes fewer passes by more than this factor (one checkpointed pass rather than
two plain ones, not two rather than three). On an H200, SmolLM2's SC-GRPO update of about 40k tokens under a 22 GiB cap
(benchmarks/results/bench_smollm2_checkpointed_22gib_h200.json): two plain passes 0.53 s, one checkpointed pass 0.39 s,
one plain pass uncapped 0.28 s"""
OWN_STATS = ("loss", "entropy", "grad_norm", "kl", "clip_fraction", NONFINITE)
"""Keys of the step's sums that step logging names itself; every other key is an objective statistic"""


@dataclass
class LossNorms:
    """Denominators of the loss, summed over all ranks so each rank's share has the global batch's scale."""

    num_tokens: float  # completion tokens in the whole batch
    num_rows: float  # rows in the whole batch
    num_teacher_rows: float  # rows with a self-teacher in the whole batch


@dataclass
class StepPlan:
    """What one optimiser step trains on, for a batch of ``N`` rollouts with ``C`` completion slots."""

    rewards: Tensor  # [N] after the objective's shaping
    credit: Credit  # advantages [N], token weights [N, C]
    signal: Optional[TeacherSignal]  # the self-teacher's signal, when the objective has one
    selection: Optional[Tensor]  # [N, C] tokens whose policy-gradient term counts (80/20), or None
    rows: Tensor  # [n] long, the rows that enter the loss (rows with zero advantage add nothing)
    chunks: list[Tensor]  # this rank's micro-batches of ``rows``
    num_chunks: int  # forward/backward passes every rank runs (the most chunks of any rank)
    global_rows: float  # rows in the loss over all ranks
    norms: LossNorms
    spans: Optional[list[Span]] = None  # the chunks' columns, when the memory budget cuts them (None: whole rows)
    kind: str = "train"  # the budget's kind of pass: "train", or "train_checkpointed" under checkpointing


@dataclass
class MismatchMeter:
    """Sums of the sampler-trainer log-prob gap over a step's sampled tokens (see :meth:`metrics`)."""

    abs: float = 0.0  # sum of |log pi_trainer - log pi_sampler|
    k3: float = 0.0  # sum of the k3 estimate of KL(sampler || trainer)
    tokens: float = 0.0
    max: float = 0.0

    def book(self, log_ratio: Tensor, mask: Tensor) -> None:
        """Adds ``[n, C]`` log pi_trainer - log pi_sampler (already 0 at padding) of ``mask``'s tokens."""
        tokens = mask.bool()
        self.abs += float(log_ratio.abs().sum())
        self.k3 += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())  # KL(sampler || trainer)
        self.tokens += float(mask.sum())
        if bool(tokens.any()):
            self.max = max(self.max, float(log_ratio.abs()[tokens].max()))

    def metrics(self, device: Optional[torch.device] = None) -> dict[str, float]:
        """rollout/logprob_mismatch_mean and _max (|log pi_sampler(y) - log pi_trainer(y)| over the sampled tokens
        of the rows in the loss) and rollout/mismatch_kl (k3 estimate of KL(sampler || trainer)), over all ranks;
        NaN when no token was compared (no sampler log-probs, or no row in the loss)."""
        total_abs, total_k3, tokens = all_reduce([self.abs, self.k3, self.tokens], device=device)
        largest = all_reduce([self.max], "max", device)[0]
        if tokens == 0:
            nan = float("nan")
            return {"rollout/logprob_mismatch_mean": nan, "rollout/logprob_mismatch_max": nan, "rollout/mismatch_kl": nan}
        return {"rollout/logprob_mismatch_mean": total_abs / tokens, "rollout/logprob_mismatch_max": largest,
                "rollout/mismatch_kl": total_k3 / tokens}


def optimizers(params: list, optimizer: Optional[Callable] = None, lr_scheduler: Optional[Callable] = None):
    """What ``configure_optimizers`` returns: ``optimizer`` (a callable of the parameters; default AdamW(lr=1e-4,
    weight_decay=0)) over the trainable ``params``, and ``lr_scheduler`` (a callable of the optimiser) stepped after
    every optimiser step."""
    if not params:
        raise ValueError("the policy has no trainable parameters")
    built = optimizer(params) if optimizer else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    if lr_scheduler is None:
        return built
    return {"optimizer": built, "lr_scheduler": {"scheduler": lr_scheduler(built), "interval": "step"}}


def check_update_settings(micro_batch_size: Optional[int], tis_cap: float) -> None:
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
    check_tis_cap(tis_cap)


def check_tis_cap(tis_cap: float) -> None:
    if tis_cap < 0 or (0 < tis_cap < 1):
        raise ValueError(f"tis_cap must be 0 (off) or >= 1 (a cap on pi_trainer / pi_sampler), got {tis_cap}")


def sampler_correction(trainer: Tensor, sampler: Tensor, mask: Tensor, token_weights: Optional[Tensor],
                       tis_cap: float, meter: Optional[MismatchMeter] = None) -> Optional[Tensor]:
    """Books the sampler-trainer mismatch of these rows in ``meter`` (when given) and, with ``tis_cap`` > 0,
    multiplies ``token_weights`` by the truncated importance ratio min(pi_trainer / pi_sampler, tis_cap).
    ``trainer``, ``sampler``: ``[n, C]`` log-probs of the sampled tokens; ``mask``: ``[n, C]``."""
    log_ratio = (trainer.detach() - sampler) * mask  # [n, C] log pi_trainer - log pi_sampler
    if meter is not None:
        meter.book(log_ratio, mask)
    if tis_cap <= 0:
        return token_weights
    ratio = log_ratio.exp().clamp(max=tis_cap) * mask  # [n, C]
    return ratio if token_weights is None else token_weights * ratio


def without_rows(credit: Credit, rows: Tensor) -> Credit:
    """``credit`` with no advantage on ``rows`` (``[N]`` bool: rows without a reward, whatever the objective gave)."""
    def cleared(x: Optional[Tensor]) -> Optional[Tensor]:
        if x is None:
            return None
        where = rows.view(-1, *([1] * (x.dim() - 1)))
        return torch.where(where, torch.zeros_like(x), x)

    return dataclasses.replace(credit, advantages=cleared(credit.advantages),
                               token_advantages=cleared(credit.token_advantages))


@dataclass
class StepSums:
    """A step's loss and statistics, summed over its optimisation passes (each pass's micro-batches are
    weighted by their share of the rows in the loss)."""

    values: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def __contains__(self, name: str) -> bool:
        return name in self.values

    def get(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)

    def add(self, name: str, value: float) -> None:
        self.values[name] += value

    def objective_stats(self) -> dict[str, float]:
        """The objective's own statistics (every key that step logging does not name itself)."""
        return {k: v for k, v in self.values.items() if k not in OWN_STATS}


class PolicyUpdate:
    """Plans a step's micro-batches and accumulates their gradients (verl's actor update, without the
    optimiser step).

    Args:
        policy: the network and its forward passes.
        objective: turns rewards and the teacher's signal into credit, and log-probs into a loss.
        backward: runs backward on a loss (Lightning's ``manual_backward``).
        micro_batch_size: rows per forward/backward pass (None: all rows at once).
        max_grad_norm: gradient clipping by global norm (0 = measured, not clipped).
        tis_cap: truncated importance sampling cap on pi_trainer / pi_sampler (0 = off).
        auto_checkpointing: with a memory budget, switch gradient checkpointing on for a step whose longest row
            does not fit without it, or whose rows it packs into fewer passes by :data:`CHECKPOINTED_PASS` (and
            off otherwise).
        gamma: the discount of episodes' per-turn returns (``episodes.gamma``), handed to the credit.
    """

    def __init__(self, policy: Policy, objective: Objective, backward: Callable[[Tensor], None],
                 micro_batch_size: Optional[int] = None, max_grad_norm: float = 1.0, tis_cap: float = 0.0,
                 auto_checkpointing: bool = False, gamma: float = 1.0) -> None:
        self.policy, self.objective, self.backward, self.gamma = policy, objective, backward, gamma
        self.auto_checkpointing = auto_checkpointing
        self.micro_batch_size, self.max_grad_norm, self.tis_cap = micro_batch_size, max_grad_norm, tis_cap
        self.mismatch = MismatchMeter()  # booked on the step's first optimisation pass only
        self.first_pass = True

    @property
    def device(self) -> torch.device:
        return self.policy.device

    def plan(self, rollouts: RolloutBatch, signal: Optional[TeacherSignal] = None) -> StepPlan:
        """Rewards, the objective's credit (advantages, token weights), the rows that enter the loss, their
        micro-batches and the loss denominators, summed over all ranks."""
        objective = self.objective
        mask = rollouts.completion_mask  # [N, C]
        max_len = self.policy.max_completion_tokens
        # lengths as the budget counts them: an episode's environment tokens share its token budget
        rewards = objective.shape_rewards(rollouts.rewards, rollouts.context_mask.sum(1).to(mask.dtype), max_len)  # [N]
        needs, extra = objective.needs, {}
        if needs.scored_credit:
            extra = dict(old_logprobs=rollouts.old_logprobs, ref_logprobs=rollouts.ref_logprobs)
        valid = rollouts.valid  # [N] bool, the rows with a reward (None: all)
        if valid is not None:  # the others are out of the credit's statistics and of the loss and its denominators
            mask = mask * valid.unsqueeze(1).to(mask.dtype)
        if rollouts.turn_rewards is not None:
            extra.update(turn_rewards=rollouts.turn_rewards, turn_index=rollouts.turn_index,
                         turn_returns=turn_returns(rollouts.turn_rewards, self.gamma))
        credit = objective.credit(CreditInputs(rewards, mask, rollouts.group_size, signal, self.micro_batch_size,
                                               valid=valid, **extra))  # groups never span ranks
        if valid is not None:
            credit = without_rows(credit, ~valid)
        selection = None
        if needs.batch_entropy:
            selection = objective.token_mask(self.policy.batch_entropy(rollouts, self.micro_batch_size), mask)
        in_loss = objective.rows_in_loss(credit, signal)
        rows = torch.nonzero(in_loss if valid is None else in_loss & valid).squeeze(1)  # [n]
        spans, kind = self._micro_batches(rollouts, rows)
        chunks = [span.rows for span in spans]
        teacher_rows = float(signal.has_teacher.sum()) if signal is not None else 0.0
        kept = float(mask.shape[0]) if valid is None else float(valid.sum())
        local = [float(mask.sum()), kept, teacher_rows, float(len(rows))]
        num_tokens, num_rows, num_teacher_rows, global_rows = all_reduce(local, device=self.device)
        num_chunks = len(chunks)
        if world_size() > 1:  # every rank runs as many forward/backward passes (FSDP's collectives pair up)
            num_chunks = int(all_reduce([float(len(chunks))], "max", self.device)[0])
        return StepPlan(rewards=rewards, credit=credit, signal=signal, selection=selection, rows=rows, chunks=chunks,
                        num_chunks=num_chunks, global_rows=global_rows,
                        norms=LossNorms(num_tokens=num_tokens, num_rows=num_rows, num_teacher_rows=num_teacher_rows),
                        spans=spans if self._budgeted else None, kind=kind)

    @property
    def _budgeted(self) -> bool:
        return active(getattr(self.policy, "budget", None)) is not None

    def _micro_batches(self, rollouts: RolloutBatch, rows: Tensor) -> tuple[list[Span], str]:
        """The update's micro-batches of ``rows`` and their kind of pass. With a memory budget (GPU) and
        ``auto_checkpointing``, gradient checkpointing is on for this step when the longest row alone does not fit
        without it, or when it packs the rows into so many fewer passes that it is faster
        (:data:`CHECKPOINTED_PASS`), and off otherwise; the rows are packed by what the chosen kind of pass costs."""
        policy = self.policy
        if not self._budgeted:
            return whole_rows(rows, self.micro_batch_size, rollouts.completion_ids.shape[1]), "train"
        if not len(rows):  # (a rank without rows runs zero-weight passes: as the others checkpoint, so does it)
            if self.auto_checkpointing and world_size() > 1:
                policy.set_gradient_checkpointing(bool(all_reduce([0.0], "max", self.device)[0]))
            return [], "train_checkpointed" if policy.checkpointing else "train"
        budget = policy.budget
        fixed = budget.logit_fixed(policy.chunk_size())
        spans = None
        if self.auto_checkpointing:
            first, width = row_extents(rollouts.prompt_mask[rows], rollouts.context_mask[rows])
            longest = max(rollouts.prompt_ids.shape[1] - f + w for f, w in zip(first, width))
            plain = policy.spans("train", rollouts, rows, self.micro_batch_size, fixed) if budget.fits(
                "train", longest, fixed) else None
            held = policy.spans("train_checkpointed", rollouts, rows, self.micro_batch_size, fixed)
            checkpointed = plain is None or CHECKPOINTED_PASS * len(held) < len(plain)
            if world_size() > 1:  # one choice on every rank (a sharded backward's recomputation gathers weights)
                checkpointed = bool(all_reduce([float(checkpointed)], "max", self.device)[0])
            policy.set_gradient_checkpointing(checkpointed)
            spans = held if checkpointed else plain
        kind = "train_checkpointed" if policy.checkpointing else "train"
        if spans is None:
            spans = policy.spans(kind, rollouts, rows, self.micro_batch_size, fixed)
        budget.note("update", [s.tokens(rollouts.prompt_ids.shape[1]) for s in spans])
        budget.chosen["gradient_checkpointing"] = float(policy.checkpointing)
        return spans, kind

    def accumulate(self, rollouts: RolloutBatch, plan: StepPlan, sums: StepSums, step: int = 0) -> None:
        """One pass of forward + backward over the rows of ``plan`` (no optimiser step) at optimiser step ``step``
        (the objectives' warm-up schedules). Adds to ``sums`` the global loss, the objective's statistics weighted by
        rows, and ``nonfinite`` (> 0 on every rank when any rank met a NaN/inf loss)."""
        world = world_size()
        local: dict[str, float] = defaultdict(float)
        tp = rollouts.prompt_ids.shape[1]
        backward_begun, current = False, 0

        def run(i: int) -> None:
            nonlocal backward_begun, current
            current = i
            real = i < len(plan.chunks)
            # a rank with fewer chunks runs a zero-weight pass on row 0 so that its collectives match
            chunk = plan.chunks[i] if real else torch.zeros(1, dtype=torch.long, device=plan.rows.device)
            span = plan.spans[i] if real and plan.spans is not None else None
            budget = self.policy.budget if span is not None else None  # (a budget's own spans only)
            tokens = span.tokens(tp) if span is not None else 0
            fixed = budget.logit_fixed(self.policy.chunk_size()) if budget is not None else 0.0
            booked = dataclasses.replace(self.mismatch)  # (a forward that runs out of memory is booked again)
            backward_begun = False
            with measuring(budget, plan.kind, tokens, fixed):
                try:
                    with record_function("scgrpo.update.forward"):
                        out, entropy = self.policy.runner(
                            lambda: self.micro_batch_loss(rollouts, chunk, plan, real, step, span))
                    finite = bool(torch.isfinite(out.loss))
                except BaseException:
                    self.mismatch = booked
                    raise
                if not finite:  # counted and reported once per step by the guard
                    local[NONFINITE] += 1
                if finite or world > 1:  # sharded backward passes must pair up across ranks, NaN or not
                    # FSDP averages gradients over ranks; each rank's loss is its share of the global one
                    backward_begun = True
                    with record_function("scgrpo.update.backward"), attention_backends(self.device, self.policy.passes.cudnn_attention):
                        self.backward(out.loss * (world if real else 0.0))
            if finite and real:
                self._book(local, out, entropy, share=len(chunk) / max(len(plan.rows), 1))

        def replan(rows: list[int]) -> range:
            """The plan's passes from the failed one on, planned again as a step's are (one process: they are all
            this rank's; with ``auto_checkpointing`` the choice of checkpointing is made again at the raised cost);
            the plan keeps them for the batch's later optimisation passes."""
            spans, plan.kind = self._micro_batches(rollouts, torch.tensor(rows, dtype=torch.long, device=plan.rows.device))
            plan.spans[current:] = spans
            plan.chunks[current:] = [span.rows for span in spans]
            plan.num_chunks = len(plan.chunks)
            self.policy.budget.note("update", [span.tokens(tp) for span in plan.spans])
            return range(current, plan.num_chunks)

        run_passes(self.policy.budget if plan.spans is not None else None, lambda: plan.kind, range(plan.num_chunks),
                   lambda i: plan.chunks[i].tolist() if i < len(plan.chunks) else [0],
                   lambda i: plan.spans[i].tokens(tp) if plan.spans is not None and i < len(plan.spans) else 0,
                   replan, run, undone=lambda: not backward_begun)
        if world > 1:
            sums.add(NONFINITE, all_reduce([local[NONFINITE]], "max", self.device)[0])
            sums.add("loss", all_reduce([local["loss"]], device=self.device)[0])
            stats = mean_over_ranks({k: v for k, v in local.items() if k not in ("loss", NONFINITE)} if len(plan.rows) else {})
        else:
            sums.add(NONFINITE, local[NONFINITE])
            sums.add("loss", local["loss"])
            stats = {k: v for k, v in local.items() if k not in ("loss", NONFINITE)}
        for name, value in stats.items():
            sums.add(name, value)

    @staticmethod
    def _book(local: dict[str, float], out: LossOutput, entropy: Tensor, share: float) -> None:
        local["loss"] += float(out.loss.detach())
        for name, value in out.stats.items():
            if torch.isfinite(torch.as_tensor(value)):
                local[name] += float(value) * share
        local["entropy"] += float(entropy) * share

    def micro_batch_loss(self, rollouts: RolloutBatch, rows: Tensor, plan: StepPlan, book: bool = True,
                         step: int = 0, span: Optional[Span] = None) -> tuple[LossOutput, Tensor]:
        """The loss of the rows ``rows`` and their mean token entropy (run inside the policy runner's forward);
        the caller runs backward. ``book``: count these rows in the step's sampler-trainer mismatch (not for a
        rank's zero-weight pass). ``span``: the rows' columns that the pass runs on (a budget's micro-batch; the
        completion columns after its ``width`` are padding for every row of it); None: whole rows."""
        c = rollouts.completion_ids.shape[1]
        span = span if span is not None else Span(rows, 0, c)
        width = span.width
        credit, policy = plan.credit, self.policy
        hidden = policy.span_hidden(rollouts, span)  # [n, width, H]
        mask = rollouts.completion_mask[rows, :width]
        logprobs, entropy = policy.head_logprobs(hidden, rollouts.completion_ids[rows, :width], mask=mask)  # [n, width]

        def pick(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x[rows, :width]

        old_logprobs = pick(rollouts.old_logprobs) if rollouts.old_logprobs is not None else logprobs.detach()
        token_weights = pick(credit.token_weights)
        if rollouts.sampler_logprobs is not None:
            meter = self.mismatch if book and self.first_pass else None
            token_weights = sampler_correction(old_logprobs, pick(rollouts.sampler_logprobs), mask, token_weights,
                                               self.tis_cap, meter)
        inputs = LossInputs(
            completion_mask=mask,
            advantages=credit.advantages[rows],
            token_advantages=pick(credit.token_advantages),
            old_logprobs=old_logprobs,
            ref_logprobs=pick(rollouts.ref_logprobs),
            token_weights=token_weights,
            token_selection=pick(plan.selection),
            entropy=entropy,
            num_tokens=plan.norms.num_tokens,
            num_sequences=plan.norms.num_rows,
            max_len=policy.max_completion_tokens,
            temperature=policy.temperature,
            chunk_size=policy.chunk_size(),
            step=step,
            distill=self._distill_inputs(hidden, rows, width, plan),
        )
        return self.objective.loss(logprobs, inputs), masked_mean(entropy.detach(), mask)

    def _distill_inputs(self, hidden: Tensor, rows: Tensor, width: int, plan: StepPlan) -> Optional[DistillInputs]:
        """The distillation term's inputs of these rows, for an objective whose teacher gives hidden states (the
        student's states on every pass, a rank's zero-weight one too: the term keeps the graph connected)."""
        spec, signal = self.objective.needs.teacher, plan.signal
        if spec is None or spec.output != "hidden":
            return None
        teacher = signal.teacher_hidden if signal is not None else None
        has_teacher = signal.has_teacher[rows] if signal is not None else torch.zeros(len(rows), dtype=torch.bool,
                                                                                      device=hidden.device)
        return DistillInputs(hidden=hidden, lm_head=self.policy.lm_head(),
                             teacher_hidden=teacher[rows, :width] if teacher is not None else None,
                             has_teacher=has_teacher, num_teacher_rows=plan.norms.num_teacher_rows)

    def optimise(self, rollouts: RolloutBatch, plan: Optional[StepPlan], sums: StepSums, reason: Optional[str],
                 optimizer, scheduler, step: Callable[[], int], keep: Callable[[], None],
                 stepping: Callable[[], None]) -> Optional[str]:
        """``objective.num_iterations`` optimiser steps on the batch, each after a pass of :meth:`accumulate` and
        :meth:`clip` (none where ``reason`` already says why not); returns why the update was skipped, or None. A
        skipped step still steps the optimiser, without gradients: no weight moves, the step counts. ``step()``: the
        optimiser step about to be taken (each pass's objective schedules read it). ``keep`` runs
        once the first pass's gradients are finite (the divergence guard's copy of the weights), ``stepping`` before
        each optimiser step."""
        for iteration in range(self.objective.num_iterations):
            self.first_pass = iteration == 0  # the sampler-trainer mismatch is booked on it only
            if reason is None:
                self.accumulate(rollouts, plan, sums, step())
                reason = self.clip(plan, sums)
                if reason is None and iteration == 0:
                    keep()
            if reason is not None:
                optimizer.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights, on any rank
            stepping()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        return reason

    def clip(self, plan: StepPlan, sums: StepSums) -> Optional[str]:
        """Clips the gradients (``max_grad_norm``) and adds their norm before clipping to ``sums``; returns why
        the update must be skipped (a non-finite loss or gradient norm), or None."""
        if sums[NONFINITE]:
            return "loss"
        if not plan.global_rows:
            return None
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")  # inf: measured, not clipped
        norm = float(torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), max_norm))
        if not math.isfinite(norm):  # the norm is global: every rank sees the same
            return "gradient norm"
        sums.add("grad_norm", norm)
        return None
