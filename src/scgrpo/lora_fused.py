"""peft's LoRA layer with the adapter term added by one matmul into the base layer's output
(:attr:`scgrpo.models.LoraSettings.fused_16bit`, and over a 4-bit base :mod:`scgrpo.lora4bit`).

peft runs the adapter of a 16-bit layer in the adapters' own dtype (fp32): it casts the input to fp32, runs both
adapter matmuls in fp32, scales the fp32 term and adds it to a copy of the output, then casts the sum back. On
SmolLM2-135M's training and teacher passes those casts and fp32 passes took most of the GPU time (H100 profile
of an SC-GRPO step). The fused forward runs ``z = dropout(x) A^T`` and ``out = base(x) + z (s B)^T`` in the
compute dtype, as autocast would run them, the last as one ``addmm`` into the base output; the fp32 adapter
weights stay the trained ones (their gradients flow through the casts)."""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear

HALF = (torch.bfloat16, torch.float16)


def fused_lora_forward(layer, x: torch.Tensor, fallback, args, kwargs) -> torch.Tensor:
    """``layer``'s output with its one active adapter added by ``addmm`` in the output's dtype; ``fallback(x, *args,
    **kwargs)`` (peft's forward) for anything else: adapters disabled or merged, several active adapters, per-call
    adapter or variant arguments, a variant such as DoRA, an adapter bias, or autocast on."""
    names = layer.active_adapters
    name = names[0] if len(names) == 1 else None
    if (name is None or args or kwargs or layer.disable_adapters or layer.merged or name not in layer.lora_A
            or name in layer.lora_variant or layer.lora_B[name].bias is not None or torch.is_autocast_enabled()):
        return fallback(x, *args, **kwargs)
    result = layer.base_layer(x)  # [..., out], the compute dtype
    dtype = result.dtype
    z = torch.nn.functional.linear(layer.lora_dropout[name](x).to(dtype), layer.lora_A[name].weight.to(dtype))
    up = (layer.lora_B[name].weight * layer.scaling[name]).to(dtype)  # [out, r]
    out = torch.addmm(result.reshape(-1, result.shape[-1]), z.reshape(-1, z.shape[-1]), up.t())
    return out.view(result.shape)


class FusedLoraLinear(Linear):
    """peft's LoRA ``Linear`` over a 16-bit (bf16 or fp16) ``nn.Linear``, the adapter term fused as the module doc
    says. Over an fp32 base peft's own forward runs (there is nothing to cast, and its results stay bit for bit)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.base_layer.weight.dtype not in HALF:
            return super().forward(x, *args, **kwargs)
        return fused_lora_forward(self, x, super().forward, args, kwargs)


def fuse_16bit_lora_adds(model) -> int:
    """Gives each LoRA layer over a 16-bit ``nn.Linear`` the fused adapter add (:attr:`LoraSettings.fused_16bit`);
    returns how many. The layers keep their parameters and peft type (a subclass). Layers over an fp32 base are
    converted too: they run peft's forward until the base is cast to 16 bits."""
    count = 0
    for module in model.modules():
        if type(module) is Linear and isinstance(module.base_layer, torch.nn.Linear):
            module.__class__ = FusedLoraLinear
            count += 1
    return count
