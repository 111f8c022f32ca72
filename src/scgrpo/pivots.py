"""Decisions a task marks in the model's text, and whether the token weights land on them (DESIGN §4.2).

A task says which spans of the model's text were *decisions* and whether each was right:

- an environment in ``StepResult.info["decisions"]`` (spans of that turn's text, ``Action.text``, unless a
  decision names another model turn);
- a verifier in ``VerificationResult.info["decisions"]`` (spans of the completion it scored).

Each decision is a :class:`Decision`, a dict ``{"turn": k, "span": [start, end], "correct": bool}`` (``turn``
optional) or a triple ``(turn, (start, end), correct)``; spans are character offsets, end exclusive.

:func:`decision_labels` maps the spans to the model's own tokens through the offsets of the ids as they were
sampled (each token's characters in the decoded text, never a re-tokenisation): a token is a decision token when
its characters overlap a decision's span. :func:`pivot_metrics` then measures, in the failed rollouts of
partial-solve groups that had a teacher and mark at least one decision (their reference holds the right decisions):

- ``credit/pivot_auroc``: the AUROC of the weight f at tokens of wrong decisions against tokens of right ones
  (the probability that a wrong decision's token weighs more than a right one's, ties counting half): 0.5 means
  the weights do not tell them apart, 1 that every wrong decision outweighs every right one;
- ``credit/pivot_share``: the decisions' share of the f mass over their share of the tokens (1: no more weight
  on decisions than uniform weights would put there);
- ``credit/pivot_rows``: the rows counted;
- ``credit/pivot_auroc_turn``: the same AUROC within each model turn, pooled over turns (each turn's pairs: a wrong
  decision's token against a right one's of the same turn index, in any row). Where a task puts its hard decision
  at a fixed turn, wrong and right decisions also differ by position, and the pooled AUROC reads the weights'
  position as much as their targeting; this one compares tokens at the same turn only;
- ``credit/pivot_auroc_row``: within each row, pooled over rows (a row's wrong-decision tokens against its own
  right ones): a row whose weights are all higher moves it not at all, as it moves the pooled AUROC.

A task whose only decision decides the reward (a numeric answer: right exactly when it scores 1) has no right
decision in a failed rollout: its AUROC is undefined (NaN) and only the share speaks. The offsets decode each
token alone and join the pieces; where that is not the whole text (a character split over tokens, or a tokenizer
whose pieces drop a leading space, as SentencePiece's do) every prefix is decoded, a cost quadratic in the turn's
length on the credit-logging steps.
"""

from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from scgrpo.distributed import all_reduce, gather_values, rank

NONE, RIGHT, WRONG, BOTH = 0, 1, 2, 3
"""A token's label: in no decision, in right decisions only, in wrong ones only, in both (one token that two
decisions of either kind split: counted as a decision token, left out of the AUROC's two classes)"""

PIVOT_KEYS = ("credit/pivot_auroc", "credit/pivot_share", "credit/pivot_rows", "credit/pivot_auroc_turn",
              "credit/pivot_auroc_row")


@dataclass(frozen=True)
class Decision:
    """One decision in the model's text: characters ``start`` to ``end`` (exclusive) of model turn ``turn``
    (0-based; None: the turn whose step reported it, or the completion for a verifier), right or not."""

    start: int
    end: int
    correct: bool
    turn: Optional[int] = None

    def as_info(self) -> dict[str, Any]:
        """The decision as plain data, for ``info`` (kept in the completions table)."""
        return {"turn": self.turn, "span": [self.start, self.end], "correct": self.correct}


class DecisionError(ValueError):
    """A task's ``info["decisions"]`` that is not a list of decisions."""


def _int(value: Any, what: str) -> int:
    """``value`` as an int: any integer type (numpy's too), not a bool."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise DecisionError(f"{what} must be an int, got {value!r}") from None


def read_decision(item: Any, turn: Optional[int]) -> Decision:
    """One decision from any of its forms (see the module docstring); ``turn`` is the one it defaults to."""
    if isinstance(item, Decision):
        found = item
    elif isinstance(item, dict):
        if "span" in item:
            span = item["span"]
            if not isinstance(span, (list, tuple)) or len(span) != 2:
                raise DecisionError(f"a decision's span must be [start, end], got {span!r}")
            start, end = span
        else:
            start, end = item.get("start"), item.get("end")
        if "correct" not in item:
            raise DecisionError(f"a decision needs 'correct', got {item!r}")
        found = Decision(_int(start, "a decision's start"), _int(end, "a decision's end"), item["correct"],
                         None if item.get("turn") is None else _int(item["turn"], "a decision's turn"))
    elif isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[1], (list, tuple)):
        if len(item[1]) != 2:
            raise DecisionError(f"a decision's span must be (start, end), got {item[1]!r}")
        found = Decision(_int(item[1][0], "a decision's start"), _int(item[1][1], "a decision's end"), item[2],
                         None if item[0] is None else _int(item[0], "a decision's turn"))
    else:
        raise DecisionError(f"a decision is a Decision, a dict with span and correct, or (turn, (start, end), "
                            f"correct); got {item!r}")
    if not isinstance(found.correct, bool) and type(found.correct).__name__ in ("bool", "bool_"):  # numpy's
        found = Decision(found.start, found.end, bool(found.correct), found.turn)
    if not isinstance(found.correct, bool):
        raise DecisionError(f"a decision's correct must be true or false, got {found.correct!r}")
    if found.turn is not None:
        _int(found.turn, "a decision's turn")
    if not 0 <= found.start <= found.end:
        raise DecisionError(f"a decision's span must have 0 <= start <= end, got ({found.start}, {found.end})")
    return Decision(found.start, found.end, found.correct, turn if found.turn is None else found.turn)


def read_decisions(value: Any, turn: Optional[int] = None) -> list[Decision]:
    """``info["decisions"]`` as decisions (turn None defaulting to ``turn``); raises :class:`DecisionError`."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise DecisionError(f"info['decisions'] must be a list of decisions, got {type(value).__name__}")
    return [read_decision(item, turn) for item in value]


def row_decisions(info: Optional[dict], episode: bool) -> list[Decision]:
    """Every decision a rollout's ``info`` holds: an episode's per-step infos (``info["env"][k]`` for model turn
    ``k``), or a verifier's ``info``. Raises :class:`DecisionError` for a malformed one."""
    if not isinstance(info, dict):
        return []
    if not episode:
        return [Decision(d.start, d.end, d.correct, 0) for d in read_decisions(info.get("decisions"), 0)]
    found: list[Decision] = []
    for turn, step in enumerate(info.get("env") or []):
        if isinstance(step, dict):
            found += read_decisions(step.get("decisions"), turn)
    return found


def turn_text(decode: Callable[[list[int]], str], ids: list[int], strip: bool) -> str:
    """The text of a model turn as the task read it: the ids decoded without special tokens (stripped for an
    episode's turn, as :class:`~scgrpo.envs.runner.EpisodeRunner` hands it to the environment)."""
    text = decode(ids)
    return text.strip() if strip else text


def token_offsets(decode: Callable[[list[int]], str], ids: list[int], strip: bool) -> list[tuple[int, int]]:
    """Each token's characters ``[start, end)`` in :func:`turn_text` of ``ids``: the length of the decoded text up
    to the token and up to its end (so a character that two tokens' bytes make belongs to the one that completes
    it, and a token that decodes to nothing, a special token, covers no character)."""
    if not ids:
        return []
    pieces = [decode([t]) for t in ids]
    whole = decode(ids)
    if "".join(pieces) == whole:
        ends, total = [], 0
        for piece in pieces:
            total += len(piece)
            ends.append(total)
    else:  # a character split over tokens: how much of the whole text each decoded prefix already holds (an
        # incomplete character decodes to a replacement character, not the character)
        ends = [len(os.path.commonprefix([decode(ids[: k + 1]), whole])) for k in range(len(ids))]
    lead = len(whole) - len(whole.lstrip()) if strip else 0
    starts = [0] + ends[:-1]
    return [(a - lead, b - lead) for a, b in zip(starts, ends)]


def model_turns(mask_row: list[int]) -> list[tuple[int, int]]:
    """The runs ``[start, end)`` of model tokens in a completion's mask, in order: an episode's model turns
    (an observation of at least one token lies between two turns)."""
    runs, start = [], None
    for k, m in enumerate(mask_row):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    if start is not None:
        runs.append((start, len(mask_row)))
    return runs


def label_turn(offsets: list[tuple[int, int]], decisions: Sequence[Decision]) -> list[int]:
    """Each token's label (``NONE``/``RIGHT``/``WRONG``/``BOTH``) from ``decisions`` over its ``offsets``."""
    labels = []
    for a, b in offsets:
        label = NONE
        for d in decisions:
            if b > a and a < d.end and b > d.start:  # the token's characters overlap the span
                label |= RIGHT if d.correct else WRONG
        labels.append(label)
    return labels


def decision_labels(completion_ids: Tensor, completion_mask: Tensor, infos: Optional[list], episode: bool,
                    decode: Callable[[list[int]], str]) -> tuple[Optional[Tensor], int]:
    """``[N, C]`` int8 labels of every rollout's tokens (``NONE`` where no decision, and at the environment's
    tokens and padding), or None when no rollout marks a decision; and the rows whose decisions were malformed
    (those rows are left unlabelled)."""
    n, width = completion_ids.shape
    labels = torch.zeros(n, width, dtype=torch.int8)
    ids_rows, mask_rows = completion_ids.cpu().tolist(), completion_mask.cpu().bool().tolist()
    marked, malformed = False, 0
    for row in range(n):
        try:
            decisions = row_decisions(infos[row] if infos else None, episode)
        except DecisionError:
            malformed += 1
            continue
        if not decisions:
            continue
        marked = True
        turns = model_turns(mask_rows[row]) if episode else [(0, sum(mask_rows[row]))]
        for k, (start, end) in enumerate(turns):
            mine = [d for d in decisions if d.turn == k]
            if not mine:
                continue
            offsets = token_offsets(decode, ids_rows[row][start:end], strip=episode)
            labels[row, start:end] = torch.tensor(label_turn(offsets, mine), dtype=torch.int8)
    return (labels if marked else None), malformed


def auroc(positive: Tensor, negative: Tensor) -> float:
    """P(a value of ``positive`` > one of ``negative``) + half P(equal), from ranks (Mann-Whitney U); NaN when
    either is empty."""
    n_pos, n_neg = positive.numel(), negative.numel()
    if n_pos == 0 or n_neg == 0:
        return math.nan
    values = torch.cat([positive.double().reshape(-1), negative.double().reshape(-1)])
    order = torch.argsort(values)
    _, inverse, counts = torch.unique(values[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    average_rank = ends - (counts.double() - 1) / 2  # 1-based rank of each distinct value, ties averaged
    ranks = torch.empty_like(values)
    ranks[order] = average_rank[inverse]
    u = float(ranks[:n_pos].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def stratified_auroc(positive: Tensor, positive_strata: Tensor, negative: Tensor, negative_strata: Tensor) -> float:
    """The AUROC of ``positive`` against ``negative`` within strata, pooled: the sum over strata of each one's
    Mann-Whitney count over the sum of its pairs (a stratum holding one class only has none); NaN without pairs."""
    pairs, wins = 0.0, 0.0
    for stratum in torch.unique(positive_strata).tolist():
        pos, neg = positive[positive_strata == stratum], negative[negative_strata == stratum]
        n = pos.numel() * neg.numel()
        if n:
            pairs, wins = pairs + n, wins + auroc(pos, neg) * n
    return wins / pairs if pairs else math.nan


def _turn_index(mask: Tensor) -> Tensor:
    """``[N, C]`` each model token's turn (0-based run of model tokens in its row); -1 elsewhere."""
    index = torch.full(mask.shape, -1, dtype=torch.long)
    for row, mask_row in enumerate(mask.int().tolist()):
        for k, (start, end) in enumerate(model_turns(mask_row)):
            index[row, start:end] = k
    return index


def pivot_metrics(weights: Tensor, labels: Tensor, completion_mask: Tensor, rows: Tensor,
                  device: Optional[torch.device] = None) -> dict[str, float]:
    """The ``credit/pivot_*`` keys over ``rows`` (``[N]`` bool: failed partial-solve rollouts with a teacher),
    from the ``[N, C]`` token ``weights`` f, the :func:`decision_labels` and the model-token mask, pooled over
    every rank. Only rows with at least one decision token count."""
    weights, labels = weights.detach().float().cpu(), labels.cpu()
    mask = completion_mask.cpu().bool()
    rows = rows.cpu().bool() & ((labels != NONE) & mask).any(1)
    model = mask & rows.unsqueeze(1)
    decision = model & (labels != NONE)
    turn = _turn_index(mask)
    row_id = torch.arange(mask.shape[0]).unsqueeze(1).expand_as(turn) + (rank() << 32)  # (unique over ranks)
    # per class, each token's (f, turn, row), gathered over ranks in one collective
    (wrong, wrong_turn, wrong_row), (right, right_turn, right_row) = (
        gather_values(torch.stack([weights[where].double(), turn[where].double(), row_id[where].double()], 1)
                      .to(device or "cpu")).reshape(-1, 3).cpu().unbind(1)
        for where in (model & (labels == WRONG), model & (labels == RIGHT)))
    f_all, f_decision, n_all, n_decision, n_rows = all_reduce(
        [float(weights[model].sum()), float(weights[decision].sum()), float(model.sum()), float(decision.sum()),
         float(rows.sum())], "sum", device)
    share = (f_decision / f_all) / (n_decision / n_all) if f_all > 0 and n_decision > 0 else math.nan
    return {"credit/pivot_auroc": auroc(wrong, right), "credit/pivot_share": share, "credit/pivot_rows": n_rows,
            "credit/pivot_auroc_turn": stratified_auroc(wrong, wrong_turn, right, right_turn),
            "credit/pivot_auroc_row": stratified_auroc(wrong, wrong_row, right, right_row)}
