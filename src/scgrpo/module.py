"""The LightningModule: it holds the policy and conducts one training step, roll out -> verify -> teacher
signal -> credit -> update -> log. The computation lives in the parts it calls: :mod:`scgrpo.stage` (the
rollouts, before the step), :mod:`scgrpo.policy` (forward passes), :mod:`scgrpo.selfteacher`, the objective,
:mod:`scgrpo.update`, :mod:`scgrpo.guard`, :mod:`scgrpo.step_log` and :mod:`scgrpo.evaluation`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import Tensor
from torch.profiler import record_function

from scgrpo import lightning_internals as internals
from scgrpo.budget import MemoryBudget
from scgrpo.callbacks import (AdapterExport, AtomicCheckpointIO, CompletionsTable, CreditLogging, ReleaseHeldInterrupt,
                              RolloutCallback, ValidateBeforeTraining)
from scgrpo.callbacks.validation import log_evaluation, logged_step
from scgrpo.data.lengths import PromptFit
from scgrpo.distributed import PolicyRunner, check_run_shared, full_state
from scgrpo.envs import Environment, EpisodeSettings
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.evaluation import Evaluation
from scgrpo.guard import DivergenceGuard, nonfinite_inputs, on_any_rank
from scgrpo.models import LoraSettings, check_model_settings, max_sequence_length
from scgrpo.objectives import GRPO, Objective
from scgrpo.oom import out_of_memory_as_error
from scgrpo.policy import Policy, load_run_policy
from scgrpo.rollout.engine import GenerationSettings
from scgrpo.rollout.types import PromptBatch, RolloutBatch, TeacherSignal
from scgrpo.run_state import RngBookmark, check_trainable, checkpoint_rng, restore_rng, trainable_only
from scgrpo.selfteacher import SelfTeacher
from scgrpo.stage import (RolloutStage, check_reward_failure_steps, completion_lengths, run_environment, run_verifier,
                          verified_rollouts)
from scgrpo.step_log import StepPhases, skipped_step_metrics, step_metrics
from scgrpo.update import PolicyUpdate, StepPlan, StepSums, check_update_settings, optimizers
from scgrpo.verifiers import Verifier, VerifierRunner
from scgrpo.verifiers.rewards import run_reward


class RLVRModule(LightningModule):
    """Trains a causal LM with an RLVR objective on rollouts that the rollout stage attaches to each batch.

    Before each step :class:`~scgrpo.callbacks.RolloutCallback` runs the :class:`~scgrpo.stage.RolloutStage`:
    completions (or episodes) sampled, verified, and for DAPO resampled. The step turns rewards into credit with the
    objective and runs ``objective.num_iterations`` optimiser steps over it (manual optimisation, :mod:`scgrpo.update`).

    Args:
        model: "smollm2" (the embedded SmolLM2-135M-Instruct), a local Hugging Face folder, a hub id, a ``.gguf``
            file, or a LoRA adapter folder as scgrpo, peft and TRL save it (that adapter on its base model).
        base_model: with ``model`` an adapter folder, the base to load it on in place of the one it names.
        objective: the RLVR objective (default: GRPO).
        lora: LoRA settings; ``null`` trains all weights.
        dtype: "auto" (fp32 on CPU, bf16 on GPU), "float32", "bfloat16" or "float16".
        generation: sampling settings for training rollouts (G, lengths, temperature, engine).
        verifier: scores completions; default: the data source's own.
        optimizer: built over the trainable parameters only; default AdamW(lr=1e-4, weight_decay=0).
        lr_scheduler: stepped after every optimiser step.
        system_prompt: a system message before each question (None: the chat template's; a chat prompt's own wins).
        success_threshold: a rollout counts as correct (and verified) when its reward is >= this.
        max_grad_norm: gradient clipping by global norm (0 = off).
        micro_batch_size: rows per forward/backward (None: all on CPU; on a GPU what the memory budget holds).
        logprob_chunk_size: tokens per chunk of fp32 logits (fewer where the memory budget needs it).
        gradient_checkpointing: recompute activations in backward; None: on a GPU, where the budget needs it.
        memory_budget_gib: GPU memory (GiB) the process may hold (:mod:`scgrpo.budget`: decode slots, micro-batches,
            chunks, checkpointing); None: what it can reach at load, less 5%. Ignored on CPU.
        quantization: "nf4": the frozen base in 4 bits through bitsandbytes (QLoRA; one GPU per run); None: ``dtype``.
        eval_samples: k for Avg@k and Pass@k in validation.
        eval_temperature: sampling temperature in validation (None: the training temperature).
        eval_greedy: also measure greedy accuracy in validation.
        validate_before_training: run validation once before the first step.
        log_completions_every_n_steps: write sample completions and credit every N steps (0 = never).
        save_adapter_every_n_steps: export the adapter every N steps (None: only at the end).
        max_nonfinite_skips: a step meeting a NaN or inf changes no weight (:mod:`scgrpo.guard`); after this many in
            a row the run stops with the last good weights back (0: never stops).
        tis_cap: truncated importance sampling, min(pi_trainer / pi_sampler, tis_cap) per token (0 = off).
        environment: rollouts are multi-turn episodes in it (:mod:`scgrpo.envs`); default: the data source's own.
        episodes: turn limit, token budget, time limits, turn discount and faults (:class:`EpisodeSettings`).
        reward_funcs: reward functions with TRL's calling convention in place of ``verifier``, by import path
            (:mod:`scgrpo.verifiers.rewards`); each one's mean is logged as ``reward/<name>/mean``.
        reward_weights: one weight per reward function (default 1 each); a row's reward is the weighted sum.
        max_reward_failure_steps: stop the run when every reward of this many steps in a row failed (0: never).
    """

    def __init__(
        self,
        model: str = "smollm2",
        base_model: Optional[str] = None,
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
        gradient_checkpointing: Optional[bool] = None,
        memory_budget_gib: Optional[float] = None,
        quantization: Optional[str] = None,
        eval_samples: int = 4,
        eval_temperature: Optional[float] = None,
        eval_greedy: bool = True,
        validate_before_training: bool = True,
        log_completions_every_n_steps: int = 10,
        save_adapter_every_n_steps: Optional[int] = None,
        tis_cap: float = 0.0,
        max_nonfinite_skips: int = 3,
        environment: Optional[Environment] = None,
        episodes: EpisodeSettings = EpisodeSettings(),
        reward_funcs: Optional[list[Callable]] = None,
        reward_weights: Optional[list[float]] = None,
        max_reward_failure_steps: int = 3,
    ) -> None:
        super().__init__()
        self.evaluation = Evaluation(eval_samples, eval_temperature, eval_greedy, success_threshold)
        check_update_settings(micro_batch_size, tis_cap)
        check_reward_failure_steps(max_reward_failure_steps)
        self.adapter = check_model_settings(model, lora, quantization, dtype, base_model)  # None: not an adapter
        self.budget = MemoryBudget(memory_budget_gib)  # (checks the value)
        if memory_budget_gib is not None and generation.memory_budget_gib is None:  # the rollout plans for it too
            generation = dataclasses.replace(generation, memory_budget_gib=memory_budget_gib)
        self.guard = DivergenceGuard(max_nonfinite_skips)
        self.model_name, self.quantization, self.lora, self.dtype_name = model, quantization, lora, dtype
        self.objective = objective if objective is not None else GRPO()
        self.generation, self.system_prompt, self.success_threshold = generation, system_prompt, success_threshold
        self._verifier = run_reward(verifier, reward_funcs, reward_weights)
        self._optimizer, self._lr_scheduler = optimizer, lr_scheduler
        self.max_grad_norm, self.micro_batch_size, self.tis_cap = max_grad_norm, micro_batch_size, tis_cap
        self.logprob_chunk_size, self.gradient_checkpointing = logprob_chunk_size, gradient_checkpointing
        self.validate_before_training, self.max_reward_failure_steps = validate_before_training, max_reward_failure_steps
        self.log_completions_every_n_steps = log_completions_every_n_steps
        self.save_adapter_every_n_steps = save_adapter_every_n_steps
        self._environment, self.episodes = environment, episodes
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the trainable weights
        self.runner: Optional[PolicyRunner] = None  # holds the policy; the FSDP root when sharded
        self.actor: Optional[Policy] = None  # the policy with its tokenizer and forward passes
        self.tokenizer, self.verifier_runner = None, None
        self.episode_runner: Optional[EpisodeRunner] = None  # set up when rollouts are episodes
        self.rollout_stage: Optional[RolloutStage] = None  # set up with the policy (see setup)
        self.updating = False  # from the step's first weight update to its callbacks' end: no checkpoint in between
        self.rng_between_steps = RngBookmark()  # what a checkpoint written on an exception holds
        self._self_teacher: Optional[SelfTeacher] = None
        self.last_step_metrics: dict[str, float] = {}
        self.last_plan: Optional[StepPlan] = None  # the last step's plan, None if skipped (CreditLogging draws it)
        self._checkpoint_step: Optional[int] = None  # the global step of a checkpoint loaded (see evaluated_step)

    @property
    def policy(self):
        """The policy (a peft model with LoRA, or the bare causal LM)."""
        return self.runner.policy if self.runner is not None else None

    @property
    def self_teacher(self) -> Optional[SelfTeacher]:
        """The self-teacher for the objective's spec (None when the objective uses none)."""
        spec = self.objective.needs.teacher
        if spec is not None and (self._self_teacher is None or self._self_teacher.spec is not spec):
            self._self_teacher = SelfTeacher(spec)
        return self._self_teacher if spec is not None else None

    @property
    def memory_budget_gib(self) -> Optional[float]:
        """The budget the run was given (None: the default, :attr:`budget` resolves it on a GPU)."""
        return self.budget.gib

    @property
    def base_model_name(self) -> str:
        """The model the run started from, as the user named it: ``model``, or the base of an adapter folder."""
        return self.adapter.base if self.adapter is not None else self.model_name

    def configure_model(self) -> None:
        if self.runner is not None:
            return
        if self._trainer is not None:
            device = self.trainer.strategy.root_device
        else:  # used outside a Trainer: a 4-bit base must load onto a GPU
            device = torch.device("cuda" if self.quantization is not None else "cpu")
        longest = completion_lengths(self.episode_runner, self.generation.max_new_tokens)[0]
        self.actor = load_run_policy(self.model_name, self.adapter, self.lora, self.dtype_name, self.quantization,
                                     device, self.generation, self.budget, longest,
                                     self.system_prompt, self.logprob_chunk_size, self.gradient_checkpointing is True,
                                     getattr(self, "_device_mesh", None))
        self.runner, self.tokenizer = self.actor.runner, self.actor.tokenizer

    def setup(self, stage: str) -> None:
        """The run's parts before the first batch: the environment (episodes) or the verifier, the policy, the
        rollout stage, and the data module's prompts fitted to the model."""
        if self._trainer is not None:  # several nodes: before the model loads, what they must share
            check_run_shared(self.trainer, stage)
        datamodule = self._datamodule()
        environment = run_environment(self._environment, datamodule)
        if environment is None or self.episode_runner is None or self.episode_runner.environment is not environment:
            self.episode_runner = EpisodeRunner(environment, self.episodes) if environment is not None else None
        self.configure_model()
        self.actor.max_completion_tokens = completion_lengths(self.episode_runner, self.generation.max_new_tokens)[0]
        spec = self.objective.needs.teacher
        verifier = run_verifier(self._verifier, datamodule, type(environment).__name__ if environment else None,
                                spec is not None and spec.privileged)
        self.verifier_runner = VerifierRunner(verifier)
        self.rollout_stage = RolloutStage.for_run(
            self.actor, self.generation, self.verifier_runner, self.episode_runner, self.objective,
            self.max_reward_failure_steps, self.device, self.budget.peaks, lambda: out_of_memory_as_error("rollout", self),
            self.episodes.on_fault)
        if hasattr(datamodule, "fit_prompts"):  # (rows whose prompt is too long for the model are left out)
            datamodule.fit_prompts(self.prompt_fit())
        if self._trainer is not None:  # the validation after N steps at logger step N, not N - 1
            internals.evaluations_logged_at_global_step(self.trainer, lambda: logged_step(self))
        if self._trainer is not None and type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # Lightning's own writer stages each checkpoint in $TMPDIR, where a killed save leaves it behind
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def _datamodule(self):
        return getattr(self.trainer, "datamodule", None) if self._trainer is not None else None

    def prompt_fit(self) -> PromptFit:
        """What the data module needs to leave out the rows too long for the model (:mod:`scgrpo.data.lengths`)."""
        teacher = self.self_teacher
        room = completion_lengths(self.episode_runner, self.generation.max_new_tokens)[1]
        return PromptFit(self.tokenizer, self.actor.format_prompts, room, max_sequence_length(self.policy),
                         (lambda qs: teacher.teacher_prompts(self.actor, qs, [""] * len(qs))) if teacher else None)

    def configure_callbacks(self):
        # first: a Ctrl-C that StepCheckpoint held at the last step's end takes effect before the next rollout
        callbacks = [ReleaseHeldInterrupt(), RolloutCallback(), CompletionsTable(self.log_completions_every_n_steps),
                     AdapterExport(self.save_adapter_every_n_steps), CreditLogging(self.log_completions_every_n_steps)]
        return callbacks + ([ValidateBeforeTraining()] if self.validate_before_training else [])

    def configure_optimizers(self):
        return optimizers(self.actor.trainable_parameters(), self._optimizer, self._lr_scheduler)

    def run_self_teacher(self, rollouts: RolloutBatch) -> Optional[TeacherSignal]:
        """The self-teacher's signal for the batch (routes, references, teacher pass), or None."""
        if self.self_teacher is None:
            return None
        buffer = getattr(self._datamodule(), "verified_buffer", None)
        return self.self_teacher(self.actor, rollouts, self.success_threshold, self.micro_batch_size, buffer,
                                 self.global_step)

    def policy_update(self) -> PolicyUpdate:
        """The update as the module's settings stand now (micro-batches, clipping, TIS)."""
        return PolicyUpdate(self.actor, self.objective, self.manual_backward, self.micro_batch_size,
                            self.max_grad_norm, self.tis_cap, self.gradient_checkpointing is None, self.episodes.gamma)

    # ------------------------------------------------------------------------------------------ training
    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        """roll out -> verify (the rollout stage, run before the step: ``batch.rollouts``) -> teacher signal ->
        credit -> update -> log. A NaN or inf met on the way skips the step: no weight changes (see
        :class:`~scgrpo.guard.DivergenceGuard`)."""
        rollouts = verified_rollouts(batch)
        self.budget.begin_step()
        phases, update, plan = StepPhases(self.device, self.budget.peaks), self.policy_update(), None
        reason = on_any_rank(nonfinite_inputs(rollouts), self.device)  # a diverged sampler: skip the rest
        signal = self.teacher_signal(rollouts, phases) if reason is None else None
        rollouts.student_states = None  # (read by the self-teacher, if it ran: the host memory goes)
        start = time.perf_counter()
        if reason is None:
            plan = self.credit(update, rollouts, signal)
            reason = on_any_rank(nonfinite_inputs(rollouts, plan), self.device)
        sums, reason = self.update(update, rollouts, plan, reason, phases, start)
        self.log_step(rollouts, plan, sums, update, phases)
        return torch.tensor(sums["loss"] / self.objective.num_iterations)

    def teacher_signal(self, rollouts: RolloutBatch, phases: StepPhases) -> Optional[TeacherSignal]:
        """The scoring pass (old or reference log-probs, when the objective needs them) and the self-teacher."""
        needs = self.objective.needs
        if needs.old_logprobs or needs.ref_logprobs:
            start = time.perf_counter()
            with out_of_memory_as_error("scoring", self):
                self.actor.score(rollouts, needs.old_logprobs, needs.ref_logprobs, self.micro_batch_size)
                self.actor.sync()
            phases.scoring_s = time.perf_counter() - start
            phases.peak("scoring")
        with record_function("scgrpo.teacher"), out_of_memory_as_error("teacher", self):
            signal = self.run_self_teacher(rollouts)
        if signal is not None:
            phases.peak("teacher")
        return signal

    def credit(self, update: PolicyUpdate, rollouts: RolloutBatch, signal: Optional[TeacherSignal]) -> StepPlan:
        """The objective's credit, the rows in the loss and their micro-batches."""
        with out_of_memory_as_error("scoring", self):  # (the batch-entropy pass of objectives that need one)
            return update.plan(rollouts, signal)

    def update(self, update: PolicyUpdate, rollouts: RolloutBatch, plan: Optional[StepPlan], reason: Optional[str],
               phases: StepPhases, start: float) -> tuple[StepSums, Optional[str]]:
        """``objective.num_iterations`` optimiser steps (none with gradients where ``reason`` says why not), booked
        with the guard; the sums and why it was skipped (None: not). From ``start``: the step's training time."""
        sums, params = StepSums(), self.actor.trainable_parameters
        with record_function("scgrpo.update"), out_of_memory_as_error("update", self):  # (a profiler's range)
            reason = update.optimise(rollouts, plan, sums, reason, self.optimizers(), self.lr_schedulers(),
                                     lambda: self.global_step, keep=lambda: self.guard.keep(params(), self.global_step),
                                     stepping=lambda: setattr(self, "updating", True))  # (until on_train_batch_end)
            self.actor.sync()
        phases.train_s = time.perf_counter() - start
        phases.peak("update")
        phases.note_budget(self.budget)
        # the guard books the step; when it says stop, the last good weights are back and the run ends
        lr = self.optimizers().param_groups[0]["lr"] if self._trainer is not None else float("nan")
        if self.guard.finish_step(reason, params(), self.global_step, lr, self.max_grad_norm,
                                  report=self.global_rank == 0) and self._trainer is not None:
            self.trainer.should_stop = True
        return sums, reason

    def log_step(self, rollouts: RolloutBatch, plan: Optional[StepPlan], sums: StepSums, update: PolicyUpdate,
                 phases: StepPhases) -> None:
        """The step's metrics (:mod:`scgrpo.step_log`), logged; a step skipped before its loss logs the rollouts'
        and NaN for every other key of the last logged step."""
        common = dict(success_threshold=self.success_threshold, train_time=phases.train_s, phases=phases,
                      nonfinite_skips=self.guard.nonfinite_skips, lr=self.optimizers().param_groups[0]["lr"])
        self.last_plan = plan
        if plan is None:
            metrics = skipped_step_metrics(rollouts, list(self.last_step_metrics), **common)
        else:
            metrics = step_metrics(rollouts, plan, sums, update.mismatch.metrics(self.device), device=self.device,
                                   passes=self.objective.num_iterations, log_kl=self.objective.needs.ref_logprobs,
                                   **common)
            self.last_step_metrics = metrics
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=max(len(rollouts.rewards), 1))
        if plan is not None:
            self.log("reward", metrics["train/reward"], prog_bar=True, on_step=True, on_epoch=False, logger=False)
        if hasattr(datamodule := self._datamodule(), "batches_consumed"):
            datamodule.batches_consumed += 1

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.updating = False  # (runs after every callback's on_train_batch_end: the step is whole)
        self.rng_between_steps.mark()

    def on_train_start(self) -> None:
        self.rng_between_steps.mark()

    def on_validation_end(self) -> None:
        if self._trainer is not None and self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.rng_between_steps.mark()  # (the next step draws from here)

    # -------------------------------------------------------------------------------------------- eval
    def on_validation_epoch_start(self) -> None:
        self.evaluation.start()

    def validation_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Samples (or plays episodes of: seeds fixed by the rows) and verifies one batch of held-out prompts."""
        runner = self.episode_runner
        episodes = (lambda rows, k, greedy, t: runner.run(self.actor, rows, k, greedy, t, 0)) if runner else None
        with out_of_memory_as_error("validation", self):
            self.evaluation.add(batch, self.actor, self.verifier_runner, episodes)

    def on_validation_epoch_end(self) -> None:  # (after StepCheckpoint's, which holds a Ctrl-C until the row is logged)
        log_evaluation(self, "val")

    def on_test_epoch_end(self) -> None:
        log_evaluation(self, "test")

    test_step, on_test_epoch_start = validation_step, on_validation_epoch_start

    @property
    def evaluated_step(self) -> int:
        """The optimiser steps behind the weights being evaluated: ``global_step`` in a fit; in ``validate`` or
        ``test`` from a checkpoint, the checkpoint's (Lightning restores no training step there)."""
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        return self.global_step if fitting or self._checkpoint_step is None else self._checkpoint_step

    # ------------------------------------------------------------------------------------- checkpoints
    def trainable_names(self) -> set[str]:
        """State-dict keys of the trained tensors (LoRA weights, or all weights without LoRA)."""
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Only the trainable tensors: checkpoints never carry (or, sharded, gather) the frozen base."""
        state = super().state_dict(*args, **kwargs)
        return state if self.runner is None else trainable_only(state, self.trainable_names(), kwargs.get("prefix", ""))

    def trainable_state(self) -> dict[str, Tensor]:
        """The trainable tensors, whole on every rank (gathered when sharded: call on all ranks)."""
        return full_state({name: p for name, p in self.named_parameters() if p.requires_grad})

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # (its state_dict: the trainable tensors)
        interrupted = self._trainer is not None and self.trainer.interrupted  # (StepCheckpoint's on_exception)
        checkpoint["scgrpo"] = {**self.guard.state_dict(), **checkpoint_rng(self.rng_between_steps.saved(interrupted))}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_step = checkpoint.get("global_step")
        self.configure_model()
        check_trainable(checkpoint, self.trainable_names())
        state = checkpoint.get("scgrpo", {})
        self.guard.load_state_dict(state)
        restore_rng(state, self.global_rank)  # sampling goes on as it would have
        self.rng_between_steps.mark()  # (a validation left pending runs before on_train_start)
