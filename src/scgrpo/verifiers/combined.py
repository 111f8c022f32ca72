"""A weighted sum of several verifiers (e.g. correctness plus a format bonus)."""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from scgrpo.verifiers.base import VerificationResult, Verifier, VerifierSetupError
from scgrpo.verifiers.rewards import NoReward, reward_names
from scgrpo.verifiers.runner import VerifierTimeout

log = logging.getLogger(__name__)


class WeightedVerifier(Verifier):
    """score = sum_k weight_k * score_k over the parts that scored (a part that raises gives no value, as a reward
    function's None; a row no part scored has no reward). ``info["rewards"]`` holds each part's score under its class
    name (two parts of one class: ``Name``, ``Name_2``), logged as ``reward/<name>/mean``; the rows a part raised on
    as ``reward/<name>/errors`` (its first failure logged). The time limit is the whole sum's.

    Args:
        verifiers: the parts, each any :class:`Verifier`.
        weights: one weight per part (default: all 1).
    """

    def __init__(
        self, verifiers: Sequence[Verifier], weights: Optional[Sequence[float]] = None, timeout_s: Optional[float] = 10.0
    ) -> None:
        if not verifiers:
            raise ValueError("WeightedVerifier needs at least one verifier")
        weights = list(weights) if weights is not None else [1.0] * len(verifiers)
        if len(weights) != len(verifiers):
            raise ValueError(f"{len(weights)} weights given for {len(verifiers)} verifiers")
        self.verifiers = list(verifiers)
        self.weights = weights
        self.names = reward_names(self.verifiers)
        self.timeout_s = timeout_s
        self.failed_rows = {name: 0 for name in self.names}  # rows each part raised on

    def verify(self, completion: str, answer: Any, question: str = "") -> VerificationResult:
        total, scores, decisions, errors = 0.0, {}, [], {}
        for verifier, weight, name in zip(self.verifiers, self.weights, self.names):
            try:
                result = verifier.verify(completion, answer, question)
            except (VerifierSetupError, VerifierTimeout):  # (the sum's own time limit: the runner counts it)
                raise
            except Exception as err:  # noqa: BLE001 - a part's failure leaves its value out, as a reward function's
                scores[name], errors[name] = None, f"{type(err).__name__}: {err}"
                if not self.failed_rows[name]:
                    log.warning("%s (a part of WeightedVerifier) raised %s; its value is left out of those rows' sums "
                                "(counted under reward/%s/errors; further failures are not logged)", name,
                                errors[name], name)
                self.failed_rows[name] += 1
                continue
            scores[name] = result.score
            total += weight * result.score
            marked = result.info.get("decisions") if isinstance(result.info, dict) else None
            if isinstance(marked, list):  # each part's decisions (scgrpo.pivots), in the parts' order
                decisions += marked
        if len(errors) == len(self.verifiers):  # no part scored: the row has no reward
            raise NoReward("no part scored (" + "; ".join(f"{k} {v}" for k, v in errors.items()) + ")")
        extra = {"decisions": decisions} if decisions else {}
        return VerificationResult(total, {"rewards": scores, **extra, **({"errors": errors} if errors else {})})
