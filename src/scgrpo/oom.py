"""The GPU running out of memory in a phase of a run, as one line that names the phase, the memory and the setting
to change.

:func:`out_of_memory_as_error` wraps each phase: "rollout" (sampling, episodes), "scoring" (old and reference
log-probs, batch entropies), "teacher" (the self-teacher pass), "update" (forward, backward, optimiser step) and
"validation". An out-of-memory error raised inside becomes a :class:`~scgrpo.errors.GPUOutOfMemory`, which
``scgrpo`` prints as one ``scgrpo: error:`` line (``SCGRPO_DEBUG=1``: raised, with the original error as its
cause). Before that the memory the failed phase held is let go, so that the checkpoint written on the exception
(:class:`~scgrpo.callbacks.StepCheckpoint`, the last whole step's) finds room.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

from scgrpo.errors import GPUOutOfMemory

PHASES = ("rollout", "scoring", "teacher", "update", "validation")
"""The phases a message names"""

_OOM_TEXTS = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA error: out of memory")
"""What the RuntimeErrors of a failed allocation say (cuBLAS's workspace, a CUDA call outside PyTorch's allocator)"""

_GIB = 2**30
_HELD_ELSEWHERE_GIB = 2.0
"""Memory used on the card beyond this process's allocator above which another process is named (the CUDA
context and libraries take well under this)"""


def is_out_of_memory(err: BaseException) -> bool:
    """``err`` is a failed GPU allocation."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _OOM_TEXTS)


def card_memory(device: Optional[torch.device] = None) -> Optional[tuple[float, float, float, float]]:
    """(allocated, reserved, free, total) GiB of ``device`` (None: the current CUDA device); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    try:
        free, total = torch.cuda.mem_get_info(device)
        return (torch.cuda.memory_allocated(device) / _GIB, torch.cuda.memory_reserved(device) / _GIB,
                free / _GIB, total / _GIB)
    except Exception:  # noqa: BLE001 - the figures only add to the message; the out-of-memory error is reported
        return None


def out_of_memory_message(phase: str, module) -> str:
    """The one line for an out-of-memory error in ``phase`` of ``module``'s run: the memory budget (the one
    ``module.budget`` resolved, else ``module.memory_budget_gib``; None: the card's free memory), this process's allocated and reserved memory and
    the card's free and total memory, and the settings that make ``phase`` smaller."""
    given = getattr(module, "memory_budget_gib", None)
    resolved = getattr(getattr(module, "budget", None), "gib_resolved", None)  # (the default, once on a GPU)
    budget = resolved if resolved is not None else given
    memory = [f"budget {budget:.1f} GiB{'' if given is not None else ' (the default)'}" if budget is not None
              else "budget: the card's free memory"]
    device = getattr(module, "device", None)
    figures = card_memory(device if isinstance(device, torch.device) and device.type == "cuda" else None)
    held_elsewhere = 0.0
    if figures is not None:
        allocated, reserved, free, total = figures
        memory.append(f"{allocated:.1f} GiB allocated, {reserved:.1f} GiB reserved, {free:.1f} of {total:.1f} GiB "
                      "free on the card")
        held_elsewhere = total - free - reserved
    advice = _advice(phase, module, budget)
    if held_elsewhere > _HELD_ELSEWHERE_GIB:
        advice = f"{held_elsewhere:.1f} GiB of the card are held by another process: free it, or {advice}"
    trainer = getattr(module, "_trainer", None)
    fitting = trainer is not None and trainer.state.fn == "fit" and bool(trainer.checkpoint_callbacks)
    kept = "; the last checkpoint is kept" if fitting and getattr(module, "global_step", 0) > 0 else ""
    return f"out of GPU memory in the {phase} phase ({'; '.join(memory)}): {advice}{kept}"


def _advice(phase: str, module, budget: Optional[float]) -> str:
    """The settings to change: a smaller memory budget (smaller micro-batches and fewer decode slots) for every
    phase, and the phase's own sizes."""
    if phase in ("rollout", "validation"):
        lower, switch = ["model.generation.max_slots"], []
    else:
        lower = [] if getattr(module, "micro_batch_size", None) == 1 else ["model.micro_batch_size"]
        # checkpointing holds less only in the update (the other passes keep no activations), and not once it is on
        on = getattr(module, "gradient_checkpointing", False) or getattr(getattr(module, "actor", None), "checkpointing", False)
        switch = ["model.gradient_checkpointing: true"] if phase == "update" and not on else []
    if budget is not None:
        text = "lower " + " or ".join(["model.memory_budget_gib", *lower])
        return text + "".join(f", or set {setting}" for setting in switch)
    actions = ["set model.memory_budget_gib below the card's free memory"]
    actions += ["lower " + " or ".join(lower)] if lower else []
    actions += [f"set {setting}" for setting in switch]
    return ", ".join(actions[:-1]) + " or " + actions[-1] if len(actions) > 1 else actions[0]


def release_memory(err: Optional[BaseException] = None) -> None:
    """Lets go of what a failed phase or pass held: the tensors in the finished frames of ``err``'s traceback (the
    traceback still prints; their local variables are gone), what only reference cycles still hold, and PyTorch's
    cached blocks."""
    if err is not None:
        traceback.clear_frames(err.__traceback__)  # (frames still running are left as they are)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def out_of_memory_as_error(phase: str, module) -> Iterator[None]:
    """Turns a failed GPU allocation inside into :class:`~scgrpo.errors.GPUOutOfMemory` (see the module), after
    releasing the memory the phase held; any other error passes as it is."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    try:
        yield
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        message = out_of_memory_message(phase, module)  # the figures as at the failure
        release_memory(err)
        raise GPUOutOfMemory(message) from err
