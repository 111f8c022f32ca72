"""The Triton kernels between the decode step's matmuls (:mod:`scgrpo.rollout.norms`), in fp32: the add-and-norm
with LoRA terms against the same sums in PyTorch, the gated activation, and the decode step built from them
against Hugging Face's ``generate`` (LoRA unmerged, updated in place, against the merged model; Qwen2's
biases). Runs on a GPU, or on CPU under Triton's interpreter (``tests/rollout/test_kernels.py`` runs this
module so in a subprocess)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scgrpo.rollout import kernels, norms
from scgrpo.rollout.compact import CompactDecoder, rms_norm
from scgrpo.rollout.slots import SlotDecoder
from tests.rollout.test_compact import batch, hf_greedy, tiny, tok, with_lora  # noqa: F401

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")
NEW = 5 if kernels.INTERPRET else 12


@pytest.mark.parametrize("launch", [dict(block_m=1, block_r=4, num_warps=1), dict(block_m=4, block_r=16, num_warps=2),
                                    dict(block_m=16, block_k=64, block_r=16, num_warps=4)])
@pytest.mark.parametrize("r_in,r_out,with_y", [(5, 12, True), (3, 0, True), (0, 20, False)])
def test_add_norm_equals_the_sums_in_pytorch(launch, r_in, r_out, with_y):
    torch.manual_seed(0)
    m, d = 19, 72  # rows not a multiple of 16, width not a multiple of the column step
    x = torch.randn(m, d, device=DEVICE)
    y = torch.randn(m, d + r_in, device=DEVICE) if with_y else None
    up = torch.randn(r_in, d, device=DEVICE) if r_in else None
    weight = torch.rand(d, device=DEVICE) + 0.5
    a = torch.randn(r_out, d, device=DEVICE) if r_out else None
    x_new, h = norms.add_norm(x, y, up, weight, 1e-5, a, launch=launch)

    expected_x = x
    if with_y:
        expected_x = x + y[:, :d] + (y[:, d:] @ up if r_in else 0)
    expected_h = rms_norm(expected_x, weight, 1e-5)
    assert h.shape == (m, d + r_out)
    assert torch.allclose(x_new, expected_x, atol=1e-5)
    assert (x_new is x) == (not with_y)
    assert torch.allclose(h[:, :d], expected_h, atol=1e-5, rtol=1e-5)
    if r_out:
        assert torch.allclose(h[:, d:], expected_h @ a.t(), atol=1e-4, rtol=1e-5)


def test_add_norm_rejects_a_y_of_the_wrong_width():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="ranks"):
        norms.add_norm(x, torch.zeros(2, 10, device=DEVICE), torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE),
                       1e-5)


def test_silu_mul_equals_pytorch():
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 100, device=DEVICE)
    gate, up = gate_up.chunk(2, -1)
    assert torch.allclose(norms.silu_mul(gate_up, block=32), F.silu(gate) * up, atol=1e-6)


def _decoder(model, **kwargs):
    decoder = CompactDecoder(model, block_kernels=True, **kwargs)
    assert decoder.block_kernels
    return decoder


def test_the_block_kernels_with_unmerged_lora_equal_the_merged_model(tok, batch):
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)
    qkv = decoder.layers[0].qkv
    assert qkv.inner and qkv.down.shape == (16, 64) and qkv.weight.shape == (64 + 2 * 32, 64 + 16)  # 12 ranks -> 16
    sampler = SlotDecoder(decoder, [], 2, NEW, greedy=True)
    unmerged = sampler(batch["input_ids"], batch["attention_mask"])[0]
    with torch.no_grad():  # the optimiser's step: the next rollout follows the new adapters, same storage
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    pointer = qkv.weight.data_ptr()
    decoder.refresh()
    assert qkv.weight.data_ptr() == pointer
    updated = sampler(batch["input_ids"], batch["attention_mask"])[0]
    merged = model.merge_and_unload()
    assert torch.equal(updated, hf_greedy(merged, batch, NEW))
    assert not torch.equal(updated, unmerged)  # the update changed the tokens: the test sees it


def test_the_block_kernels_with_biases_equal_generate(tok, batch):
    model = tiny("qwen2", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)
    assert decoder.layers[0].qkv.down is None and decoder.layers[0].qkv.bias is not None
    tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model, batch, NEW))


def test_qwen3_keeps_the_compiled_step(tok):
    model = tiny("qwen3", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    decoder = CompactDecoder(model.to(DEVICE), block_kernels=True)
    assert not decoder.block_kernels and not decoder.layers[0].qkv.inner
