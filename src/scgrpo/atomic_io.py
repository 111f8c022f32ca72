"""Files and folders written whole or not at all: written beside their target under ``.<name>.tmp-<pid>`` and
renamed into place; what a killed writer left is removed by the next write into that folder."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from scgrpo import lightning_internals as internals

_TEMPORARY = re.compile(r"^\..+\.tmp-(\d+)$")  # .<name>.tmp-<pid>: a file or folder being written


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(folder: str) -> None:
    """Removes what killed writers left in ``folder`` (``.<name>.tmp-<pid>`` of a process that is gone)."""
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        match = _TEMPORARY.match(entry)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            path = os.path.join(folder, entry)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def _temporary_beside(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    remove_stale_temporaries(folder)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


def write_file_atomically(write: Callable[[Any], None], path: str) -> None:
    """``write(f)`` into ``.<name>.tmp-<pid>`` beside ``path`` (an open binary file), then renamed over ``path``:
    readers see the old file or the new one, never a part. Interrupted, the temporary file is removed; a killed
    process leaves it beside ``path``, where the next write into that folder removes it."""
    tmp = _temporary_beside(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_folder_atomically(write: Callable[[str], None], folder: str) -> None:
    """``write(tmp)`` fills a new folder beside ``folder``, which then takes its place (the old one is removed
    after the swap): an interrupted export leaves the previous folder whole."""
    tmp = _temporary_beside(folder)
    try:
        write(tmp)
        if os.path.isdir(folder):
            old = _temporary_beside(folder + "-old")
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, with the file written beside its target and renamed into place.
    Lightning's own stages each save in a temporary file of ``$TMPDIR`` (fsspec's transaction), where a killed
    save leaves up to a checkpoint's size behind; here nothing goes to ``$TMPDIR``, the checkpoint is streamed
    to disk without a copy in memory, and a killed save's ``.<name>.tmp-<pid>`` is removed by the next save."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not internals.is_local_path(str(path)):
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_file_atomically(lambda f: torch.save(checkpoint, f), os.fspath(path))
