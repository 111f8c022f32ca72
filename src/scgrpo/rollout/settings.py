"""How rollouts are sampled (:class:`GenerationSettings`) and what a rollout backend hands back (:class:`Generated`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from scgrpo.errors import InputError
from scgrpo.rollout.four_bit import MODES as FOUR_BIT_MODES


@dataclass
class GenerationSettings:
    """How rollouts are sampled."""

    num_generations: int = 4
    """G: completions sampled per prompt (the group size)"""
    max_new_tokens: int = 48
    """Completion length cap; longer completions are cut and flagged as truncated"""
    temperature: float = 1.0
    """Sampling temperature (log-probs in the loss use the same temperature)"""
    top_p: float = 1.0
    """Nucleus sampling mass"""
    top_k: int = 0
    """Top-k sampling (0 = off)"""
    engine: str = "loop"
    """The rollout backend (:mod:`scgrpo.rollout.backends`): "loop", this package's decode loop (the compact forward
    where it runs, see ``decode_forward``); "hf", ``model.generate``; or the import path of a
    :class:`~scgrpo.rollout.backends.Sampler` class of your own (``my_pkg.samplers.MySampler``)"""
    decode_forward: str = "auto"
    """Forward pass of the "loop" engine: "auto" = the compact decode forward (fused projections, LoRA as
    low-rank adds, slots with compaction and refill, whole-step CUDA graphs) for Llama, Mistral, Qwen2, Qwen3
    and SmolLM models, the Hugging Face forward for any other (logged once); "hf" = always the latter"""
    compile: str = "auto"
    """torch.compile the compact forward's per-layer code: "auto" (on a GPU with Triton), "on" or "off"."""
    max_slots: int = 0
    """Rows decoded at once by the compact forward (its KV cache holds this many); waiting rows take the slots
    of finished ones. 0 = as many as a quarter of the free GPU memory holds (every row on CPU)"""
    memory_budget_gib: Optional[float] = None
    """GPU memory (GiB) the whole process may hold while sampling, the weights and optimiser state included: the
    compact forward's decode slots (its KV cache) are as many as fit in 90% of what the budget leaves beside the
    largest prefill's activations, and
    ``four_bit: auto`` picks by it. Null = the card's free memory (a quarter of it for the KV cache). Set it (with
    keep_workspace: false) to train on a card smaller than the rollouts' KV cache: rows then decode in waves"""
    four_bit: str = "auto"
    """How the compact forward multiplies by a 4-bit (QLoRA) base, with bitsandbytes' own dequantization (the
    values training multiplies by): "resident" dequantizes the base once per rollout into a copy in the model dtype
    (2 bytes a weight while sampling), "streamed" one weight at a time inside every decode step (no copy: a
    scratch as big as the largest weight, and fp32 block scales; slower), "auto" resident when the copy takes at
    most half the memory left (see memory_budget_gib), or a quarter when keep_workspace keeps it through the
    update, else streamed; "layers" calls the 4-bit layers' own forwards"""
    keep_workspace: bool = True
    """Keep the compact forward's KV cache, CUDA graphs and fused weight copies between rollouts (no
    re-recording; that memory stays allocated during the update). False frees them after each rollout (with
    ``four_bit: auto`` a 4-bit base's resident copy may then take up to half the memory left while sampling)"""
    min_new_tokens: int = 0
    """Forbid end-of-sequence before this many tokens (benchmarks fix lengths with it)"""
    cuda_graphs: bool = True
    """On a GPU, record the decode step once per rollout as a CUDA graph and replay it for every token (one
    launch instead of hundreds of kernels per step); engine "loop" only, not for a sharded policy. Falls back
    to plain launches, with a warning, where recording fails"""
    merge_lora: str = "auto"
    """Fold LoRA into the weights while sampling: "auto" (only fp32 weights, where rounding is negligible),
    "always" or "never". In bf16 a merged weight rounds away small adapter updates, and sampling would then
    lag behind the policy that is trained"""
    extra: dict = field(default_factory=dict)
    """Further ``model.generate`` arguments (engine "hf" only)"""
    student_states: str = "auto"
    """Where the self-teacher's student side (the policy's distribution before each sampled token, which D compares
    with the teacher's) comes from: "rollout", the final hidden states the sampler computed as it drew each token
    (kept on the host; no second forward: the teacher pass runs the teacher's rows alone); "forward", a forward pass
    of the policy over the rollouts, without gradient, in the teacher pass (the training forward's numerics, as the
    teacher's: the sampler's differ at the kernels' rounding, which moves D by a few percent, see
    docs/benchmarks.md); "auto", "rollout" on a GPU where the student's forward would be a pass of its own (an 8B
    step of 1,024 tokens: 31.7 s against 33.8 s in one call), else "forward": on a CPU, and where the student's rows
    ride in the teacher's forward (the self-teacher's shared pass: teacher "policy", max_new_tokens at most half of
    ``selfteacher.SHARED_PASS_TOKENS``; SmolLM2's step of 128 tokens: 0.76 s against 0.81 s). Single-turn rollouts
    through the compact decode forward only: episodes, engine "hf" and sharded policies take the forward"""

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"num_generations (G) must be >= 2 for group-relative advantages, got {self.num_generations}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.engine not in ("loop", "hf"):
            engine_class(self.engine)  # (imported here: a wrong path is one error before the model loads)
        if self.decode_forward not in ("auto", "hf"):
            raise ValueError(f"decode_forward={self.decode_forward!r}: expected 'auto' or 'hf'")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile={self.compile!r}: expected 'auto', 'on' or 'off'")
        if self.max_slots < 0:
            raise ValueError(f"max_slots must be >= 0 (0 = automatic), got {self.max_slots}")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib must be > 0 GiB (or null), got {self.memory_budget_gib}")
        if self.four_bit not in FOUR_BIT_MODES:
            raise ValueError(f"four_bit={self.four_bit!r}: expected one of {', '.join(map(repr, FOUR_BIT_MODES))}")
        if self.merge_lora not in ("auto", "always", "never"):
            raise ValueError(f"merge_lora={self.merge_lora!r}: expected 'auto', 'always' or 'never'")
        if self.student_states not in ("auto", "rollout", "forward"):
            raise ValueError(f"student_states={self.student_states!r}: expected 'auto', 'rollout' or 'forward'")


@dataclass
class Generated:
    prompt_ids: Tensor  # [N, Tp] left-padded
    prompt_mask: Tensor  # [N, Tp]
    completion_ids: Tensor  # [N, C] right-padded with the pad token
    completion_mask: Tensor  # [N, C] float
    truncated: Tensor  # [N] bool
    completions: list[str]  # [N]
    entropy_sum: Optional[Tensor] = None  # [N] fp32 sampling entropy summed over each completion's tokens
    sampler_logprobs: Optional[Tensor] = None  # [N, C] fp32 log-prob of each sampled token under the sampler
    stats: dict = field(default_factory=dict)  # the engine's counters (rollout/...)
    states: Optional[Tensor] = None  # [N, C, H] the sampler's final hidden state before each token (when asked for,
    # where the compact forward sampled; on the host): undefined after a row's end


SAMPLER_METHODS = ("draw", "release", "one_model_state")
"""What a rollout backend class has (:class:`scgrpo.rollout.backends.Sampler`; subclass it for the last two)"""


def engine_class(engine: str) -> type:
    """The rollout backend class ``generation.engine`` names by import path (``my_pkg.samplers.MySampler``)."""
    module, _, name = engine.rpartition(".")
    if not module:
        raise ValueError(f"engine={engine!r}: expected 'loop', 'hf' or the import path of a Sampler class")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"generation.engine={engine!r}: no such class to import ({err})") from err
    missing = [m for m in SAMPLER_METHODS if not callable(getattr(found, m, None))] if isinstance(found, type) else ["draw"]
    if missing:
        raise InputError(f"generation.engine={engine!r} is not a Sampler class (it has no {', '.join(missing)}; "
                         "subclass scgrpo.rollout.backends.Sampler)")
    return found


def budget_bytes(gib: Optional[float]) -> Optional[int]:
    return None if gib is None else int(gib * 2**30)
