"""The LightningDataModule: a seeded, resumable stream of training prompts and fixed evaluation splits."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset

from scgrpo.data.buffer import VerifiedBuffer
from scgrpo.data.lengths import PromptFit, drop_long_rows, prompt_limits
from scgrpo.distributed import world_size
from scgrpo.errors import InputError
from scgrpo.data.sources import PromptSource, Row
from scgrpo.data.tasks import resolve_source
from scgrpo.rollout.types import PromptBatch


def _batch(rows: list[Row], split: str) -> PromptBatch:
    return PromptBatch(
        ids=[str(r["id"]) for r in rows], questions=[r["question"] for r in rows], answers=[r["answer"] for r in rows],
        split=split, columns=[r.get("columns", {}) for r in rows]
    )


class PromptStream(IterableDataset):
    """Endless batches of training prompts: each epoch a fresh seeded permutation of the rows.

    Batch ``k`` is a pure function of (seed, k, rank), so a resumed run starting at ``start_batch`` sees exactly
    the prompts it would have seen without stopping. With several ranks, rank ``r`` takes the ``r``-th slice of
    each global batch.
    """

    def __init__(self, rows: list[Row], batch_size: int, seed: int, start_batch: int = 0, rank: int = 0, world_size: int = 1):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.start_batch, self.rank, self.world_size = start_batch, rank, world_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def __iter__(self) -> Iterator[PromptBatch]:
        global_size = self.batch_size * self.world_size
        per_epoch = max(len(self.rows) // global_size, 1)
        k = self.start_batch
        while True:
            epoch, within = divmod(k, per_epoch)
            order = self._order(epoch)
            start = within * global_size + self.rank * self.batch_size
            picked = [self.rows[order[(start + j) % len(order)]] for j in range(self.batch_size)]
            yield _batch(picked, "train")
            k += 1


class AtTheEnd(IterableDataset):
    """An evaluation split's batches (``loader``'s) when ``when()`` says so, else none: a final split
    (``PromptDataModule.final_splits``)."""

    def __init__(self, loader: DataLoader, when: Callable[[], bool]) -> None:
        self.loader, self.when = loader, when

    def __iter__(self) -> Iterator[PromptBatch]:
        return iter(self.loader) if self.when() else iter(())


class PromptDataModule(LightningDataModule):
    """Streams prompts for training and serves evaluation splits.

    Args:
        source: a built-in task name ("arithmetic", "countdown") or any PromptSource, e.g.
            ``{class_path: scgrpo.data.FileSource, init_args: {files: data.jsonl, columns: {question: q}}}``.
        batch_size: prompts per training step and rank (each is sampled ``num_generations`` times).
        eval_batch_size: prompts per evaluation batch.
        eval_splits: which of the source's evaluation splits to run (default: all of them).
        final_splits: evaluation splits run at the fit's last evaluation only (at ``trainer.max_steps``), and by
            ``scgrpo validate`` and ``test`` (e.g. an OOD split: measured at the end, not on the way). A split
            named in both lists is a final one.
        max_eval_prompts: cap on prompts per evaluation split (None = all).
        seed: fixes the order of training prompts.
        buffer_size_per_prompt: K, verified completions kept per prompt for the self-teacher (0 = none).
        buffer_max_total: cap on verified completions kept overall.
        max_prompt_tokens: rows whose prompt (the question in the chat template) has more tokens are skipped when a
            split is loaded, with one warning that counts them and names the longest. None: the model's context
            minus ``generation.max_new_tokens``; a larger value is lowered to that. With a self-teacher objective its
            view of the row (the question under a system block holding a reference of up to ``max_new_tokens``)
            must fit the same context too.
    """

    def __init__(
        self,
        source: Union[str, PromptSource] = "arithmetic",
        batch_size: int = 8,
        eval_batch_size: int = 64,
        eval_splits: Optional[list[str]] = None,
        final_splits: Optional[list[str]] = None,
        max_eval_prompts: Optional[int] = None,
        seed: int = 0,
        buffer_size_per_prompt: int = 4,
        buffer_max_total: Optional[int] = 100_000,
        max_prompt_tokens: Optional[int] = None,
    ) -> None:
        super().__init__()
        if batch_size < 1 or eval_batch_size < 1:
            raise ValueError(f"batch sizes must be >= 1, got batch_size={batch_size}, eval_batch_size={eval_batch_size}")
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 or null, got {max_prompt_tokens}")
        self.max_prompt_tokens = max_prompt_tokens
        self._fitting: dict[tuple, list[Row]] = {}
        self.prompt_fit: Optional[PromptFit] = None  # the model's (fit_prompts); None: every row
        self.source = resolve_source(source)
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        available = self.source.eval_splits()
        self.eval_splits = list(eval_splits) if eval_splits is not None else available
        self.final_splits = list(final_splits or [])
        unknown = {key: [s for s in asked if s not in available]
                   for key, asked in (("eval_splits", self.eval_splits), ("final_splits", self.final_splits))}
        if any(unknown.values()):
            raise ValueError(self._unknown_splits({k: v for k, v in unknown.items() if v}, available))
        self.eval_splits += [s for s in self.final_splits if s not in self.eval_splits]
        self.max_eval_prompts, self.seed = max_eval_prompts, seed
        self.batches_consumed = 0  # per rank; saved in checkpoints so a resumed run continues the stream
        self.extra_consumed = 0
        self.verified_buffer = VerifiedBuffer(buffer_size_per_prompt, buffer_max_total)

    def _unknown_splits(self, unknown: dict[str, list[str]], available: list[str]) -> str:
        """The message for ``data.eval_splits`` / ``data.final_splits`` naming splits the source lacks (both at once),
        after a local file's own data errors: a FileSource's train file is read first (a malformed file is the fault
        to fix first; its rows are kept for the run). A hub dataset is not downloaded for the message."""
        from scgrpo.data.sources import FileSource, HubDataset

        if isinstance(self.source, FileSource) and "train" in self.source.splits():
            self.source.rows("train")  # (raises the data's own error, if it has one)
        name = type(self.source).__name__
        has = f"its evaluation splits are {available}" if available else "it has no evaluation split"
        first = next(iter(unknown.values()))[0]
        fixes = []
        for key in unknown:
            fixes.append(f"set data.{key}: []" if not available else f"set data.{key} to some of {available} or []")
        fix = " and ".join(fixes) + " (no evaluation)"
        if isinstance(self.source, FileSource):  # (a file per split)
            fix += f", or give a file for each: data.source.init_args.files: {{train: ..., {first}: ...}}"
        elif isinstance(self.source, HubDataset):
            fix += f", or map it to a split of the dataset: data.source.init_args.splits: {{train: ..., {first}: ...}}"
        said = " and ".join(f"data.{key} {names}" for key, names in unknown.items())
        return f"{said} are not splits of {name} ({has}): {fix}"

    def setup(self, stage: str) -> None:
        """``fit`` needs the source's train split (one clear error before the model loads); ``validate`` and ``test``
        read its evaluation splits only, so a source without a train split evaluates."""
        splits = self.source.splits()
        trainer = self.trainer
        interval = getattr(trainer, "val_check_interval", None)
        if stage == "fit" and self.final_splits and isinstance(interval, int) and trainer.max_steps > 0 \
                and trainer.max_steps % interval:
            raise InputError(f"data.final_splits {self.final_splits} are evaluated at the fit's last step, but "
                             f"trainer.max_steps={trainer.max_steps} is no multiple of trainer.val_check_interval="
                             f"{interval}: no evaluation falls there (set max_steps to "
                             f"{-(-trainer.max_steps // interval) * interval})")
        if stage == "fit" and "train" not in splits:
            raise InputError(f"data.source ({type(self.source).__name__}) has no train split, only {splits}: scgrpo "
                             "fit trains on one (FileSource: files: {train: ..., test: ...}); scgrpo validate and "
                             "test evaluate without it")

    def default_verifier(self):
        return self.source.default_verifier()

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def fit_prompts(self, fit: PromptFit) -> None:
        """From now on, the rows of every split that fit the model ``fit`` describes (the module calls it at setup)."""
        if fit != self.prompt_fit:
            self.prompt_fit, self._fitting = fit, {}

    def split_rows(self, split: str) -> list[Row]:
        """The rows of ``split`` that fit the model being trained (see ``max_prompt_tokens``): the source's rows,
        with those too long skipped and counted once. Before a module has called :meth:`fit_prompts` (outside a
        Trainer), all of them."""
        fit = self.prompt_fit
        if fit is None:
            return self.source.rows(split)
        limits = prompt_limits(fit, self.max_prompt_tokens)
        # the teacher limit applies to training rows only: evaluation samples without a teacher
        if split != "train":
            limits = replace(limits, teacher=None)
        key = (split, limits)
        if key not in self._fitting:
            self._fitting[key] = drop_long_rows(fit, self.source.rows(split), limits, self.source.describe(split))
        return self._fitting[key]

    def train_dataloader(self) -> DataLoader:
        rows = self.split_rows("train")
        if not rows:
            raise ValueError(f"{type(self.source).__name__} gave an empty train split")
        rank, world = self._rank_world()
        stream = PromptStream(rows, self.batch_size, self.seed, self.batches_consumed, rank, world)
        # a private generator: creating a loader's iterator draws a seed from it, and drawing from the global one
        # would shift the sampling RNG of a resumed run (and of every run at each validation)
        return DataLoader(stream, batch_size=None, num_workers=0, generator=torch.Generator().manual_seed(self.seed))

    def eval_rows(self, split: str) -> list[Row]:
        rows = self.split_rows(split)
        return rows[: self.max_eval_prompts] if self.max_eval_prompts else rows

    def val_dataloader(self) -> list[DataLoader]:
        loaders = []
        for split in self.eval_splits:
            rows = self.eval_rows(split)
            if not rows:
                raise ValueError(f"evaluation split {split!r} is empty")
            if split in self.final_splits:  # (Lightning gives the wrapper below no distributed sampler: the
                rank, world = self._rank_world()  # rows are dealt to the ranks here; each evaluates its share)
                rows = rows[rank::world]
            loader = DataLoader(rows, batch_size=self.eval_batch_size, shuffle=False,
                                collate_fn=lambda b, s=split: _batch(b, s), generator=torch.Generator().manual_seed(self.seed))
            loaders.append(DataLoader(AtTheEnd(loader, self.final_evaluation), batch_size=None)
                           if split in self.final_splits else loader)
        return loaders

    def final_evaluation(self) -> bool:
        """Whether the evaluation being run is the fit's last (at ``max_steps``), or one outside a fit: the
        evaluations that run ``final_splits``."""
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return True
        return not trainer.sanity_checking and 0 < trainer.max_steps <= trainer.global_step

    def test_dataloader(self) -> list[DataLoader]:
        return self.val_dataloader()

    def extra_batch(self) -> PromptBatch:
        """One more batch of training prompts for DAPO's dynamic sampling, from a second seeded stream (the
        main one is already being read ahead by the data loader); its position is checkpointed too."""
        rank, world = self._rank_world()
        stream = PromptStream(self.split_rows("train"), self.batch_size, self.seed + 1_000_003, self.extra_consumed, rank, world)
        self.extra_consumed += 1
        return next(iter(stream))

    def state_dict(self) -> dict[str, Any]:
        """Stream positions and the verified buffer. With several ranks (Lightning asks every rank), each rank's
        buffer holds the solutions of its own prompts: they are gathered, so the checkpoint keeps them all."""
        buffer = self.verified_buffer.state_dict()
        if world_size() > 1:
            parts: list[Any] = [None] * world_size()
            torch.distributed.all_gather_object(parts, buffer)
            buffer = VerifiedBuffer.merge_states(parts)
        return {
            "batches_consumed": self.batches_consumed,
            "extra_consumed": self.extra_consumed,
            "verified_buffer": buffer,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_consumed = int(state_dict.get("batches_consumed", 0))
        self.extra_consumed = int(state_dict.get("extra_consumed", 0))
        if "verified_buffer" in state_dict:
            self.verified_buffer.load_state_dict(state_dict["verified_buffer"])
