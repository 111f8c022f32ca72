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


ROWS_1, ROWS_4 = dict(block_m=1, block_r=4, num_warps=1), dict(block_m=4, block_r=16, num_warps=2)
TILES = dict(block_m=16, block_k=64, block_r=16, num_warps=4)  # 16 ranks a program: 20 ranks take two


@pytest.mark.parametrize("launch,r_in,r_out,with_y", [
    (ROWS_1, 5, 12, True), (ROWS_4, 5, 12, True), (TILES, 5, 12, True), (ROWS_4, 3, 0, True), (ROWS_1, 0, 20, False),
    (TILES, 0, 20, False), (TILES, 2, 20, True), (ROWS_4, 2, 20, True)])
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


def test_add_norm_rejects_a_y_of_the_wrong_width_and_an_up_without_y():
    x, up, w = torch.zeros(2, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="ranks"):
        norms.add_norm(x, torch.zeros(2, 10, device=DEVICE), up, w, 1e-5)
    with pytest.raises(ValueError, match="without"):
        norms.add_norm(x, None, up, w, 1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
@pytest.mark.parametrize("rows", [19, 64, 512])
def test_add_norm_in_bf16_rounds_as_the_model_does(rows):
    """x + y bit for bit against PyTorch doing Hugging Face's operations in bf16 (each kernel setting), the
    norm's output but for rare single roundings, z within one rounding of the product of the rounded h."""
    torch.manual_seed(0)
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    d, r_in, r_out = 576, 16, 48
    x, y = torch.randn(rows, d, **bf16), torch.randn(rows, d + r_in, **bf16)
    # z and up of small integers (up scaled by 2^-6): the LoRA term's fp32 sum is exact in any order
    y[:, d:] = torch.randint(-3, 4, (rows, r_in), device=DEVICE).to(torch.bfloat16)
    up = torch.randint(-3, 4, (r_in, d), device=DEVICE).to(torch.bfloat16) / 64
    a = torch.randn(r_out, d, **bf16) * 0.1
    weight = torch.rand(d, **bf16) + 0.5
    lora = (y[:, d:].float() @ up.float()).to(torch.bfloat16)
    expected_x = x + (y[:, :d] + lora)
    expected_h = rms_norm(expected_x, weight, 1e-5)
    expected_z = expected_h.float() @ a.float().t()
    for launch in (None, dict(block_m=1, block_r=16, num_warps=4), dict(block_m=16, block_k=128, block_r=16, num_warps=4)):
        x_new, h = norms.add_norm(x, y, up, weight, 1e-5, a, launch=launch)
        assert torch.equal(x_new, expected_x), launch
        # the norm's fp32 sum of squares in another order: a rare rounding of h one step apart, no more
        off = h[:, :d] != expected_h
        assert off.float().mean() < 1e-3, launch
        assert torch.allclose(h[:, :d].float(), expected_h.float(), rtol=2 ** -7, atol=0), launch
        assert torch.allclose(h[:, d:].float(), expected_z, rtol=2 ** -7, atol=1e-2), launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_pytorch(dtype):
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
    torch.manual_seed(0)
    gate_up = torch.randn(7, 2 * 100, device=DEVICE).to(dtype)
    gate, up = gate_up.chunk(2, -1)
    got, expected = norms.silu_mul(gate_up, block=32), F.silu(gate) * up
    assert torch.equal(got, expected) if dtype == torch.bfloat16 else torch.allclose(got, expected, atol=1e-6)


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
    before = qkv.weight.clone()
    with torch.no_grad():  # the optimiser's step: the next rollout follows the new adapters, same storage
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    tensors = lambda: [t.data_ptr() for layer in decoder.layers  # noqa: E731
                       for t in (layer.qkv.weight, layer.qkv.down, layer.o.weight, layer.o.up, layer.gate_up.down)]
    pointers = tensors()
    decoder.refresh()
    assert tensors() == pointers
    updated = sampler(batch["input_ids"], batch["attention_mask"])[0]
    merged = model.merge_and_unload()
    assert torch.equal(updated, hf_greedy(merged, batch, NEW))
    assert torch.equal(qkv.weight[:, :64], before[:, :64]) and not torch.equal(qkv.weight[:, 64:], before[:, 64:])


def test_some_layers_adapted_with_their_own_ranks_equal_the_merged_model(tok, batch):
    from peft import LoraConfig, get_peft_model

    base = tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                        rank_pattern={"v_proj": 2, "down_proj": 6}, init_lora_weights=False)
    model = get_peft_model(base, config).to(DEVICE).eval()
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)
    layer = decoder.layers[0]
    assert layer.qkv.down.shape[0] == 8 and layer.o.up is None and layer.down.up.shape[0] == 6  # 4 + 2 -> 8
    tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model.merge_and_unload(), batch, NEW))


def test_a_failing_kernel_falls_back_to_the_uncompiled_step(tok, batch, monkeypatch, caplog):
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(norms, "add_norm", broken)
    with caplog.at_level("WARNING", logger="scgrpo.rollout.compact"):
        tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert decoder.compile_failed and not decoder.block_kernels
    assert "block kernels failed (RuntimeError: out of resources" in caplog.text
    assert torch.equal(tokens, hf_greedy(model.merge_and_unload(), batch, NEW))


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
