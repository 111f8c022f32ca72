"""Sample completions to a table, adapter export, and validation before training."""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only

from scgrpo import lightning_internals as internals
from scgrpo.atomic_io import write_folder_atomically
from scgrpo.callbacks.validation import run_validation
from scgrpo.chat import prompt_text
from scgrpo.model_card import model_card, name_base_model, run_config
from scgrpo.models import ADAPTER_CONFIG, portable_model_name

log = logging.getLogger(__name__)


def run_dir(trainer) -> str:
    """Where this run writes its files: the first logger's folder, else the trainer's root dir. Read from the
    logger directly: ``trainer.log_dir`` broadcasts, and a rank-zero-only caller would wait forever."""
    logger = trainer.loggers[0] if trainer.loggers else None
    directory = getattr(logger, "log_dir", None) or trainer.default_root_dir
    os.makedirs(directory, exist_ok=True)
    return directory


INFO_CHARS = 120  # the longest info shown in a cell of the TensorBoard table (completions.jsonl holds it whole)


def compact_json(value) -> str:
    """``value`` as JSON on one line, without spaces; a value JSON has no type for (a set, a tensor) as its text."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)


def table_cell(text: str, limit: Optional[int] = None) -> str:
    """``text`` in one cell of a markdown table: on one line, no column bar, cut to ``limit`` characters."""
    text = text.replace("|", "/").replace("\r", " ").replace("\n", " ")
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


class CompletionsTable(Callback):
    """Every ``every_n_steps`` steps (steps 0, ``every_n_steps``, ...), appends sample completions with their rewards
    and their verifier's ``info`` (the extracted answer, a reason; an episode's turns and faults) to
    ``<log_dir>/completions.jsonl``, and to TensorBoard as a text table (the info as compact JSON, cut to
    ``INFO_CHARS``) when a TensorBoard logger is present. A row's ``step``, and the table's ``global_step``, is the
    step's number in ``metrics.csv`` (:func:`~scgrpo.lightning_internals.train_step`: 0 for the first).

    Args:
        every_n_steps: how often to write (0 = never).
        num_groups: how many prompts' groups to write each time.
    """

    def __init__(self, every_n_steps: int = 10, num_groups: int = 2) -> None:
        self.every_n_steps, self.num_groups = every_n_steps, num_groups

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        rollouts = batch.rollouts
        if not self.every_n_steps or rollouts is None or rollouts.rewards is None:
            return
        step = internals.train_step(trainer)
        if step % self.every_n_steps:
            return
        rows = []
        for i in range(min(self.num_groups * rollouts.group_size, len(rollouts.completions))):
            rows.append(
                {
                    "step": step,
                    "id": rollouts.sample_ids[i],
                    "question": rollouts.questions[i],
                    "answer": rollouts.answers[i],  # (as JSON: None as null, tests as a list; else its text)
                    "completion": rollouts.completions[i],
                    "reward": float(rollouts.rewards[i]),
                    "tokens": int(rollouts.completion_mask[i].sum()),
                    "truncated": bool(rollouts.truncated[i]),
                    "info": rollouts.infos[i] if rollouts.infos is not None else {},
                }
            )
        with open(os.path.join(run_dir(trainer), "completions.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                table = "| reward | question | completion | info |\n|---|---|---|---|\n" + "\n".join(
                    f"| {r['reward']:.2f} | {table_cell(prompt_text(r['question']))} | {table_cell(r['completion'])} | "
                    f"{table_cell(compact_json(r['info']) if r['info'] else '', INFO_CHARS)} |"
                    for r in rows
                )
                experiment.add_text("completions", table, global_step=step)


class AdapterExport(Callback):
    """Saves the LoRA adapter in PEFT format (``PeftModel.from_pretrained`` loads it) to
    ``<log_dir>/adapter/step-N`` every ``every_n_steps`` steps and to ``<log_dir>/adapter/final`` at the end.
    Full fine-tuning runs save the whole model the same way.

    An adapter is written only when its weights, and the policy's log-probs on a probe text, are finite (a
    diverged run's weights can be finite and still give NaN logits); after the divergence guard stopped a run,
    ``final`` holds the weights it restored. Each folder is written beside its place and then swapped in, so an
    interrupted export leaves the previous one whole.

    The adapter is portable: its ``adapter_config.json`` names the base model as the user gave it (a hub id, a
    folder's absolute path; never the local conversion cache; the embedded model as its hub id, which plain peft
    loads, with ``scgrpo.json`` beside it saying it was trained on the embedded file, which scgrpo loads again),
    which ``scgrpo validate|test --model.model <adapter folder>`` loads it on, and a ``README.md`` model card
    (:mod:`scgrpo.model_card`) holds the base model,
    objective, LoRA settings, the last validation's metrics and the run's ``config.yaml`` (else the module's
    settings)."""

    def __init__(self, every_n_steps: Optional[int] = None, dirpath: Optional[str] = None) -> None:
        self.every_n_steps, self.dirpath = every_n_steps, dirpath

    @staticmethod
    def _card(trainer, pl_module, folder: str, base: str) -> str:
        config = run_config(os.path.join(run_dir(trainer), "config.yaml"), pl_module)  # (LightningCLI writes it)
        adapter_config = os.path.join(folder, ADAPTER_CONFIG)
        lora = None
        if os.path.isfile(adapter_config):
            with open(adapter_config) as f:
                lora = json.load(f)
        return model_card(base_model=base, objective=pl_module.objective, steps=trainer.global_step, lora=lora,
                          metrics=dict(trainer.callback_metrics), config=config,
                          trained_on=pl_module.base_model_name)

    def _save(self, trainer, pl_module, name: str) -> None:
        folder = os.path.join(self.dirpath or os.path.join(run_dir(trainer), "adapter"), name)
        if not pl_module.actor.is_finite():  # every rank: a probe forward of a sharded policy is a collective
            if trainer.is_global_zero:
                log.warning("adapter %s not written: the policy's weights or log-probs are not finite", folder)
            return
        state = None
        if pl_module.actor.sharded:  # gather the sharded trainable tensors (all ranks), save them from rank 0
            whole = pl_module.trainable_state()
            prefix = "runner.policy."
            state = {k[len(prefix):]: v for k, v in whole.items() if k.startswith(prefix)}
        if trainer.is_global_zero:
            def write(path: str) -> None:
                pl_module.policy.save_pretrained(path, **({"state_dict": state} if state is not None else {}))
                pl_module.tokenizer.save_pretrained(path)
                base = portable_model_name(pl_module.base_model_name)
                name_base_model(path, base, trained_on=pl_module.base_model_name)
                with open(os.path.join(path, "README.md"), "w") as f:  # (over peft's empty template)
                    f.write(self._card(trainer, pl_module, path, base))

            write_folder_atomically(write, folder)
            log.info("saved adapter to %s", folder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer, pl_module, f"step-{trainer.global_step}")

    def on_train_end(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, "final")


class ValidateBeforeTraining(Callback):
    """Runs the validation loop once before the first training step, so logs hold a step-0 baseline."""

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step > 0 or trainer.limit_val_batches == 0:
            return
        run_validation(trainer)
