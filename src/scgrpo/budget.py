"""One GPU memory budget sizes every pass of a training step (``model.memory_budget_gib``).

The budget is the memory the whole process may hold on its GPU: by default what the card has free when the run
starts (or, under ``torch.cuda.set_per_process_memory_fraction``, what that cap allows), less a margin. Each
phase asks it how to split its rows:

- the rollout's decode slots and KV cache (the engine sizes them from the same budget);
- the scoring and teacher passes (forwards without gradient) and the update's forward/backward passes: rows
  sorted by length and packed into micro-batches whose padded tokens fit what the budget leaves beside the memory
  already allocated, each micro-batch cut to its own rows' span (no column that is padding for all its rows);
- gradient checkpointing in the update, switched on only when one row does not fit without it;
- the fp32 log-prob chunks (tokens per block of full-vocabulary logits).

Costs are bytes per padded token of a pass, plus a fixed part (a block of fp32 logits). Before a kind of pass has
run they come from the model's shapes (:func:`shape_costs`, deliberately high); every pass then measures its own
peak (``torch.cuda.max_memory_allocated`` above what was allocated when it began) and the cost of that kind of
pass becomes the largest measured, so later steps are sized by what the passes really took.

A pass that runs out of memory anyway (a cost measured on shorter rows, a fragmented cache, another process on the
card) is not the end of the step: the cached blocks are released, its kind's cost per token is raised so that such a
pass no longer fits (at least doubled), and its rows and those of the passes after it are planned again
(:func:`run_passes`; ``memory/split_passes`` counts them). Only a pass of one row, a backward, or a pass on several
ranks (whose passes must pair up) still fails, with the one-line message of :mod:`scgrpo.oom`.

On CPU there is no budget: passes run ``micro_batch_size`` rows at a time in batch order, uncut (packed:
:attr:`scgrpo.policy.Policy.packs`).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import torch
from torch import Tensor

from scgrpo.distributed import world_size
from scgrpo.oom import is_out_of_memory, release_memory
from scgrpo.rollout.memory import memory_free

log = logging.getLogger(__name__)

GIB = 2**30
MARGIN_SHARE = 0.05
"""Share of what the process can reach kept out of the default budget (at least :data:`MIN_MARGIN`): the CUDA
context, cuBLAS and NCCL workspaces and other processes' growth are not the caching allocator's"""
MIN_MARGIN = GIB // 2
TENSOR_SHARE = 0.85
"""Share of the budget that live tensors may take: the caching allocator reserves more than it hands out (blocks
split and cached by size), and the budget bounds what it reserves"""
PASS_KINDS = ("forward", "train", "train_checkpointed")
"""Kinds of pass: a forward without gradient (scoring, teacher), a forward + backward, the same under gradient
checkpointing"""
CHOICES = ("scoring_passes", "scoring_tokens_per_pass", "student_passes", "student_tokens_per_pass", "teacher_passes",
           "teacher_tokens_per_pass", "update_passes", "update_tokens_per_pass", "gradient_checkpointing",
           "split_passes")
"""What the plans of a step choose, logged as ``memory/<name>`` (NaN where the phase did not run)"""
MIN_MEASURED_TOKENS = 256
"""A pass of fewer padded tokens does not update the measured costs (its fixed part would dominate)"""
FLOOR_SHARE = 0.25
"""A measured cost is taken no lower than this share of the shape-based estimate (a pass whose peak fell inside
memory freed during it would otherwise read as almost free)"""
SPLIT_GROWTH = 2.0
"""After a pass runs out of memory, its kind's cost per token becomes this times the larger of the cost and what
would have let the pass fit the room left (:meth:`MemoryBudget.missed`), before its rows are planned again"""
LOGIT_COPIES = 3
"""fp32 [tokens, V] blocks alive at once while a chunk of log-probs (or of a divergence, per model) is computed"""


@dataclass
class Span:
    """A micro-batch: ``rows`` of the batch, the columns ``[left, Tp + width)`` of their ``[Tp + C]`` sequences."""

    rows: Tensor  # [n] long
    left: int  # first column kept (columns before it are padding for every row)
    width: int  # completion columns kept (after them only padding), >= 1

    def tokens(self, prompt_width: int) -> int:
        return len(self.rows) * (prompt_width - self.left + self.width)


def span_rows(span: Span) -> list[int]:
    """The batch rows of a micro-batch."""
    return span.rows.tolist()


def whole_rows(rows: Tensor, max_rows: Optional[int], completion_width: int) -> list[Span]:
    """Blocks of ``max_rows`` of ``rows`` (all at once: None) in their order, uncut: the passes without a budget."""
    if not len(rows):
        return []
    return [Span(block, 0, completion_width) for block in torch.split(rows, max_rows or len(rows))]


def active(budget: Optional["MemoryBudget"]) -> Optional["MemoryBudget"]:
    """``budget`` where it sizes passes (resolved on a GPU), else None."""
    return budget if budget is not None and budget.active else None


def measuring(budget: Optional["MemoryBudget"], kind: str, tokens: int, fixed: float = 0.0):
    """``budget.measure(...)`` for a pass, or nothing without an active budget."""
    return budget.measure(kind, tokens, fixed) if budget is not None and budget.active else contextlib.nullcontext()


def row_extents(prompt_mask: Tensor, context_mask: Tensor) -> tuple[list[int], list[int]]:
    """Per row, the first prompt column that holds a token and the completion columns up to the last that does
    (at least 1): ``[N, Tp]`` and ``[N, C]`` masks (prompts left-padded, completions right-padded)."""
    tp, c = prompt_mask.shape[1], context_mask.shape[1]
    held = prompt_mask.bool()
    first = torch.where(held.any(1), held.float().argmax(1), torch.full_like(held[:, 0], tp, dtype=torch.long))
    cols = torch.arange(1, c + 1, device=context_mask.device)
    width = (context_mask.bool() * cols).amax(1).clamp(min=1) if c else torch.ones_like(first)
    return first.tolist(), width.tolist()


def pack(first: list[int], width: list[int], prompt_width: int, per_token: float, fixed: float, room: float,
         max_rows: Optional[int] = None, rows: Optional[list[int]] = None) -> list[tuple[list[int], int, int]]:
    """Micro-batches ``(rows, left, width)`` of the rows ``rows`` (default: all), packed so that each one's cost,
    ``fixed + per_token x rows x (prompt_width - left + width)``, stays within ``room`` bytes, with at most
    ``max_rows`` rows. Rows are taken in order of their own span (``prompt_width - first + width``), then of
    completion width, so that a micro-batch holds rows of like lengths and little padding. A row that alone exceeds
    ``room`` still gets a micro-batch of its own (the pass may then run out of memory, and says so)."""
    order = sorted(rows if rows is not None else range(len(first)),
                   key=lambda i: (prompt_width - first[i] + width[i], width[i], i))
    batches: list[tuple[list[int], int, int]] = []
    members: list[int] = []
    left = right = 0
    for i in order:
        new_left, new_right = (min(left, first[i]), max(right, width[i])) if members else (first[i], width[i])
        cost = fixed + per_token * (len(members) + 1) * (prompt_width - new_left + new_right)
        if members and (cost > room or (max_rows is not None and len(members) >= max_rows)):
            batches.append((members, left, right))
            members, new_left, new_right = [], first[i], width[i]
        members.append(i)
        left, right = new_left, new_right
    if members:
        batches.append((members, left, right))
    return batches


Item = TypeVar("Item")


def run_passes(budget: Optional["MemoryBudget"], kind: str | Callable[[], str], items: Sequence[Item],
               rows_of: Callable[[Item], list[int]], tokens_of: Callable[[Item], int],
               replan: Callable[[list[int]], Sequence[Item]], run: Callable[[Item], None],
               undone: Callable[[], bool] = lambda: True) -> list[Item]:
    """``run(item)`` for each planned pass of ``items``. Under an active budget on one process, a pass of several rows
    that runs out of GPU memory is given up: the cost of ``kind`` (or of what ``kind()`` says now) is raised so that
    such a pass no longer fits (:meth:`MemoryBudget.missed`), the cached blocks are released, and its rows with those
    of every later pass are planned again (``replan(rows)``) and run. The failed ``run`` must have left nothing half
    done (what it wrote is written again by the passes that replace it); ``undone()`` says whether it did, when it
    was asked at the failure (an update's backward had begun, a buffer for the whole batch was being allocated:
    False). Without a budget, on several ranks, for a pass of one row or a pass not undone, the error passes on.
    Returns the passes that ran."""
    pending, ran = list(items), []
    while pending:
        item = pending.pop(0)
        try:
            run(item)
            ran.append(item)
            continue
        except Exception as err:  # noqa: BLE001 - only a failed allocation is handled; the rest is raised again
            if not (is_out_of_memory(err) and active(budget) is not None and len(rows_of(item)) > 1
                    and world_size() == 1 and undone()):
                raise
        rows = [row for failed in (item, *pending) for row in rows_of(failed)]  # (the error and its frames are gone)
        budget.missed(kind() if callable(kind) else kind, len(rows_of(item)), tokens_of(item))
        pending = list(replan(rows))
    return ran


def shape_costs(config, dtype_bytes: int) -> dict[str, float]:
    """Bytes per token of each kind of pass, from a decoder's shapes (hidden H, MLP I, L layers): an upper estimate
    used until the passes have measured their own. A forward without gradient holds a layer's temporaries (the
    residual, norms in fp32, q/k/v, MLP: about 14H + 6I bytes in bf16); a forward kept for backward saves about 8H +
    4I values a layer plus two fp32 norm inputs; under checkpointing every layer's input plus two layers' worth (the one recomputed and its gradients)."""
    h = int(getattr(config, "hidden_size", 0) or 0)
    i = int(getattr(config, "intermediate_size", 0) or 4 * h)
    layers = int(getattr(config, "num_hidden_layers", 0) or 1)
    if not h:
        return {kind: 1 << 20 for kind in PASS_KINDS}  # (an unknown architecture: 1 MiB a token)
    layer = (8 * h + 4 * i) * dtype_bytes + 2 * 4 * h
    return {
        "forward": 1.5 * ((3 * h + 3 * i) * dtype_bytes + 2 * 4 * h + h * dtype_bytes),
        "train": 1.25 * layers * layer,
        "train_checkpointed": 1.25 * (layers * h * dtype_bytes + 2 * layer),
    }


def process_limit(device: torch.device) -> tuple[int, int, int]:
    """(bytes this process may reserve on ``device``, the card's total, its free bytes now): the card's free memory
    plus what this process already reserved, within a ``set_per_process_memory_fraction`` cap."""
    free, total = torch.cuda.mem_get_info(device)
    return memory_free(device) + torch.cuda.memory_allocated(device), total, free


class MemoryBudget:
    """The budget of one process's GPU (see the module docstring); inactive (``active`` False) off a GPU.

    Args:
        gib: the budget in GiB; None = what the process can reach when the model is loaded (the card's free memory
            and its own reserve, within a per-process cap), less :data:`MARGIN_SHARE` of it (at least
            :data:`MIN_MARGIN`).
    """

    def __init__(self, gib: Optional[float] = None) -> None:
        if gib is not None and not gib > 0:
            raise ValueError(f"memory_budget_gib must be > 0 GiB (or null: the card's free memory), got {gib}")
        self.gib = gib
        self.device: Optional[torch.device] = None
        self.total: Optional[int] = None  # bytes, once resolved on a GPU
        self.costs: dict[str, float] = {}
        self.measured: set[str] = set()
        self.floor: dict[str, float] = {}  # a measured cost is never taken below this (a quarter of the estimate)
        self.chosen: dict[str, float] = {}  # what this step's plans chose (logged as memory/*)
        self.peaks = PeakTracker()  # the phases' peaks, across the resets of the passes measured here
        self._logged = False
        self._warned_split = False

    @property
    def active(self) -> bool:
        return self.total is not None

    def setup(self, device: torch.device, config, dtype: torch.dtype) -> None:
        """Resolves the budget on ``device`` (nothing off a GPU) and the shape-based costs of ``config``'s passes."""
        if device.type != "cuda" or self.total is not None:
            return
        self.device = device
        reachable, total, _ = process_limit(device)
        self.reachable = reachable
        if self.gib is not None:
            self.total = int(self.gib * GIB)
        else:
            self.total = max(int(reachable - max(MIN_MARGIN, MARGIN_SHARE * min(total, reachable))), 0)
        self.costs = shape_costs(config, torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 2)
        self.floor = {kind: FLOOR_SHARE * cost for kind, cost in self.costs.items()}
        self.vocab = int(getattr(config, "vocab_size", 0) or 0)

    def rollout_settings(self, generation):
        """``generation`` (:class:`~scgrpo.rollout.engine.GenerationSettings`) with this default budget, once
        resolved, as its ``memory_budget_gib`` where it has none and frees its workspace after each rollout, so that
        its decode slots fill what the budget leaves rather than a quarter of the free memory (a kept workspace
        records its prefills as CUDA graphs, which a budgeted rollout does not)."""
        if (self.total is None or self.gib is not None or generation.memory_budget_gib is not None
                or generation.keep_workspace):
            return generation
        return replace(generation, memory_budget_gib=self.total / GIB)

    @property
    def gib_resolved(self) -> Optional[float]:
        return None if self.total is None else self.total / GIB

    def room(self) -> float:
        """Bytes new tensors may take now: the budget's tensor share less what is allocated."""
        return TENSOR_SHARE * self.total - torch.cuda.memory_allocated(self.device)

    def logit_fixed(self, chunk_size: int, models: int = 1) -> float:
        """Bytes of the fp32 logit blocks of a chunk of ``chunk_size`` tokens (``models``: 2 for a divergence)."""
        return float(LOGIT_COPIES * models * chunk_size * self.vocab * 4)

    def chunk_size(self, configured: int, models: int = 1) -> int:
        """Tokens per block of fp32 logits: ``configured``, or fewer (a multiple of 64, at least 64 or
        ``configured`` if that is smaller) so that the blocks take at most a tenth of the room left."""
        if not self.active or not self.vocab:
            return configured
        fit = int(0.1 * max(self.room(), 0) // (LOGIT_COPIES * models * self.vocab * 4))
        return min(configured, max(64, fit // 64 * 64))

    def plan(self, kind: str, first: list[int], width: list[int], prompt_width: int, device: torch.device,
             rows: Optional[list[int]] = None, max_rows: Optional[int] = None, fixed: float = 0.0) -> list[Span]:
        """Micro-batches of ``rows`` (default all) for a pass of ``kind`` (see :func:`pack`)."""
        room = self.room()
        batches = pack(first, width, prompt_width, self.costs[kind], fixed, room, max_rows, rows)
        return [Span(torch.tensor(b, dtype=torch.long, device=device), left, w) for b, left, w in batches]

    def begin_step(self) -> None:
        """Forgets the last step's choices (a phase that does not run this step logs NaN)."""
        self.chosen = {key: float("nan") for key in CHOICES}

    def note(self, phase: str, tokens: list[int]) -> None:
        """Records a phase's choice (``memory/*``): its number of passes and the padded tokens of its largest, from
        the padded tokens of each pass."""
        if tokens:
            self.chosen[f"{phase}_passes"] = float(len(tokens))
            self.chosen[f"{phase}_tokens_per_pass"] = float(max(tokens))

    def missed(self, kind: str, rows: int, tokens: int) -> None:
        """A pass of ``kind`` over ``rows`` rows (``tokens`` padded tokens) ran out of memory: the allocator's cached
        blocks are released, and the cost per token of ``kind`` is raised to :data:`SPLIT_GROWTH` times the larger of
        itself and what the room left now allows such a pass (so that the failed pass's rows are planned in at least two
        passes; no later measurement lowers it). The step's ``memory/split_passes`` counts it; the first time, a
        warning says so."""
        release_memory()
        self.costs[kind] = SPLIT_GROWTH * max(self.costs[kind], max(self.room(), 0.0) / max(tokens, 1))
        self.measured.add(kind)
        split = self.chosen.get("split_passes", float("nan"))
        self.chosen["split_passes"] = 1.0 if split != split else split + 1.0
        if not self._warned_split:
            log.warning("a %s pass of %d rows (%d tokens) ran out of GPU memory within the %.1f GiB budget; its rows "
                        "are planned again at %.0f KiB a token (memory/split_passes counts such passes)",
                        kind.replace("_", " "), rows, tokens, self.total / GIB, self.costs[kind] / 1024)
            self._warned_split = True

    def fits(self, kind: str, tokens: int, fixed: float = 0.0) -> bool:
        return fixed + self.costs[kind] * tokens <= self.room()

    @contextlib.contextmanager
    def measure(self, kind: str, tokens: int, fixed: float = 0.0) -> Iterator[None]:
        """Measures the peak of the pass run inside (bytes above what was allocated when it began) and raises the
        cost of ``kind`` to it when the pass had :data:`MIN_MEASURED_TOKENS` tokens or more."""
        if not self.active:
            yield
            return
        start = torch.cuda.memory_allocated(self.device)
        self.peaks.reset(self.device)
        yield
        peak = torch.cuda.max_memory_allocated(self.device) - start
        if tokens >= MIN_MEASURED_TOKENS:
            per_token = max((peak - fixed) / tokens, self.floor.get(kind, 0.0))
            if kind not in self.measured:  # the first measurement replaces the shape-based estimate
                self.costs[kind], self.measured = per_token, self.measured | {kind}
            else:
                self.costs[kind] = max(self.costs[kind], per_token)

    def metrics(self) -> dict[str, float]:
        """``memory/budget_gib``, the KiB per padded token of each kind of pass (measured, or estimated until
        measured) and what this step's plans chose (passes and tokens per pass of each phase, checkpointing)."""
        if not self.active:
            return {}
        out = {"memory/budget_gib": self.total / GIB}
        out.update({f"memory/{kind}_kib_per_token": self.costs[kind] / 1024 for kind in PASS_KINDS})
        out.update({f"memory/{name}": value for name, value in self.chosen.items()})
        return out

    def describe(self) -> str:
        """One line: the budget and what the step's passes chose (logged once per run)."""
        _, total, free = process_limit(self.device)
        source = f"set to {self.gib:g} GiB" if self.gib is not None else (
            f"default: {self.reachable / GIB:.1f} GiB reachable at the start less a margin")
        chosen = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in self.chosen.items() if v == v)
        return (f"memory budget {self.total / GIB:.1f} GiB ({source}; card {total / GIB:.1f} GiB, {free / GIB:.1f} "
                f"free): {chosen}")

    def log_once(self) -> None:
        if self.active and not self._logged:
            log.info("%s", self.describe())
            self._logged = True


# --------------------------------------------------------------------------- peaks shared with the phase logging
class PeakTracker:
    """A step's phases' peaks of allocated GPU memory, across the allocator resets of the passes a budget measures
    inside a phase (a pass measured inside a phase does not hide the phase's own peak). The budget holds one
    (:attr:`MemoryBudget.peaks`); the step's phase logging reads it."""

    def __init__(self) -> None:
        self.carried: dict[int, int] = {}  # device index -> the phase's peak before the last reset

    def reset(self, device: torch.device) -> None:
        """Resets the allocator's peak, carrying the peak so far into :meth:`phase_peak`'s next answer."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.carried[index] = max(self.carried.get(index, 0), torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    def phase_peak(self, device: torch.device) -> int:
        """The peak allocated since the last call (across :meth:`reset` calls in between), and a new phase."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        peak = max(self.carried.pop(index, 0), torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
