"""What a rollout backend is: :class:`Sampler`, which draws one completion of each prompt row, and :class:`Draw`,
what it hands back. The engine (:func:`scgrpo.rollout.engine.generate_ids`) masks and pads the draw after each
row's end and decodes its text, so a backend only draws tokens."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Optional, Protocol, Sequence

from torch import Tensor

from scgrpo.rollout.settings import GenerationSettings


@dataclass
class Draw:
    """One completion of each of ``N`` prompt rows, as drawn (anything after a row's end is masked afterwards)."""

    completion_ids: Tensor  # [N, C] long, C <= max_new_tokens
    entropy_sum: Optional[Tensor] = None  # [N] fp32 sampling entropy summed over each row's tokens (None: unknown)
    logprobs: Optional[Tensor] = None  # [N, C] fp32 each drawn token's log-probability under the sampler
    stats: dict[str, float] = field(default_factory=dict)  # the backend's own counters (logged as they are named)
    states: Optional[Tensor] = None  # [N, C, H] final hidden state before each token (only when asked for; host)


class Sampler(Protocol):
    """A rollout backend. It keeps whatever it reuses between rollouts (KV caches, graphs, a server connection) as
    its own state; the policy holds one for the run (``generation.engine`` names it). Subclass it for the defaults
    of :meth:`release` and :meth:`one_model_state`; ``docs/extending.md`` shows one added in a file of its own."""

    def draw(self, model, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, eos_ids: Sequence[int],
             pad_id: int, temperature: float, greedy: bool, cuda_graphs: bool = True,
             reserve: Optional[tuple[int, int]] = None, states: bool = False) -> Draw:
        """One completion of each left-padded prompt row ``[N, Tp]`` of ``model`` (in train mode; the backend puts
        it in the mode it samples in), at ``temperature`` or ``greedy``, ended by any of ``eos_ids``. ``reserve``
        ``(rows, length)``: calls that grow up to it follow (the turns of episodes); ``states``: keep
        :attr:`Draw.states` where the backend can."""
        ...

    def release(self) -> None:
        """Frees what the backend keeps between rollouts (it is rebuilt at the next draw)."""

    def one_model_state(self) -> ContextManager[None]:
        """Inside the block the sampled model does not change (the turns of one episode batch)."""
        return contextlib.nullcontext()
