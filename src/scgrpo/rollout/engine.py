"""Sampling completions with Hugging Face ``generate`` and turning them into padded, masked tensors."""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import logging
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from scgrpo.rollout.four_bit import MODES as FOUR_BIT_MODES
from scgrpo.rollout.graphs import warmup_stream
from scgrpo.rollout.sampling import sample_from_logits, sample_tokens  # noqa: F401 (sample_from_logits: re-exported)

log = logging.getLogger(__name__)


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
    """"loop": this package's decode loop; "hf": model.generate"""
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
            raise ValueError(f"engine={self.engine!r}: expected 'loop' or 'hf'")
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


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(ids)


def completion_mask_from_eos(completion_ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask ``[N, C]`` that is 1 up to and including the first end-of-sequence token, and the ``[N]`` flag of
    rows that have none (truncated)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    n, c = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), c, device=completion_ids.device))
    positions = torch.arange(c, device=completion_ids.device).expand(n, c)
    mask = (positions <= first.unsqueeze(1)).float()
    return mask, ~has_eos


@contextlib.contextmanager
def merged_adapters(model, policy: str = "always") -> Iterator[bool]:
    """Run the base layers with LoRA folded in (W + scale * B A) and the adapter branches switched off.

    Generation then costs what the plain model costs. The merged weights are new tensors; on exit each base
    layer gets back its original tensor object, so nothing drifts (unlike merge_adapter/unmerge_adapter,
    which add and subtract in the weight dtype). Layers whose base weight is not a plain float tensor
    (4-bit) keep their adapter branch, and so do all layers when ``policy`` is "never", or "auto" with
    weights in less than fp32. Yields whether anything was merged.
    """
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        yield False
        return
    swapped = []
    if hasattr(model, "get_base_model"):
        for module in model.modules():
            if not isinstance(module, LoraLinear) or module.merged or module.disable_adapters:
                continue
            if any(name in getattr(module, "lora_variant", {}) for name in module.active_adapters):
                continue  # DoRA and other variants are not a plain additive delta
            weight = module.get_base_layer().weight
            if not weight.dtype.is_floating_point or type(weight.data) is not torch.Tensor:
                continue
            if policy == "never" or (policy == "auto" and weight.dtype != torch.float32):
                continue
            delta = sum(module.get_delta_weight(name) for name in module.active_adapters if name in module.lora_A)
            if isinstance(delta, int):
                continue
            original = weight.data
            weight.data = (original.float() + delta.float()).to(original.dtype)
            swapped.append((module, weight, original, module.disable_adapters))
            module._disable_adapters = True
    try:
        yield bool(swapped)
    finally:
        for module, weight, original, disabled in swapped:
            weight.data = original
            module._disable_adapters = disabled


@contextlib.contextmanager
def generation_mode(model, merge_lora: str = "auto") -> Iterator[None]:
    """Eval mode, no grad, KV cache on, gradient checkpointing off and LoRA merged for the duration;
    everything restored after."""
    was_training = model.training  # (a model in eval mode is left as it is: no walk over its modules)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    checkpointing = was_training and bool(getattr(inner, flag, False))  # (checkpointing runs in training mode only)
    if checkpointing:
        model.gradient_checkpointing_disable()
    if was_training:
        model.eval()
    try:
        with torch.no_grad(), merged_adapters(model, merge_lora):
            yield
    finally:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if was_training:
            model.train()


def _cache_counters(cache) -> list[Tensor]:
    """Integer tensors a static cache keeps to know where the next token goes (``cumulative_length`` in recent
    transformers, which ignores ``cache_position``)."""
    counters = []
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, Tensor) and not value.is_floating_point() and value.numel() <= 16:
                counters.append(value)
    return counters


def _cache_kwarg(causal_lm) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(causal_lm.forward).parameters else "past_key_values"


class _GraphedStep:
    """The decode step (one new token for every row) recorded as a CUDA graph over fixed input buffers."""

    def __init__(self, step, ids: Tensor, positions: Tensor, cache_position: Tensor, counters: list[Tensor]) -> None:
        self.ids, self.positions, self.cache_position = ids.clone(), positions.clone(), cache_position.clone()
        saved = [c.clone() for c in counters]
        stream = warmup_stream(ids.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (it writes the same cache slot again later)
            for _ in range(2):
                step(self.ids, self.positions, self.cache_position)
        torch.cuda.current_stream().wait_stream(stream)
        for counter, value in zip(counters, saved):  # the cache's own write positions, as before the warm-up
            counter.copy_(value)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step(self.ids, self.positions, self.cache_position)

    def __call__(self, ids: Tensor, positions: Tensor, cache_position: Tensor) -> Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.cache_position.copy_(cache_position)
        self.graph.replay()
        return self.logits


@torch.no_grad()
def decode_loop(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    min_new_tokens: int = 0,
    cuda_graphs: bool = False,
) -> tuple[Tensor, Tensor]:
    """Autoregressive sampling with a preallocated (static) KV cache; stops when every row has ended.

    ``prompt_ids`` ``[N, Tp]`` are left-padded; positions count real tokens only, as ``generate`` does.
    Returns ``[N, C]`` new tokens, ``C <= max_new_tokens``, pad after a row's end-of-sequence token, ``[N]``
    the entropy of the sampling distribution (at ``temperature``) summed over each row's tokens and ``[N, C]``
    each sampled token's log-probability under that distribution. With
    ``cuda_graphs`` on a GPU the per-token step (after the prompt's forward) is replayed from a CUDA graph.
    """
    from transformers import StaticCache

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone, lm_head = getattr(causal_lm, causal_lm.base_model_prefix), causal_lm.get_output_embeddings()
    n, tp = prompt_ids.shape
    device = prompt_ids.device
    cache = StaticCache(config=causal_lm.config, max_cache_len=tp + max_new_tokens)
    cache_arg = _cache_kwarg(backbone)
    attention = torch.cat([prompt_mask, prompt_mask.new_zeros(n, max_new_tokens)], dim=1).bool()  # [N, Tp + max_new]
    # With SDPA the decode steps get the mask ready-made ([N, 1, 1, L] view, True = attend): no mask building
    # per token, nothing that reads GPU values on the host (a CUDA graph can record the step)
    ready_mask = getattr(causal_lm.config, "_attn_implementation", None) == "sdpa"
    attention_4d = attention.view(n, 1, 1, -1) if ready_mask else attention
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [N, Tp]

    def step(input_ids: Tensor, position_ids: Tensor, cache_position: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        hidden = backbone(
            input_ids=input_ids,
            attention_mask=attention_4d if mask is None else mask,
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=True,
            **{cache_arg: cache},
        ).last_hidden_state[:, -1].contiguous()  # [N, H]
        return lm_head(hidden).float()  # [N, V]

    logits = step(prompt_ids, positions, torch.arange(tp, device=device), attention.long())
    next_position = positions[:, -1:] + 1  # [N, 1]
    eos = torch.tensor(list(eos_ids), device=device, dtype=torch.long)
    tokens = torch.full((n, max_new_tokens), pad_id, device=device, dtype=torch.long)  # [N, max_new]
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    entropy_sum = torch.zeros(n, dtype=torch.float32, device=device)  # [N]
    ended_at = torch.full((n,), max_new_tokens - 1, dtype=torch.long, device=device)  # last step each row needs
    cache_positions = torch.arange(tp, tp + max_new_tokens, device=device)
    decode = step
    if cuda_graphs and ready_mask and device.type == "cuda" and max_new_tokens > 1:
        try:
            attention[:, tp] = True
            decode = _GraphedStep(step, tokens[:, :1], next_position, cache_positions[:1], _cache_counters(cache))
        except Exception as err:  # noqa: BLE001 - any failure to record: plain launches still work
            log.warning("CUDA graph recording of the decode step failed (%s); decoding without graphs", err)
            decode = step
        attention[:, tp] = False
    # on a GPU, asking "has every row ended?" waits for the GPU: ask every few steps, trim afterwards
    check_every = 8 if device.type == "cuda" else 1
    steps = 0
    logprobs = torch.zeros(n, max_new_tokens, dtype=torch.float32, device=device)  # [N, max_new]
    for t in range(max_new_tokens):
        if t < min_new_tokens and eos.numel():
            logits[:, eos] = float("-inf")
        uniform = None if greedy else torch.rand(n, 1, device=device)
        token, logprob, entropy = sample_tokens(logits, uniform, temperature, top_p, top_k)  # [N] x 3
        entropy_sum += torch.where(finished, torch.zeros_like(entropy), entropy)  # where it sampled (rows going)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens[:, t] = token
        logprobs[:, t] = torch.where(finished, torch.zeros_like(logprob), logprob)
        steps = t + 1
        if eos.numel():
            newly = torch.isin(token, eos) & ~finished
            ended_at = torch.where(newly, torch.full_like(ended_at, t), ended_at)
            finished |= newly
        if t == max_new_tokens - 1 or (steps % check_every == 0 and bool(finished.all())):
            break
        attention[:, tp + t] = True
        logits = decode(token.unsqueeze(1), next_position, cache_positions[t : t + 1])
        next_position = next_position + 1
    if eos.numel() and bool(finished.all()):
        steps = min(steps, int(ended_at.max()) + 1)
    return tokens[:, :steps], entropy_sum, logprobs[:, :steps]


_DECODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compact_decoder(model, settings: GenerationSettings, max_length: int):
    """The model's :class:`~scgrpo.rollout.compact.CompactDecoder` (kept between rollouts, adapters refreshed),
    or None when the settings or the model rule it out (the reason is logged once per model)."""
    from scgrpo.rollout.compact import CompactDecoder
    from scgrpo.rollout.model_parts import unsupported_reason

    if settings.engine != "loop" or settings.decode_forward != "auto":
        return None
    entry = _DECODERS.get(model)
    # (the check walks every module and parameter: inside one episode batch, whose turns call again, done once up to
    # the longest length asked, a check that passes at a length passing at every shorter one; outside, every call, as
    # the model may have changed in between)
    checked = _CHECKED_LENGTHS.get() if entry is not None and "decoder" in entry else None
    seen = checked.get(id(model)) if checked is not None else None  # (longest length checked, decoder releases)
    # (a decoder released since, keep_workspace off, has no weight copies left: it is refreshed again)
    same = seen is not None and seen[0] >= max_length and seen[1] == entry["decoder"].releases
    reason = None if same else unsupported_reason(model, max_length)
    if reason is not None:
        if entry is None or entry.get("reason") != reason:
            log.info("compact decode forward not used (%s); decoding with the Hugging Face forward", reason)
            _DECODERS[model] = {"reason": reason}
        return None
    device = next(model.parameters()).device
    compile_layers = settings.compile == "on" or (
        settings.compile == "auto" and device.type == "cuda" and importlib.util.find_spec("triton") is not None)
    options = (compile_layers, settings.four_bit, settings.memory_budget_gib, settings.keep_workspace)
    if entry is None or "decoder" not in entry or entry["options"] != options:
        if entry is not None:  # the old workspaces and weight copies go before the new decoder takes its own
            _release_entry(entry)
            _DECODERS.pop(model, None)
            entry = None
        decoder = CompactDecoder(model, compile_layers=compile_layers, four_bit=settings.four_bit,
                                 memory_budget=budget_bytes(settings.memory_budget_gib),
                                 keep_workspace=settings.keep_workspace)
        entry = _DECODERS[model] = {"decoder": decoder, "options": options, "samplers": {}}
        same = False
    if not same:  # (inside one model state the adapters read at its first call stay)
        entry["decoder"].refresh()
    if _CHECKED_LENGTHS.get() is not None:
        lengths = _CHECKED_LENGTHS.get()
        longest = max(lengths[id(model)][0], max_length) if id(model) in lengths else max_length
        lengths[id(model)] = (longest, entry["decoder"].releases)
    return entry


_CHECKED_LENGTHS: "contextvars.ContextVar[Optional[dict]]" = contextvars.ContextVar("scgrpo_checked_lengths",
                                                                                      default=None)


@contextlib.contextmanager
def one_model_state() -> Iterator[None]:
    """Inside the block the sampled model does not change (the turns of one episode batch): the compact forward's
    support check and its adapters' refresh run at the first call (and at a call longer than any before, for the
    check), not at every call."""
    token = _CHECKED_LENGTHS.set({})
    try:
        yield
    finally:
        _CHECKED_LENGTHS.reset(token)


def budget_bytes(gib: Optional[float]) -> Optional[int]:
    return None if gib is None else int(gib * 2**30)


def _release_entry(entry: dict) -> None:
    """Frees an entry's samplers' workspaces and its decoder's weight copies (whatever still refers to them)."""
    for sampler in entry.get("samplers", {}).values():
        sampler.release()
    if "decoder" in entry:
        entry["decoder"].release()


def release_rollout_workspaces() -> None:
    """Frees every kept compact-engine workspace (KV caches, CUDA graphs, weight copies) and forgets the decoders."""
    for entry in list(_DECODERS.values()):
        _release_entry(entry)
    _DECODERS.clear()


def _slot_decoder(entry: dict, settings: GenerationSettings, eos_ids, pad_id: int, temperature: float,
                  greedy: bool, cuda_graphs: bool, states: bool = False):
    from scgrpo.rollout.slots import SlotDecoder

    key = (tuple(eos_ids), pad_id, settings.max_new_tokens, temperature, settings.top_p, settings.top_k, greedy,
           settings.min_new_tokens, cuda_graphs, settings.max_slots, settings.memory_budget_gib)
    samplers = entry["samplers"]
    if states and key in samplers and not samplers[key].keep_states:  # rebuilt once, with a stage (its graphs write it)
        samplers.pop(key).release()
    if key not in samplers:
        if len(samplers) >= 2:  # training and evaluation settings; drop the oldest other
            samplers.pop(next(iter(samplers))).release()
        samplers[key] = SlotDecoder(
            entry["decoder"], eos_ids, pad_id, settings.max_new_tokens, temperature, settings.top_p, settings.top_k,
            greedy, settings.min_new_tokens, cuda_graphs=cuda_graphs, max_slots=settings.max_slots,
            memory_budget=budget_bytes(settings.memory_budget_gib), keep_states=states)
    sampler = samplers[key]
    sampler.keep_workspace = settings.keep_workspace
    sampler.want_states = states  # (a sampler with a stage serves calls without states too: evaluation at T)
    return sampler


def generate(
    model,
    tokenizer,
    prompts: list[str],
    num_samples: int,
    settings: GenerationSettings,
    device: torch.device,
    greedy: bool = False,
    temperature: Optional[float] = None,
    cuda_graphs: bool = True,
    states: bool = False,
) -> Generated:
    """Sample ``num_samples`` completions of each prompt (rows ``[p0 x num_samples, p1 x num_samples, ...]``)."""
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    prompt_ids = encoded["input_ids"].repeat_interleave(num_samples, dim=0)  # [N, Tp]
    prompt_mask = encoded["attention_mask"].repeat_interleave(num_samples, dim=0)  # [N, Tp]
    return generate_ids(model, tokenizer, prompt_ids, prompt_mask, settings, greedy, temperature, cuda_graphs,
                        states=states)


def generate_ids(
    model,
    tokenizer,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: GenerationSettings,
    greedy: bool = False,
    temperature: Optional[float] = None,
    cuda_graphs: bool = True,
    reserve: Optional[tuple[int, int]] = None,
    texts: bool = True,
    states: bool = False,
) -> Generated:
    """One completion of each left-padded prompt ``[N, Tp]`` (token ids, as they are: nothing is re-tokenized).
    ``reserve`` ``(rows, length)``: size the compact engine's workspace for up to that many rows of that many
    positions, so that calls that grow (the turns of episodes) reuse one KV cache and its CUDA graphs (and the
    compact forward's support is checked for that length). ``texts``: decode the completions to text (False:
    ``completions`` is empty, for callers that read the ids only). ``states``: also keep the final hidden state
    before each sampled token (:attr:`Generated.states`), where the compact forward samples."""
    eos_ids = eos_token_ids(model, tokenizer)
    temperature = temperature if temperature is not None else settings.temperature
    entropy_sum = sampler_logprobs = None
    stats: dict = {}
    hidden = None
    if settings.memory_budget_gib is not None and not settings.keep_workspace and prompt_ids.is_cuda:
        # a budget sizes the rollout's copies and KV cache by what is allocated; the blocks the allocator keeps
        # cached from the last update would count on top of it against a per-process cap (a 20 GiB card's second
        # 8B step ran out of memory in its rollout with 7.1 GiB allocated and 16.6 GiB reserved)
        torch.cuda.empty_cache()
    max_length = max(prompt_ids.shape[1] + settings.max_new_tokens, reserve[1] if reserve is not None else 0)
    use_graphs = settings.cuda_graphs and cuda_graphs
    compact = compact_decoder(model, settings, max_length)
    if compact is not None:
        sampler = _slot_decoder(compact, settings, eos_ids, tokenizer.pad_token_id, temperature, greedy, use_graphs,
                                states)
        with generation_mode(model, "never"):
            completion_ids, sampler_logprobs, entropy_sum = sampler(prompt_ids, prompt_mask, reserve)  # [N, C] x 2, [N]
        stats, hidden = dict(sampler.stats), sampler.states
        sampler.states = None
        if not settings.keep_workspace:
            compact["decoder"].release()  # the fused weight copies too
    else:
        with generation_mode(model, settings.merge_lora):
            if settings.engine == "loop":
                completion_ids, entropy_sum, sampler_logprobs = decode_loop(
                    model, prompt_ids, prompt_mask, settings.max_new_tokens, eos_ids, tokenizer.pad_token_id,
                    temperature, settings.top_p, settings.top_k, greedy, settings.min_new_tokens,
                    cuda_graphs=use_graphs,
                )  # [N, C]
            else:
                kwargs = dict(max_new_tokens=settings.max_new_tokens, min_new_tokens=settings.min_new_tokens or None,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids or None, use_cache=True)
                if greedy:
                    kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
                else:
                    kwargs.update(do_sample=True, temperature=temperature, top_p=settings.top_p,
                                  top_k=settings.top_k or None)
                kwargs.update(settings.extra)
                output = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)  # [N, Tp + C]
                completion_ids = output[:, prompt_ids.shape[1] :]  # [N, C]
    completion_mask, truncated = completion_mask_from_eos(completion_ids, eos_ids)
    completion_ids = torch.where(completion_mask.bool(), completion_ids, torch.full_like(completion_ids, tokenizer.pad_token_id))
    if sampler_logprobs is not None:
        sampler_logprobs = sampler_logprobs * completion_mask
    decoded = tokenizer.batch_decode(completion_ids, skip_special_tokens=True) if texts else []
    return Generated(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, decoded,
                     None if greedy else entropy_sum, None if greedy else sampler_logprobs, stats, hidden)
