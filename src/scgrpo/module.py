"""The LightningModule: the policy, the loss on a prepared rollout batch, and evaluation."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from scgrpo.callbacks import AdapterExport, CompletionsTable, RolloutCallback, ValidateBeforeTraining, VerificationCallback
from scgrpo.models import LoraSettings, check_model_name, load_policy, parse_dtype
from scgrpo.objectives import GRPO, LossInputs, Objective
from scgrpo.objectives.functional import chunked_token_logprobs, masked_mean
from scgrpo.rollout.engine import GenerationSettings, generate
from scgrpo.rollout.types import PromptBatch, RolloutBatch
from scgrpo.verifiers import Verifier, VerifierRunner

log = logging.getLogger(__name__)


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
        eval_samples: k for Avg@k and Pass@k in validation.
        eval_temperature: sampling temperature in validation (None: the training temperature).
        eval_greedy: also measure greedy accuracy in validation.
        validate_before_training: run validation once before the first step.
        log_completions_every_n_steps: write sample completions every N steps (0 = never).
        save_adapter_every_n_steps: export the adapter every N steps (None: only at the end).
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
        eval_samples: int = 4,
        eval_temperature: Optional[float] = None,
        eval_greedy: bool = True,
        validate_before_training: bool = True,
        log_completions_every_n_steps: int = 10,
        save_adapter_every_n_steps: Optional[int] = None,
    ) -> None:
        super().__init__()
        if eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1, got {eval_samples}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        check_model_name(model)
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
        self.policy = None
        self.tokenizer = None
        self.verifier_runner: Optional[VerifierRunner] = None
        self.nonfinite_skips = 0
        self._eval: dict[str, dict[str, float]] = {}

    # ----------------------------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        if self.policy is not None:
            return
        device_type = self.trainer.strategy.root_device.type if self._trainer is not None else "cpu"
        self.policy, self.tokenizer = load_policy(self.model_name, parse_dtype(self.dtype_name, device_type), self.lora)
        self.policy.train()  # from_pretrained returns eval mode; generation switches to eval by itself
        if self.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.lora is not None and hasattr(self.policy, "enable_input_require_grads"):
                self.policy.enable_input_require_grads()

    def setup(self, stage: str) -> None:
        self.configure_model()
        verifier = self._verifier
        if verifier is None:
            datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            if datamodule is None or not hasattr(datamodule, "default_verifier"):
                raise ValueError("no verifier given and the data module offers no default; set model.verifier")
            verifier = datamodule.default_verifier()
        self.verifier_runner = VerifierRunner(verifier)

    def configure_callbacks(self):
        callbacks = [RolloutCallback(), VerificationCallback(), CompletionsTable(self.log_completions_every_n_steps),
                     AdapterExport(self.save_adapter_every_n_steps)]
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
    def token_logprobs(self, model, input_ids: Tensor, attention_mask: Tensor, num_completion: int) -> tuple[Tensor, Tensor]:
        """fp32 log-probs ``[N, C]`` of the last ``num_completion`` tokens of ``input_ids`` and the entropy of
        each predicted distribution, at the sampling temperature. Only the backbone runs on the whole
        sequence; logits are computed in chunks for the completion positions alone."""
        causal_lm = _unwrap_causal_lm(model)
        backbone = getattr(causal_lm, causal_lm.base_model_prefix)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # [N, T, H]
        hidden = hidden[:, -num_completion - 1 : -1]  # [N, C, H]: the state before each completion token
        targets = input_ids[:, -num_completion:]  # [N, C]
        return chunked_token_logprobs(
            hidden, causal_lm.get_output_embeddings(), targets, self.generation.temperature, self.logprob_chunk_size
        )

    @torch.no_grad()
    def score_rollouts(self, rollouts: RolloutBatch) -> None:
        """Log-probs the objective needs besides the trained ones: under the sampling policy when it takes
        several optimiser steps per batch, and under the reference (adapters off) when it has a KL term."""
        c = rollouts.completion_ids.shape[1]
        was_training = self.policy.training
        self.policy.eval()
        try:
            if self.objective.num_iterations > 1:
                rollouts.old_logprobs = self.token_logprobs(self.policy, rollouts.input_ids, rollouts.attention_mask, c)[0]
            if self.objective.beta > 0:
                if not hasattr(self.policy, "disable_adapter"):
                    raise ValueError("beta > 0 uses the base model (adapters off) as reference; it needs LoRA (lora != null)")
                with self.policy.disable_adapter():
                    rollouts.ref_logprobs = self.token_logprobs(self.policy, rollouts.input_ids, rollouts.attention_mask, c)[0]
        finally:
            self.policy.train(was_training)

    # ------------------------------------------------------------------------------------------ training
    def training_step(self, batch: PromptBatch, batch_idx: int) -> Tensor:
        rollouts = batch.rollouts
        if rollouts is None or rollouts.rewards is None:
            raise RuntimeError("the batch has no verified rollouts; RolloutCallback and VerificationCallback must run first")
        start = time.perf_counter()
        advantages = self.objective.advantages(rollouts.rewards, rollouts.group_size)  # [N]
        mask = rollouts.completion_mask  # [N, C]
        num_tokens, num_rows = float(mask.sum()), float(mask.shape[0])
        if self.objective.skips_zero_advantage_rows():
            rows = torch.nonzero(advantages != 0).squeeze(1)  # [n]
        else:
            rows = torch.arange(mask.shape[0], device=mask.device)
        micro = self.micro_batch_size or max(len(rows), 1)
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        sums: dict[str, float] = defaultdict(float)
        for _ in range(self.objective.num_iterations):
            for chunk in torch.split(rows, micro) if len(rows) else ():
                out, entropy = self._micro_step(rollouts, chunk, advantages, num_tokens, num_rows)
                if out is None:
                    sums["nonfinite"] += 1
                    continue
                sums["loss"] += float(out.loss.detach())
                for name, value in out.stats.items():
                    sums[name] += float(value) * len(chunk) / max(len(rows), 1)
                sums["entropy"] += float(entropy) * len(chunk) / max(len(rows), 1)
            if sums["nonfinite"]:
                optimizer.zero_grad(set_to_none=True)  # a NaN/inf loss never reaches the weights
            elif self.max_grad_norm > 0 and len(rows):
                params = [p for p in self.policy.parameters() if p.requires_grad]
                sums["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        train_time = time.perf_counter() - start
        self._log_step(rollouts, advantages, rows, sums, train_time)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "batches_consumed"):
            datamodule.batches_consumed += 1
        return torch.tensor(sums["loss"] / self.objective.num_iterations)

    def _micro_step(self, rollouts: RolloutBatch, rows: Tensor, advantages: Tensor, num_tokens: float, num_rows: float):
        c = rollouts.completion_ids.shape[1]
        input_ids, attention_mask = rollouts.input_ids[rows], rollouts.attention_mask[rows]
        logprobs, entropy = self.token_logprobs(self.policy, input_ids, attention_mask, c)  # [n, C]
        mask = rollouts.completion_mask[rows]
        old = rollouts.old_logprobs[rows] if rollouts.old_logprobs is not None else logprobs.detach()
        inputs = LossInputs(
            completion_mask=mask,
            advantages=advantages[rows],
            old_logprobs=old,
            ref_logprobs=rollouts.ref_logprobs[rows] if rollouts.ref_logprobs is not None else None,
            entropy=entropy,
            num_tokens=num_tokens,
            num_sequences=num_rows,
            max_len=self.generation.max_new_tokens,
        )
        out = self.objective.loss(logprobs, inputs)
        if not torch.isfinite(out.loss):
            self.nonfinite_skips += 1
            log.warning("non-finite loss (%s) at step %d: the step is skipped (%d so far)", out.loss.item(),
                        self.global_step, self.nonfinite_skips)
            return None, None
        self.manual_backward(out.loss)
        return out, masked_mean(entropy.detach(), mask)

    def _log_step(self, rollouts: RolloutBatch, advantages: Tensor, rows: Tensor, sums: dict, train_time: float) -> None:
        rewards, mask = rollouts.rewards, rollouts.completion_mask
        grouped = rewards.view(-1, rollouts.group_size)
        lengths = mask.sum(1)
        iters = self.objective.num_iterations
        metrics = {
            "train/loss": sums["loss"] / iters,
            "train/reward": rewards.mean(),
            "train/reward_std": rewards.std() if rewards.numel() > 1 else torch.tensor(0.0),
            "train/accuracy": (rewards >= self.success_threshold).float().mean(),
            "train/mixed_groups": (grouped.max(1).values != grouped.min(1).values).float().mean(),
            "train/completion_length": lengths.mean(),
            "train/truncated": rollouts.truncated.float().mean(),
            "train/rows_in_loss": float(len(rows)) / max(len(rewards), 1),
            "train/advantage_abs": advantages.abs().mean(),
            "train/nonfinite_skips": float(self.nonfinite_skips),
            "time/train_s": train_time,
        }
        if len(rows):
            metrics["train/clip_fraction"] = sums.get("clip_fraction", 0.0) / iters
            metrics["train/entropy"] = sums["entropy"] / iters
            if "grad_norm" in sums:
                metrics["train/grad_norm"] = sums["grad_norm"] / iters
        if "kl" in sums:
            metrics["train/kl"] = sums["kl"] / iters
        for name, value in sums.items():
            if name not in ("loss", "entropy", "grad_norm", "kl", "clip_fraction", "nonfinite"):
                metrics[f"train/{name}"] = value / iters
        metrics.update(rollouts.stats)
        metrics["time/step_s"] = sum(v for k, v in rollouts.stats.items() if k.startswith("time/")) + train_time
        optimizer = self.optimizers()
        metrics["train/lr"] = optimizer.param_groups[0]["lr"]
        self.log_dict({k: float(v) for k, v in metrics.items()}, on_step=True, on_epoch=False, prog_bar=False,
                      batch_size=len(rewards))
        self.log("reward", float(rewards.mean()), prog_bar=True, on_step=True, on_epoch=False, logger=False)

    # -------------------------------------------------------------------------------------------- eval
    def on_validation_epoch_start(self) -> None:
        self._eval = {}
        self._eval_start = time.perf_counter()

    def validation_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        prompts = self.format_prompts(batch.questions)
        k = self.eval_samples
        sampled = generate(self.policy, self.tokenizer, prompts, k, self.generation, self.device,
                           temperature=self.eval_temperature)
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
            greedy = generate(self.policy, self.tokenizer, prompts, 1, self.generation, self.device, greedy=True)
            results = self.verifier_runner(greedy.completions, batch.answers, batch.questions, batch.ids)
            acc["greedy"] += sum(float(r.score >= self.success_threshold) for r in results)

    def on_validation_epoch_end(self) -> None:
        k = self.eval_samples
        for split, acc in self._eval.items():
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
            self.log_dict(metrics, on_step=False, on_epoch=True, add_dataloader_idx=False, sync_dist=True)
            summary = ", ".join(f"{name.split('/')[-1]} {value:.3f}" for name, value in metrics.items())
            log.info("step %d validation [%s] on %d prompts: %s", self.global_step, split, int(n), summary)
            self.eval_summary = getattr(self, "eval_summary", [])
            self.eval_summary.append({"step": self.global_step, "split": split, **{k_.split("/")[-1]: v for k_, v in metrics.items()}})

    def test_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validation_step(batch, batch_idx, dataloader_idx)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_test_epoch_end(self) -> None:
        self.on_validation_epoch_end()

    # ------------------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {f"policy.{name}" for name, p in self.policy.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["scgrpo"] = {"nonfinite_skips": self.nonfinite_skips}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.configure_model()
        trainable = {f"policy.{name}" for name, p in self.policy.named_parameters() if p.requires_grad}
        missing = sorted(trainable - set(checkpoint["state_dict"]))
        if missing:
            raise ValueError(
                f"checkpoint lacks {len(missing)} trainable tensors of this model (e.g. {missing[0]}); "
                "was it written with another model or LoRA setting?"
            )
        self.nonfinite_skips = checkpoint.get("scgrpo", {}).get("nonfinite_skips", 0)
