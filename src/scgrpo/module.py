"""The LightningModule: the policy, the loss on a prepared rollout batch, and evaluation."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor
from torch.profiler import record_function

from scgrpo.callbacks import (
    AdapterExport,
    AtomicCheckpointIO,
    CompletionsTable,
    CreditLogging,
    DynamicSamplingCallback,
    ReleaseHeldInterrupt,
    RolloutCallback,
    ValidateBeforeTraining,
    VerificationCallback,
)
from scgrpo.distributed import (
    PolicyRunner,
    all_reduce,
    data_parallel_mesh,
    full_parameters,
    full_state,
    is_sharded,
    mean_over_ranks,
    shard_policy,
    sum_over_ranks,
    world_size,
)
from scgrpo.models import QUANTIZATIONS, LoraSettings, check_model_name, load_policy, parse_dtype, warn_if_slow_cpu_dtype
from scgrpo.objectives import GRPO, Credit, LossInputs, Objective
from scgrpo.objectives.functional import chunked_token_logprobs, masked_mean
from scgrpo.rollout.engine import Generated, GenerationSettings, generate
from scgrpo.rollout.types import PromptBatch, RolloutBatch
from scgrpo.selfteacher import SelfTeacher, TeacherSignal
from scgrpo.verifiers import Verifier, VerifierRunner

log = logging.getLogger(__name__)


def _rng_state() -> dict:
    import random

    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    # plain types and tensors only: Lightning loads checkpoints with torch.load(weights_only=True)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _unwrap_causal_lm(policy):
    """The Hugging Face *ForCausalLM inside a peft wrapper (LoRA layers stay injected in it)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


class RLVRModule(LightningModule):
    """Trains a causal LM with an RLVR objective on rollouts that the callbacks attach to each batch.

    A training step reads the batch's :class:`RolloutBatch` (completions sampled by
    :class:`~scgrpo.callbacks.RolloutCallback`, rewards set by :class:`~scgrpo.callbacks.VerificationCallback`),
    turns rewards into advantages with the objective, and runs ``objective.num_iterations`` optimiser steps
    over it (manual optimisation). Rows whose advantage is exactly zero add nothing to the gradient of a
    clipped-surrogate loss without KL, so they are left out of the forward pass; the loss denominators still
    count their tokens, so the loss equals the full-batch one.

    Args:
        model: "smollm2" (the embedded SmolLM2-135M-Instruct), a local Hugging Face folder, a hub id, or a
            ``.gguf`` file.
        objective: the RLVR objective (default: GRPO).
        lora: LoRA settings; ``null`` trains all weights.
        dtype: "auto" (fp32 on CPU, bf16 on GPU), "float32", "bfloat16" or "float16".
        generation: sampling settings for training rollouts (G, lengths, temperature).
        verifier: scores completions; default: the data source's own.
        optimizer: built over the trainable parameters only; default AdamW(lr=1e-4, weight_decay=0).
        lr_scheduler: stepped after every optimiser step.
        system_prompt: a system message put before each question (None: the chat template's default).
        success_threshold: a rollout counts as correct (and verified) when its reward is >= this.
        max_grad_norm: gradient clipping by global norm (0 = off).
        micro_batch_size: rows per forward/backward (gradient accumulation inside a step); None = all at once.
        logprob_chunk_size: tokens per chunk of fp32 logits in the log-prob computation.
        gradient_checkpointing: recompute activations in backward (non-reentrant); off during generation.
        quantization: "nf4" loads the frozen base in 4 bits through bitsandbytes (QLoRA: double quantisation,
            compute and storage in bf16); None keeps it in ``dtype``. Needs a GPU; one GPU per run (not sharded).
        eval_samples: k for Avg@k and Pass@k in validation.
        eval_temperature: sampling temperature in validation (None: the training temperature).
        eval_greedy: also measure greedy accuracy in validation.
        validate_before_training: run validation once before the first step.
        log_completions_every_n_steps: write sample completions every N steps (0 = never).
        save_adapter_every_n_steps: export the adapter every N steps (None: only at the end).
        max_nonfinite_skips: the divergence guard. A step whose sampling log-probs or entropies, scoring or
            teacher log-probs, advantages, loss or gradient norm is NaN or infinite changes no weight and is
            counted (``train/nonfinite_skips``); after this many such steps in a row the run stops with one
            message, the weights of the last step that gave finite values are put back (the final adapter holds
            them) and no checkpoint is written over the last good one. 0: skip such steps but never stop (and keep
            no copy of the trainable weights, which costs their size in memory).
        tis_cap: truncated importance sampling: each token's policy-gradient term is weighted by
            min(pi_trainer(y) / pi_sampler(y), tis_cap), the ratio of the trainer's probability (at sampling time)
            to the sampler's, correcting for the gap between the two (numerics, and top-k / top-p filtering,
            whose log-probabilities the sampler reports renormalised); 0 = off (default). Acts through the
            objective's token weights, so objectives without a policy-gradient term (OPSD) are unchanged. With
            num_iterations 1 the trainer's side is the training forward itself (LoRA dropout included).
    """

    def __init__(
        self,
        model: str = "smollm2",
        objective: Optional[Objective] = None,
        lora: Optional[LoraSettings] = LoraSettings(),
        dtype: str = "auto",
        generation: GenerationSettings = GenerationSettings(),
        verifier: Optional[Verifier] = None,
        optimizer: Optional[OptimizerCallable] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        system_prompt: Optional[str] = None,
        success_threshold: float = 1.0,
        max_grad_norm: float = 1.0,
        micro_batch_size: Optional[int] = None,
        logprob_chunk_size: int = 1024,
        gradient_checkpointing: bool = False,
        quantization: Optional[str] = None,
        eval_samples: int = 4,
        eval_temperature: Optional[float] = None,
        eval_greedy: bool = True,
        validate_before_training: bool = True,
        log_completions_every_n_steps: int = 10,
        save_adapter_every_n_steps: Optional[int] = None,
        tis_cap: float = 0.0,
        max_nonfinite_skips: int = 3,
    ) -> None:
        super().__init__()
        if eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {eval_samples}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        check_model_name(model)
        if tis_cap < 0 or (0 < tis_cap < 1):
            raise ValueError(f"tis_cap must be 0 (off) or >= 1 (a cap on pi_trainer / pi_sampler), got {tis_cap}")
        self.tis_cap = tis_cap
        if max_nonfinite_skips < 0:
            raise ValueError(f"max_nonfinite_skips must be >= 0 (0 = never stop), got {max_nonfinite_skips}")
        self.max_nonfinite_skips = max_nonfinite_skips
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization={quantization!r}: expected null or one of {QUANTIZATIONS}")
        if quantization is not None and lora is None:
            raise ValueError("a quantised base cannot be trained; set lora (QLoRA) or quantization: null")
        if quantization is not None and not torch.cuda.is_available():
            raise ValueError("quantization (QLoRA) needs a GPU: bitsandbytes' 4-bit layers run on CUDA; "
                             "set model.quantization: null to train in model.dtype")
        self.quantization = quantization
        self.model_name = model
        self.objective = objective if objective is not None else GRPO()
        self.lora, self.dtype_name, self.generation = lora, dtype, generation
        parse_dtype(dtype, "cpu")  # fail early on an unknown name
        self._verifier, self._optimizer, self._lr_scheduler = verifier, optimizer, lr_scheduler
        self.system_prompt, self.success_threshold = system_prompt, success_threshold
        self.max_grad_norm, self.micro_batch_size = max_grad_norm, micro_batch_size
        self.logprob_chunk_size, self.gradient_checkpointing = logprob_chunk_size, gradient_checkpointing
        self.eval_samples, self.eval_temperature, self.eval_greedy = eval_samples, eval_temperature, eval_greedy
        self.validate_before_training = validate_before_training
        self.log_completions_every_n_steps = log_completions_every_n_steps
        self.save_adapter_every_n_steps = save_adapter_every_n_steps
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the trainable weights
        self.runner: Optional[PolicyRunner] = None  # holds the policy; the FSDP root when sharded
        self.tokenizer = None
        self.verifier_runner: Optional[VerifierRunner] = None
        self.nonfinite_skips = 0  # steps skipped for a NaN/inf, over the whole run (checkpointed)
        self.consecutive_skips = 0  # of them, in a row up to the last step
        self.diverged = False  # the guard stopped the run; checkpoint and adapter callbacks read it
        self.last_step_skipped = False  # the last training step changed no weight (its rollouts are not stored)
        # from the step's first weight update to the end of its bookkeeping (data position, buffer, logs: the
        # callbacks' on_train_batch_end): a checkpoint taken in between would hold half a step
        self.updating = False
        # the RNG state where the run last stood between steps (a step's end, a validation's end, the start): what
        # a checkpoint written on an exception holds, not the state that a rollout cut short has drawn from
        self._rng_between_steps: Optional[dict] = None
        self._good_weights: Optional[list[Tensor]] = None  # trainable tensors of the last step with finite values
        self._good_step = 0
        self._self_teacher: Optional[SelfTeacher] = None
        self.last_step_metrics: dict[str, float] = {}
        self._mismatch: dict[str, float] = defaultdict(float)  # this step's sampler-trainer mismatch sums
        self._first_pass = True  # the step's first optimisation pass (the mismatch is booked on it only)
        self.last_credit: Optional[dict] = None  # what CreditLogging draws: the step's signal and credit
        self._eval: dict[str, dict[str, float]] = {}

    # ----------------------------------------------------------------------------------------------- setup
    @property
    def policy(self):
        """The policy (a peft model with LoRA, or the bare causal LM)."""
        return self.runner.policy if self.runner is not None else None

    @property
    def self_teacher(self) -> Optional[SelfTeacher]:
        """The self-teacher for the objective's spec (None when the objective uses none)."""
        spec = self.objective.teacher
        if spec is None:
            return None
        if self._self_teacher is None or self._self_teacher.spec is not spec:
            self._self_teacher = SelfTeacher(spec)
        return self._self_teacher

    @property
    def sharded(self) -> bool:
        return self.runner is not None and is_sharded(self.runner)

    def configure_model(self) -> None:
        if self.runner is not None:
            return
        if self._trainer is not None:
            device = self.trainer.strategy.root_device
        else:  # used outside a Trainer: a 4-bit base must load onto a GPU
            device = torch.device("cuda" if self.quantization is not None else "cpu")
        dtype = parse_dtype(self.dtype_name, device.type)
        warn_if_slow_cpu_dtype(dtype, device.type)
        policy, self.tokenizer = load_policy(self.model_name, dtype, self.lora, self.quantization, device)
        self.runner = PolicyRunner(policy)
        policy.train()  # from_pretrained returns eval mode; generation switches to eval by itself
        if self.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.lora is not None and hasattr(policy, "enable_input_require_grads"):
                policy.enable_input_require_grads()
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None:  # a ModelParallelStrategy run (FSDP2Strategy): shard over the data-parallel ranks
            if self.quantization is not None:
                raise ValueError(
                    "quantization (4-bit QLoRA) cannot be sharded by FSDP2Strategy: FSDP2 gathers packed 4-bit "
                    "weights without their quantisation state. Use one GPU per run for QLoRA, or bf16 LoRA with FSDP"
                )
            shard_policy(self.runner, data_parallel_mesh(mesh), dtype)

    def setup(self, stage: str) -> None:
        self.configure_model()
        verifier = self._verifier
        if verifier is None:
            datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            if datamodule is None or not hasattr(datamodule, "default_verifier"):
                raise ValueError("no verifier given and the data module offers no default; set model.verifier")
            verifier = datamodule.default_verifier()
        self.verifier_runner = VerifierRunner(verifier)
        if self._trainer is not None and type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # Lightning's own writer stages each checkpoint in $TMPDIR, where a killed save leaves it behind
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def configure_callbacks(self):
        # first: a Ctrl-C that StepCheckpoint held at the last step's end takes effect before the next rollout
        callbacks = [ReleaseHeldInterrupt(), RolloutCallback(), VerificationCallback()]
        if self.objective.dynamic_sampling:
            callbacks.append(DynamicSamplingCallback())
        callbacks += [CompletionsTable(self.log_completions_every_n_steps), AdapterExport(self.save_adapter_every_n_steps)]
        if self.objective.teacher is not None:
            callbacks.append(CreditLogging(self.log_completions_every_n_steps))
        if self.validate_before_training:
            callbacks.append(ValidateBeforeTraining())
        return callbacks

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the policy has no trainable parameters")
        optimizer = self._optimizer(params) if self._optimizer else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        if self._lr_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self._lr_scheduler(optimizer), "interval": "step"}}

    # ------------------------------------------------------------------------------------------- prompts
    def format_prompts(self, questions: list[str]) -> list[str]:
        """Each question as the model's chat prompt (user turn + assistant header), or raw text without a
        chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            return [q if self.system_prompt is None else f"{self.system_prompt}\n\n{q}" for q in questions]
        prompts = []
        for q in questions:
            messages = [{"role": "user", "content": q}]
            if self.system_prompt is not None:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            prompts.append(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        return prompts

    # ------------------------------------------------------------------------------------------ log-probs
    def completion_hidden(self, model, input_ids: Tensor, attention_mask: Tensor, num_completion: int) -> Tensor:
        """``[N, C, H]`` final hidden states that predict the last ``num_completion`` tokens of ``input_ids``."""
        causal_lm = _unwrap_causal_lm(model)
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [N, T, H]
        return hidden[:, -num_completion - 1 : -1]  # [N, C, H]: the state before each completion token

    def lm_head(self):
        return _unwrap_causal_lm(self.policy).get_output_embeddings()

    def token_logprobs(
        self, model, input_ids: Tensor, attention_mask: Tensor, num_completion: int, entropy: bool = True
    ) -> tuple[Tensor, Tensor]:
        """fp32 log-probs ``[N, C]`` of the last ``num_completion`` tokens of ``input_ids`` and the entropy of
        each predicted distribution, at the sampling temperature. Only the backbone runs on the whole
        sequence; logits are computed in chunks for the completion positions alone."""
        hidden = self.completion_hidden(model, input_ids, attention_mask, num_completion)
        targets = input_ids[:, -num_completion:]  # [N, C]
        return chunked_token_logprobs(
            hidden, self.lm_head(), targets, self.generation.temperature, self.logprob_chunk_size, entropy
        )

    def sample(self, prompts: list[str], num_samples: int, greedy: bool = False,
               temperature: Optional[float] = None) -> Generated:
        """``num_samples`` completions of each prompt under the current policy (eval mode, no grad). When the
        policy is sharded, its parameters are gathered once for the whole decode loop."""

        def run() -> Generated:
            with full_parameters(self.runner), record_function("scgrpo.sample"):
                settings = self.generation
                if self.sharded and settings.merge_lora == "always":
                    settings = dataclasses.replace(settings, merge_lora="never")  # weights are FSDP's views
                return generate(self.policy, self.tokenizer, prompts, num_samples, settings, self.device,
                                greedy=greedy, temperature=temperature)

        return self.runner(run)

    def score_rollouts(self, rollouts: RolloutBatch) -> None:
        """Log-probs the objective needs besides the trained ones: under the sampling policy when it takes
        several optimiser steps per batch, and under the reference (adapters off) when it has a KL term."""
        self.runner(lambda: self._score_rollouts(rollouts))

    @torch.no_grad()
    def _score_rollouts(self, rollouts: RolloutBatch) -> None:
        c = rollouts.completion_ids.shape[1]
        was_training = self.policy.training
        self.policy.eval()
        try:
            if self.objective.num_iterations > 1:
                rollouts.old_logprobs = self.token_logprobs(
                    self.policy, rollouts.input_ids, rollouts.attention_mask, c, entropy=False)[0]
            if self.objective.beta > 0:
                if not hasattr(self.policy, "disable_adapter"):
                    raise ValueError("beta > 0 uses the base model (adapters off) as reference; it needs LoRA (lora != null)")
                with self.policy.disable_adapter():
                    rollouts.ref_logprobs = self.token_logprobs(
                        self.policy, rollouts.input_ids, rollouts.attention_mask, c, entropy=False)[0]
        finally:
            self.policy.train(was_training)

    # ------------------------------------------------------------------------------------------ training
    def _sync(self) -> None:
        """Waits for the GPU so that phase timings measure the work, not the kernel launches."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def phase_peak(self, stats: dict, name: str) -> None:
        """On a GPU, records the peak memory allocated since the last call as ``memory/<name>_peak_gib`` and
        starts a new phase (the peaks of sampling, teacher pass and update are logged apart)."""
        if self.device.type == "cuda":
            key = f"memory/{name}_peak_gib"
            stats[key] = max(stats.get(key, 0.0), torch.cuda.max_memory_allocated(self.device) / 2**30)
            torch.cuda.reset_peak_memory_stats(self.device)

    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        """sample -> verify (callbacks, before this) -> self-teacher -> credit -> loss -> log. A NaN or inf met
        on the way (see :meth:`nonfinite_inputs`) skips the step: no weight changes, see ``max_nonfinite_skips``."""
        rollouts = batch.rollouts
        if rollouts is None or rollouts.rewards is None:
            raise RuntimeError("the batch has no verified rollouts; RolloutCallback and VerificationCallback must run first")
        start = time.perf_counter()
        objective = self.objective
        signal, plan = None, None
        reason = self._on_any_rank(self.nonfinite_inputs(rollouts))  # a diverged sampler: skip the rest
        if reason is None:
            if objective.num_iterations > 1 or objective.beta > 0:
                self.score_rollouts(rollouts)
                self._sync()
                rollouts.stats["time/scoring_s"] = time.perf_counter() - start
            # verification and DAPO's extra rounds belong to the rollout phase; the scoring pass, when run, to its own
            self.phase_peak(rollouts.stats, "scoring" if "time/scoring_s" in rollouts.stats else "rollout")
            with record_function("scgrpo.teacher"):
                signal = self.run_self_teacher(rollouts)
            if signal is not None:
                self.phase_peak(rollouts.stats, "teacher")
            start = time.perf_counter()
            plan = self.plan_step(rollouts, signal)
            reason = self._on_any_rank(self.nonfinite_inputs(rollouts, plan))
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        sums: dict[str, float] = defaultdict(float)
        self._mismatch = defaultdict(float)
        with record_function("scgrpo.update"):  # (a profiler's range; nothing when none runs)
            for iteration in range(objective.num_iterations):
                self._first_pass = iteration == 0
                if reason is None:
                    self.accumulate_gradients(rollouts, plan, sums)
                    reason = self._clip_gradients(plan, sums)
                    if reason is None and iteration == 0:
                        self._keep_good_weights()
                if reason is not None:
                    optimizer.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights, on any rank
                self.updating = True  # until on_train_batch_end
                optimizer.step()  # without gradients (a skipped step) no weight moves; the step still counts
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
            self._sync()
        train_time = time.perf_counter() - start
        self.phase_peak(rollouts.stats, "update")
        self._count_skip(reason)
        if plan is None:
            self._log_skipped_step(rollouts, train_time)
        else:
            self.last_credit = {"signal": signal, "credit": plan["credit"]} if signal is not None else None
            self._log_step(rollouts, plan, sums, train_time, signal)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "batches_consumed"):
            datamodule.batches_consumed += 1
        return torch.tensor(sums["loss"] / objective.num_iterations)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.updating = False  # (runs after every callback's on_train_batch_end: the step is whole)
        self._rng_between_steps = _rng_state()

    def on_train_start(self) -> None:
        self._rng_between_steps = _rng_state()

    def on_validation_end(self) -> None:
        if self._trainer is not None and self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self._rng_between_steps = _rng_state()  # (the next step draws from here)

    # ------------------------------------------------------------------------------------ divergence guard
    @staticmethod
    def nonfinite_inputs(rollouts: RolloutBatch, plan: Optional[dict] = None) -> Optional[str]:
        """What in the step's inputs is NaN or infinite, or None. Without ``plan``: the sampler's log-probs and
        entropies (a diverged policy samples from NaN logits; its completions look ordinary, often all alike, so
        no loss would ever show it). With ``plan``: the scoring pass's log-probs, the teacher's divergences and
        states, the advantages and token weights."""
        mask = rollouts.completion_mask.bool()  # [N, C]

        def bad(x: Optional[Tensor], tokens: bool = True) -> bool:
            return x is not None and not bool(torch.isfinite(x[mask] if tokens else x).all())

        if plan is None:
            checks = {"sampling log-probs": bad(rollouts.sampler_logprobs),
                      "sampling entropy": bad(rollouts.entropy_sum, tokens=False)}
        else:
            signal, credit = plan["signal"], plan["credit"]
            checks = {"scoring log-probs": bad(rollouts.old_logprobs) or bad(rollouts.ref_logprobs),
                      "teacher pass": signal is not None and (
                          bad(signal.divergence) or bad(signal.teacher_hidden, tokens=False)),
                      "advantages": bad(credit.advantages, tokens=False) or bad(credit.token_weights)}
        return next((name for name, failed in checks.items() if failed), None)

    def _on_any_rank(self, reason: Optional[str]) -> Optional[str]:
        """``reason``, or a stand-in when another rank met a non-finite value (all ranks skip together)."""
        if all_reduce([float(reason is not None)], "max", self.device)[0] > 0:
            return reason or "another rank's inputs"
        return None

    def _clip_gradients(self, plan: dict, sums: dict[str, float]) -> Optional[str]:
        """Clips the gradients (``max_grad_norm``) and logs their norm before clipping; returns why the update
        must be skipped (a non-finite loss or gradient norm), or None."""
        if sums["nonfinite"]:
            return "loss"
        if not plan["global_rows"]:
            return None
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")  # inf: measured, not clipped
        norm = float(torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm))
        if not math.isfinite(norm):  # the norm is global: every rank sees the same
            return "gradient norm"
        sums["grad_norm"] += norm
        return None

    def trainable_parameters(self) -> list[Tensor]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    @torch.no_grad()
    def _keep_good_weights(self) -> None:
        """Copies the trainable weights of a step that met only finite values, before its update."""
        if not self.max_nonfinite_skips:
            return
        params = self.trainable_parameters()
        if self._good_weights is None:
            self._good_weights = [p.detach().clone() for p in params]
        else:
            for kept, p in zip(self._good_weights, params):
                kept.copy_(p.detach())
        self._good_step = self.global_step

    @torch.no_grad()
    def restore_good_weights(self) -> None:
        """Puts back the trainable weights kept by the last step that met only finite values (a no-op when no
        step got that far: the weights are then still the initial ones)."""
        if self._good_weights is not None:
            for kept, p in zip(self._good_weights, self.trainable_parameters()):
                p.copy_(kept)

    def _count_skip(self, reason: Optional[str]) -> None:
        """Counts a skipped step (``reason``: what was not finite) and stops the run after
        ``max_nonfinite_skips`` in a row, putting back the last good weights."""
        self.last_step_skipped = reason is not None
        if reason is None:
            self.consecutive_skips = 0
            return
        self.nonfinite_skips += 1
        self.consecutive_skips += 1
        step = self.global_step  # already counts this step
        limit = self.max_nonfinite_skips
        if not limit or self.consecutive_skips < limit:
            if self.global_rank == 0:
                log.warning("non-finite %s at step %d: the step is skipped (%d so far, %d in a row)", reason, step,
                            self.nonfinite_skips, self.consecutive_skips)
            return
        self.diverged = True
        self.restore_good_weights()
        if self._trainer is not None:
            self.trainer.should_stop = True
        if self.global_rank == 0:
            lr = self.optimizers().param_groups[0]["lr"] if self._trainer is not None else float("nan")
            kept = f"as they were after step {self._good_step}" if self._good_step else "as they were at the start"
            log.error(
                "training diverged: %d steps in a row met non-finite values (the last: %s at step %d). Stopped; the "
                "weights %s, the last to give finite values, are restored for the final adapter; earlier "
                "checkpoints are kept and none is written now. Lower model.optimizer's lr (now %g) or "
                "model.max_grad_norm (now %g).", self.consecutive_skips, reason, step, kept, lr, self.max_grad_norm)

    @torch.no_grad()
    def policy_is_finite(self) -> bool:
        """True when every trainable tensor is finite and so are the policy's log-probs on a short probe text
        (weights can be finite and still overflow the activations). Every rank must call it when sharded."""
        local = all(bool(torch.isfinite(getattr(p, "_local_tensor", p)).all()) for p in self.trainable_parameters())
        ids = self.tokenizer("1 + 1 = 2", return_tensors="pt", add_special_tokens=False)["input_ids"].to(self.device)

        def probe() -> Tensor:
            was_training = self.policy.training
            self.policy.eval()
            try:
                with full_parameters(self.runner):
                    return self.token_logprobs(self.policy, ids, torch.ones_like(ids), ids.shape[1] - 1, entropy=False)[0]
            finally:
                self.policy.train(was_training)

        local = local and bool(torch.isfinite(self.runner(probe)).all())
        return all_reduce([float(not local)], "max", self.device)[0] == 0

    def run_self_teacher(self, rollouts: RolloutBatch) -> Optional[TeacherSignal]:
        """The self-teacher's signal for the batch (routes, references, teacher pass), or None when the
        objective uses none."""
        if self.self_teacher is None:
            return None
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        buffer = getattr(datamodule, "verified_buffer", None)
        step = self.global_step if self._trainer is not None else 0
        return self.self_teacher(self, rollouts, buffer, step)

    def plan_step(self, rollouts: RolloutBatch, signal: Optional[TeacherSignal] = None) -> dict:
        """Rewards, the objective's credit (advantages, token weights), the rows that enter the loss and the
        loss denominators, summed over all ranks so that every rank's loss share has the global batch's scale."""
        objective = self.objective
        mask = rollouts.completion_mask  # [N, C]
        rewards = objective.shape_rewards(rollouts.rewards, mask.sum(1), self.generation.max_new_tokens)  # [N]
        credit = objective.credit(rewards, mask, rollouts.group_size, signal, self.micro_batch_size)  # groups never span ranks
        selection = objective.token_mask(self._batch_entropy(rollouts), mask) if objective.needs_batch_entropy else None
        rows = torch.nonzero(objective.rows_in_loss(credit, signal)).squeeze(1)  # [n]
        micro = self.micro_batch_size or max(len(rows), 1)
        chunks = list(torch.split(rows, micro)) if len(rows) else []
        teacher_rows = float(signal.has_teacher.sum()) if signal is not None else 0.0
        local = [float(mask.sum()), float(mask.shape[0]), teacher_rows, float(len(rows))]
        num_tokens, num_rows, num_teacher_rows, global_rows = all_reduce(local, device=self.device)
        num_chunks = len(chunks)
        if world_size() > 1:  # every rank runs as many forward/backward passes (FSDP's collectives pair up)
            num_chunks = int(all_reduce([float(len(chunks))], "max", self.device)[0])
        return {
            "rewards": rewards, "credit": credit, "selection": selection, "rows": rows, "chunks": chunks,
            "num_chunks": num_chunks, "signal": signal, "global_rows": global_rows,
            "norms": {"num_tokens": num_tokens, "num_rows": num_rows, "num_teacher_rows": num_teacher_rows},
        }

    def accumulate_gradients(self, rollouts: RolloutBatch, plan: dict, sums: dict[str, float]) -> None:
        """One pass of forward + backward over the rows of ``plan`` (no optimiser step). Adds to ``sums`` the
        global loss, the objective's statistics weighted by rows, and ``nonfinite`` (> 0 on every rank when any
        rank met a NaN/inf loss)."""
        world = world_size()
        rows, chunks = plan["rows"], plan["chunks"]
        local = defaultdict(float)
        for i in range(plan["num_chunks"]):
            real = i < len(chunks)
            # a rank with fewer chunks runs a zero-weight pass on row 0 so that its collectives match
            chunk = chunks[i] if real else torch.zeros(1, dtype=torch.long, device=rows.device)
            out, entropy = self.runner(lambda: self._micro_forward(rollouts, chunk, plan, book=real))
            finite = bool(torch.isfinite(out.loss))
            if not finite:  # counted and reported once per step by the caller (_count_skip)
                local["nonfinite"] += 1
            if finite or world > 1:  # sharded backward passes must pair up across ranks, NaN or not
                # FSDP averages gradients over ranks; each rank's loss is its share of the global one
                self.manual_backward(out.loss * (world if real else 0.0))
            if not (finite and real):
                continue
            share = len(chunk) / max(len(rows), 1)
            local["loss"] += float(out.loss.detach())
            for name, value in out.stats.items():
                if torch.isfinite(torch.as_tensor(value)):
                    local[name] += float(value) * share
            local["entropy"] += float(entropy) * share
        if world > 1:
            sums["nonfinite"] += all_reduce([local["nonfinite"]], "max", self.device)[0]
            sums["loss"] += all_reduce([local["loss"]], device=self.device)[0]
            stats = mean_over_ranks({k: v for k, v in local.items() if k not in ("loss", "nonfinite")} if len(rows) else {})
        else:
            sums["nonfinite"] += local["nonfinite"]
            sums["loss"] += local["loss"]
            stats = {k: v for k, v in local.items() if k not in ("loss", "nonfinite")}
        for name, value in stats.items():
            sums[name] += value

    def _batch_entropy(self, rollouts: RolloutBatch) -> Tensor:
        """``[N, C]`` token entropies of the whole batch under the current (= sampling) policy, no dropout."""

        @torch.no_grad()
        def run() -> Tensor:
            c = rollouts.completion_ids.shape[1]
            micro = self.micro_batch_size or rollouts.completion_ids.shape[0]
            parts = []
            was_training = self.policy.training
            self.policy.eval()
            try:
                with full_parameters(self.runner):
                    for rows in torch.split(torch.arange(rollouts.completion_ids.shape[0], device=self.device), micro):
                        parts.append(self.token_logprobs(
                            self.policy, rollouts.input_ids[rows], rollouts.attention_mask[rows], c)[1])
            finally:
                self.policy.train(was_training)
            return torch.cat(parts)

        return self.runner(run)

    def _micro_forward(self, rollouts: RolloutBatch, rows: Tensor, plan: dict, book: bool = True):
        """The loss of the rows ``rows`` (run inside the policy runner's forward); the caller runs backward.
        ``book``: count these rows in the step's sampler-trainer mismatch (not for a rank's zero-weight pass)."""
        c = rollouts.completion_ids.shape[1]
        credit: Credit = plan["credit"]
        signal: Optional[TeacherSignal] = plan["signal"]
        input_ids, attention_mask = rollouts.input_ids[rows], rollouts.attention_mask[rows]
        hidden = self.completion_hidden(self.policy, input_ids, attention_mask, c)  # [n, C, H]
        logprobs, entropy = chunked_token_logprobs(
            hidden, self.lm_head(), rollouts.completion_ids[rows], self.generation.temperature, self.logprob_chunk_size
        )  # [n, C]
        mask = rollouts.completion_mask[rows]

        def pick(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x[rows]

        old_logprobs = rollouts.old_logprobs[rows] if rollouts.old_logprobs is not None else logprobs.detach()
        token_weights = pick(credit.token_weights)
        if rollouts.sampler_logprobs is not None:
            token_weights = self._sampler_correction(old_logprobs, rollouts.sampler_logprobs[rows], mask, token_weights,
                                                     book=book)
        inputs = LossInputs(
            completion_mask=mask,
            advantages=credit.advantages[rows],
            old_logprobs=old_logprobs,
            ref_logprobs=pick(rollouts.ref_logprobs),
            token_weights=token_weights,
            token_selection=pick(plan["selection"]),
            entropy=entropy,
            hidden=hidden,
            lm_head=self.lm_head(),
            teacher_hidden=pick(signal.teacher_hidden) if signal is not None else None,
            has_teacher=pick(signal.has_teacher) if signal is not None else None,
            num_teacher_rows=plan["norms"]["num_teacher_rows"],
            num_tokens=plan["norms"]["num_tokens"],
            num_sequences=plan["norms"]["num_rows"],
            max_len=self.generation.max_new_tokens,
            temperature=self.generation.temperature,
            chunk_size=self.logprob_chunk_size,
            step=self.global_step if self._trainer is not None else 0,
        )
        return self.objective.loss(logprobs, inputs), masked_mean(entropy.detach(), mask)

    def _sampler_correction(self, trainer: Tensor, sampler: Tensor, mask: Tensor,
                            token_weights: Optional[Tensor], book: bool = True) -> Optional[Tensor]:
        """Books the sampler-trainer mismatch of these rows (when ``book``, on a step's first pass) and, with
        ``tis_cap``, multiplies ``token_weights`` by the truncated importance ratio min(pi_trainer / pi_sampler,
        tis_cap)."""
        log_ratio = (trainer.detach() - sampler) * mask  # [n, C] log pi_trainer - log pi_sampler
        if book and self._first_pass:
            tokens = mask.bool()
            self._mismatch["abs"] += float(log_ratio.abs().sum())
            self._mismatch["k3"] += float(((log_ratio.exp() - 1 - log_ratio) * mask).sum())  # KL(sampler || trainer)
            self._mismatch["tokens"] += float(mask.sum())
            if bool(tokens.any()):
                self._mismatch["max"] = max(self._mismatch["max"], float(log_ratio.abs()[tokens].max()))
        if self.tis_cap <= 0:
            return token_weights
        ratio = log_ratio.exp().clamp(max=self.tis_cap) * mask  # [n, C]
        return ratio if token_weights is None else token_weights * ratio

    def _mismatch_metrics(self) -> dict[str, float]:
        """rollout/logprob_mismatch_mean and _max (|log pi_sampler(y) - log pi_trainer(y)| over the sampled tokens
        of the rows in the loss) and rollout/mismatch_kl (k3 estimate of KL(sampler || trainer)); NaN when no
        token was compared (no sampler log-probs, or no row in the loss)."""
        m = self._mismatch
        total_abs, total_k3, tokens = all_reduce([m.get("abs", 0.0), m.get("k3", 0.0), m.get("tokens", 0.0)],
                                                 device=self.device)
        largest = all_reduce([m.get("max", 0.0)], "max", self.device)[0]
        if tokens == 0:
            nan = float("nan")
            return {"rollout/logprob_mismatch_mean": nan, "rollout/logprob_mismatch_max": nan, "rollout/mismatch_kl": nan}
        return {"rollout/logprob_mismatch_mean": total_abs / tokens, "rollout/logprob_mismatch_max": largest,
                "rollout/mismatch_kl": total_k3 / tokens}

    def _log_step(self, rollouts: RolloutBatch, plan: dict, sums: dict, train_time: float,
                  signal: Optional[TeacherSignal]) -> None:
        mask = rollouts.completion_mask
        rewards, rows, credit = plan["rewards"], plan["rows"], plan["credit"]
        grouped = rewards.view(-1, rollouts.group_size)
        lengths = mask.sum(1)
        iters = self.objective.num_iterations
        nan = float("nan")
        metrics = {
            "train/loss": sums["loss"] / iters,
            "train/reward": rollouts.rewards.mean(),
            "train/shaped_reward": rewards.mean(),
            "train/reward_std": rewards.std() if rewards.numel() > 1 else torch.tensor(0.0),
            "train/accuracy": (rollouts.rewards >= self.success_threshold).float().mean(),
            "train/mixed_groups": (grouped.max(1).values != grouped.min(1).values).float().mean(),
            "train/completion_length": lengths.mean(),
            "train/truncated": rollouts.truncated.float().mean(),
            "train/rows_in_loss": float(len(rows)) / max(len(rewards), 1),
            "train/advantage_abs": credit.advantages.abs().mean(),
            "train/nonfinite_skips": float(self.nonfinite_skips),
            "time/train_s": train_time,
            # mean token entropy of the sampled responses, from the sampler (NaN where the engine gives none)
            "policy/entropy": (float(rollouts.entropy_sum.sum()) / max(float(mask.sum()), 1.0)
                               if rollouts.entropy_sum is not None else nan),
        }
        # every key every step (NaN when undefined): Lightning would otherwise repeat a stale value
        metrics["train/clip_fraction"] = sums.get("clip_fraction", 0.0) / iters if len(rows) else nan
        metrics["train/entropy"] = sums["entropy"] / iters if len(rows) else nan
        metrics["train/grad_norm"] = sums["grad_norm"] / iters if "grad_norm" in sums else nan
        if self.objective.beta > 0:
            metrics["train/kl"] = sums["kl"] / iters if "kl" in sums else nan
        for name, value in sums.items():
            if name not in ("loss", "entropy", "grad_norm", "kl", "clip_fraction", "nonfinite"):
                metrics[f"train/{name}"] = value / iters
        if signal is not None:
            metrics.update(signal.stats)
        metrics.update(credit.stats)
        metrics.update(rollouts.stats)
        mismatch = self._mismatch_metrics()
        width = rollouts.input_ids.shape[1]
        metrics["tokens/completion"] = float(mask.sum())  # sampled tokens (without padding)
        metrics["tokens/train"] = float(len(rows) * width)  # rows in the loss x padded sequence length
        metrics["time/step_s"] = sum(v for k, v in metrics.items() if k.startswith("time/") and k != "time/step_s")
        optimizer = self.optimizers()
        metrics["train/lr"] = optimizer.param_groups[0]["lr"]
        memory = {k: float(v) for k, v in metrics.items() if k.startswith("memory/")}
        metrics = mean_over_ranks({k: float(v) for k, v in metrics.items()})  # rewards etc. of the global batch
        if memory:  # peaks: the largest rank's
            metrics.update(zip(memory, all_reduce(list(memory.values()), "max", self.device)))
        metrics.update(mismatch)  # already global
        self.last_step_metrics = metrics
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False, prog_bar=False,
                      batch_size=max(len(rewards), 1))
        self.log("reward", metrics["train/reward"], prog_bar=True, on_step=True, on_epoch=False, logger=False)

    def _log_skipped_step(self, rollouts: RolloutBatch, train_time: float) -> None:
        """The metrics of a step skipped before its loss (non-finite sampling): rewards, the rollouts' own
        statistics and the skip count; every other key of the last logged step as NaN (Lightning would otherwise
        repeat a stale value)."""
        metrics = {k: float("nan") for k in self.last_step_metrics}
        metrics.update({k: float(v) for k, v in rollouts.stats.items()})
        metrics.update({
            "train/reward": float(rollouts.rewards.mean()),
            "train/accuracy": float((rollouts.rewards >= self.success_threshold).float().mean()),
            "train/nonfinite_skips": float(self.nonfinite_skips),
            "train/lr": self.optimizers().param_groups[0]["lr"],
            "time/train_s": train_time,
        })
        metrics = mean_over_ranks(metrics)
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=max(len(rollouts.rewards), 1))

    # -------------------------------------------------------------------------------------------- eval
    def on_validation_epoch_start(self) -> None:
        self._eval = {}
        self._eval_start = time.perf_counter()

    def validation_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        prompts = self.format_prompts(batch.questions)
        k = self.eval_samples
        sampled = self.sample(prompts, k, temperature=self.eval_temperature)
        ids = [i for i in batch.ids for _ in range(k)]
        answers = [a for a in batch.answers for _ in range(k)]
        questions = [q for q in batch.questions for _ in range(k)]
        scores = torch.tensor([r.score for r in self.verifier_runner(sampled.completions, answers, questions, ids)])
        correct = (scores >= self.success_threshold).float().view(-1, k)  # [P, k]
        acc = self._eval.setdefault(batch.split, defaultdict(float))
        acc["prompts"] += correct.shape[0]
        acc["avg"] += float(correct.mean(1).sum())
        acc["pass"] += float(correct.max(1).values.sum())
        acc["length"] += float(sampled.completion_mask.sum(1).view(-1, k).mean(1).sum())
        acc["truncated"] += float(sampled.truncated.float().view(-1, k).mean(1).sum())
        if self.eval_greedy:
            greedy = self.sample(prompts, 1, greedy=True)
            results = self.verifier_runner(greedy.completions, batch.answers, batch.questions, batch.ids)
            acc["greedy"] += sum(float(r.score >= self.success_threshold) for r in results)

    def on_validation_epoch_end(self) -> None:
        k = self.eval_samples
        for split, acc in sum_over_ranks(self._eval).items():  # each rank evaluated its share of the prompts
            n = max(acc["prompts"], 1.0)
            metrics = {
                f"val/{split}/avg@{k}": acc["avg"] / n,
                f"val/{split}/pass@{k}": acc["pass"] / n,
                f"val/{split}/completion_length": acc["length"] / n,
                f"val/{split}/truncated": acc["truncated"] / n,
            }
            if self.eval_greedy:
                metrics[f"val/{split}/greedy"] = acc["greedy"] / n
            metrics[f"val/{split}/time_s"] = time.perf_counter() - self._eval_start
            self.log_dict(metrics, on_step=False, on_epoch=True, add_dataloader_idx=False)
            summary = ", ".join(f"{name.split('/')[-1]} {value:.3f}" for name, value in metrics.items())
            if self.global_rank == 0:
                    log.info("step %d validation [%s] on %d prompts: %s", self.global_step, split, int(n), summary)
            self.eval_summary = getattr(self, "eval_summary", [])
            self.eval_summary.append({"step": self.global_step, "split": split, **{k_.split("/")[-1]: v for k_, v in metrics.items()}})
        # the optimiser steps done before this evaluation (the logger's own step column counts differently)
        self.log("val/global_step", float(self.global_step), on_step=False, on_epoch=True, add_dataloader_idx=False)

    def test_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, dataloader_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()

    # ------------------------------------------------------------------------------------- checkpoints
    def trainable_names(self) -> set[str]:
        """State-dict keys of the trained tensors (LoRA weights, or all weights without LoRA)."""
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Only the trainable tensors: checkpoints never carry (or, sharded, gather) the frozen base."""
        state = super().state_dict(*args, **kwargs)
        if self.runner is None:
            return state
        prefix = kwargs.get("prefix", "")
        trainable = self.trainable_names()
        for key in [k for k in state if k[len(prefix):] not in trainable]:
            del state[key]
        return state

    def trainable_state(self) -> dict[str, Tensor]:
        """The trainable tensors, whole on every rank (gathered when sharded: call on all ranks)."""
        return full_state({name: p for name, p in self.named_parameters() if p.requires_grad})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # checkpoint["state_dict"] already holds only the trainable tensors (see state_dict)
        interrupted = self._trainer is not None and self.trainer.interrupted  # (StepCheckpoint's on_exception)
        # written on an exception, the checkpoint is of the last whole step (see StepCheckpoint): its RNG state
        # too, so that the resumed run draws the rollout or validation cut short as the uninterrupted run did
        rng = self._rng_between_steps if interrupted and self._rng_between_steps is not None else _rng_state()
        checkpoint["scgrpo"] = {"nonfinite_skips": self.nonfinite_skips, "consecutive_skips": self.consecutive_skips,
                                "rng": rng}
        if world_size() > 1:  # every rank samples with its own generator state (Lightning asks every rank)
            per_rank: list[Any] = [None] * world_size()
            torch.distributed.all_gather_object(per_rank, rng)
            checkpoint["scgrpo"]["rng_per_rank"] = per_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        trainable = self.trainable_names()
        missing = sorted(trainable - set(checkpoint["state_dict"])) if "state_dict" in checkpoint else []
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} trainable tensors of this model (e.g. {missing[0]}); "
                "was it written with another model or LoRA setting?"
            )
        state = checkpoint.get("scgrpo", {})
        self.nonfinite_skips = state.get("nonfinite_skips", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        per_rank = state.get("rng_per_rank")
        if per_rank is not None and len(per_rank) == world_size():  # sampling goes on as it would have
            _set_rng_state(per_rank[self.global_rank])
        elif "rng" in state:
            _set_rng_state(state["rng"])
        self._rng_between_steps = _rng_state()  # (a validation left pending runs before on_train_start)
