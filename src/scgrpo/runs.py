"""Where a run writes: one folder ``<root>/<name>/version_N`` shared by all its file loggers, checkpoints,
completions and adapters; a resumed run goes on in the folder of its checkpoint and appends to its metrics."""

from __future__ import annotations

import csv
import logging
import os
from typing import Any, Optional

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

from scgrpo import lightning_internals as internals

log = logging.getLogger(__name__)

DEFAULT_ROOT = "runs"  # the file loggers' save_dir when neither they nor trainer.default_root_dir name one
DEFAULT_NAME = "scgrpo"
FOLDER_LOGGERS = (CSVLogger, TensorBoardLogger)  # the loggers with a run folder (Lightning's Trainer.log_dir)
# their class names in a config (RunCSVLogger: ours, below), whose folder is <save_dir>/<name>/<version>
FILE_LOGGERS = (*(cls.__name__ for cls in FOLDER_LOGGERS), "RunCSVLogger")
SETUP_FILES = ("config.yaml", "hparams.yaml")  # what a run writes into its folder before it has done anything


def _number(value) -> Optional[float]:
    return None if value in (None, "") else float(value)


def rows_before(rows: list[dict], first: dict) -> list[dict]:
    """The rows of a run's ``metrics.csv`` (in the order logged) that a process resuming it keeps, ``first`` being
    the first row it logs: those of earlier steps, and those of ``first``'s step logged before ``first`` was
    the first time. A validation shares its logger step with the training row of the next optimiser step, logged
    after it (the validation after k steps and the training row of step k + 1 both at step k): they are told apart
    by ``val/global_step``, which the module logs with each validation only."""
    step, mark = int(first["step"]), _number(first.get("val/global_step"))
    kept, found = [], False
    for row in rows:
        row_step = int(float(row["step"]))
        found = found or (row_step == step and _number(row.get("val/global_step")) == mark)
        if row_step < step or (row_step == step and not found):
            kept.append(row)
    return kept


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued rather than deleted: the
    rows logged before the checkpoint a run resumed from are kept, those logged after it (which the resumed run
    logs again) are replaced (see :func:`rows_before`)."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        self._continued = False

    def _check_log_dir_exists(self) -> None:
        pass  # Lightning's warns and deletes metrics.csv

    def save(self) -> None:
        fs = internals.filesystem(self)
        if not self._continued and self.metrics and fs.isfile(self.metrics_file_path):
            self._continued = True
            with fs.open(self.metrics_file_path, "r", newline="") as f:
                reader = csv.DictReader(f)
                keys, kept = list(reader.fieldnames or []), rows_before(list(reader), self.metrics[0])
            self.metrics_keys = sorted(set(self.metrics_keys) | set(keys))
            with fs.open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(kept)
        self._continued = self._continued or bool(self.metrics)
        super().save()


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` whose ``metrics.csv`` is continued when the run folder already has one (a resumed run),
    instead of being deleted: rows logged before the checkpoint are kept, those logged after it are replaced by
    the new ones (see :func:`rows_before`)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        return internals.csv_experiment(self, lambda: _AppendingWriter(log_dir=self.log_dir))


def checkpoint_run_folder(ckpt_path: Optional[str]) -> Optional[tuple[str, str, str]]:
    """``(root, name, version)`` of the run folder holding ``ckpt_path`` (``<root>/<name>/<version>/checkpoints/
    x.ckpt``, the folder holding a metrics.csv, config.yaml or hparams.yaml), or None."""
    if not ckpt_path or ckpt_path in ("last", "best", "hpc", "registry") or "://" in str(ckpt_path):
        return None
    folder = os.path.dirname(os.path.normpath(ckpt_path))  # relative stays relative, as the run wrote it
    if os.path.basename(folder) != "checkpoints":
        return None
    run = os.path.dirname(folder)
    if os.path.dirname(os.path.dirname(run)) == "":  # too short a relative path to name root and name
        return checkpoint_run_folder(os.path.abspath(ckpt_path))
    if not any(os.path.isfile(os.path.join(run, f)) for f in ("metrics.csv", "config.yaml", "hparams.yaml")):
        return None
    name_dir = os.path.dirname(run)
    return os.path.dirname(name_dir), os.path.basename(name_dir), os.path.basename(run)


def share_run_folder(trainer_config: Any, ckpt_path: Optional[str] = None) -> Optional[str]:
    """Points every file logger (CSV, TensorBoard) of the parsed ``trainer`` config at one folder, in place:

    - root: a ``save_dir`` set on any of them (other than the default ``runs``), else ``default_root_dir``,
      else ``runs``;
    - name: a ``name`` set on any of them (other than ``scgrpo``), else ``scgrpo``;
    - version: a ``version`` set on any of them, else the folder of the checkpoint being resumed when it is the
      run's ``last.ckpt`` (``<root>/<name>/<version>/checkpoints/last.ckpt``), else the next free number
      (Lightning's). A run resumed from an earlier checkpoint of its folder (``best-step=N.ckpt``) branches into a
      new folder beside it, so that the later steps' checkpoints, adapter and metrics are kept.

    Lightning's CSV logger becomes :class:`RunCSVLogger`, so a resumed run appends to its metrics. Returns the
    resumed run's folder, or None."""
    loggers = trainer_config.get("logger")
    entries = loggers if isinstance(loggers, list) else [loggers]
    entries = [e for e in entries if hasattr(e, "class_path") and e.class_path.rsplit(".", 1)[-1] in FILE_LOGGERS]
    if not entries:
        return None

    def chosen(key: str, default):
        values = [e.init_args.get(key) for e in entries]
        return next((v for v in values if v is not None and str(v) != str(default)), default)

    root = chosen("save_dir", DEFAULT_ROOT)
    if str(root) == DEFAULT_ROOT and trainer_config.get("default_root_dir"):
        root = trainer_config.get("default_root_dir")
    name, version = chosen("name", DEFAULT_NAME), chosen("version", None)
    resumed = checkpoint_run_folder(ckpt_path) if version is None else None
    if resumed is not None and os.path.basename(os.path.normpath(ckpt_path)) != "last.ckpt":
        root, name, _ = resumed
        logging.getLogger(__name__).info(
            "resuming from %s in a new run folder beside %s (which keeps its later steps)", ckpt_path, os.path.join(*resumed))
        resumed = None
    if resumed is not None:
        root, name, version = resumed
    for entry in entries:
        entry.init_args.save_dir, entry.init_args.name = os.fspath(root), name
        if version is not None:
            entry.init_args.version = version
        if entry.class_path == "lightning.pytorch.loggers.CSVLogger" or entry.class_path.endswith("csv_logs.CSVLogger"):
            entry.class_path = f"{__name__}.RunCSVLogger"
    return os.path.join(*resumed) if resumed is not None else None


def new_run_folders(loggers: list) -> list[str]:
    """The run folders of ``loggers`` that do not exist yet, and the parents that making them will make, deepest
    first: what a run that fails before it has done anything takes away again (:func:`remove_unused_folders`)."""
    folders: list[str] = []
    for logger in loggers:
        if not isinstance(logger, FOLDER_LOGGERS) or not internals.is_local_path(logger.log_dir):
            continue
        folder = os.path.abspath(logger.log_dir)
        while not os.path.exists(folder) and folder not in folders:
            folders.append(folder)
            folder = os.path.dirname(folder)
    return sorted(folders, key=lambda f: -f.count(os.sep))


def holds_nothing_of_use(folder: str) -> bool:
    """Whether ``folder`` holds only what a run writes before its first step: its config (``config.yaml``,
    ``hparams.yaml``), TensorBoard event files and empty folders. Anything else (a checkpoint, an adapter, metrics,
    completions, a file of the user's) is of use."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            if os.listdir(path):
                return False
        elif not (os.path.isfile(path) and (name in SETUP_FILES or name.startswith("events.out.tfevents."))):
            return False
    return True


def remove_unused_folders(folders: list[str], logged: bool) -> list[str]:
    """After a failed run: removes the folders it made (``folders``, from :func:`new_run_folders`, deepest first)
    that hold nothing of use (:func:`holds_nothing_of_use`; a parent once its run folder is gone), unless the run
    logged a metric (its event files hold it). A folder that was there before the run, such as a resumed run's, is
    never in ``folders``. Returns the folders removed."""
    removed: list[str] = []
    if logged:
        return removed
    for folder in folders:  # deepest first
        if not os.path.isdir(folder) or not holds_nothing_of_use(folder):
            continue
        try:
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)  # (empty)
                else:
                    os.remove(path)
            os.rmdir(folder)
        except OSError:  # something was written into it meanwhile
            continue
        removed.append(folder)
    return removed
