"""A page of SC-GRPO's per-token credit: each rollout's tokens coloured by their weight f(D), beside the
reference its teacher saw and its group's route. (The ``credit/*`` statistics are logged every step by the
module, from the objective's credit and the self-teacher's signal.)"""

from __future__ import annotations

import html
import json
import logging
import os

import torch

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from scgrpo import lightning_internals as internals
from scgrpo.callbacks.logging import run_dir
from scgrpo.chat import prompt_text
from scgrpo.distributed import all_reduce
from scgrpo.pivots import BOTH, NONE, PIVOT_KEYS, RIGHT, WRONG, decision_labels, pivot_metrics
from scgrpo.rollout.types import PARTIAL, ROUTES

log = logging.getLogger(__name__)


def weight_colour(weight: float) -> str:
    """One scale for f in [0, 1): white at 0 (gradient suppressed), deep red towards 1 (kept)."""
    t = min(max(weight, 0.0), 1.0)
    return f"rgb(255,{int(255 * (1 - 0.8 * t))},{int(255 * (1 - 0.8 * t))})"


ENVIRONMENT_STYLE = "background:#e4e4e4;color:#888"
"""Environment tokens of an episode (observations, tool results): grey, no weight (they are never trained on)"""


DECISION_OUTLINE = {RIGHT: ("right decision", "#1a7f37"), WRONG: ("wrong decision", "#cf222e"),
                    BOTH: ("right and wrong decisions", "#8250df")}
"""A decision token's outline (the task's ``info["decisions"]``): green right, red wrong, purple both"""


def token_span(text: str, weight, model_token: bool, decision: int = NONE) -> str:
    """One token of the page: coloured by its weight f (None: uncoloured), outlined when it is part of a decision
    the task marked, or greyed out when the environment wrote it."""
    if not model_token:
        return f'<span title="environment" style="{ENVIRONMENT_STYLE}">{html.escape(text)}</span>'
    title, style = [], []
    if weight is not None:
        title.append(f"f={weight:.3f}")
        style.append(f"background:{weight_colour(weight)}")
    if decision != NONE:
        name, colour = DECISION_OUTLINE[decision]
        title.append(name)
        style.append(f"outline:2px solid {colour}")
    if not style:
        return html.escape(text)
    return f'<span title="{", ".join(title)}" style="{";".join(style)}">{html.escape(text)}</span>'


class CreditLogging(Callback):
    """Every ``every_n_steps`` steps (steps 0, ``every_n_steps``, ...) appends up to ``num_rollouts`` rollouts to
    ``<log_dir>/credit_heatmap.html`` under the heading ``step N`` (and every rollout of the batch, machine-readable,
    to ``credit_tokens.jsonl``, each row with its ``step``), N being the step's number in ``metrics.csv``
    (:func:`~scgrpo.lightning_internals.train_step`: 0 for the first),
    two of each route present (see :meth:`pick_rows`): the group's route, reward and advantage, the rollout
    with each token's background set by its weight f (hover for the value; rows without a teacher are plain
    GRPO, weight 1), and beside it the reference in the teacher's system prompt. An episode's environment tokens
    (observations, tool results) are greyed out. Distillation objectives, which have no token weights, are shown
    uncoloured.

    Where the task marks its decisions (:mod:`scgrpo.pivots`), the same steps log ``credit/pivot_auroc``,
    ``credit/pivot_share``, ``credit/pivot_rows`` and the turn- and row-stratified AUROCs over the failed rollouts of partial-solve groups that had a
    teacher, outline the decision tokens on the page (green right, red wrong) and add each token's label to
    ``credit_tokens.jsonl`` (``decision``: 0 none, 1 right, 2 wrong, 3 both). A step on which no rollout marks a
    decision logs none of these keys; the first such step says so once."""

    def __init__(self, every_n_steps: int = 10, num_rollouts: int = 8) -> None:
        self.every_n_steps, self.num_rollouts = every_n_steps, num_rollouts
        self._said_unmarked = self._said_malformed = self._pivots_logged = False

    def pick_rows(self, signal, group_size: int) -> list[int]:
        """Rows to draw: for each route present, in ``ROUTES`` order, up to two rows of its first group (rows
        with a teacher first), at most ``num_rollouts`` in all."""
        rows: list[int] = []
        for k in range(len(ROUTES)):
            groups = [p for p in range(signal.num_rows // group_size) if int(signal.route[p * group_size]) == k]
            if groups:
                members = range(groups[0] * group_size, (groups[0] + 1) * group_size)
                rows += sorted(members, key=lambda i: not bool(signal.has_teacher[i]))[:2]
        return rows[: self.num_rollouts]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        record = pl_module.last_plan  # (None: the step was skipped; no signal: the objective has no self-teacher)
        step = internals.train_step(trainer)
        if record is not None and record.signal is not None and self.every_n_steps and step % self.every_n_steps == 0:
            labels = self._pivots(pl_module, batch, record, step)
            self._heatmap(trainer, pl_module, batch, record, labels, step)
            self._token_log(trainer, pl_module, batch, record, labels, step)
        elif self._pivots_logged:  # Lightning would log a key's last value again at every later step: NaN between
            pl_module.log_dict({key: float("nan") for key in PIVOT_KEYS}, on_step=True, on_epoch=False,
                               prog_bar=False, batch_size=1)

    def _pivots(self, pl_module, batch, record, step: int):
        """The decision labels of the batch's tokens (None: no rollout marks one), with the ``credit/pivot_*``
        keys logged where a rank's rollouts mark any (every rank takes part in the collectives). ``step``: the
        step's number, for the log."""
        rollouts, signal, credit = batch.rollouts, record.signal, record.credit
        if credit.token_weights is None:
            return None
        labels, malformed = decision_labels(rollouts.completion_ids, rollouts.completion_mask, rollouts.infos,
                                            rollouts.env_mask is not None,
                                            lambda ids: pl_module.tokenizer.decode(ids, skip_special_tokens=True))
        device = rollouts.completion_ids.device
        marked, malformed = all_reduce([float(labels is not None), float(malformed)], "sum", device)
        if malformed and not self._said_malformed and pl_module.global_rank == 0:
            self._said_malformed = True
            log.warning("%d rollout(s) of step %d hold info['decisions'] that is not a list of decisions (see "
                        "scgrpo.pivots); they are left out of credit/pivot_*", int(malformed), step)
        if not marked:
            if not self._said_unmarked and pl_module.global_rank == 0:
                self._said_unmarked = True
                log.info("the task marks no decisions (StepResult.info['decisions'] or VerificationResult."
                         "info['decisions']): the credit/pivot_* keys are not logged")
            if self._pivots_logged:  # marked on an earlier step: not this step's values
                pl_module.log_dict({key: float("nan") for key in PIVOT_KEYS}, on_step=True, on_epoch=False,
                                   prog_bar=False, batch_size=1)
            return None
        if labels is None:
            labels = rollouts.completion_ids.new_zeros(rollouts.completion_ids.shape).cpu().to(torch.int8)
        failed = rollouts.rewards.cpu() < pl_module.success_threshold
        rows = (signal.route.cpu() == PARTIAL) & signal.has_teacher.cpu() & failed
        metrics = pivot_metrics(credit.token_weights, labels, rollouts.completion_mask, rows, device)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        self._pivots_logged = True
        return labels

    @rank_zero_only
    def _token_log(self, trainer, pl_module, batch, record, labels, step: int) -> None:
        """Every rollout of the batch as one JSON line of ``<log_dir>/credit_tokens.jsonl`` (for
        ``scripts/weight_shares.py``): step (the step's number in ``metrics.csv``, 0 for the first), row, group,
        route, whether it had a teacher and was its group's reference, reward, advantage, and per token its text,
        whether the model wrote it (1) or the environment (0), its weight f (4 decimals; 1 on rows without a
        teacher) and, where the task marks decisions, its label (``decision``: 0 none, 1 right, 2 wrong, 3 both).
        Objectives without token weights log nothing here."""
        rollouts, signal, credit = batch.rollouts, record.signal, record.credit
        if credit.token_weights is None:
            return
        weights, advantages = credit.token_weights.float().cpu(), credit.advantages.float().cpu()
        context, model = rollouts.context_mask.cpu(), rollouts.completion_mask.cpu().bool()
        ids = rollouts.completion_ids.cpu()
        decode = pl_module.tokenizer.decode
        lines = []
        for row in range(ids.shape[0]):
            length = int(context[row].sum())
            line = {
                "step": step, "row": row, "group": row // rollouts.group_size,
                "route": ROUTES[int(signal.route[row])], "has_teacher": bool(signal.has_teacher[row]),
                "is_reference": bool(signal.is_reference[row]), "reward": float(rollouts.rewards[row]),
                "advantage": round(float(advantages[row]), 6),
                "tokens": [decode([t]) for t in ids[row][:length].tolist()],
                "model": [int(m) for m in model[row][:length].tolist()],
                "f": [round(w, 4) for w in weights[row][:length].tolist()],
            }
            if labels is not None:
                line["decision"] = labels[row][:length].tolist()
            lines.append(json.dumps(line, ensure_ascii=False))
        with open(os.path.join(run_dir(trainer), "credit_tokens.jsonl"), "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")

    @rank_zero_only
    def _heatmap(self, trainer, pl_module, batch, record, labels, step: int) -> None:
        rollouts, tokenizer = batch.rollouts, pl_module.tokenizer
        signal, credit = record.signal, record.credit
        weights = credit.token_weights.cpu() if credit.token_weights is not None else None
        advantages = credit.advantages.cpu()
        c = credit.stats.c if credit.stats is not None else None
        parts = [f"<h2>step {step}" + (f", c = {c:.3g}" if c is not None else "") + "</h2>"]
        rows = self.pick_rows(signal, rollouts.group_size)
        context = rollouts.context_mask.cpu()
        model = rollouts.completion_mask.cpu().bool()
        for row in rows:
            length = int(context[row].sum())  # an episode's environment tokens lie between its turns
            tokens = rollouts.completion_ids[row][:length].tolist()
            own = model[row][:length].tolist()
            row_weights = weights[row][:length].tolist() if weights is not None else [None] * length
            row_labels = labels[row][:length].tolist() if labels is not None else [NONE] * length
            spans = "".join(token_span(tokenizer.decode([t]), w, mine, d)
                            for t, w, mine, d in zip(tokens, row_weights, own, row_labels))
            route = ROUTES[int(signal.route[row])] + (" (reference row)" if bool(signal.is_reference[row]) else "")
            if not bool(signal.has_teacher[row]):
                route += ", no teacher: weight 1"
            parts.append(
                f"<p><b>{html.escape(prompt_text(rollouts.questions[row]))}</b> route <i>{route}</i>, reward "
                f"{float(rollouts.rewards[row]):.2f}, advantage {float(advantages[row]):+.3f}</p>"
                "<table style='width:100%;table-layout:fixed'><tr>"
                f"<td style='vertical-align:top'><pre style='white-space:pre-wrap'>{spans}</pre></td>"
                "<td style='vertical-align:top;color:#555'><pre style='white-space:pre-wrap'>reference: "
                f"{html.escape(signal.references[row] or '')}</pre></td></tr></table>")
        path = os.path.join(run_dir(trainer), "credit_heatmap.html")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            if new:
                f.write("<html><meta charset='utf-8'><body><h1>SC-GRPO per-token credit</h1>"
                        "<p>token background: the weight f(D) = D / (D + c) on one scale, white = 0 (gradient "
                        "suppressed) to red = 1 (kept); grey: an episode's environment tokens (not trained on); right: the "
                        "reference in the teacher's system prompt; outlined: a decision the task marked, green right, red "
                        "wrong</p>\n")
            f.write("\n".join(parts) + "\n")
