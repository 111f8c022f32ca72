"""The self-teacher: the policy shown one of its own verified solutions in its system prompt (SC-GRPO §5.1).

One component, called once per training step by the module. From a scored rollout batch it

1. routes each group by its number of correct rollouts n_c (:func:`group_routes`),
2. picks each row's reference (:func:`route_rollouts`): a verified sibling with other tokens (partial-solve),
   one random rollout of the group (solve-none), an earlier verified completion from the buffer (option),
   or the row's ground-truth answer (privileged teachers, OPSD),
3. builds the teacher's inputs: the reference goes into the *system* message only (base system prompt +
   guide instruction + reference); the user turn is the student's and the response tokens are the rollout's,
4. runs the teacher pass (same network, no gradient, no dropout) and, for divergence-weighted objectives,
   the student pass (or reads the student's states the sampler kept: ``generation.student_states``), and
   returns a :class:`TeacherSignal`: per row its route, reference, per-token
   divergence D_i,t (full vocabulary, fp32 logits, clamped at 0) and the tokens its solve-none diversity
   score averages over (the first L_i = min(|o_i|, |o_r|) tokens the model sampled).

What the signal becomes (weights, advantages, a distillation term) is the objective's business.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, ContextManager, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from scgrpo.budget import MemoryBudget, Span, active, measuring, pack, row_extents, run_passes, span_rows
from scgrpo.data.buffer import VerifiedBuffer
from scgrpo.chat import Prompt, prompt_key, prompt_text, render, split_system, system_prompt_layout  # noqa: F401
from scgrpo.distributed import full_parameters
from scgrpo.models import max_sequence_length
from scgrpo.objectives.functional import chunked_divergence
from scgrpo.rollout.types import (  # noqa: F401 - the signal's types, importable from here too
    ALL,
    DEFAULT_TEACHER_TEMPLATE,
    PARTIAL,
    ROUTES,
    SINGLE,
    SOLVE_NONE,
    RolloutBatch,
    TeacherSignal,
    TeacherSpec,
    TeacherStats,
)

log = logging.getLogger(__name__)

SHARED_PASS_TOKENS = 1024
"""The longest teacher sequence (prompt and completion columns) for which the shared forward is taken: short rows'
passes are bound by their launches, which it halves (SmolLM2's step, sequences of about 300 tokens); in long rows the
student's sequences are packed in rows as wide as the teacher's, which costs more than it saves (8B-shaped QLoRA step of
1,024 tokens, sequences of about 1,450, on an H200: teacher pass 6.5 s in passes of their own against 7.3 s shared,
benchmarks/results/bench_qwen8b_1k_20gib_shared_prompts_h200.json)"""


@dataclass
class RoutePlan:
    """Per row (``N``): the group's case, the reference text (None: no teacher), which row of the group it
    came from (None: buffer or answer), whether the row is a solve-none reference, and L_i."""

    route: list[int]
    references: list[Optional[str]]
    reference_rows: list[Optional[int]]
    is_reference: list[bool]
    diversity_length: list[int]


def group_routes(rewards: Tensor, group_size: int, threshold: float, valid: Optional[Tensor] = None) -> Tensor:
    """``[P]`` case of each group (``ROUTES`` index) from ``[N]`` rewards, groups adjacent; with ``valid`` (``[N]``
    bool), of its valid rows only (the others have no reward)."""
    held = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    n_c = ((rewards >= threshold) & held).view(-1, group_size).sum(1)  # [P]
    route = torch.full_like(n_c, PARTIAL)
    route[n_c == 1] = SINGLE
    route[n_c == held.view(-1, group_size).sum(1)] = ALL
    route[n_c == 0] = SOLVE_NONE  # (also a group without a valid row: it has no teacher)
    return route


def first_tokens(mask: Tensor, lengths: Tensor) -> Tensor:
    """``[N, C]`` float: the first ``lengths[i]`` tokens of row i that ``mask`` marks (the model's own tokens: in an
    episode the environment's tokens between its turns are not counted)."""
    return mask * (mask.cumsum(1) <= lengths.unsqueeze(1).to(mask.dtype)).to(mask.dtype)


def _tokens(rollouts: RolloutBatch, i: int) -> list[int]:
    return rollouts.completion_ids[i][rollouts.completion_mask[i].bool()].tolist()


def route_rollouts(
    rollouts: RolloutBatch,
    spec: TeacherSpec,
    threshold: float,
    buffer: Optional[VerifiedBuffer] = None,
    step: int = 0,
) -> RoutePlan:
    """References for every row, by the rules of SC-GRPO §5.1 (see the module docstring).

    Partial-solve (and, when routed, single- and all-correct) groups: each rollout's reference is drawn
    uniformly from the *correct* rollouts of its group whose tokens differ from its own (an identical copy
    is the rollout itself); a correct rollout with none takes a buffer entry with other tokens when
    ``buffer_references``, else it has no teacher (weight 1). Solve-none groups: one rollout o_r drawn
    uniformly is every other row's reference, L_i = min(|o_i|, |o_r|) (``diversity_window="group"``: the group's
    shortest length; 0, no score, where L_i < ``diversity_min_tokens``). Draws are seeded by (seed, step,
    prompt id, place in the group), so they do not depend on how a batch is split over ranks.
    """
    if rollouts.rewards is None:
        raise RuntimeError("the self-teacher needs verified rollouts (rewards)")
    n, g = len(rollouts.completions), rollouts.group_size
    routes = group_routes(rollouts.rewards.float(), g, threshold, rollouts.valid).tolist()
    valid = [True] * n if rollouts.valid is None else rollouts.valid.tolist()  # (the others get no teacher)
    correct = [c and v for c, v in zip((rollouts.rewards >= threshold).tolist(), valid)]
    lengths = rollouts.completion_mask.sum(1).long().tolist()
    plan = RoutePlan(route=[routes[i // g] for i in range(n)], references=[None] * n, reference_rows=[None] * n,
                     is_reference=[False] * n, diversity_length=[0] * n)
    for p, route in enumerate(routes):
        start = p * g
        members = [i for i in range(start, start + g) if valid[i]]
        if not members:
            continue
        pid = rollouts.sample_ids[start]
        if spec.privileged:
            for i in members:
                plan.references[i] = str(rollouts.answers[i])
            continue
        if ROUTES[route] not in spec.routes:
            continue
        if route == SOLVE_NONE:
            r = members[random.Random(f"{spec.seed}-{step}-{pid}-solve-none").randrange(len(members))]
            plan.is_reference[r] = True
            shortest = min(lengths[k] for k in members)
            for i in members:
                if i != r:
                    plan.references[i], plan.reference_rows[i] = rollouts.completions[r], r
                    window = shortest if spec.diversity_window == "group" else min(lengths[i], lengths[r])
                    plan.diversity_length[i] = window if window >= spec.diversity_min_tokens else 0
            continue
        tokens = {i: _tokens(rollouts, i) for i in members}
        for i in members:
            rng = random.Random(f"{spec.seed}-{step}-{pid}-{i - start}")
            siblings = [j for j in members if j != i and correct[j] and tokens[j] != tokens[i]]
            if siblings:
                j = rng.choice(siblings)
                plan.references[i], plan.reference_rows[i] = rollouts.completions[j], j
            elif spec.buffer_references and buffer is not None:
                stored = [e.text for e in buffer.get(pid) if e.token_ids != tokens[i]]
                if stored:
                    plan.references[i] = rng.choice(stored)
    return plan


class TeacherModel(Protocol):
    """What the self-teacher needs of the policy it conditions (:class:`scgrpo.policy.Policy` is one)."""

    tokenizer: Any
    system_prompt: Optional[str]
    runner: nn.Module  # every pass runs inside it (FSDP's root when sharded)
    model: nn.Module  # the network (a peft model: ``disable_adapter`` for the base weights)
    temperature: float
    logprob_chunk_size: int
    budget: Optional[MemoryBudget]  # sizes the passes on a GPU (None or inactive: blocks of rows in batch order)
    passes: Any  # how the passes run (:class:`~scgrpo.policy.PassOptions`: shared_teacher_passes)

    def lm_head(self) -> nn.Module: ...

    def chunk_size(self, models: int = 1) -> int: ...

    def spans(self, kind: str, rollouts: RolloutBatch, rows: Optional[Tensor] = None, max_rows: Optional[int] = None,
              fixed: float = 0.0) -> list[Span]: ...

    def span_hidden(self, rollouts: RolloutBatch, span: Span, model: Optional[nn.Module] = None) -> Tensor: ...

    @property
    def packs(self) -> bool: ...

    def completion_hidden(self, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                          model: Optional[nn.Module] = None, packed: bool = False) -> Tensor: ...

    def eval_mode(self) -> ContextManager[None]: ...

    def sync(self) -> None: ...


def keeps_sampler_states(spec: Optional[TeacherSpec], generation, device: torch.device, episodes: bool,
                         shared_passes: bool = True) -> bool:
    """Whether training rollouts keep the sampler's final hidden states as the self-teacher's student side
    (``generation.student_states``): single-turn rollouts of an objective whose teacher compares distributions;
    "auto", on a GPU where the student's forward is a pass of its own (not shared with the teacher's, see
    ``shared_passes``, :attr:`~scgrpo.policy.PassOptions.shared_teacher_passes`)."""
    if spec is None or spec.output != "divergence" or episodes:
        return False
    mode = generation.student_states
    if mode == "auto":
        shared = shared_passes and spec.weights == "policy" and 2 * generation.max_new_tokens <= SHARED_PASS_TOKENS
        return device.type == "cuda" and not shared
    return mode == "rollout"


class SelfTeacher:
    """Routes a scored rollout batch, builds the teacher's inputs, runs the teacher pass and returns a
    :class:`TeacherSignal`. ``policy`` (a :class:`TeacherModel`) is both the student and, conditioned, the teacher.

    Truncation rule: when the teacher's context (system block with the reference, question, completion
    slots) would exceed the model's maximum length, the reference loses tokens from its *start* (its end,
    where a solution states its answer, is kept); the number of cut references on the rank is logged
    (``credit/truncated_references``). If even an empty reference does not fit, the step ends with a clear
    error.
    """

    def __init__(self, spec: TeacherSpec) -> None:
        self.spec = spec
        self._layout: Optional[tuple[bool, str]] = None
        self._warned_truncation = False

    # ---------------------------------------------------------------------------------------- inputs
    def teacher_prompts(self, policy: TeacherModel, questions: Sequence[Prompt], references: Sequence[str]) -> list[str]:
        """The teacher's prompts: the base system prompt (the prompt's own system message, else the run's) + the
        guide instruction with the reference as the system message, then the student's own turns (or, for a
        template without a system role, the block before the first turn)."""
        if self._layout is None:
            self._layout = system_prompt_layout(policy.tokenizer, policy.system_prompt)
        has_system, default = self._layout
        prompts = []
        for question, ref in zip(questions, references):
            own, turns = split_system(question)
            base = own if own is not None else default
            block = self.spec.template.format(reference=ref)
            prompts.append(render(policy.tokenizer, turns, f"{base}\n\n{block}" if base else block, has_system))
        return prompts

    def _fit_references(self, policy: TeacherModel, questions: list[str], references: list[str], prompt_ids: list[list[int]],
                        completion_len: int) -> tuple[list[str], list[int]]:
        """References cut at their start so that every teacher sequence fits the model (see the class doc);
        returns them and the positions that were cut."""
        limit = max_sequence_length(policy.model)
        if limit is None:
            return references, []
        tok = policy.tokenizer
        out, cut = list(references), []
        for k, (ids, ref) in enumerate(zip(prompt_ids, references)):
            over = len(ids) + completion_len - limit
            if over <= 0:
                continue
            ref_ids = tok(ref, add_special_tokens=False)["input_ids"]
            if len(ref_ids) < over:
                raise ValueError(
                    f"the self-teacher's context for {prompt_text(questions[k])[:60]!r} needs {len(ids) - len(ref_ids) + completion_len} "
                    f"tokens without any reference, over the model's maximum of {limit}: shorten the prompt or "
                    "max_new_tokens, or shorten model.objective.init_args.teacher_template")
            keep = max(len(ref_ids) - over - 1, 0)  # one token of slack for re-tokenisation at the cut
            out[k] = tok.decode(ref_ids[len(ref_ids) - keep :], skip_special_tokens=True) if keep else ""
            cut.append(k)
        if cut and not self._warned_truncation:
            log.warning("self-teacher: %d reference(s) cut from their start to fit the model's %d tokens "
                        "(counted in credit/truncated_references)", len(cut), limit)
            self._warned_truncation = True
        return out, cut

    def teacher_prompt_ids(self, policy: TeacherModel, rollouts: RolloutBatch, rows: list[int],
                           references: list[str]) -> tuple[list[list[int]], int]:
        """Token ids of the teacher's prompt for each of ``rows`` (references cut to fit, see the class doc), and
        the number of cut references."""
        tok = policy.tokenizer
        questions = [rollouts.questions[i] for i in rows]
        c = rollouts.completion_ids.shape[1]
        # rendered and tokenised once per (question, reference): a solve-none group's rows share both
        keys = [(prompt_key(q), r) for q, r in zip(questions, references)]
        first: dict = {}  # each distinct (question, reference): the first row holding it
        for k, key in enumerate(keys):
            first.setdefault(key, k)
        rendered = tok(self.teacher_prompts(policy, [questions[k] for k in first.values()],
                                            [references[k] for k in first.values()]),
                       add_special_tokens=False)["input_ids"]
        by_pair = dict(zip(first, rendered))
        prompt_ids = [list(by_pair[key]) for key in keys]
        references, cut = self._fit_references(policy, questions, list(references), prompt_ids, c)
        if cut:  # only the cut rows are rendered and tokenised again
            redone = tok(self.teacher_prompts(policy, [questions[k] for k in cut], [references[k] for k in cut]),
                         add_special_tokens=False)["input_ids"]
            for k, ids in zip(cut, redone):
                prompt_ids[k] = ids
        return prompt_ids, len(cut)

    @staticmethod
    def assemble(policy: TeacherModel, rollouts: RolloutBatch, rows: list[int], prompt_ids: list[list[int]],
                 width: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """Input ids and attention mask ``[n, Tt + width]`` of the teacher view of ``rows``: their teacher prompts
        left-padded to the longest, then the first ``width`` (default all ``C``) completion tokens the rollouts
        sampled."""
        c = rollouts.completion_ids.shape[1] if width is None else width
        encoded = policy.tokenizer.pad({"input_ids": prompt_ids}, padding=True, return_tensors="pt")  # left-padded
        device = rollouts.completion_ids.device
        index = torch.tensor(rows, device=device)
        ids = torch.cat([encoded["input_ids"].to(device), rollouts.completion_ids[index, :c]], dim=1)  # [n, Tt + c]
        mask = torch.cat([encoded["attention_mask"].to(device), rollouts.context_mask[index, :c].long()], dim=1)
        return ids, mask

    def teacher_inputs(self, policy: TeacherModel, rollouts: RolloutBatch, rows: list[int], references: list[str]) -> tuple[Tensor, Tensor, int]:
        """Input ids and attention mask ``[n, Tt + C]`` of the teacher view for ``rows``: the teacher's prompt
        (left-padded), then the very completion tokens the rollout sampled. Also the number of cut references."""
        prompt_ids, cut = self.teacher_prompt_ids(policy, rollouts, rows, references)
        ids, mask = self.assemble(policy, rollouts, rows, prompt_ids)
        return ids, mask, cut

    # ------------------------------------------------------------------------------------------ pass
    def __call__(self, policy: TeacherModel, rollouts: RolloutBatch, threshold: float,
                 micro_batch_size: Optional[int] = None, buffer: Optional[VerifiedBuffer] = None,
                 step: int = 0) -> TeacherSignal:
        """The signal for ``rollouts``: rollouts with reward >= ``threshold`` are correct; the passes run
        ``micro_batch_size`` rows at a time (None: all); ``buffer`` and ``step`` as :func:`route_rollouts`."""
        start = time.perf_counter()
        spec = self.spec
        plan = route_rollouts(rollouts, spec, threshold, buffer, step)
        n, c = rollouts.completion_ids.shape
        device = rollouts.completion_ids.device
        rows = [i for i in range(n) if plan.references[i] is not None]
        signal = TeacherSignal(
            route=torch.tensor(plan.route, dtype=torch.long, device=device),
            has_teacher=torch.tensor([r is not None for r in plan.references], dtype=torch.bool, device=device),
            is_reference=torch.tensor(plan.is_reference, dtype=torch.bool, device=device),
            diversity_mask=first_tokens(rollouts.completion_mask, torch.tensor(plan.diversity_length, device=device)),
            references=plan.references,
        )
        micro = micro_batch_size or max(len(rows), 1)
        cut, tokens = policy.runner(lambda: self._passes(policy, rollouts, rows, plan.references, signal, micro))
        policy.sync()
        group_route = signal.route.view(-1, rollouts.group_size)[:, 0] if n else signal.route
        if rollouts.excluded is not None and n:  # a skipped group (fewer than 2 rows with a reward) has no case
            group_route = group_route[~rollouts.excluded.view(-1, rollouts.group_size).all(1)]
        groups = max(len(group_route), 1)
        signal.stats = TeacherStats(
            route_shares=tuple(float((group_route == k).sum()) / groups for k in range(len(ROUTES))),
            teacher_rows=float(len(rows)) / max(n, 1), truncated_references=float(cut), tokens=float(tokens),
            time_s=time.perf_counter() - start)
        return signal

    @torch.no_grad()
    def _passes(self, policy: TeacherModel, rollouts: RolloutBatch, rows: list[int], references: list[Optional[str]],
                signal: TeacherSignal, micro: int) -> tuple[int, int]:
        """Student, then teacher passes over ``rows``, eval mode (no dropout), weights gathered once when sharded;
        fills the signal's divergence (or teacher states). Passes: blocks of ``micro`` rows in batch order, or,
        under a memory budget, the micro-batches it packs (rows of like lengths, each cut to its own span, at most
        ``micro`` rows). The student's states before the model's tokens are kept (``[N, C, H]``, zeros elsewhere)
        until the teacher passes have compared them, and only those tokens go through the head; under a budget a
        micro-batch's teacher and student rows share one forward instead (:meth:`_shared_passes`) when the step's
        longest teacher sequence is at most :data:`SHARED_PASS_TOKENS`. Where the rollouts hold the sampler's states
        (``rollouts.student_states``), those are the student's and only the teacher's rows run."""
        n, c = rollouts.completion_ids.shape
        device = rollouts.completion_ids.device
        spec = self.spec
        budget = active(policy.budget)
        if spec.output == "divergence":
            signal.divergence = torch.zeros(n, c, dtype=torch.float32, device=device)
        else:
            signal.teacher_hidden = None  # allocated at the first pass, in the model's dtype
        mask = rollouts.completion_mask.bool()  # [N, C] the model's tokens: where D is defined
        prompt_ids, cut = [], 0
        if rows:
            with record_function("scgrpo.teacher.inputs"):
                prompt_ids, cut = self.teacher_prompt_ids(policy, rollouts, rows, [references[i] for i in rows])
        chunk = policy.chunk_size(2)
        fixed = budget.logit_fixed(chunk, models=2) if budget is not None else 0.0
        with policy.eval_mode(), full_parameters(policy.runner):  # (every rank gathers, rows or not)
            if not rows:
                return cut, 0
            kept = rollouts.student_states if spec.output == "divergence" else None  # [N, C, H] on the host
            short = max(len(ids) for ids in prompt_ids) + rollouts.completion_ids.shape[1] <= SHARED_PASS_TOKENS
            if (policy.passes.shared_teacher_passes and short and budget is not None and kept is None and spec.output == "divergence"
                    and spec.weights == "policy"):
                return cut, self._shared_passes(policy, rollouts, rows, prompt_ids, signal, budget, chunk, fixed, micro)
            student = None
            if spec.output == "divergence" and kept is None:
                with record_function("scgrpo.teacher.student_forward"):
                    student = self._student_states(policy, rollouts, rows, mask, micro, budget)
            # teacher sequences: prompts of their own lengths, the rollouts' completions after them
            lengths = [len(ids) for ids in prompt_ids]
            widest = max(lengths)
            first = [widest - length for length in lengths]
            _, width = row_extents(rollouts.prompt_mask[rows], rollouts.context_mask[rows])

            def plan(members: Optional[list[int]] = None) -> list[tuple[list[int], int, int]]:
                return pack(first, width, widest, budget.costs["forward"], fixed, budget.room(), micro, members)

            if budget is not None:
                batches = plan()
            else:
                batches = [(list(range(k, min(k + micro, len(rows)))), 0, c) for k in range(0, len(rows), micro)]
            tokens, allocating = 0, False

            def run(batch: tuple[list[int], int, int]) -> None:
                nonlocal tokens, allocating
                members, _, w = batch
                index_rows = [rows[k] for k in members]
                index = torch.tensor(index_rows, device=device)
                with record_function("scgrpo.teacher.inputs"):
                    ids, attention = self.assemble(policy, rollouts, index_rows, [prompt_ids[k] for k in members], w)
                with measuring(budget, "forward", ids.numel(), fixed):
                    with record_function("scgrpo.teacher.teacher_forward"):
                        teacher_hidden = self._teacher_hidden(policy, ids, attention, w, policy.packs)  # [n, w, H]
                    if spec.output == "hidden":
                        if signal.teacher_hidden is None:  # (the whole batch's: a failure here is not the pass's)
                            allocating = True
                            signal.teacher_hidden = teacher_hidden.new_zeros(n, c, teacher_hidden.shape[-1])
                            allocating = False
                        signal.teacher_hidden[index, :w] = teacher_hidden
                    else:
                        keep = mask[index, :w]  # [n, w]
                        if kept is not None:  # the sampler's states of these rows, brought to the device
                            own = kept[torch.tensor(index_rows), :w].to(device, non_blocking=True)
                        else:
                            own = student[index, :w]
                        with record_function("scgrpo.teacher.divergence"):
                            divergence = chunked_divergence(
                                teacher_hidden[keep].unsqueeze(0), own[keep].unsqueeze(0),
                                policy.lm_head(), spec.divergence, policy.temperature, chunk)[0]  # [k] the model's tokens
                        signal.divergence[index, :w] = signal.divergence[index, :w].masked_scatter(keep, divergence)
                tokens += ids.numel()

            def tokens_of(batch: tuple[list[int], int, int]) -> int:
                return len(batch[0]) * (widest - batch[1] + batch[2])

            ran = run_passes(budget, "forward", batches, lambda batch: batch[0], tokens_of, plan, run,
                             undone=lambda: not allocating)
            if budget is not None:
                budget.note("teacher", [tokens_of(batch) for batch in ran])
        return cut, tokens

    def _shared_passes(self, policy: TeacherModel, rollouts: RolloutBatch, rows: list[int], prompt_ids: list[list[int]],
                       signal: TeacherSignal, budget: MemoryBudget, chunk: int, fixed: float, micro: int) -> int:
        """Under a memory budget: each micro-batch's teacher and student rows in one forward (``[2n, W + w]``: the
        teacher prompts and the student's own, left-padded to the longest, then the same ``w`` completion columns),
        which halves the passes' launches where they bind, at the price of padding the student's rows to the
        teacher's width (measured on an H200, SmolLM2's step: 0.37 s against 0.35 s in passes of their own,
        ``passes.shared_teacher_passes``). Rows are packed by their teacher sequences, each row costing twice, at most ``micro``
        rows (``2 x micro`` sequences) a pass. Returns the padded tokens of the teacher sequences."""
        device = rollouts.completion_ids.device
        tp = rollouts.prompt_ids.shape[1]
        mask = rollouts.completion_mask.bool()
        teacher_len = [len(ids) for ids in prompt_ids]
        student_len = rollouts.prompt_mask[rows].sum(1).tolist()
        widest = max(max(teacher_len), max(student_len))
        first = [widest - max(t, s) for t, s in zip(teacher_len, student_len)]
        _, width = row_extents(rollouts.prompt_mask[rows], rollouts.context_mask[rows])

        def plan(members: Optional[list[int]] = None) -> list[tuple[list[int], int, int]]:
            return pack(first, width, widest, 2 * budget.costs["forward"], fixed, budget.room(), micro, members)

        batches = plan()
        pad = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else 0
        tokens = 0

        def run(batch: tuple[list[int], int, int]) -> None:
            nonlocal tokens
            members, left, w = batch
            index = torch.tensor([rows[k] for k in members], device=device)
            span = widest - left  # prompt columns of this micro-batch
            with record_function("scgrpo.teacher.inputs"):
                teacher, teacher_mask = self.assemble(policy, rollouts, index.tolist(), [prompt_ids[k] for k in members], w)
                own = min(span, tp)  # the student's prompts are left-padded to tp: their last ``own`` columns
                student = torch.cat([rollouts.prompt_ids[index, tp - own :], rollouts.completion_ids[index, :w]], 1)
                student_mask = torch.cat([rollouts.prompt_mask[index, tp - own :], rollouts.context_mask[index, :w].long()], 1)
                ids = torch.cat([_left_pad(teacher, span + w, pad), _left_pad(student, span + w, pad)])  # [2n, W + w]
                attention = torch.cat([_left_pad(teacher_mask, span + w, 0), _left_pad(student_mask, span + w, 0)])
            with budget.measure("forward", ids.numel(), fixed):
                with record_function("scgrpo.teacher.shared_forward"):
                    hidden = policy.completion_hidden(ids, attention, w, packed=True)  # [2n, w, H]
                k = len(members)
                keep = mask[index, :w]  # [n, w]
                with record_function("scgrpo.teacher.divergence"):
                    divergence = chunked_divergence(
                        hidden[:k][keep].unsqueeze(0), hidden[k:][keep].unsqueeze(0), policy.lm_head(),
                        self.spec.divergence, policy.temperature, chunk)[0]  # [m] the model's tokens of these rows
                signal.divergence[index, :w] = signal.divergence[index, :w].masked_scatter(keep, divergence)
            tokens += ids.numel() // 2  # (the teacher's half, as the passes without a budget count them)

        def tokens_of(batch: tuple[list[int], int, int]) -> int:  # (teacher and student sequences)
            return 2 * len(batch[0]) * (widest - batch[1] + batch[2])

        ran = run_passes(budget, "forward", batches, lambda batch: batch[0], tokens_of, plan, run)
        budget.note("teacher", [tokens_of(batch) for batch in ran])
        return tokens

    @staticmethod
    def _student_states(policy: TeacherModel, rollouts: RolloutBatch, rows: list[int], mask: Tensor, micro: int,
                        budget) -> Tensor:
        """``[N, C, H]`` the student's final states before each of the model's tokens of ``rows`` (zeros elsewhere),
        in blocks of ``micro`` rows or the budget's micro-batches."""
        n, c = rollouts.completion_ids.shape
        tp = rollouts.prompt_ids.shape[1]
        spans = policy.spans("forward", rollouts, torch.tensor(rows, device=rollouts.completion_ids.device), micro)
        states, allocating = None, False

        def run(span: Span) -> None:
            nonlocal states, allocating
            with measuring(budget, "forward", span.tokens(tp)):
                hidden = policy.span_hidden(rollouts, span)  # [n, width, H]
            if states is None:  # (the whole batch's: a failure here is not the pass's)
                allocating = True
                states = hidden.new_zeros(n, c, hidden.shape[-1])
                allocating = False
            keep = mask[span.rows, : span.width].unsqueeze(-1)
            states[span.rows, : span.width] = hidden * keep

        ran = run_passes(budget, "forward", spans, span_rows, lambda span: span.tokens(tp),
                         lambda again: policy.spans("forward", rollouts, torch.tensor(again, device=mask.device), micro),
                         run, undone=lambda: not allocating)
        if budget is not None:
            budget.note("student", [s.tokens(tp) for s in ran])
        return states

    def _teacher_hidden(self, policy: TeacherModel, ids: Tensor, mask: Tensor, c: int, packed: bool = False) -> Tensor:
        if self.spec.weights == "base":
            if not hasattr(policy.model, "disable_adapter"):
                raise ValueError("teacher='base' runs the base model with adapters disabled; it needs LoRA")
            with policy.model.disable_adapter():
                return policy.completion_hidden(ids, mask, c, packed=packed)
        return policy.completion_hidden(ids, mask, c, packed=packed)


def _left_pad(x: Tensor, width: int, value: int) -> Tensor:
    """``[n, t]`` -> ``[n, width]`` with ``value`` columns before it (``width`` >= t)."""
    if x.shape[1] >= width:
        return x[:, x.shape[1] - width :]
    return torch.cat([x.new_full((x.shape[0], width - x.shape[1]), value), x], 1)
