"""What every rollout backend shares: the end-of-sequence ids and masks, and the model's state while it samples
(eval mode, no grad, LoRA folded in where that is exact)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = set()
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(ids)


def completion_mask_from_eos(completion_ids: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask ``[N, C]`` that is 1 up to and including the first end-of-sequence token, and the ``[N]`` flag of
    rows that have none (truncated)."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    n, c = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), c, device=completion_ids.device))
    positions = torch.arange(c, device=completion_ids.device).expand(n, c)
    mask = (positions <= first.unsqueeze(1)).float()
    return mask, ~has_eos


@contextlib.contextmanager
def merged_adapters(model, policy: str = "always") -> Iterator[bool]:
    """Run the base layers with LoRA folded in (W + scale * B A) and the adapter branches switched off.

    Generation then costs what the plain model costs. The merged weights are new tensors; on exit each base
    layer gets back its original tensor object, so nothing drifts (unlike merge_adapter/unmerge_adapter,
    which add and subtract in the weight dtype). Layers whose base weight is not a plain float tensor
    (4-bit) keep their adapter branch, and so do all layers when ``policy`` is "never", or "auto" with
    weights in less than fp32. Yields whether anything was merged.
    """
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        yield False
        return
    swapped = []
    if hasattr(model, "get_base_model") and policy != "never":  # ("never": no walk over the modules)
        for module in model.modules():
            if not isinstance(module, LoraLinear) or module.merged or module.disable_adapters:
                continue
            if any(name in getattr(module, "lora_variant", {}) for name in module.active_adapters):
                continue  # DoRA and other variants are not a plain additive delta
            weight = module.get_base_layer().weight
            if not weight.dtype.is_floating_point or type(weight.data) is not torch.Tensor:
                continue
            if policy == "never" or (policy == "auto" and weight.dtype != torch.float32):
                continue
            delta = sum(module.get_delta_weight(name) for name in module.active_adapters if name in module.lora_A)
            if isinstance(delta, int):
                continue
            original = weight.data
            weight.data = (original.float() + delta.float()).to(original.dtype)
            swapped.append((module, weight, original, module.disable_adapters))
            module._disable_adapters = True
    try:
        yield bool(swapped)
    finally:
        for module, weight, original, disabled in swapped:
            weight.data = original
            module._disable_adapters = disabled


@contextlib.contextmanager
def generation_mode(model, merge_lora: str = "auto") -> Iterator[None]:
    """Eval mode, no grad, KV cache on, gradient checkpointing off and LoRA merged for the duration;
    everything restored after."""
    was_training = model.training  # (a model in eval mode is left as it is: no walk over its modules)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    checkpointing = was_training and bool(getattr(inner, flag, False))  # (checkpointing runs in training mode only)
    if checkpointing:
        model.gradient_checkpointing_disable()
    if was_training:
        model.eval()
    try:
        with torch.no_grad(), merged_adapters(model, merge_lora):
            yield
    finally:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if was_training:
            model.train()
