"""Reading a Hugging Face (or peft) Llama-family model for the compact forward: its base model and layers, its
LoRA adapters, which weights are plain float tensors, and whether the compact forward can decode it exactly."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def inner_model(model):
    """The causal language model inside a peft wrapper (``model`` itself when it has none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def base_layer(module):
    """The layer a peft adapter wraps (``module`` itself when it wraps none)."""
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def is_plain(weight: Tensor) -> bool:
    """A float weight used as it is (not a bitsandbytes 4/8-bit parameter, which may even have a float dtype
    when its packed storage is bf16)."""
    if hasattr(weight, "quant_state") or hasattr(weight, "SCB") or type(weight).__name__ in ("Params4bit", "Int8Params"):
        return False
    if weight.element_size() == 1:  # float8 checkpoints keep their scales elsewhere
        return False
    return weight.dtype.is_floating_point and type(weight.data) is torch.Tensor


def lora_parts(module) -> list[tuple[Tensor, Tensor, float]]:
    """(A ``[r, in]``, B ``[out, r]``, scale) of each active adapter of a peft LoRA layer; [] for a plain one.
    (Read through the modules' own dicts: a refresh asks this of every linear layer before each rollout, and
    ``nn.Module.__getattr__`` would cost more host time than the copies.)"""
    children = module.__dict__.get("_modules", {})
    lora_a, lora_b = children.get("lora_A"), children.get("lora_B")
    if lora_a is None or lora_b is None or getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    parts = []
    for name in module.active_adapters:
        a = lora_a._modules.get(name)
        if a is not None:
            parts.append((a._parameters["weight"], lora_b._modules[name]._parameters["weight"],
                          float(module.scaling[name])))
    return parts


def model_structure(model) -> tuple:
    """What a kept :class:`CompactDecoder` holds on to, as a key that changes when the model is rebuilt around it:
    each module and parameter object (an adapter added or unloaded, a state dict loaded with ``assign``), each
    parameter's dtype, device and shape (``.to()``, a resized embedding), and each adapted layer's active adapters and
    whether they are off. Values changed in place leave it as it is (the decoder's refresh reads them)."""
    parts = []
    for module in model.modules():
        own = vars(module)
        parts.append((id(module), str(own.get("_active_adapter")), own.get("_disable_adapters")))
        parts.extend((id(p), p.dtype, p.device, p.shape) for p in module._parameters.values() if p is not None)
    return tuple(parts)


def unsupported_reason(model, max_length: int) -> Optional[str]:
    """Why :class:`CompactDecoder` cannot decode ``model`` exactly up to ``max_length`` tokens, or None."""
    causal_lm = inner_model(model)
    config = causal_lm.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} (compact forward: {', '.join(FAMILIES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, None)
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return f"RoPE type {rotary.rope_type!r} (frequencies change with length)"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = any(t == "sliding_attention" for t in layer_types) or (kind == "mistral" and window)
    if uses_window and window and window < max_length:
        return f"sliding-window attention ({window} tokens) within the {max_length}-token rollouts"
    # (every call walks the model, on a peft model over a thousand modules: each class's ancestry is read once, and
    # peft's attributes straight from the module's dicts, not through nn.Module's slow lookup of a missing name)
    kinds, dtensors = set(), False
    for module in causal_lm.modules():
        kinds.add(type(module))
        dora = vars(module).get("use_dora")
        if dora and any(dora.values()):
            return "DoRA adapters"
        variants = vars(module).get("lora_variant")
        if variants:  # (peft's other variants: aLoRA, Arrow, ... are not a plain low-rank add)
            return f"a LoRA variant ({type(next(iter(variants.values()))).__name__})"
        lora_b = module._modules.get("lora_B")
        if lora_b is not None and any(getattr(b, "bias", None) is not None for b in lora_b.values()):
            return "LoRA with biases"
        dtensors = dtensors or any(p is not None and type(p.data) is not torch.Tensor
                                   and p.data.__class__.__name__ == "DTensor" for p in module._parameters.values())
    # FSDP swaps parameter objects between rollouts: decode through the HF forward
    if any(cls.__name__ in ("FSDPModule", "FullyShardedDataParallel") for kind in kinds for cls in kind.__mro__):
        return "sharded (FSDP) weights"
    if dtensors:
        return "sharded (DTensor) weights"
    lm_head = causal_lm.get_output_embeddings()
    if lora_parts(lm_head) or not is_plain(base_layer(lm_head).weight):
        return "an adapted or quantised output head"
    if not is_plain(backbone.embed_tokens.weight) or hasattr(backbone.embed_tokens, "lora_embedding_A"):
        return "an adapted or quantised embedding"
    return None
