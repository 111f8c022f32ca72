"""The policy and every forward pass a step runs on it: sampling, completion hidden states, chunked token
log-probs and entropies, the scoring passes and the finiteness probe.

The update, the self-teacher and evaluation all reach the network through one :class:`Policy`, so each
pass runs inside the :class:`~scgrpo.distributed.PolicyRunner` (FSDP's root when sharded), sees the same
position ids as the sampler, and computes fp32 logits chunk by chunk for completion positions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from scgrpo.chat import Prompt, render, system_prompt_layout
from scgrpo.budget import MemoryBudget, Span, active, measuring, row_extents, run_passes, span_rows, whole_rows
from scgrpo.distributed import (PolicyRunner, all_reduce, data_parallel_mesh, full_parameters, is_sharded, on_every_rank,
                                shard_policy)
from scgrpo.errors import InputError, one_line
from scgrpo.models import LoraSettings, load_policy, parse_dtype, warn_if_slow_cpu_dtype
from scgrpo.objectives.functional import chunked_token_logprobs
from scgrpo import packing
from scgrpo.packing import packed_inputs, plan_packing, unpack_columns
from scgrpo.rollout.backends import Sampler, make_sampler
from scgrpo.rollout.engine import Generated, GenerationSettings, generate, generate_ids
from scgrpo.rollout.types import RolloutBatch

@dataclasses.dataclass(frozen=True)
class PassOptions:
    """How a step's passes run (each policy holds its own; benchmarks measure one against another)."""

    packing: bool = True
    """The passes that may run packed do (the self-teacher's shared passes, every pass over a budget's micro-batches,
    and every pass on a CPU: :attr:`Policy.packs`); False: every pass runs padded"""
    packed_training: bool = True
    """The update's passes (those with a gradient) pack too; False: only the passes without one"""
    cudnn_attention: bool = False
    """The passes of a step (scoring, teacher, update, their backward) may use cuDNN's attention. Off: PyTorch picks
    among the other kernels the process allows (flash, memory-efficient, math). cuDNN's attention builds an execution
    plan for each new shape of a pass, tens of milliseconds of host time, and a step's passes change shape from step to
    step (their rows and widths follow the sampled lengths). The rollout engine's own passes are not affected"""
    shared_teacher_passes: bool = True
    """Under a memory budget, a micro-batch's teacher and student rows share one forward where the teacher's sequences
    are short (:data:`scgrpo.selfteacher.SHARED_PASS_TOKENS`); False: always passes of their own"""


def attention_backends(device: torch.device, cudnn: bool = False) -> contextlib.AbstractContextManager:
    """The context of a step's forward and backward passes on ``device``: on a GPU, the attention kernels the process
    allows less cuDNN's, unless ``cudnn`` (:attr:`PassOptions.cudnn_attention`; a backward recomputing a checkpointed
    layer must pick the kernel its forward did, so the update's backward runs inside it too); elsewhere nothing."""
    if device.type != "cuda" or cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flags = torch.backends.cuda
    kept = [backend for backend, on in ((SDPBackend.FLASH_ATTENTION, flags.flash_sdp_enabled()),
                                        (SDPBackend.EFFICIENT_ATTENTION, flags.mem_efficient_sdp_enabled()),
                                        (SDPBackend.MATH, flags.math_sdp_enabled())) if on]
    # (the process's own choice stands, less cuDNN; where it allowed cuDNN alone, cuDNN it is)
    return sdpa_kernel(kept) if kept else contextlib.nullcontext()


ATTENTION_LAYERS = ("full_attention", "sliding_attention")
"""``config.layer_types`` a packed pass allows (each sequence sees only itself through the mask)."""


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face *ForCausalLM inside a peft wrapper (LoRA layers stay injected in it)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class Policy:
    """The trained network (a peft model with LoRA, or the bare causal LM) with its tokenizer and the forward
    passes of a step.

    Args:
        runner: holds the network; every pass runs inside it (FSDP's root when sharded).
        tokenizer: the model's tokenizer (chat template, padding side left).
        generation: sampling settings; log-probs and entropies are taken at its temperature.
        device: where the network was loaded (the device of its weights, which :attr:`device` follows when the
            network is moved, e.g. by ``module.to("cuda")``).
        system_prompt: a system message put before each question (None: the chat template's default).
        logprob_chunk_size: tokens per chunk of fp32 logits.
    """

    def __init__(self, runner: PolicyRunner, tokenizer, generation: GenerationSettings, device: torch.device,
                 system_prompt: Optional[str] = None, logprob_chunk_size: int = 1024) -> None:
        self.runner, self.tokenizer, self.generation = runner, tokenizer, generation
        self.system_prompt, self.logprob_chunk_size = system_prompt, logprob_chunk_size
        self._system_role: Optional[bool] = None  # the chat template renders a system message (read once)
        self.passes = PassOptions()  # how the step's passes run
        self._sampler: Optional[Sampler] = None  # the rollout backend (see sampler)
        self._sampler_key: Optional[tuple[str, str]] = None
        self._loaded_on = device
        self.max_completion_tokens = generation.max_new_tokens  # an episode's token budget when rollouts are episodes
        self.budget: Optional[MemoryBudget] = None  # sizes the passes on a GPU (set by the module)
        self.checkpointing = False  # gradient checkpointing is on in the network
        self.has_lora = False

    @property
    def device(self) -> torch.device:
        """Where the network's weights are now (batches are built there)."""
        first = next(self.model.parameters(), None)
        return self._loaded_on if first is None else first.device

    @property
    def model(self) -> nn.Module:
        return self.runner.policy

    @property
    def sharded(self) -> bool:
        return is_sharded(self.runner)

    @property
    def temperature(self) -> float:
        return self.generation.temperature

    def lm_head(self) -> nn.Module:
        return unwrap_causal_lm(self.model).get_output_embeddings()

    def trainable_parameters(self) -> list[Tensor]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def sync(self) -> None:
        """Waits for the GPU so that phase timings measure the work, not the kernel launches."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """No dropout inside the block; the network's train/eval mode is put back after it."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    # ---------------------------------------------------------------------------------------- prompts
    def format_prompts(self, questions: list[Prompt]) -> list[str]:
        """Each prompt (a question, or a list of chat messages: :mod:`scgrpo.chat`) as the model reads it: through
        the chat template with the assistant's header, ``system_prompt`` as the system message unless the prompt has
        its own (for a template that renders no system message, the system text opens the first turn, as in the
        self-teacher's view); without a chat template, the texts between blank lines."""
        if self._system_role is None:
            self._system_role = system_prompt_layout(self.tokenizer, None)[0]
        return [render(self.tokenizer, q, self.system_prompt, self._system_role) for q in questions]

    def sample(self, prompts: list[str], num_samples: int, greedy: bool = False,
               temperature: Optional[float] = None, states: bool = False) -> Generated:
        """``num_samples`` completions of each prompt under the current weights (eval mode, no grad). When the
        network is sharded, its parameters are gathered once for the whole decode loop. ``states``: keep the
        sampler's final hidden states (:attr:`~scgrpo.rollout.engine.Generated.states`)."""

        return self._sampling(lambda settings: generate(self.model, self.tokenizer, prompts, num_samples, settings,
                                                        self.device, greedy=greedy, temperature=temperature,
                                                        states=states, sampler=self.sampler))

    def sample_ids(self, prompt_ids: Tensor, prompt_mask: Tensor, greedy: bool = False,
                   temperature: Optional[float] = None, reserve: Optional[tuple[int, int]] = None) -> Generated:
        """One completion of each left-padded prompt of token ids ``[N, Tp]`` (the histories of episodes, as
        sampled), as ids only (``completions`` empty); ``reserve`` as :func:`~scgrpo.rollout.engine.generate_ids`."""
        return self._sampling(lambda settings: generate_ids(self.model, self.tokenizer, prompt_ids, prompt_mask,
                                                            settings, greedy, temperature, reserve=reserve,
                                                            texts=False, sampler=self.sampler))

    @property
    def sampler(self) -> Sampler:
        """The rollout backend ``generation.engine`` names, kept for the run (with its caches); a new one, the old one
        released, when the setting changes."""
        key = (self.generation.engine, self.generation.decode_forward)
        if self._sampler is None or self._sampler_key != key:
            if self._sampler is not None:
                self._sampler.release()
            self._sampler, self._sampler_key = make_sampler(self.generation), key
        return self._sampler

    def one_model_state(self) -> ContextManager[None]:
        """Inside the block the sampled weights do not change (the turns of one episode batch): the backend may
        check and refresh its copies of them once (:meth:`~scgrpo.rollout.backends.Sampler.one_model_state`)."""
        return self.sampler.one_model_state()

    def release_rollout_workspaces(self) -> None:
        """Frees what the rollout backend keeps between rollouts (KV caches, CUDA graphs, weight copies)."""
        if self._sampler is not None:
            self._sampler.release()

    def _sampling(self, sample) -> Generated:
        def run() -> Generated:
            with full_parameters(self.runner), record_function("scgrpo.sample"):
                settings = self.generation
                if self.sharded and settings.merge_lora == "always":
                    settings = dataclasses.replace(settings, merge_lora="never")  # weights are FSDP's views
                return sample(settings)

        return self.runner(run)

    # ------------------------------------------------------------------------------------ forward passes
    def completion_hidden(self, input_ids: Tensor, attention_mask: Tensor, num_completion: int,
                          model: Optional[nn.Module] = None, packed: bool = False) -> Tensor:
        """``[N, C, H]`` final hidden states that predict the last ``num_completion`` tokens of ``input_ids``
        (``model``: the network to run, by default this policy's). ``packed``: the sequences run packed
        (:mod:`scgrpo.packing`) where that saves enough tokens and the model's attention allows it (its states
        before tokens outside a row's own are then zeros)."""
        causal_lm = unwrap_causal_lm(self.model if model is None else model)
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        if packed:
            hidden = self._packed_hidden(backbone, input_ids, attention_mask, num_completion)
            if hidden is not None:
                return hidden
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        with attention_backends(input_ids.device, self.passes.cudnn_attention):
            hidden = backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state  # [N, T, H]
        return hidden[:, -num_completion - 1 : -1]  # [N, C, H]: the state before each completion token

    def _packed_hidden(self, backbone: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                       num_completion: int) -> Optional[Tensor]:
        """:meth:`completion_hidden` over packed rows, or None where packing does not apply: attention other than
        PyTorch's or eager (flash's kernels take no mask), layers other than attention, a sliding window shorter than
        the rows, too little padding to save (:func:`~scgrpo.packing.plan_packing`)."""
        if not self.passes.packing:
            return None
        config = backbone.config
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in ("sdpa", "eager"):
            return None
        if any(kind not in ATTENTION_LAYERS for kind in getattr(config, "layer_types", None) or ()):
            return None  # (a recurrent or linear-attention layer would carry state from one sequence to the next)
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True) and window < input_ids.shape[1]:
            return None
        # a group's rows share their prompt, and the self-teacher's rows with one reference their teacher prompt: the
        # columns before the completion's are computed once for all the rows that hold the same tokens there
        shared = input_ids.shape[1] - num_completion if packing.SHARED_PREFIXES else 0
        plan = plan_packing(attention_mask, input_ids=input_ids, shared_columns=shared)
        if plan is None:
            return None
        dtype = backbone.get_input_embeddings().weight.dtype  # (the states' dtype: 4-bit layers hold bytes)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, positions, mask = packed_inputs(plan, input_ids, pad, None if implementation == "sdpa" else dtype)
        with attention_backends(input_ids.device, self.passes.cudnn_attention):
            hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions,
                              use_cache=False).last_hidden_state  # [R, W, H]
        t = input_ids.shape[1]
        columns = torch.arange(t - num_completion - 1, t - 1, device=input_ids.device)
        return unpack_columns(plan, hidden, columns)  # [N, C, H]

    def token_logprobs(self, input_ids: Tensor, attention_mask: Tensor, num_completion: int, entropy: bool = True,
                       model: Optional[nn.Module] = None) -> tuple[Tensor, Tensor]:
        """fp32 log-probs ``[N, C]`` of the last ``num_completion`` tokens of ``input_ids`` and the entropy of
        each predicted distribution, at the sampling temperature. Only the backbone runs on the whole
        sequence; logits are computed in chunks for the completion positions alone."""
        hidden = self.completion_hidden(input_ids, attention_mask, num_completion, model)
        return self.head_logprobs(hidden, input_ids[:, -num_completion:], entropy)

    def head_logprobs(self, hidden: Tensor, targets: Tensor, entropy: bool = True,
                      mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """fp32 log-probs ``[N, C]`` of ``targets`` from the states ``hidden`` ``[N, C, H]`` through the LM head,
        chunk by chunk, at the sampling temperature, and each distribution's entropy (when ``entropy``). With
        ``mask`` ``[N, C]`` only its tokens go through the head (the others, padding or the environment's, are 0:
        each token's values are those of the whole pass, bit for bit)."""
        chunk = self.chunk_size()
        if mask is None:
            return chunked_token_logprobs(hidden, self.lm_head(), targets, self.temperature, chunk, entropy)
        keep = mask.bool()
        logprobs, entropies = chunked_token_logprobs(hidden[keep].unsqueeze(0), self.lm_head(), targets[keep].unsqueeze(0),
                                                     self.temperature, chunk, entropy)
        full = logprobs.new_zeros(keep.shape).masked_scatter(keep, logprobs[0])
        return full, entropies.new_zeros(keep.shape).masked_scatter(keep, entropies[0])

    def chunk_size(self, models: int = 1) -> int:
        """Tokens per block of fp32 logits: ``logprob_chunk_size``, fewer where the memory budget needs it."""
        return self.budget.chunk_size(self.logprob_chunk_size, models) if self.budget is not None else self.logprob_chunk_size

    def spans(self, kind: str, rollouts: RolloutBatch, rows: Optional[Tensor] = None, max_rows: Optional[int] = None,
              fixed: float = 0.0) -> list[Span]:
        """Micro-batches of ``rows`` (default all) for a pass of ``kind``: sized and cut by the memory budget on a
        GPU (:mod:`scgrpo.budget`); else blocks of ``max_rows`` rows (all: None) in batch order, uncut."""
        n, c = rollouts.completion_ids.shape
        chosen = torch.arange(n, device=self.device) if rows is None else rows
        if active(self.budget) is None:
            return whole_rows(chosen, max_rows, c)
        first, width = row_extents(rollouts.prompt_mask, rollouts.context_mask)
        return self.budget.plan(kind, first, width, rollouts.prompt_ids.shape[1], self.device, chosen.tolist(),
                                max_rows, fixed)

    def span_hidden(self, rollouts: RolloutBatch, span: Span, model: Optional[nn.Module] = None) -> Tensor:
        """``[n, width, H]`` final hidden states of the span's rows that predict their first ``width`` completion
        tokens, the span's columns only; packed (:mod:`scgrpo.packing`) where :attr:`packs` (with a gradient, where
        :attr:`PassOptions.packed_training`)."""
        rows = span.rows
        ids = torch.cat([rollouts.prompt_ids[rows, span.left :], rollouts.completion_ids[rows, : span.width]], 1)
        mask = torch.cat([rollouts.prompt_mask[rows, span.left :], rollouts.context_mask[rows, : span.width]], 1)
        packed = self.packs and (self.passes.packed_training or not torch.is_grad_enabled())
        return self.completion_hidden(ids, mask, span.width, model, packed=packed)

    @property
    def packs(self) -> bool:
        """Whether the passes over rollouts run packed (:mod:`scgrpo.packing`): under an active memory budget, and on
        a CPU, where a pass's time is its tokens' arithmetic and packing drops the padding and the prompts that a
        group's rows repeat (:attr:`PassOptions.packing` off: never)."""
        return self.passes.packing and (active(self.budget) is not None or self.device.type == "cpu")

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Switches gradient checkpointing (non-reentrant) on or off in the network."""
        if on == self.checkpointing:
            return
        causal_lm = unwrap_causal_lm(self.model)
        if on:
            causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.has_lora and hasattr(causal_lm, "enable_input_require_grads"):
                causal_lm.enable_input_require_grads()
        else:
            causal_lm.gradient_checkpointing_disable()
            if self.has_lora and hasattr(causal_lm, "disable_input_require_grads"):
                causal_lm.disable_input_require_grads()
        self.checkpointing = on

    def score(self, rollouts: RolloutBatch, old: bool, reference: bool, micro_batch_size: Optional[int] = None) -> None:
        """Fills the log-probs an objective needs besides the trained ones: ``old_logprobs`` under the sampling
        weights (``old``: several optimiser steps per batch, or a KL-shaped reward) and ``ref_logprobs`` under the
        reference, the adapters off (``reference``: a KL term or reward), in passes of at most ``micro_batch_size`` rows (None: all, or what
        the memory budget holds). No dropout, no gradient."""

        if reference and not hasattr(self.model, "disable_adapter"):
            raise ValueError("a KL to the reference (GRPO's beta > 0, REINFORCE++'s kl_coef > 0) uses the base model "
                             "(adapters off) as reference; it needs LoRA (lora != null), or set that coefficient to 0")

        @torch.no_grad()
        def run() -> None:
            with self.eval_mode(), full_parameters(self.runner):
                if old:
                    rollouts.old_logprobs = self._span_logprobs(rollouts, False, micro_batch_size)[0]
                if reference:
                    with self.model.disable_adapter():
                        rollouts.ref_logprobs = self._span_logprobs(rollouts, False, micro_batch_size)[0]

        self.runner(run)

    def _span_logprobs(self, rollouts: RolloutBatch, entropy: bool, max_rows: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """``[N, C]`` log-probs and entropies of the model's tokens of the whole batch (0 elsewhere), in the passes
        :meth:`spans` plans (no gradient)."""
        n, c = rollouts.completion_ids.shape
        logprobs = torch.zeros(n, c, dtype=torch.float32, device=self.device)
        entropies = torch.zeros_like(logprobs)
        tp = rollouts.prompt_ids.shape[1]
        budget = active(self.budget)
        fixed = budget.logit_fixed(self.chunk_size()) if budget is not None else 0.0
        spans = self.spans("forward", rollouts, max_rows=max_rows, fixed=fixed)

        def run(span: Span) -> None:
            with measuring(budget, "forward", span.tokens(tp), fixed):
                hidden = self.span_hidden(rollouts, span)
                mask = rollouts.completion_mask[span.rows, : span.width]
                lp, ent = self.head_logprobs(hidden, rollouts.completion_ids[span.rows, : span.width], entropy, mask)
            logprobs[span.rows, : span.width] = lp
            entropies[span.rows, : span.width] = ent

        ran = run_passes(budget, "forward", spans, span_rows, lambda span: span.tokens(tp),
                         lambda rows: self.spans("forward", rollouts, torch.tensor(rows, device=self.device), max_rows,
                                                 fixed), run)
        if budget is not None:
            budget.note("scoring", [s.tokens(tp) for s in ran])
        return logprobs, entropies

    def batch_entropy(self, rollouts: RolloutBatch, micro_batch_size: Optional[int]) -> Tensor:
        """``[N, C]`` token entropies of the whole batch under the current (= sampling) weights, no dropout, in
        passes of ``micro_batch_size`` rows (None: one)."""

        @torch.no_grad()
        def run() -> Tensor:
            with self.eval_mode(), full_parameters(self.runner):
                return self._span_logprobs(rollouts, entropy=True, max_rows=micro_batch_size)[1]

        return self.runner(run)

    @torch.no_grad()
    def is_finite(self) -> bool:
        """True when every trainable tensor is finite and so are the log-probs on a short probe text (weights
        can be finite and still overflow the activations). Every rank must call it when sharded."""
        local = all(bool(torch.isfinite(getattr(p, "_local_tensor", p)).all()) for p in self.trainable_parameters())
        ids = self.tokenizer("1 + 1 = 2", return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device)

        def probe() -> Tensor:
            with self.eval_mode(), full_parameters(self.runner):
                return self.token_logprobs(ids, torch.ones_like(ids), ids.shape[1] - 1, entropy=False)[0]

        local = local and bool(torch.isfinite(self.runner(probe)).all())
        return all_reduce([float(not local)], "max", self.device)[0] == 0


def build_policy(model: str, dtype: str, lora: Optional[LoraSettings], quantization: Optional[str],
                 device: torch.device, generation: GenerationSettings, system_prompt: Optional[str] = None,
                 logprob_chunk_size: int = 1024, gradient_checkpointing: bool = False, mesh=None) -> Policy:
    """Loads the model (``model``: "smollm2", a folder, a hub id or a .gguf file) with LoRA and optional 4-bit
    base onto ``device`` in train mode, and shards it over ``mesh``'s data-parallel ranks when given."""
    compute_dtype = parse_dtype(dtype, device.type)
    warn_if_slow_cpu_dtype(compute_dtype, device.type)
    # (on several ranks, a rank whose loading fails stops the others, which would wait for it in the first collective)
    network, tokenizer = on_every_rank(lambda: load_policy(model, compute_dtype, lora, quantization, device),
                                       "loading the model")
    runner = PolicyRunner(network)
    network.train()  # from_pretrained returns eval mode; generation switches to eval by itself
    if gradient_checkpointing:
        network.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora is not None and hasattr(network, "enable_input_require_grads"):
            network.enable_input_require_grads()
    if mesh is not None:  # a ModelParallelStrategy run (FSDP2Strategy): shard over the data-parallel ranks
        if quantization is not None:
            raise ValueError(
                "quantization (4-bit QLoRA) cannot be sharded by FSDP2Strategy: FSDP2 gathers packed 4-bit "
                "weights without their quantisation state. Use one GPU per run for QLoRA, or bf16 LoRA with FSDP"
            )
        shard_policy(runner, data_parallel_mesh(mesh), compute_dtype)
    policy = Policy(runner, tokenizer, generation, device, system_prompt, logprob_chunk_size)
    policy.checkpointing, policy.has_lora = gradient_checkpointing, lora is not None
    return policy


def load_run_policy(model: str, adapter, lora: Optional[LoraSettings], dtype: str, quantization: Optional[str],
                    device: torch.device, generation: GenerationSettings, budget: MemoryBudget,
                    max_completion_tokens: int, system_prompt: Optional[str] = None, logprob_chunk_size: int = 1024,
                    gradient_checkpointing: bool = False, mesh=None) -> Policy:
    """The run's policy (:func:`build_policy`): ``model``, or with ``adapter`` (a
    :class:`~scgrpo.models.AdapterFolder`) its base with LoRA layers shaped as the adapter's and then its weights;
    ``budget`` resolved on ``device`` for it, and the rollout's settings as the budget sizes them."""
    name = model
    if adapter is not None:
        name, lora = adapter.base, adapter.lora_settings(lora)
    try:
        policy = build_policy(name, dtype, lora, quantization, device, generation, system_prompt, logprob_chunk_size,
                              gradient_checkpointing, mesh)
    except (ValueError, TypeError) as err:
        if adapter is None:
            raise
        # peft's word on a layout that does not fit the base (target modules it lacks, a bad setting)
        raise InputError(f"adapter {adapter.folder} does not fit the base model {adapter.base}: "
                         f"{one_line(err)}") from err
    if adapter is not None:
        adapter.load_weights(policy.model)
    network = policy.model
    budget.setup(device, getattr(network, "config", None), next(network.parameters()).dtype)
    policy.budget = budget
    policy.generation = budget.rollout_settings(policy.generation)
    policy.max_completion_tokens = max_completion_tokens
    return policy
