"""peft's LoRA layer over a bitsandbytes 4-bit base, with the adapter term added by one matmul
(:attr:`scgrpo.models.LoraSettings.fused_4bit`). Imported only where bitsandbytes is."""

from __future__ import annotations

import torch
from peft.tuners.lora.bnb import Linear4bit

from scgrpo.lora_fused import fused_lora_forward


class FusedLoraLinear4bit(Linear4bit):
    """The base layer's output plus ``dropout(x) A^T (s B)^T`` as one ``addmm``, the adapter weights and ``z = x
    A^T`` in the compute dtype (as autocast runs them; the fp32 weights stay the trained ones), where peft copies
    the output, casts x to fp32, and scales an fp32 term and casts it back. Dropout runs on the input as it comes
    (its 1/(1-p) rescale then rounds in that dtype). Anything else (adapters disabled or merged, several active
    adapters, per-call adapter or variant arguments, a variant such as DoRA, an adapter bias, autocast on) takes
    peft's own forward."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return fused_lora_forward(self, x, super().forward, args, kwargs)
