"""Dr. GRPO (Understanding R1-Zero-Like Training, arXiv 2503.20783)."""

from __future__ import annotations

from scgrpo.objectives.grpo import GRPO


class DrGRPO(GRPO):
    """GRPO without its two biases: advantages are not divided by the group std (``scale="none"``), and each
    sequence's token sum is divided by a constant (the generation cap) instead of its own length
    (``seq-mean-token-sum-norm``)."""

    def __init__(self, eps_low: float = 0.2, eps_high: float = 0.2, beta: float = 0.0, num_iterations: int = 1) -> None:
        super().__init__("none", eps_low, eps_high, beta, "seq-mean-token-sum-norm", num_iterations)


