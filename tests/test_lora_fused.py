"""LoraSettings.fused_16bit: peft's LoRA layers over a bf16 base add the adapter term by one addmm in bf16."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear

from scgrpo.lora_fused import FusedLoraLinear
from scgrpo.models import fuse_16bit_lora_adds
from tests.rollout.test_compact import tiny


def lora_model(dtype: torch.dtype, dropout: float = 0.0):
    model = get_peft_model(tiny("qwen2", 64).to(dtype), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                    lora_dropout=dropout))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a large update: the adapters change the outputs visibly
    return model


def run(model, ids: torch.Tensor, seed: int = 3):
    model.train()
    torch.manual_seed(seed)  # (the same dropout masks)
    logits = model(input_ids=ids).logits.float()
    logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits.float()
    return logits.detach(), grads, base


def test_fused_bf16_lora_is_pefts_forward_within_bf16_rounding(monkeypatch):
    """Over a bf16 base (fp32 adapters, as get_peft_model makes them) the fused layers give peft's outputs and
    gradients within bf16 rounding, without running peft's forward; with adapters disabled, the base alone. bf16
    rounding: measured against the same network in fp32, the fused outputs are no further off than twice peft's."""
    reference = lora_model(torch.bfloat16)
    exact = copy.deepcopy(reference).float()
    assert all(p.dtype == torch.float32 for n, p in reference.named_parameters() if "lora_" in n)
    fused = copy.deepcopy(reference)
    assert fuse_16bit_lora_adds(fused) == 2 * 7  # every projection of the 2 blocks
    assert fuse_16bit_lora_adds(fused) == 0  # (already fused)
    layer = fused.base_model.model.model.layers[0].mlp.up_proj
    assert type(layer) is FusedLoraLinear and pickle.loads(pickle.dumps(layer)).__class__ is FusedLoraLinear
    ids = torch.randint(3, 64, (2, 9))
    ref, ref_grads, ref_base = run(reference, ids)
    with monkeypatch.context() as patch:  # peft's forward may run only with the adapters disabled
        patch.setattr(Linear, "forward", lambda self, *a, **k: (
            self.base_layer(*a, **k) if self.disable_adapters else pytest.fail("peft's forward ran")))
        logits, grads, base = run(fused, ids)
    scale = float(ref.abs().max())
    truth = run(exact, ids)[0]
    peft_error, fused_error = float((ref - truth).abs().max()), float((logits - truth).abs().max())
    assert 0 < fused_error <= 2 * peft_error
    assert float((ref - ref_base).abs().max()) > 0.3 * scale  # (the adapters matter)
    assert torch.equal(base, ref_base)
    assert set(grads) == set(ref_grads) and len(grads) == 2 * 7 * 2
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32  # the trained weights stay fp32
        assert float((grads[name] - g).abs().max()) <= 0.1 * float(g.abs().max()) + 1e-12, name


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_lora_over_an_fp32_base_is_pefts_bit_for_bit(dropout):
    """An fp32 base (the CPU runs) runs peft's forward: outputs and gradients equal bit for bit."""
    reference = lora_model(torch.float32, dropout)
    fused = copy.deepcopy(reference)
    assert fuse_16bit_lora_adds(fused) == 2 * 7
    ids = torch.randint(3, 64, (3, 7))
    (ref, ref_grads, ref_base), (out, grads, base) = run(reference, ids), run(fused, ids)
    assert torch.equal(out, ref) and torch.equal(base, ref_base)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def assert_one_layer_within_two_rounding_steps(block: torch.nn.Module, fuse) -> None:
    """``block``'s one bf16 layer ``"0"`` with an ordinary adapter (B ~ N(0, 0.02)), without and with dropout, in
    train mode: the fused term (``fuse`` converts the layer) differs from peft's by at most two bf16 steps of the
    output's size (the roundings of A, z and the sum)."""
    for dropout in (0.0, 0.3):
        model = get_peft_model(block, LoraConfig(r=16, lora_alpha=32, target_modules=["0"], lora_dropout=dropout))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02)
        model.train()
        x = torch.randn(5, 256, dtype=torch.bfloat16)
        torch.manual_seed(1)
        expected = model(x)
        fused = copy.deepcopy(model)
        assert fuse(fused) == 1
        torch.manual_seed(1)  # (the same dropout mask)
        out = fused(x)
        assert out.dtype == torch.bfloat16
        step = 2.0 ** -7 * float(expected.abs().max())  # one bf16 step at the output's largest size
        assert float((out.float() - expected.float()).abs().max()) <= 2 * step
        block = model.unload()


def test_one_bf16_layer_with_dropout_is_within_two_rounding_steps():
    torch.manual_seed(0)
    assert_one_layer_within_two_rounding_steps(torch.nn.Sequential(torch.nn.Linear(256, 384).to(torch.bfloat16)),
                                               fuse_16bit_lora_adds)
