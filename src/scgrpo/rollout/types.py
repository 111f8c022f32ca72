"""Typed containers that flow from the data module through the callbacks and the self-teacher to the loss."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional

import torch
from torch import Tensor


def token_lists(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """Each row's tokens of ``[N, C]`` ``ids`` where ``mask`` holds, as lists (e.g. completions without padding)."""
    return [row[held.bool()].tolist() for row, held in zip(ids.cpu(), mask.cpu())]


NO_REWARD = "no_reward"
"""The key of a rollout's info that the package sets where the rollout has no reward (its verification raised or
timed out, every reward function gave None); an episode's fault is its info's ``fault``"""


def has_no_reward(info: Optional[dict]) -> bool:
    """Whether a rollout has no reward: its episode faulted, or its verification failed (set by the package's own
    runners only: a verifier's own ``error`` in its info is a scored result)."""
    return bool(info and (info.get("fault") or info.get(NO_REWARD)))


@dataclass
class PromptBatch:
    """A batch of prompts as the data module yields it; the rollout callback fills ``rollouts``."""

    ids: list[str]
    questions: list[Any]  # text, or a list of chat messages (scgrpo.chat)
    answers: list[Any]
    split: str = "train"
    rollouts: Optional["RolloutBatch"] = None
    columns: Optional[list[dict[str, Any]]] = None  # each row's other dataset columns (reward functions read them)

    def __len__(self) -> int:
        return len(self.ids)

    def row_columns(self) -> list[dict[str, Any]]:
        return self.columns if self.columns is not None else [{} for _ in self.ids]

    def rows(self) -> list[dict[str, Any]]:
        """The batch's data rows ``{"id", "question", "answer", "columns"}``, as environments receive them."""
        return [{"id": i, "question": q, "answer": a, "columns": c}
                for i, q, a, c in zip(self.ids, self.questions, self.answers, self.row_columns())]


@dataclass
class RolloutStats:
    """What the rollout stage measured on a step (:mod:`scgrpo.stage`), logged every step (:meth:`metrics`)."""

    sampled: float = 0.0
    """Rollouts drawn (``rollout/sampled``; under DAPO, summed over the rounds, kept or dropped)"""
    generation_s: float = 0.0
    """Seconds of sampling (``time/generation_s``; DAPO's extra rounds with their verification)"""
    sampler: dict[str, float] = field(default_factory=dict)
    """The sampling engine's or the episodes' own statistics (``rollout/*``, ``episode/*``)"""
    memory: dict[str, float] = field(default_factory=dict)
    """On a GPU, the rollout phase's peak allocated memory (``memory/rollout_peak_gib``)"""
    verification_s: Optional[float] = None
    """Seconds of verification (``time/verification_s``)"""
    verifier_errors: Optional[float] = None
    """Rollouts whose verifier raised (``verifier/errors``)"""
    verifier_timeouts: Optional[float] = None
    """Rollouts whose verifier ran out of time (``verifier/timeouts``)"""
    rewards: dict[str, float] = field(default_factory=dict)
    """Each named reward's mean, std and errors (``reward/<name>/*``)"""
    extra_rounds: Optional[float] = None
    """DAPO's extra sampling rounds (``dapo/extra_rounds``)"""
    kept_groups: Optional[float] = None
    """DAPO's groups kept (``dapo/kept_groups``)"""
    excluded: Optional[float] = None
    """Rollouts left out of the statistics and the loss for a fault (``rollout/excluded``, ``episodes.on_fault``)"""
    skipped_groups: Optional[float] = None
    """Groups left with fewer than 2 rollouts by the exclusions, skipped (``rollout/skipped_groups``)"""

    def metrics(self) -> dict[str, float]:
        """The logged names and values (those measured: an optional one left None is not logged)."""
        metrics = dict(self.sampler)
        metrics.update({"rollout/sampled": self.sampled, "time/generation_s": self.generation_s})
        metrics.update({f"memory/{name}_peak_gib": gib for name, gib in self.memory.items()})
        named = [("time/verification_s", self.verification_s), ("verifier/errors", self.verifier_errors),
                 ("verifier/timeouts", self.verifier_timeouts)]
        metrics.update({k: v for k, v in named if v is not None})
        metrics.update(self.rewards)
        named = [("dapo/extra_rounds", self.extra_rounds), ("dapo/kept_groups", self.kept_groups),
                 ("rollout/excluded", self.excluded), ("rollout/skipped_groups", self.skipped_groups)]
        metrics.update({k: v for k, v in named if v is not None})
        return {k: float(v) for k, v in metrics.items()}

    def plus(self, other: "RolloutStats") -> "RolloutStats":
        """Both rounds' statistics added up, name by name (a name only one has keeps its value)."""

        def add(a, b):
            if isinstance(a, dict):
                return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}
            return b if a is None else a if b is None else a + b

        return RolloutStats(**{f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


@dataclass
class RolloutBatch:
    """``G`` sampled completions for each of ``P`` prompts, group members adjacent (``N = P x G`` rows).

    Prompts are left-padded and completions right-padded, so ``cat([prompt_ids, completion_ids], 1)`` is the
    sequence the policy saw while sampling.

    A row may be a whole multi-turn episode (:mod:`scgrpo.envs`): its completion is the model's turns and the
    environment's observations in the order they happened, ``completion_mask`` marks the model's own tokens
    (the only ones in the loss, the entropy and the self-teacher's divergence) and ``env_mask`` the
    environment's (attended to, never trained on). ``completions`` then holds each episode's transcript.
    """

    prompt_ids: Tensor  # [N, Tp] long, left-padded
    prompt_mask: Tensor  # [N, Tp] long
    completion_ids: Tensor  # [N, C] long, right-padded
    completion_mask: Tensor  # [N, C] float, the model's tokens: 1 up to and including the first end-of-sequence token
    truncated: Tensor  # [N] bool, no end-of-sequence token within max_new_tokens
    group_size: int
    sample_ids: list[str]  # [N] prompt id of each row
    questions: list[Any]  # [N] text, or a list of chat messages
    answers: list[Any]  # [N]
    completions: list[str]  # [N] decoded completion text
    rewards: Optional[Tensor] = None  # [N] float, set by the verification callback
    infos: Optional[list[dict[str, Any]]] = None  # [N] the verifier's info per rollout
    old_logprobs: Optional[Tensor] = None  # [N, C] fp32 under the sampling policy (only when mu > 1)
    ref_logprobs: Optional[Tensor] = None  # [N, C] fp32 under the reference (only when beta > 0)
    entropy_sum: Optional[Tensor] = None  # [N] fp32 sum over each completion's tokens of the sampling entropy
    sampler_logprobs: Optional[Tensor] = None  # [N, C] fp32 log-prob of each sampled token under the sampler
    env_mask: Optional[Tensor] = None  # [N, C] float, environment tokens inside an episode (None: single turn)
    columns: Optional[list[dict[str, Any]]] = None  # [N] each row's other dataset columns (None: none)
    excluded: Optional[Tensor] = None  # [N] bool, rows without a reward (a fault, ``episodes.on_fault: exclude``):
    # out of their group's statistics and the loss (None: none)
    turn_rewards: Optional[Tensor] = None  # [N, T] fp32, an episode's reward after each model turn (None: single turn)
    turn_index: Optional[Tensor] = None  # [N, C] long, the model turn of each model token, -1 elsewhere
    student_states: Optional[Tensor] = None  # [N, C, H] the sampler's final hidden state before each completion
    # token (generation.student_states "rollout"), on the host, undefined past each row's end (read under
    # completion_mask only); read by the self-teacher and then dropped
    stats: "RolloutStats" = field(default_factory=lambda: RolloutStats())

    @property
    def num_groups(self) -> int:
        return self.completion_ids.shape[0] // self.group_size

    @property
    def valid(self) -> Optional[Tensor]:
        """``[N]`` bool, the rows the step trains on (None: every row)."""
        return None if self.excluded is None else ~self.excluded

    def rewarded(self) -> Optional[Tensor]:
        """``[N]`` bool, the rows that have a reward when faults are excluded (None: every row counts as rewarded)."""
        if self.excluded is None:
            return None
        return torch.tensor([not has_no_reward(info) for info in self.infos or [{}] * len(self.completions)],
                            dtype=torch.bool, device=self.excluded.device)

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)  # [N, Tp + C]

    @property
    def context_mask(self) -> Tensor:
        """``[N, C]`` long: the completion positions that hold a token (the model's or the environment's)."""
        mask = self.completion_mask if self.env_mask is None else self.completion_mask + self.env_mask
        return mask.to(self.prompt_mask.dtype)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.context_mask], dim=1)

    def select(self, rows: Tensor) -> "RolloutBatch":
        """The rows ``rows`` (a 1-D index tensor) as a new batch; ``group_size`` is kept for bookkeeping only."""
        idx = rows.tolist()

        def pick(x):
            return None if x is None else x[rows]

        return RolloutBatch(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            truncated=self.truncated[rows],
            group_size=self.group_size,
            sample_ids=[self.sample_ids[i] for i in idx],
            questions=[self.questions[i] for i in idx],
            answers=[self.answers[i] for i in idx],
            completions=[self.completions[i] for i in idx],
            rewards=pick(self.rewards),
            infos=[self.infos[i] for i in idx] if self.infos is not None else None,
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            entropy_sum=pick(self.entropy_sum),
            sampler_logprobs=pick(self.sampler_logprobs),
            env_mask=pick(self.env_mask),
            columns=[self.columns[i] for i in idx] if self.columns is not None else None,
            excluded=pick(self.excluded),
            turn_rewards=pick(self.turn_rewards),
            turn_index=pick(self.turn_index),
            student_states=(self.student_states[rows.to(self.student_states.device)]
                            if self.student_states is not None else None),
        )


ROUTES = ("partial", "solve_none", "single", "all")
"""Group cases by the number of correct rollouts n_c: 2 <= n_c < G, n_c = 0, n_c = 1, n_c = G"""
PARTIAL, SOLVE_NONE, SINGLE, ALL = range(4)

DEFAULT_TEACHER_TEMPLATE = (
    "Below is a verified solution to the problem you will be given. Use it as a guide, but answer in your "
    "own words.\n\nVerified solution:\n{reference}"
)
"""Guide instruction + reference, appended to the base system prompt in the teacher's view only"""


@dataclass
class TeacherSpec:
    """What self-teacher an objective asks for (objectives expose it as ``objective.teacher``)."""

    routes: tuple[str, ...] = ("partial", "solve_none")
    """Group cases (``ROUTES``) whose rollouts get a teacher; the others are plain GRPO rows"""
    template: str = DEFAULT_TEACHER_TEMPLATE
    """Guide instruction with ``{reference}``, appended to the base system prompt"""
    weights: Literal["policy", "base"] = "policy"
    """"policy": the current weights without gradient; "base": the same network with adapters disabled"""
    output: Literal["divergence", "hidden"] = "divergence"
    """"divergence": per-token D (no gradient); "hidden": the teacher's hidden states, for distillation terms"""
    divergence: str = "forward_kl"
    """forward_kl = KL(teacher || student) (the paper's), reverse_kl or jsd"""
    buffer_references: bool = False
    """A correct rollout with no distinct correct sibling takes a reference from the verified buffer"""
    privileged: bool = False
    """The reference is the row's ground-truth answer (OPSD-oracle), for every row"""
    seed: int = 0
    """Seeds the reference choice, with the step, the prompt id and the place in the group"""
    diversity_window: Literal["pair", "group"] = "pair"
    """Tokens a solve-none rollout's diversity score averages over: "pair", the first min(|o_i|, |o_r|) (the
    paper's); "group", the first min_k |o_k| over the whole group, the same positions for every rollout (ours)"""
    diversity_min_tokens: int = 1
    """A solve-none rollout whose window is shorter than this gets no diversity score (advantage 0) (ours)"""

    def __post_init__(self) -> None:
        unknown = [r for r in self.routes if r not in ROUTES]
        if unknown:
            raise ValueError(f"unknown route(s) {unknown}; expected some of {ROUTES}")
        if "{reference}" not in self.template:
            raise ValueError("the teacher template must contain {reference}")
        if self.weights not in ("policy", "base"):
            raise ValueError(f"teacher={self.weights!r}: expected 'policy' or 'base'")
        if self.diversity_window not in ("pair", "group"):
            raise ValueError(f"diversity_window={self.diversity_window!r}: expected 'pair' or 'group'")
        if self.diversity_min_tokens < 1:
            raise ValueError(f"diversity_min_tokens must be >= 1, got {self.diversity_min_tokens}")
        if self.output not in ("divergence", "hidden"):
            raise ValueError(f"teacher output {self.output!r}: expected 'divergence' or 'hidden'")


@dataclass
class TeacherSignal:
    """What the self-teacher hands the objective for a batch of ``N`` rollouts with ``C`` completion slots."""

    route: Tensor  # [N] long, the group's case (index into ROUTES)
    has_teacher: Tensor  # [N] bool, the row was scored by a teacher
    is_reference: Tensor  # [N] bool, the reference rollout of a solve-none group (its advantage is 0)
    diversity_mask: Tensor  # [N, C] float, tokens t <= L_i of solve-none rows with a teacher
    references: list[Optional[str]]  # [N] the reference text each teacher saw
    divergence: Optional[Tensor] = None  # [N, C] fp32 D_i,t >= 0; 0 at padding and rows without a teacher
    teacher_hidden: Optional[Tensor] = None  # [N, C, H] teacher states (output="hidden"); 0 where no teacher
    stats: Optional["TeacherStats"] = None  # route shares, truncations, tokens, time

    @property
    def num_rows(self) -> int:
        return self.route.shape[0]


@dataclass
class TeacherStats:
    """The self-teacher's work on a step, logged every step."""

    route_shares: tuple[float, ...]
    """Share of the groups in each case of ``ROUTES`` (``credit/route_<name>``)"""
    teacher_rows: float
    """Share of the rows with a teacher (``credit/teacher_rows``)"""
    truncated_references: float
    """References cut at their start to fit the model on this rank (``credit/truncated_references``)"""
    tokens: float
    """Tokens the teacher pass read (``tokens/teacher``)"""
    time_s: float
    """Seconds of the routing and teacher pass (``time/teacher_s``)"""

    def metrics(self) -> dict[str, float]:
        metrics = {f"credit/route_{name}": share for name, share in zip(ROUTES, self.route_shares)}
        metrics.update({"credit/teacher_rows": self.teacher_rows, "credit/truncated_references": self.truncated_references,
                        "tokens/teacher": self.tokens, "time/teacher_s": self.time_s})
        return metrics
