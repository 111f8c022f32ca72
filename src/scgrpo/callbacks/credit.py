"""A page of SC-GRPO's per-token credit: each rollout's tokens coloured by their weight f(D), beside the
reference its teacher saw and its group's route. (The ``credit/*`` statistics are logged every step by the
module, from the objective's credit and the self-teacher's signal.)"""

from __future__ import annotations

import html
import os

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from scgrpo.callbacks.logging import run_dir
from scgrpo.rollout.types import ROUTES


def weight_colour(weight: float) -> str:
    """One scale for f in [0, 1): white at 0 (gradient suppressed), deep red towards 1 (kept)."""
    t = min(max(weight, 0.0), 1.0)
    return f"rgb(255,{int(255 * (1 - 0.8 * t))},{int(255 * (1 - 0.8 * t))})"


class CreditLogging(Callback):
    """Every ``every_n_steps`` steps appends up to ``num_rollouts`` rollouts to ``<log_dir>/credit_heatmap.html``,
    two of each route present (see :meth:`pick_rows`): the group's route, reward and advantage, the rollout
    with each token's background set by its weight f (hover for the value; rows without a teacher are plain
    GRPO, weight 1), and beside it the reference in the teacher's system prompt. Distillation objectives,
    which have no token weights, are shown uncoloured."""

    def __init__(self, every_n_steps: int = 10, num_rollouts: int = 8) -> None:
        self.every_n_steps, self.num_rollouts = every_n_steps, num_rollouts

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
        record = getattr(pl_module, "last_credit", None)
        if record and self.every_n_steps and batch_idx % self.every_n_steps == 0:
            self._heatmap(trainer, pl_module, batch, record)

    @rank_zero_only
    def _heatmap(self, trainer, pl_module, batch, record) -> None:
        rollouts, tokenizer = batch.rollouts, pl_module.tokenizer
        signal, credit = record["signal"], record["credit"]
        weights = credit.token_weights.cpu() if credit.token_weights is not None else None
        advantages = credit.advantages.cpu()
        c = credit.stats.c if credit.stats is not None else None
        parts = [f"<h2>step {trainer.global_step}" + (f", c = {c:.3g}" if c is not None else "") + "</h2>"]
        rows = self.pick_rows(signal, rollouts.group_size)
        for row in rows:
            length = int(rollouts.completion_mask[row].sum())
            tokens = rollouts.completion_ids[row][:length].tolist()
            if weights is not None:
                spans = "".join(
                    f'<span title="f={w:.3f}" style="background:{weight_colour(w)}">{html.escape(tokenizer.decode([t]))}</span>'
                    for t, w in zip(tokens, weights[row][:length].tolist()))
            else:
                spans = html.escape(tokenizer.decode(tokens))
            route = ROUTES[int(signal.route[row])] + (" (reference row)" if bool(signal.is_reference[row]) else "")
            if not bool(signal.has_teacher[row]):
                route += ", no teacher: weight 1"
            parts.append(
                f"<p><b>{html.escape(rollouts.questions[row])}</b> route <i>{route}</i>, reward "
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
                        "suppressed) to red = 1 (kept); right: the reference in the teacher's system prompt</p>\n")
            f.write("\n".join(parts) + "\n")
