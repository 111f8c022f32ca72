"""What a checkpoint holds of the module: the trainable tensors only (never the frozen base), and the random
number generators' state (torch, CUDA, Python, numpy) as plain types and tensors, so that a resumed run draws as
the uninterrupted one would have (Lightning loads checkpoints with ``weights_only=True``)."""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

from scgrpo.distributed import world_size


def rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RngBookmark:
    """The RNG state where the run last stood between steps (a step's end, a validation's end, the start): what
    a checkpoint written on an exception holds (the checkpoint of the last whole step), so that the resumed run
    draws the rollout or validation cut short as the uninterrupted run did."""

    def __init__(self) -> None:
        self.state: Optional[dict] = None

    def mark(self) -> None:
        self.state = rng_state()

    def saved(self, interrupted: bool) -> dict:
        """The RNG state a checkpoint written now keeps: on an exception (``interrupted``), the marked one; else
        the current one."""
        return self.state if interrupted and self.state is not None else rng_state()


def checkpoint_rng(rng: dict) -> dict[str, Any]:
    """What a checkpoint keeps of ``rng`` (this rank's state): with several ranks, every rank's state, since each
    samples with its own generators (Lightning asks every rank to save). Every rank must call it."""
    if world_size() == 1:
        return {"rng": rng}
    per_rank: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(per_rank, rng)
    return {"rng": rng, "rng_per_rank": per_rank}


def restore_rng(state: dict[str, Any], rank: int) -> None:
    """Puts back this rank's state from what :func:`checkpoint_rng` kept (the run's single state when the
    number of ranks changed)."""
    per_rank = state.get("rng_per_rank")
    if per_rank is not None and len(per_rank) == world_size():
        set_rng_state(per_rank[rank])
    elif "rng" in state:
        set_rng_state(state["rng"])


def trainable_only(state: dict[str, Any], trainable: set[str], prefix: str = "") -> dict[str, Any]:
    """``state`` (a state dict whose keys start with ``prefix``) without the tensors not in ``trainable``."""
    for key in [k for k in state if k[len(prefix):] not in trainable]:
        del state[key]
    return state


def check_trainable(checkpoint: dict[str, Any], trainable: set[str]) -> None:
    """One clear error when ``checkpoint`` lacks a trainable tensor of the model being resumed."""
    missing = sorted(trainable - set(checkpoint["state_dict"])) if "state_dict" in checkpoint else []
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} trainable tensors of this model (e.g. {missing[0]}); "
                         "was it written with another model or LoRA setting?")
