"""The divergence guard: a step that meets a NaN or an infinity changes no weight; after too many in a row the
run stops with the last good weights put back.

Checked at each phase of a step: the sampler's log-probs and entropies (a diverged policy samples from NaN
logits, and its completions can look ordinary), then the scoring pass, the teacher's signal, the advantages
and token weights, then the loss and the gradient norm. All ranks agree before they skip. A stopped run's final adapter holds the last good
weights, and no checkpoint is written over the last good one (the checkpoint callbacks read
:attr:`DivergenceGuard.diverged`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from scgrpo.distributed import all_reduce
from scgrpo.rollout.types import RolloutBatch
from scgrpo.update import StepPlan

log = logging.getLogger(__name__)


def nonfinite_inputs(rollouts: RolloutBatch, plan: Optional[StepPlan] = None) -> Optional[str]:
    """What in a step's inputs is NaN or infinite, or None. Without ``plan``: the sampler's log-probs and
    entropies. With ``plan``: the scoring pass's log-probs, the teacher's divergences and states, the
    advantages and token weights."""
    mask = rollouts.completion_mask.bool()  # [N, C]

    def bad(x: Optional[Tensor], tokens: bool = True) -> bool:
        return x is not None and not bool(torch.isfinite(x[mask] if tokens else x).all())

    if plan is None:
        checks = {"sampling log-probs": bad(rollouts.sampler_logprobs),
                  "sampling entropy": bad(rollouts.entropy_sum, tokens=False)}
    else:
        signal, credit = plan.signal, plan.credit
        checks = {"scoring log-probs": bad(rollouts.old_logprobs) or bad(rollouts.ref_logprobs),
                  "teacher pass": signal is not None and (
                      bad(signal.divergence) or bad(signal.teacher_hidden, tokens=False)),
                  "advantages": bad(credit.advantages, tokens=False) or bad(credit.token_weights)}
    return next((name for name, failed in checks.items() if failed), None)


def on_any_rank(reason: Optional[str], device: Optional[torch.device] = None) -> Optional[str]:
    """``reason``, or a stand-in when another rank met a non-finite value (all ranks skip together)."""
    if all_reduce([float(reason is not None)], "max", device)[0] > 0:
        return reason or "another rank's inputs"
    return None


class DivergenceGuard:
    """Counts skipped steps, keeps a copy of the last good trainable weights and decides when to stop.

    Args:
        max_nonfinite_skips: stop after this many skipped steps in a row; 0 skips such steps but never stops
            (and keeps no copy of the weights, which costs their size in memory).
    """

    def __init__(self, max_nonfinite_skips: int = 3) -> None:
        if max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips must be >= 0 (0 = never stop), got {max_nonfinite_skips}")
        self.max_nonfinite_skips = max_nonfinite_skips
        self.nonfinite_skips = 0  # steps skipped for a NaN/inf, over the whole run (checkpointed)
        self.consecutive_skips = 0  # of them, in a row up to the last step
        self.diverged = False  # the guard stopped the run; checkpoint and adapter callbacks read it
        self.last_step_skipped = False  # the last training step changed no weight (its rollouts are not stored)
        self.good_weights: Optional[list[Tensor]] = None  # trainable tensors of the last step with finite values
        self.good_step = 0

    @torch.no_grad()
    def keep(self, params: list[Tensor], step: int) -> None:
        """Copies the trainable weights of a step that met only finite values, before its update."""
        if not self.max_nonfinite_skips:
            return
        if self.good_weights is None:
            self.good_weights = [p.detach().clone() for p in params]
        else:
            for kept, p in zip(self.good_weights, params):
                kept.copy_(p.detach())
        self.good_step = step

    @torch.no_grad()
    def restore(self, params: list[Tensor]) -> None:
        """Puts back the weights kept by the last step that met only finite values (a no-op when no step got
        that far: the weights are then still the initial ones)."""
        if self.good_weights is not None:
            for kept, p in zip(self.good_weights, params):
                p.copy_(kept)

    def count(self, reason: Optional[str]) -> bool:
        """Books the step's outcome (``reason``: what was not finite, or None); True when the run must stop:
        ``max_nonfinite_skips`` steps in a row were skipped (:attr:`diverged` is then set)."""
        self.last_step_skipped = reason is not None
        if reason is None:
            self.consecutive_skips = 0
            return False
        self.nonfinite_skips += 1
        self.consecutive_skips += 1
        limit = self.max_nonfinite_skips
        if not limit or self.consecutive_skips < limit:
            return False
        self.diverged = True
        return True

    def finish_step(self, reason: Optional[str], params: list[Tensor], step: int, lr: float, max_grad_norm: float,
                    report: bool = True) -> bool:
        """Books the step (:meth:`count`); a skipped one is logged (``report``), and when the run must stop the
        last good weights are put back into ``params``. True when the run must stop."""
        stop = self.count(reason)
        if stop:
            self.restore(params)
        if reason is not None and report:
            self.report(reason, step, lr, max_grad_norm, stopped=stop)
        return stop

    def report(self, reason: str, step: int, lr: float, max_grad_norm: float, stopped: bool) -> None:
        """The log line of a skipped step (a warning), or of the stop (``stopped``: an error naming what to lower)."""
        if not stopped:
            log.warning("non-finite %s at step %d: the step is skipped (%d so far, %d in a row)", reason, step,
                        self.nonfinite_skips, self.consecutive_skips)
            return
        kept = f"as they were after step {self.good_step}" if self.good_step else "as they were at the start"
        log.error(
            "training diverged: %d steps in a row met non-finite values (the last: %s at step %d). Stopped; the "
            "weights %s, the last to give finite values, are restored for the final adapter; earlier "
            "checkpoints are kept and none is written now. Lower model.optimizer's lr (now %g) or "
            "model.max_grad_norm (now %g).", self.consecutive_skips, reason, step, kept, lr, max_grad_norm)

    def state_dict(self) -> dict[str, int]:
        return {"nonfinite_skips": self.nonfinite_skips, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.nonfinite_skips = state.get("nonfinite_skips", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
