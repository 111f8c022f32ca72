"""peft's LoRA layer over a bitsandbytes 4-bit base, with the adapter term added by one matmul
(:attr:`scgrpo.models.LoraSettings.fused_4bit`). Imported only where bitsandbytes is."""

from __future__ import annotations

import torch
from peft.tuners.lora.bnb import Linear4bit


class FusedLoraLinear4bit(Linear4bit):
    """The base layer's output plus ``dropout(x) A^T (s B)^T`` as one ``addmm``, the adapter weights and ``z = x
    A^T`` in the compute dtype (as autocast runs them; the fp32 weights stay the trained ones), where peft copies
    the output, casts x to fp32, and scales an fp32 term and casts it back. Dropout runs on the input as it comes
    (its 1/(1-p) rescale then rounds in that dtype). Anything else (adapters disabled or merged, several active
    adapters, per-call adapter or variant arguments, a variant such as DoRA, an adapter bias, autocast on) takes
    peft's own forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        names = self.active_adapters
        name = names[0] if len(names) == 1 else None
        if (name is None or args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A
                or name in self.lora_variant or self.lora_B[name].bias is not None or torch.is_autocast_enabled()):
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)  # [..., out], the compute dtype
        dtype = result.dtype
        z = torch.nn.functional.linear(self.lora_dropout[name](x).to(dtype), self.lora_A[name].weight.to(dtype))
        up = (self.lora_B[name].weight * self.scaling[name]).to(dtype)  # [out, r]
        out = torch.addmm(result.reshape(-1, result.shape[-1]), z.reshape(-1, z.shape[-1]), up.t())
        return out.view(result.shape)
