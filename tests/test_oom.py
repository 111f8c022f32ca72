"""The GPU running out of memory in a phase of a run is one error naming the phase, the memory and the setting to
change. The allocator's failure is simulated on the CPU: raised as PyTorch raises it."""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from scgrpo.errors import GPUOutOfMemory
from scgrpo.oom import out_of_memory_as_error, out_of_memory_message

FAILED = "CUDA out of memory. Tried to allocate 2.00 GiB"
SMALLER_UPDATE = "lower model.memory_budget_gib or model.micro_batch_size, or set model.gradient_checkpointing: true"


# ------------------------------------------------------------------------------------------ the message
def _card(monkeypatch, allocated: float, reserved: float, free: float, total: float) -> list[str]:
    """A CUDA card as ``torch.cuda`` reports it (GiB); returns the calls to ``empty_cache``."""
    gib, emptied = 2**30, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free * gib), int(total * gib)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(allocated * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(reserved * gib))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append("empty_cache"))
    return emptied


def _module(**settings) -> SimpleNamespace:
    defaults = dict(memory_budget_gib=None, micro_batch_size=None, gradient_checkpointing=False,
                    device=torch.device("cpu"), global_step=0)
    return SimpleNamespace(**{**defaults, **settings})


@pytest.mark.parametrize("phase, settings", [
    ("rollout", "lower model.memory_budget_gib or model.generation.max_slots"),
    ("validation", "lower model.memory_budget_gib or model.generation.max_slots"),
    ("scoring", SMALLER_UPDATE),
    ("teacher", SMALLER_UPDATE),
    ("update", SMALLER_UPDATE),
])
def test_the_message_names_the_phase_the_memory_and_the_settings_of_the_phase(phase, settings, monkeypatch):
    _card(monkeypatch, allocated=21.4, reserved=21.9, free=0.3, total=22.5)
    assert out_of_memory_message(phase, _module(memory_budget_gib=22.0)) == (
        f"out of GPU memory in the {phase} phase (budget 22.0 GiB; 21.4 GiB allocated, 21.9 GiB reserved, 0.3 of "
        f"22.5 GiB free on the card): {settings}")


def test_without_a_budget_or_cuda_the_message_says_the_card_s_free_memory_and_leaves_out_settings_already_made(
        monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert out_of_memory_message("update", _module(gradient_checkpointing=True)) == (
        "out of GPU memory in the update phase (budget: the card's free memory): set model.memory_budget_gib below "
        "the card's free memory or lower model.micro_batch_size")
    assert out_of_memory_message("teacher", _module(gradient_checkpointing=True, micro_batch_size=1)) == (
        "out of GPU memory in the teacher phase (budget: the card's free memory): set model.memory_budget_gib below "
        "the card's free memory")
    assert out_of_memory_message("rollout", _module()).endswith(
        ": set model.memory_budget_gib below the card's free memory or lower model.generation.max_slots")


def test_memory_held_by_another_process_is_named(monkeypatch):
    _card(monkeypatch, allocated=21.4, reserved=21.9, free=0.3, total=79.1)
    assert out_of_memory_message("update", _module(memory_budget_gib=22.0)) == (
        "out of GPU memory in the update phase (budget 22.0 GiB; 21.4 GiB allocated, 21.9 GiB reserved, 0.3 of "
        f"79.1 GiB free on the card): 56.9 GiB of the card are held by another process: free it, or {SMALLER_UPDATE}")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(FAILED), RuntimeError(f"{FAILED} (GPU 0; 79.1 GiB)"),
                                   RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")])
def test_a_failed_allocation_becomes_one_error_after_the_phase_s_memory_is_released(error, monkeypatch):
    emptied = _card(monkeypatch, allocated=1.0, reserved=2.0, free=0.5, total=2.5)
    held = []

    def phase():
        activations = torch.ones(4)  # what a failed phase's frame holds until its traceback goes
        held.append(weakref.ref(activations))
        raise error

    with pytest.raises(GPUOutOfMemory, match="in the teacher phase") as info:
        with out_of_memory_as_error("teacher", _module()):
            phase()
    gc.collect()
    assert info.value.__cause__ is error and held[0]() is None and emptied == ["empty_cache"]


def test_other_errors_pass_as_they_are():
    error = RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError) as info, out_of_memory_as_error("update", _module()):
        raise error
    assert info.value is error
    with pytest.raises(ValueError, match="phase must be one of"), out_of_memory_as_error("sampling", _module()):
        pass
