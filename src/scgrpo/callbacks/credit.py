"""Logging of SC-GRPO's per-token credit: weight statistics every step and a token heatmap page."""

from __future__ import annotations

import html
import os

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from scgrpo.callbacks.logging import run_dir


def _colour(weight: float, w_max: float) -> str:
    """White at weight 1, red towards w_max, blue towards 0."""
    if weight >= 1.0:
        t = min((weight - 1.0) / max(w_max - 1.0, 1e-6), 1.0)
        return f"rgb(255,{int(255 * (1 - t))},{int(255 * (1 - t))})"
    t = min(1.0 - weight, 1.0)
    return f"rgb({int(255 * (1 - t))},{int(255 * (1 - t))},255)"


class CreditLogging(Callback):
    """Per step: the share of loss rollouts that had a verified reference, weight quantiles (p50/p90/p99/max),
    the share of weights clipped at w_max, and the mean divergence for positive and negative advantages
    (``credit/*``). Every ``every_n_steps`` steps it appends rollouts with each token coloured by its weight
    to ``<log_dir>/credit_heatmap.html``.
    """

    def __init__(self, every_n_steps: int = 10, num_rollouts: int = 4) -> None:
        self.every_n_steps, self.num_rollouts = every_n_steps, num_rollouts

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        record = getattr(pl_module, "last_credit", None)
        if not record or record.get("signal") != "weights":
            return
        # every key every step (NaN when undefined); credit/reference_share is logged by the module itself
        metrics = {k: float("nan") for k in ("credit/weight_p50", "credit/weight_p90", "credit/weight_p99",
                                              "credit/weight_max", "credit/clipped_share",
                                              "credit/divergence_positive_adv", "credit/divergence_negative_adv")}
        with_ref = record["has_reference"]
        if record["rows"] and "weights" in record and with_ref.any():
            mask = record["mask"][with_ref].bool()
            weights = record["weights"][with_ref][mask]
            divergence = record["divergence"][with_ref]
            q = torch.quantile(weights.float(), torch.tensor([0.5, 0.9, 0.99]))
            metrics.update({"credit/weight_p50": q[0].item(), "credit/weight_p90": q[1].item(),
                            "credit/weight_p99": q[2].item(), "credit/weight_max": weights.max().item()})
            w_max, lam = pl_module.objective.w_max, pl_module.objective.lam
            metrics["credit/clipped_share"] = (weights >= (1 - lam) + lam * w_max - 1e-6).float().mean().item()
            per_row = (divergence.sum(1) / record["mask"][with_ref].sum(1).clamp(min=1))  # [n]
            adv = record["advantages"][with_ref]
            for name, sel in (("positive", adv > 0), ("negative", adv < 0)):
                if sel.any():
                    metrics[f"credit/divergence_{name}_adv"] = per_row[sel].mean().item()
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=max(len(record["rows"]), 1))
        if self.every_n_steps and batch_idx % self.every_n_steps == 0 and "weights" in record:
            self._heatmap(trainer, pl_module, batch, record)

    @rank_zero_only
    def _heatmap(self, trainer, pl_module, batch, record) -> None:
        rollouts, tokenizer = batch.rollouts, pl_module.tokenizer
        w_max = pl_module.objective.w_max
        parts = [f"<h2>step {trainer.global_step}</h2>"]
        shown = 0
        for j, row in enumerate(record["rows"]):
            if shown >= self.num_rollouts or not bool(record["has_reference"][j]):
                continue
            shown += 1
            length = int(record["mask"][j].sum())
            tokens = rollouts.completion_ids[row][:length].tolist()
            spans = "".join(
                f'<span title="w={w:.2f}" style="background:{_colour(w, w_max)}">'
                f"{html.escape(tokenizer.decode([t]))}</span>"
                for t, w in zip(tokens, record["weights"][j][:length].tolist())
            )
            parts.append(
                f"<p><b>{html.escape(rollouts.questions[row])}</b> reward {float(rollouts.rewards[row]):.2f}, "
                f"advantage {float(record['advantages'][j]):+.2f}</p><pre style='white-space:pre-wrap'>{spans}</pre>"
            )
        path = os.path.join(run_dir(trainer), "credit_heatmap.html")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            if new:
                f.write("<html><meta charset='utf-8'><body><h1>SC-GRPO per-token credit</h1>"
                        "<p>token background: blue = weight below 1, white = 1, red = up to w_max</p>\n")
            f.write("\n".join(parts) + "\n")
