"""The LightningModule: it holds the policy and conducts one training step, sample -> verify -> teacher
signal -> credit -> update -> log. The computation lives in the parts it calls: :mod:`scgrpo.policy` (forward
passes), :mod:`scgrpo.selfteacher`, the objective, :mod:`scgrpo.update`, :mod:`scgrpo.guard`,
:mod:`scgrpo.step_log` and :mod:`scgrpo.evaluation`."""

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
from scgrpo.distributed import PolicyRunner, check_shared, full_state
from scgrpo.errors import InputError, one_line
from scgrpo.envs import Environment, EpisodeSettings
from scgrpo.envs.runner import EpisodeRunner
from scgrpo.evaluation import Evaluation
from scgrpo.guard import DivergenceGuard, nonfinite_inputs, on_any_rank
from scgrpo.models import LoraSettings, check_model_settings
from scgrpo.objectives import GRPO, Objective
from scgrpo.oom import out_of_memory_as_error
from scgrpo.policy import Policy, build_policy
from scgrpo.run_state import RngBookmark, check_trainable, checkpoint_rng, restore_rng, rng_state, trainable_only
from scgrpo.rollout.engine import Generated, GenerationSettings
from scgrpo.rollout.types import PromptBatch, RolloutBatch, TeacherSignal
from scgrpo import selfteacher as selfteacher_module
from scgrpo.selfteacher import SelfTeacher
from scgrpo.step_log import phase_peak, skipped_step_metrics, step_metrics
from scgrpo.update import PolicyUpdate, StepPlan, StepSums, check_tis_cap
from scgrpo.verifiers import RewardFunctions, Verifier, VerifierRunner


NAN = float("nan")


class RLVRModule(LightningModule):
    """Trains a causal LM with an RLVR objective on rollouts that the callbacks attach to each batch.

    A training step reads the batch's :class:`RolloutBatch` (completions sampled by
    :class:`~scgrpo.callbacks.RolloutCallback`, rewards set by :class:`~scgrpo.callbacks.VerificationCallback`),
    turns rewards into advantages with the objective, and runs ``objective.num_iterations`` optimiser steps
    over it (manual optimisation). Rows whose advantage is exactly zero add nothing to the gradient of a
    clipped-surrogate loss without KL, so they are left out of the forward pass; the loss denominators still
    count their tokens, so the loss equals the full-batch one.

    Args:
        model: "smollm2" (the embedded SmolLM2-135M-Instruct), a local Hugging Face folder, a hub id, a
            ``.gguf`` file, or a LoRA adapter folder (``adapter_config.json`` beside its weights, as scgrpo's
            ``adapter/final``, peft and TRL save it): that adapter, with its own LoRA settings, on its base model.
        base_model: with ``model`` an adapter folder, the base model to load it on ("smollm2", a hub id, a folder or
            a ``.gguf`` file) in place of the one its ``adapter_config.json`` names (None: that one).
        objective: the RLVR objective (default: GRPO).
        lora: LoRA settings; ``null`` trains all weights.
        dtype: "auto" (fp32 on CPU, bf16 on GPU), "float32", "bfloat16" or "float16".
        generation: sampling settings for training rollouts (G, lengths, temperature).
        verifier: scores completions; default: the data source's own.
        optimizer: built over the trainable parameters only; default AdamW(lr=1e-4, weight_decay=0).
        lr_scheduler: stepped after every optimiser step.
        system_prompt: a system message put before each question (None: the chat template's default); a prompt of
            chat messages with its own system message keeps that one.
        success_threshold: a rollout counts as correct (and verified) when its reward is >= this.
        max_grad_norm: gradient clipping by global norm (0 = off).
        micro_batch_size: rows per forward/backward (gradient accumulation inside a step); None = all at once on CPU,
            as many as the memory budget holds on a GPU (with a budget, at most this many).
        logprob_chunk_size: tokens per chunk of fp32 logits in the log-prob computation (fewer where the memory
            budget needs it).
        gradient_checkpointing: recompute activations in backward (non-reentrant); off during generation. None: on a
            GPU, on for a step only when the memory budget cannot hold one row's activations without it; true:
            always; false: never.
        memory_budget_gib: GPU memory (GiB) the process may hold (:mod:`scgrpo.budget`): it sizes the rollout's
            decode slots, the scoring, teacher and update micro-batches, their log-prob chunks and gradient
            checkpointing. None: what the process can reach when the model is loaded (the card's free memory and
            its own reserve, within a ``set_per_process_memory_fraction`` cap), less 5% of it (at least 0.5 GiB).
            A budget set here is also the rollout's ``generation.memory_budget_gib`` (unless that is set); the default
            one too once resolved, where the rollout frees its workspace after each rollout
            (``generation.keep_workspace: false``); a kept workspace sizes its slots from the free memory. Ignored
            on CPU.
        quantization: "nf4" loads the frozen base in 4 bits through bitsandbytes (QLoRA: double quantisation,
            compute and storage in bf16); None keeps it in ``dtype``. Needs a GPU; one GPU per run (not sharded).
        eval_samples: k for Avg@k and Pass@k in validation.
        eval_temperature: sampling temperature in validation (None: the training temperature).
        eval_greedy: also measure greedy accuracy in validation.
        validate_before_training: run validation once before the first step.
        log_completions_every_n_steps: write sample completions every N steps (0 = never).
        save_adapter_every_n_steps: export the adapter every N steps (None: only at the end).
        max_nonfinite_skips: the divergence guard (:mod:`scgrpo.guard`): a step that meets a NaN or inf changes no
            weight and is counted (``train/nonfinite_skips``); after this many in a row the run stops with the last
            good weights put back. 0: skip such steps but never stop (and keep no copy of the weights).
        tis_cap: truncated importance sampling (:mod:`scgrpo.update`): each token's policy-gradient term is
            weighted by min(pi_trainer(y) / pi_sampler(y), tis_cap); 0 = off.
        environment: rollouts are multi-turn episodes in this environment (:mod:`scgrpo.envs`), rewarded by it;
            default: the data source's own environment, if it has one (else single completions and the verifier).
        episodes: turn limit, token budget and time limits of episodes (only with an environment).
        reward_funcs: reward functions with TRL's calling convention, in place of ``verifier``
            (:mod:`scgrpo.verifiers.rewards`): in YAML, import paths such as ``my_rewards.accuracy``. Each is called
            on a batch with ``prompts``, ``completions``, ``completion_ids`` and every other dataset column as keyword
            arguments and returns a float (or None) per completion; each one's mean is logged as
            ``reward/<name>/mean``.
        reward_weights: one weight per reward function (default 1 each); a row's reward is the weighted sum.
        max_reward_failure_steps: stop the run when every reward of this many steps in a row failed (the verifier
            or every reward function raised, timed out or gave None); 0: never stop.
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
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        check_tis_cap(tis_cap)
        self.adapter = check_model_settings(model, lora, quantization, dtype, base_model)  # None: not an adapter
        self.budget = MemoryBudget(memory_budget_gib)  # (checks the value)
        if memory_budget_gib is not None and generation.memory_budget_gib is None:  # the rollout plans for it too
            generation = dataclasses.replace(generation, memory_budget_gib=memory_budget_gib)
        self.guard = DivergenceGuard(max_nonfinite_skips)
        self.model_name, self.quantization, self.lora, self.dtype_name = model, quantization, lora, dtype
        self.objective = objective if objective is not None else GRPO()
        self.generation, self.system_prompt, self.success_threshold = generation, system_prompt, success_threshold
        if reward_funcs is not None and verifier is not None:
            raise ValueError("set model.verifier or model.reward_funcs, not both (a Verifier's score can be one of "
                             "the reward functions: wrap its verify in a function)")
        if reward_weights is not None and reward_funcs is None:
            raise ValueError("model.reward_weights is set without model.reward_funcs")
        if reward_funcs is not None:
            verifier = RewardFunctions(reward_funcs, reward_weights)
        if max_reward_failure_steps < 0:
            raise ValueError(f"max_reward_failure_steps must be >= 0 (0 = never stop), got {max_reward_failure_steps}")
        self.max_reward_failure_steps = max_reward_failure_steps
        self.reward_failure_steps = 0  # steps in a row up to now whose every reward failed
        self._verifier, self._optimizer, self._lr_scheduler = verifier, optimizer, lr_scheduler
        self.max_grad_norm, self.micro_batch_size, self.tis_cap = max_grad_norm, micro_batch_size, tis_cap
        self.logprob_chunk_size, self.gradient_checkpointing = logprob_chunk_size, gradient_checkpointing
        self.eval_samples, self.eval_temperature, self.eval_greedy = eval_samples, eval_temperature, eval_greedy
        self.validate_before_training = validate_before_training
        self.log_completions_every_n_steps = log_completions_every_n_steps
        self.save_adapter_every_n_steps = save_adapter_every_n_steps
        self._environment, self.episodes = environment, episodes
        self.episode_runner: Optional[EpisodeRunner] = None  # set up when rollouts are episodes
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the trainable weights
        self.runner: Optional[PolicyRunner] = None  # holds the policy; the FSDP root when sharded
        self.actor: Optional[Policy] = None  # the policy with its tokenizer and forward passes
        self.tokenizer = None
        self.verifier_runner: Optional[VerifierRunner] = None
        # from the step's first weight update to the end of its bookkeeping (data position, buffer, logs: the
        # callbacks' on_train_batch_end): a checkpoint taken in between would hold half a step
        self.updating = False
        self.rng_between_steps = RngBookmark()  # what a checkpoint written on an exception holds
        self._self_teacher: Optional[SelfTeacher] = None
        self._said_no_states = False  # (the missing sampler states were logged)
        self.last_step_metrics: dict[str, float] = {}
        self.last_credit: Optional[dict] = None  # what CreditLogging draws: the step's signal and credit
        self._checkpoint_step: Optional[int] = None  # the global step of a checkpoint loaded (see evaluated_step)

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
    def memory_budget_gib(self) -> Optional[float]:
        """The budget the run was given (None: the default, :attr:`budget` resolves it on a GPU)."""
        return self.budget.gib

    @property
    def sharded(self) -> bool:
        return self.actor is not None and self.actor.sharded

    @property
    def diverged(self) -> bool:
        """The divergence guard stopped the run (checkpoint and adapter callbacks read it)."""
        return self.guard.diverged

    @property
    def last_step_skipped(self) -> bool:
        """The last training step changed no weight (its rollouts are not stored)."""
        return self.guard.last_step_skipped

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
        name, lora = self.model_name, self.lora
        if self.adapter is not None:  # its base, with LoRA layers shaped as the adapter's, then its weights
            name, lora = self.adapter.base, self.adapter.lora_settings(self.lora)
        try:
            self.actor = build_policy(name, self.dtype_name, lora, self.quantization, device,
                                      self.generation, self.system_prompt, self.logprob_chunk_size,
                                      self.gradient_checkpointing is True, getattr(self, "_device_mesh", None))
        except (ValueError, TypeError) as err:
            if self.adapter is None:
                raise
            # peft's word on a layout that does not fit the base (target modules it lacks, a bad setting)
            raise InputError(f"adapter {self.adapter.folder} does not fit the base model {self.adapter.base}: "
                             f"{one_line(err)}") from err
        if self.adapter is not None:
            self.adapter.load_weights(self.actor.model)
        self.runner, self.tokenizer = self.actor.runner, self.actor.tokenizer
        network = self.actor.model
        self.budget.setup(device, getattr(network, "config", None), next(network.parameters()).dtype)
        self.actor.budget = self.budget
        self.actor.generation = self.budget.rollout_settings(self.actor.generation)
        self.actor.max_completion_tokens = self.max_completion_tokens

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion a rollout may have: an episode's token budget, or ``max_new_tokens``."""
        return self.episodes.max_episode_tokens if self.episode_runner is not None else self.generation.max_new_tokens

    @property
    def completion_room(self) -> int:
        """Positions after the first prompt that sampling may fill (an episode's last turn may sample past its
        budget before it is cut)."""
        if self.episode_runner is None:
            return self.generation.max_new_tokens
        return self.episodes.max_episode_tokens + self.generation.max_new_tokens

    def setup(self, stage: str) -> None:
        if self._trainer is not None:  # several nodes: before the model loads, what they must share
            self._check_shared(stage)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        environment = self._environment
        if environment is None and callable(getattr(getattr(datamodule, "source", None), "default_environment", None)):
            environment = datamodule.source.default_environment()
        if environment is not None:
            self.episode_runner = EpisodeRunner(environment, self.episodes)
        self.configure_model()
        self.actor.max_completion_tokens = self.max_completion_tokens
        verifier = self._verifier
        if verifier is None:
            if datamodule is None or not hasattr(datamodule, "default_verifier"):
                raise ValueError("no verifier given and the data module offers no default; set model.verifier")
            verifier = datamodule.default_verifier()
        self.verifier_runner = VerifierRunner(self._checked_verifier(verifier, getattr(datamodule, "source", None)))
        if self._trainer is not None:  # the validation after N steps at logger step N, not N - 1
            internals.evaluations_logged_at_global_step(self.trainer, lambda: self.evaluated_step)
        if self._trainer is not None and type(self.trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            # Lightning's own writer stages each checkpoint in $TMPDIR, where a killed save leaves it behind
            self.trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def _check_shared(self, stage: str) -> None:
        """Every rank sees the checkpoint it will read (``ckpt_path``) and, in a fit, the folders rank 0 writes
        checkpoints and the adapter into (:func:`scgrpo.distributed.check_shared`)."""
        trainer = self.trainer
        folders = []
        if stage == "fit":
            folders = [trainer.log_dir or trainer.default_root_dir,
                       *(getattr(cb, "dirpath", None) for cb in trainer.checkpoint_callbacks)]
        path = trainer.ckpt_path
        check_shared([f for f in folders if f], [path] if isinstance(path, str) else [])

    def _checked_verifier(self, verifier: Verifier, source) -> Verifier:
        """``verifier``, once it is known to fit the data: a verifier that scores against answers (or a teacher shown
        them) needs an answer column; reward functions score single completions and their arguments' names are not
        the dataset's columns. Episodes are rewarded by their environment, not by the verifier."""
        episodes = self.episode_runner is not None
        if episodes and isinstance(verifier, RewardFunctions):
            raise InputError("model.reward_funcs score single completions, and this run's rollouts are episodes in "
                             f"{type(self.episode_runner.environment).__name__}, which rewards them itself; drop "
                             "reward_funcs, or score in the environment's step")
        if source is None:
            return verifier
        privileged = self.objective.teacher is not None and self.objective.teacher.privileged
        if (getattr(verifier, "needs_answers", True) and not episodes) or privileged:
            no_answers = source.answer_fault() if hasattr(source, "answer_fault") else None
            if no_answers:
                reader = "the objective's teacher reads them" if privileged else f"{type(verifier).__name__} scores against them"
                raise InputError(f"{no_answers} ({reader})")
        if isinstance(verifier, RewardFunctions):
            rows = source.rows(source.splits()[0])
            verifier.check_columns(rows[0].get("columns", {}) if rows else {})
        return verifier

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
        params = self.actor.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters")
        optimizer = self._optimizer(params) if self._optimizer else torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        if self._lr_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self._lr_scheduler(optimizer), "interval": "step"}}

    # ------------------------------------------------------------------ the parts a step calls (also public)
    def format_prompts(self, questions: list[str]) -> list[str]:
        return self.actor.format_prompts(questions)

    def sample(self, prompts: list[str], num_samples: int, greedy: bool = False,
               temperature: Optional[float] = None, states: bool = False) -> Generated:
        return self.actor.sample(prompts, num_samples, greedy, temperature, states)

    @property
    def rollout_states(self) -> bool:
        """Whether training rollouts keep the sampler's final hidden states as the self-teacher's student side
        (``generation.student_states``; single-turn rollouts of an objective that compares distributions)."""
        teacher = self.self_teacher
        if teacher is None or teacher.spec.output != "divergence" or self.episode_runner is not None:
            return False
        mode = self.generation.student_states
        if mode == "auto":  # where the student's forward is a pass of its own (see GenerationSettings.student_states)
            shared = (selfteacher_module.SHARED_PASSES and teacher.spec.weights == "policy"
                      and 2 * self.generation.max_new_tokens <= selfteacher_module.SHARED_PASS_TOKENS)
            return self.device.type == "cuda" and not shared
        return mode == "rollout"

    def play_episodes(self, rows: list[dict], num_samples: int, greedy: bool = False,
                      temperature: Optional[float] = None, seed: Optional[int] = 0):
        """``num_samples`` episodes of each row in the run's environment (evaluation: seeds fixed by the rows)."""
        return self.episode_runner.run(self.actor, rows, num_samples, greedy, temperature, seed)

    def score_rollouts(self, rollouts: RolloutBatch) -> None:
        self.actor.score(rollouts, old=self.objective.needs_old_logprobs, reference=self.objective.needs_ref_logprobs,
                         micro_batch_size=self.micro_batch_size)

    def policy_is_finite(self) -> bool:
        return self.actor.is_finite()

    def run_self_teacher(self, rollouts: RolloutBatch) -> Optional[TeacherSignal]:
        """The self-teacher's signal for the batch (routes, references, teacher pass), or None."""
        if self.self_teacher is None:
            return None
        buffer = getattr(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None,
                         "verified_buffer", None)
        return self.self_teacher(self.actor, rollouts, self.success_threshold, self.micro_batch_size, buffer,
                                 self._step())

    def policy_update(self) -> PolicyUpdate:
        """The update as the module's settings stand now (micro-batches, clipping, TIS)."""
        return PolicyUpdate(self.actor, self.objective, self.manual_backward, self.micro_batch_size,
                            self.max_grad_norm, self.tis_cap, auto_checkpointing=self.gradient_checkpointing is None)

    def _step(self) -> int:
        return self.global_step if self._trainer is not None else 0

    # ------------------------------------------------------------------------------------------ training
    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        """sample -> verify (the callbacks, before this) -> self-teacher -> credit -> update -> log. A NaN or inf
        met on the way skips the step: no weight changes (see :class:`~scgrpo.guard.DivergenceGuard`)."""
        rollouts = batch.rollouts
        if rollouts is None or rollouts.rewards is None:
            raise RuntimeError("the batch has no verified rollouts; RolloutCallback and VerificationCallback must run first")
        self.budget.begin_step()
        update, plan, sums, start = self.policy_update(), None, StepSums(), time.perf_counter()
        reason = on_any_rank(nonfinite_inputs(rollouts), self.device)  # a diverged sampler: skip the rest
        if reason is None:
            signal = self._teacher_signal(rollouts, start)  # the scoring pass and the self-teacher
            start = time.perf_counter()
            with out_of_memory_as_error("scoring", self):  # (the batch-entropy pass of objectives that need one)
                plan = update.plan(rollouts, signal)  # credit, the rows in the loss, micro-batches
            reason = on_any_rank(nonfinite_inputs(rollouts, plan), self.device)
        rollouts.student_states = None  # (read by the self-teacher, if it ran)
        with record_function("scgrpo.update"), out_of_memory_as_error("update", self):  # (a profiler's range)
            reason = self._optimise(update, rollouts, plan, sums, reason)
            self.actor.sync()
        train_time = time.perf_counter() - start
        phase_peak(rollouts.stats, self.device, "update")
        if self.budget.active:
            peaks = [v for k, v in rollouts.stats.items() if k.startswith("memory/") and k.endswith("_peak_gib")]
            rollouts.stats.update(self.budget.metrics(), **{"memory/peak_allocated_gib": max(peaks, default=NAN)})
            self.budget.log_once()
        self._guard_step(reason)
        self._log_step(rollouts, plan, sums, update, train_time)
        if hasattr(datamodule := getattr(self.trainer, "datamodule", None), "batches_consumed"):
            datamodule.batches_consumed += 1
        return torch.tensor(sums["loss"] / self.objective.num_iterations)

    def _teacher_signal(self, rollouts: RolloutBatch, start: float) -> Optional[TeacherSignal]:
        """The scoring pass (old or reference log-probs, when the objective needs them) and the self-teacher."""
        if self.objective.needs_old_logprobs or self.objective.needs_ref_logprobs:
            with out_of_memory_as_error("scoring", self):
                self.score_rollouts(rollouts)
                self.actor.sync()
            rollouts.stats["time/scoring_s"] = time.perf_counter() - start
        # verification and DAPO's extra rounds belong to the rollout phase; the scoring pass, when run, to its own
        phase_peak(rollouts.stats, self.device, "scoring" if "time/scoring_s" in rollouts.stats else "rollout")
        with record_function("scgrpo.teacher"), out_of_memory_as_error("teacher", self):
            signal = self.run_self_teacher(rollouts)
        if signal is not None:
            phase_peak(rollouts.stats, self.device, "teacher")
        return signal

    def _optimise(self, update: PolicyUpdate, rollouts: RolloutBatch, plan: Optional[StepPlan], sums: StepSums,
                  reason: Optional[str]) -> Optional[str]:
        """``objective.num_iterations`` optimiser steps on the batch; returns why the update was skipped, or
        None. A skipped step still steps the optimiser, without gradients: no weight moves, the step counts."""
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        for iteration in range(self.objective.num_iterations):
            update.first_pass = iteration == 0  # the sampler-trainer mismatch is booked on it only
            if reason is None:
                update.accumulate(rollouts, plan, sums, self._step())
                reason = update.clip(plan, sums)
                if reason is None and iteration == 0:
                    self.guard.keep(self.actor.trainable_parameters(), self.global_step)
            if reason is not None:
                optimizer.zero_grad(set_to_none=True)  # a NaN/inf never reaches the weights, on any rank
            self.updating = True  # until on_train_batch_end
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        return reason

    def _guard_step(self, reason: Optional[str]) -> None:
        """Books the step with the guard; when it says stop, the last good weights are back and the run ends."""
        lr = self.optimizers().param_groups[0]["lr"] if self._trainer is not None else float("nan")
        stop = self.guard.finish_step(reason, self.actor.trainable_parameters(), self.global_step, lr,
                                      self.max_grad_norm, report=self.global_rank == 0)
        if stop and self._trainer is not None:
            self.trainer.should_stop = True

    def _log_step(self, rollouts: RolloutBatch, plan: Optional[StepPlan], sums: StepSums, update: PolicyUpdate,
                  train_time: float) -> None:
        lr = self.optimizers().param_groups[0]["lr"]
        common = dict(success_threshold=self.success_threshold, train_time=train_time,
                      nonfinite_skips=self.guard.nonfinite_skips, lr=lr)
        if plan is None:  # skipped before its loss: every other key of the last step as NaN
            metrics = skipped_step_metrics(rollouts, list(self.last_step_metrics), **common)
            self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=max(len(rollouts.rewards), 1))
            return
        self.last_credit = {"signal": plan.signal, "credit": plan.credit} if plan.signal is not None else None
        metrics = step_metrics(rollouts, plan, sums, update.mismatch.metrics(self.device), passes=self.objective.num_iterations,
                               log_kl=self.objective.needs_ref_logprobs, device=self.device, **common)
        self.last_step_metrics = metrics
        self.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, batch_size=max(len(plan.rewards), 1))
        self.log("reward", metrics["train/reward"], prog_bar=True, on_step=True, on_epoch=False, logger=False)

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
        episodes = self.play_episodes if self.episode_runner is not None else None
        with out_of_memory_as_error("validation", self):
            self.evaluation.add(batch, self, self.verifier_runner, episodes)  # (samples through self.sample)

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")

    @property
    def evaluated_step(self) -> int:
        """The optimiser steps behind the weights being evaluated: ``global_step`` in a fit; in ``validate`` or
        ``test`` from a checkpoint, the checkpoint's (Lightning restores no training step there)."""
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        return self.global_step if fitting or self._checkpoint_step is None else self._checkpoint_step

    def _log_evaluation(self, stage: str) -> None:
        """``<stage>/<split>/...`` of every split and ``<stage>/global_step``, logged at the logger step
        :attr:`evaluated_step` (see ``setup``)."""
        step = self.evaluated_step
        for metrics in self.evaluation.metrics(step, self.global_rank == 0, stage).values():
            self.log_dict(metrics, on_step=False, on_epoch=True, add_dataloader_idx=False)
        # the optimiser steps done before this evaluation (a resumed run's metrics.csv tells its rows apart by it)
        self.log(f"{stage}/global_step", float(step), on_step=False, on_epoch=True, add_dataloader_idx=False)

    test_step = validation_step
    on_test_epoch_start = on_validation_epoch_start

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

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # checkpoint["state_dict"] already holds only the trainable tensors (see state_dict)
        interrupted = self._trainer is not None and self.trainer.interrupted  # (StepCheckpoint's on_exception)
        rng = self.rng_between_steps.state if interrupted and self.rng_between_steps.state is not None else rng_state()
        checkpoint["scgrpo"] = {**self.guard.state_dict(), **checkpoint_rng(rng)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._checkpoint_step = checkpoint.get("global_step")
        self.configure_model()
        check_trainable(checkpoint, self.trainable_names())
        state = checkpoint.get("scgrpo", {})
        self.guard.load_state_dict(state)
        restore_rng(state, self.global_rank)  # sampling goes on as it would have
        self.rng_between_steps.mark()  # (a validation left pending runs before on_train_start)
