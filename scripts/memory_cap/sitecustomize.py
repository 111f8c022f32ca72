"""Holds a process to a consumer card's memory: ``scripts/check_gpu_configs.py`` puts this folder first on the
``PYTHONPATH`` of each run it starts, so Python imports this file at start-up in the run and in every process the
run starts (the other ranks of a multi-GPU run).

With ``SCGRPO_CHECK_MEMORY_CAP_GIB`` set, once the process initialises CUDA its own device (``LOCAL_RANK``, else
0) is capped with ``torch.cuda.set_per_process_memory_fraction(cap * 2**30 / total)``: the caching allocator then
raises ``OutOfMemoryError`` rather than reserve more than the cap. One line on stderr says so
(``scgrpo memory cap: ...``). The allocator's cap is not what ``torch.cuda.mem_get_info`` reports, and the package
sizes its rollout workspaces by that when no ``memory_budget_gib`` is set (``scgrpo.rollout.memory.memory_free``):
with ``SCGRPO_CHECK_MEMORY_VIEW=cap`` (the default) it reports the device as a card of the cap's size (total: the
cap; free: the cap less what the process holds reserved, at most the card's free memory), as a card that small
would; ``card`` leaves the real card's figures. With ``SCGRPO_CHECK_MEMORY_PEAKS`` set, the process appends its
peak reserved and allocated memory as one JSON line to that file at exit. The package resets the peak
statistics between the phases of a step (``memory/*_peak_gib``), so the peaks are taken before every reset too.

Nothing is imported here until the program imports torch itself, and CUDA is never initialised here: a process
that does not use the GPU (a compile worker, a verifier's sandbox) gets no CUDA context from this file. Without
the variable this file only runs the ``sitecustomize`` it hides, if there is one further along ``sys.path``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys

CAP_ENV = "SCGRPO_CHECK_MEMORY_CAP_GIB"
PEAKS_ENV = "SCGRPO_CHECK_MEMORY_PEAKS"
VIEW_ENV = "SCGRPO_CHECK_MEMORY_VIEW"


def own_device() -> int:
    """The CUDA device of this process: its ``LOCAL_RANK`` (Lightning's ranks use ``cuda:LOCAL_RANK``), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def track_peaks(cuda):
    """Wraps ``cuda.reset_peak_memory_stats`` so that the peaks it is about to reset are kept; returns a function
    giving ``(peak reserved, peak allocated)`` in bytes of a device over the whole process."""
    kept: dict[int, list[int]] = {}
    original = cuda.memory.reset_peak_memory_stats

    def fold(device) -> None:
        if not cuda.is_initialized():
            return
        index = cuda._get_device_index(device, optional=True)  # as torch's own reset reads it
        stats = cuda.memory_stats(index)
        now = [stats.get("reserved_bytes.all.peak", 0), stats.get("allocated_bytes.all.peak", 0)]
        kept[index] = [max(a, b) for a, b in zip(kept.get(index, [0, 0]), now, strict=True)]

    def reset_peak_memory_stats(device=None):
        fold(device)
        return original(device)

    cuda.memory.reset_peak_memory_stats = reset_peak_memory_stats  # (reset_max_memory_allocated calls this one)
    cuda.reset_peak_memory_stats = reset_peak_memory_stats

    def peaks(device: int) -> tuple[int, int]:
        fold(device)
        return tuple(kept.get(device, [0, 0]))

    return peaks


def capped_view(cuda, applied: dict):
    """Replaces ``cuda.mem_get_info`` by one that reports the capped device as a card of ``applied["bytes"]`` (once
    the cap is applied; other devices as they are)."""
    original = cuda.memory.mem_get_info

    def mem_get_info(device=None):
        free, total = original(device)
        index = cuda._get_device_index(device, optional=True)  # (None: the current device)
        if not applied or index != applied["device"]:
            return free, total
        cap = applied["bytes"]
        return min(free, max(cap - cuda.memory_reserved(index), 0)), cap

    cuda.memory.mem_get_info = mem_get_info
    cuda.mem_get_info = mem_get_info
    return original


def install(torch) -> None:
    """Queues the cap for the moment the process initialises CUDA, and the peaks' record for its exit."""
    import atexit

    cap_gib = float(os.environ[CAP_ENV])
    view = os.environ.get(VIEW_ENV, "cap")
    if view not in ("cap", "card"):
        raise ValueError(f"{VIEW_ENV}={view!r}: expected cap or card")
    cuda = torch.cuda
    peaks = track_peaks(cuda)
    applied: dict = {}
    card_info = capped_view(cuda, applied) if view == "cap" else cuda.mem_get_info

    def apply_cap() -> None:  # runs inside torch.cuda's lazy initialisation
        device = own_device()
        if device >= cuda.device_count():  # one device per process (CUDA_VISIBLE_DEVICES set per rank)
            device = cuda.current_device()
        total = card_info(device)[1]
        fraction = min(cap_gib * 2**30 / total, 1.0)
        cuda.set_per_process_memory_fraction(fraction, device)
        applied.update(device=device, total_gib=total / 2**30, fraction=fraction, bytes=int(fraction * total))
        print(f"scgrpo memory cap: {cap_gib:g} GiB of {total / 2**30:.2f} GiB on cuda:{device} (fraction "
              f"{fraction:.4f}){'; the card has less' if fraction == 1.0 else ''}; mem_get_info reports "
              f"{'the cap' if view == 'cap' else 'the card'}", file=sys.stderr, flush=True)

    def record() -> None:
        path = os.environ.get(PEAKS_ENV)
        if not path or not applied or not cuda.is_initialized():
            return
        reserved, allocated = peaks(applied["device"])
        line = {"pid": os.getpid(), "argv": " ".join(sys.argv[:3]), "local_rank": os.environ.get("LOCAL_RANK"),
                "device": applied["device"], "cap_gib": cap_gib, "total_gib": round(applied["total_gib"], 3),
                "view": view, "peak_reserved_gib": reserved / 2**30, "peak_allocated_gib": allocated / 2**30}
        with open(path, "a") as f:  # one short write per process: lines of several ranks do not mix
            f.write(json.dumps(line) + "\n")

    cuda._lazy_call(apply_cap)
    atexit.register(record)


class _AfterTorchImport:
    """A meta-path finder that lets torch import as usual, then calls :func:`install` on it (once)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            install(module)

        spec.loader.exec_module = exec_then_install
        return spec


def chain_hidden_sitecustomize() -> None:
    """Runs the ``sitecustomize`` that this file hides (the next one on ``sys.path``), as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    if os.environ.get(CAP_ENV):
        if "torch" in sys.modules:  # (imported by a .pth file already)
            install(sys.modules["torch"])
        else:
            sys.meta_path.insert(0, _AfterTorchImport())
    chain_hidden_sitecustomize()
