"""A new objective in one file of its own: GRPO whose rewards pay for the sequence's KL to the reference, read from
the scoring pass (it declares that it needs the reference log-probs, and that its credit reads them)."""

from __future__ import annotations

import dataclasses

from scgrpo.objectives import GRPO, Credit, CreditInputs, Needs

SEEN: list[CreditInputs] = []  # what each step's credit was handed (the test reads it)


class KLPenalisedGRPO(GRPO):
    """r_i - kl_coef * sum_t (log pi_old(y_t) - log pi_ref(y_t)), then GRPO's group advantages.

    Args:
        kl_coef: price of a nat of sequence KL.
    """

    def __init__(self, kl_coef: float = 0.5) -> None:
        super().__init__()
        self.kl_coef = kl_coef

    @property
    def needs(self) -> Needs:
        return dataclasses.replace(super().needs, old_logprobs=True, ref_logprobs=True, scored_credit=True)

    def credit(self, inputs: CreditInputs) -> Credit:
        SEEN.append(inputs)
        kl = ((inputs.old_logprobs - inputs.ref_logprobs) * inputs.mask).sum(1)  # [N]
        return Credit(advantages=self.advantages(inputs.rewards - self.kl_coef * kl, inputs.group_size, inputs.valid))
