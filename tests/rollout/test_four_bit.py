"""The compact decoder over a 4-bit (bitsandbytes) base: the dequantized runs equal bitsandbytes' own
dequantization bit for bit, and resident and streamed decoding sample the model the trainer multiplies by (CPU,
bitsandbytes' CPU kernels).

On a CPU with AVX-512, bitsandbytes' (0.50) CPU dequantization of an ``(m, n)`` weight reads ``n / 64`` blocks a
row, where its quantizer (and CUDA's kernel) lays 64-blocks over the flattened weight: the two agree only where a
row is whole blocks. So the reference here is the flat-block definition written out (:func:`flat_dequantized`),
checked against bitsandbytes' own where a row is whole blocks, and the models whose bitsandbytes forward is compared
have rows of whole blocks (64 and 128 inputs)."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from scgrpo.rollout import four_bit  # noqa: E402
from scgrpo.rollout.compact import CompactDecoder  # noqa: E402
from scgrpo.rollout.four_bit import Dequantizer, chunk_plan, streamed_matmul  # noqa: E402
from scgrpo.rollout.slots import SlotDecoder, slots_within  # noqa: E402
import copy  # noqa: E402

from tests.rollout.test_compact import tiny, with_lora  # noqa: E402


def packed(weight: torch.Tensor, quant_type: str = "nf4", storage=torch.uint8, nested: bool = True,
           blocksize: int = 64):
    """A quantized ``Params4bit`` of ``weight`` (CPU), as QLoRA's loader makes it."""
    param = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, compress_statistics=nested,
                              quant_type=quant_type, quant_storage=storage, blocksize=blocksize)
    return param.to("cpu")


def flat_dequantized(data: torch.Tensor, state, scales=None) -> torch.Tensor:
    """bitsandbytes' blockwise 4-bit dequantization written out: the flattened weight's codes (two a byte, the high
    nibble first) in blocks of ``state.blocksize``, each times its block's fp32 scale (``scales``, else the state's:
    for double quantisation the 8-bit scales dequantized plus the offset), rounded once to the state's dtype. The
    same on every device (CUDA's kernel, bitsandbytes' quantizer)."""
    data = data.reshape(-1)
    data = data if data.dtype == torch.uint8 else data.view(torch.uint8)
    rows, cols = state.shape
    if scales is None:
        scales = state.absmax.float()
        if state.nested:
            scales = (bnb.functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
    codes = torch.stack([data >> 4, data & 0xF], 1).reshape(-1)[: rows * cols].long()
    table = bnb.functional.get_4bit_type(state.quant_type, device="cpu").float()
    values = table[codes] * scales.cpu().repeat_interleave(state.blocksize)[: rows * cols]  # (a GPU state's too)
    return values.to(state.dtype).reshape(rows, cols)


def quantize_linears(model, quant_type: str = "nf4", storage=torch.uint8):
    """Every decoder block's linear layer as a bitsandbytes ``Linear4bit`` (the head and embeddings stay), in the
    flat layout CUDA runs: on a CPU with AVX512-BF16, ``Linear4bit``'s first forward in eval mode without gradients
    would repack its weight for a bf16 CPU gemm (bf16 inputs and scales; none on CUDA, and none on a CPU without
    AVX512-BF16), which :func:`test_dequantizer_reads_bitsandbytes_cpu_layout` covers."""
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear):
                    continue
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=child.weight.dtype, quant_type=quant_type,
                                          quant_storage=storage)
                layer.support_avx512bf16_for_cpu = False  # (bitsandbytes' CPU repacking, see above)
                layer.weight = packed(child.weight.data, quant_type, storage)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, layer)
    return model


def dequantized_copy(model4, family: str, vocab: int, **overrides):
    """The same network with each 4-bit weight replaced by bitsandbytes' dequantization of it, as plain floats."""
    plain = tiny(family, vocab, **overrides)
    plain.load_state_dict({k: v for k, v in model4.state_dict().items() if k in plain.state_dict()
                           and v.shape == plain.state_dict()[k].shape}, strict=False)
    for block4, block in zip(model4.model.layers, plain.model.layers):
        for parent4, parent in ((block4.self_attn, block.self_attn), (block4.mlp, block.mlp)):
            for name, child in parent4.named_children():
                if isinstance(child, bnb.nn.Linear4bit):
                    w = flat_dequantized(child.weight.data, child.weight.quant_state)
                    assert torch.equal(w, bnb.functional.dequantize_4bit(child.weight.data, child.weight.quant_state))
                    getattr(parent, name).weight.data.copy_(w)
    return plain


@pytest.mark.parametrize("quant_type,storage,nested", [("nf4", torch.uint8, True), ("nf4", torch.bfloat16, True),
                                                       ("fp4", torch.uint8, False)])
@pytest.mark.parametrize("shape", [(48, 128), (40, 96), (7, 64)])
def test_chunked_dequantization_is_bitsandbytes_own(quant_type, storage, nested, shape):
    torch.manual_seed(0)
    weight = packed(torch.randn(*shape, dtype=torch.bfloat16), quant_type, storage, nested)
    expected = flat_dequantized(weight.data, weight.quant_state)
    if shape[1] % weight.quant_state.blocksize == 0:  # (rows of whole blocks: bitsandbytes' own on every CPU)
        assert torch.equal(bnb.functional.dequantize_4bit(weight.data, weight.quant_state), expected)
    d = Dequantizer(weight)
    assert d.row_step() == (1 if shape[1] % 64 == 0 else 2)  # 96 columns: two rows make whole 64-blocks
    for chunk in (64, 3 * shape[1], 10**6):  # one row, a few rows, the whole weight at once
        plan = chunk_plan([d], chunk)
        assert [(s, e) for _, s, e, _ in plan][0][0] == 0 and plan[-1][2] == shape[0]
        assert all(e - s > 0 and s % d.row_step() == 0 for _, s, e, _ in plan)
        out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
        for _, start, end, at in plan:
            d.into(out[start:end], start, end)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("storage,nested", [(torch.uint8, True), (torch.bfloat16, True), (torch.uint8, False)])
def test_dequantizer_reads_bitsandbytes_cpu_layout(storage, nested):
    """A weight that bitsandbytes repacked for its CPU gemm (on a CPU with AVX512-BF16, in a ``Linear4bit``'s
    first eval forward without gradients) dequantizes to the same codes times the bf16 scales that gemm multiplies
    by, in the state's original dtype; the repacking itself runs on any CPU."""
    convert = getattr(bnb.functional, "_convert_weight_packed_for_cpu", None)
    if convert is None:
        pytest.skip("bitsandbytes without its CPU repacking")
    torch.manual_seed(0)
    weight = packed(torch.randn(96, 128), "nf4", storage, nested)  # fp32 dequantization
    codes, state = weight.data.clone(), weight.quant_state
    expected = flat_dequantized(codes, state, four_bit.block_scales(state).bfloat16().float())
    weight.data, _ = convert(weight.data, state)
    assert four_bit.cpu_packed(state) and state.dtype == torch.bfloat16 and weight.data.shape == (96, 64)
    d = Dequantizer(weight)
    assert d.dtype == torch.float32 and torch.equal(d.packed, codes.reshape(-1).view(torch.uint8))
    out = torch.full((96, 128), float("nan"))
    for _, start, end, _ in chunk_plan([d], 5 * 128):
        d.into(out[start:end], start, end)
    assert torch.equal(out, expected)


def test_streamed_matmul_lays_out_outputs_then_adapter_rows():
    torch.manual_seed(0)
    weights = [packed(torch.randn(24, 64)), packed(torch.randn(8, 64))]
    ds = [Dequantizer(w) for w in weights]
    full = torch.cat([bnb.functional.dequantize_4bit(w.data, w.quant_state) for w in weights])  # [32, 64]
    x, lora_a, bias = torch.randn(5, 64), torch.randn(3, 64), torch.randn(35)
    plan = chunk_plan(ds, 5 * 64)  # runs of 5 rows, across both weights
    scratch = torch.empty(5 * 64)
    y = streamed_matmul(x, ds, plan, scratch, lora_a, bias)
    torch.testing.assert_close(y, torch.cat([x @ full.t(), x @ lora_a.t()], 1) + bias, rtol=1e-5, atol=1e-5)
    assert y.is_contiguous() and y.shape == (5, 35)


WIDE = dict(hidden_size=64, intermediate_size=128)
"""the 4-bit decoding models' widths: rows of whole 64-blocks, where bitsandbytes' CPU forward dequantizes as its
quantizer lays the blocks (see the module's note; runs that start inside a row: the chunked test above)"""


@pytest.fixture(scope="module")
def models(tok):
    from tests.rollout.test_compact import tiny as make

    model4 = quantize_linears(make("qwen2", len(tok), **WIDE))  # q/k/v biases; fp32 compute
    plain = dequantized_copy(model4, "qwen2", len(tok), **WIDE)
    model4, plain = with_lora(model4), with_lora(plain)
    adapters = {k: v for k, v in model4.named_parameters() if "lora_" in k}
    with torch.no_grad():
        for k, v in plain.named_parameters():
            if "lora_" in k:
                v.copy_(adapters[k])
    return model4, plain


@pytest.fixture(scope="module")
def tok():
    from tests.conftest import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.padding_side = "left"
    return tokenizer


def prompts(tok):
    texts = ["hello there", "a", "what is 2+2? answer:", "zzz", "The quick brown fox"]
    return tok(texts, return_tensors="pt", padding=True)


def test_resident_and_streamed_decode_the_dequantized_model(models, tok, monkeypatch):
    model4, plain = models
    batch = prompts(tok)
    monkeypatch.setattr(four_bit, "STREAM_CHUNK", 3 * 64)  # runs of three rows: many runs per projection
    reference = CompactDecoder(plain)
    resident = CompactDecoder(model4, four_bit="resident")
    streamed = CompactDecoder(model4, four_bit="streamed")
    layers = CompactDecoder(model4, four_bit="layers")
    assert {p.mode for p in resident._projections} == {"resident"} and resident.fused
    assert {p.mode for p in streamed._projections} == {"streamed"} and not streamed.fused
    assert {p.mode for p in layers._projections} == {"layers"}
    # runs of at most 192 weights on whole 64-weight blocks: three rows of 64 inputs, one row of down's 128
    assert streamed.scratch.numel() == max(p.chunk_numel for p in streamed._projections) == 3 * 64
    assert {p.chunk_numel for p in streamed._projections} == {3 * 64, 128}
    assert min(len(p.plan) for p in streamed._projections) > 4
    # resident: the dequantized weights in the plain path, bit for bit
    for a, b in zip(resident._projections, reference._projections):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.up, b.up)
    runs = {}
    for name, decoder in (("reference", reference), ("resident", resident), ("streamed", streamed), ("layers", layers)):
        sampler = SlotDecoder(decoder, [], 2, 12, greedy=True)
        runs[name] = sampler(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(runs["resident"], runs["reference"])
    assert torch.equal(runs["streamed"], runs["reference"])
    assert torch.equal(runs["layers"], runs["reference"])  # bitsandbytes' own forward agrees


def test_streamed_logits_match_the_4bit_models_forward(models, tok):
    model4, _ = models
    batch = prompts(tok)
    decoder = CompactDecoder(model4, four_bit="streamed")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lengths = mask.sum(1)
    right = torch.stack([torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(ids, mask)])  # right-padded
    cache = decoder.new_cache(len(ids), 64)
    logits = decoder.prefill(right, lengths, torch.arange(len(ids)), cache)
    with torch.no_grad():
        expected = model4(input_ids=ids, attention_mask=mask).logits[:, -1].float()
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_streamed_runs_follow_adapter_updates_in_place(models, tok):
    model4, _ = models
    decoder = CompactDecoder(model4, four_bit="streamed")
    proj = decoder.layers[0].qkv
    lora_a, version = proj.lora_a, decoder.version
    a = model4.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    before = a.detach().clone()  # (the module's models are shared: put the adapter back bit for bit, which
    try:  # subtracting the 1.0 again would not, whatever the tests that run after this one)
        with torch.no_grad():
            a.add_(1.0)
            decoder.refresh()
            assert proj.lora_a is lora_a and decoder.version == version  # same storage: recorded graphs stay valid
            assert torch.equal(proj.lora_a[: a.shape[0]], a)
    finally:
        with torch.no_grad():
            a.copy_(before)
    decoder.refresh()


def test_budget_picks_slots_and_rejects_bad_settings():
    from scgrpo.rollout.engine import GenerationSettings

    gib = 2**30
    assert slots_within(budget=20 * gib, allocated=8 * gib, per_row=gib // 2, rows=64) == 21  # 0.9 * 12 / 0.5
    assert slots_within(budget=20 * gib, allocated=8 * gib, per_row=gib // 2, rows=64, workspace=2 * gib) == 18  # 0.9 * 10 / 0.5
    assert slots_within(budget=20 * gib, allocated=8 * gib, per_row=gib // 2, rows=10) == 10
    assert slots_within(budget=8 * gib, allocated=9 * gib, per_row=gib // 2, rows=64) == 1  # none fits: one
    with pytest.raises(ValueError, match="four_bit"):
        GenerationSettings(four_bit="fast")
    with pytest.raises(ValueError, match="memory_budget_gib"):
        GenerationSettings(memory_budget_gib=0)
    assert four_bit.resident_fits(copy=6 * gib, left=12 * gib) and not four_bit.resident_fits(copy=7 * gib, left=12 * gib)


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_release_frees_every_copy(models, mode):
    """After ``release`` (keep_workspace: false) no concatenated weight, A rows, scratch or fp32 scale is left alive
    (a view that refresh writes through would keep a whole resident copy: 2 bytes a weight of an 8B model)."""
    import gc
    import weakref

    model4, _ = models
    decoder = CompactDecoder(model4, four_bit=mode)
    held = [weakref.ref(t) for p in decoder._projections
            for t in (p.weight, p.lora_a, p.up, *(d.scales for d in p.dequantizers)) if t is not None]
    if decoder.scratch is not None:
        held.append(weakref.ref(decoder.scratch))
    assert len(held) >= 2 * len(decoder._projections)
    decoder.release()
    gc.collect()
    assert [r for r in held if r() is not None] == []
    decoder.refresh()  # rebuilt, and decodes as before
    assert all(p.weight is not None for p in decoder._projections) == (mode == "resident")


def test_new_decoder_options_free_the_old_decoders_copies_first(models, tok, monkeypatch):
    """Changing four_bit/memory_budget_gib rebuilds the decoder: the old one's resident copy is released before the
    new one is built (else both copies are held at once, and ``auto`` counts the old one as used memory)."""
    from scgrpo.rollout import compact
    from scgrpo.rollout.backends import CompactSampler
    from scgrpo.rollout.engine import GenerationSettings

    model4, _ = models
    sampler = CompactSampler()
    old = sampler.decoder(model4, GenerationSettings(four_bit="resident"), 64)["decoder"]
    assert old.layers[0].qkv.weight is not None
    seen = []

    original = compact.CompactDecoder.__init__

    def spy(self, *args, **kwargs):
        seen.append(old.layers[0].qkv.weight is None)
        original(self, *args, **kwargs)

    monkeypatch.setattr(compact.CompactDecoder, "__init__", spy)
    new = sampler.decoder(model4, GenerationSettings(four_bit="streamed"), 64)["decoder"]
    assert seen == [True] and new.four_bit == "streamed"
    sampler.release()
    assert all(d.scales is None for p in new._projections for d in p.dequantizers) and new.scratch is None


def test_auto_sizes_the_resident_copy_to_the_memory_left(models):
    """``four_bit: auto`` makes the resident copy when it takes at most half of the memory left, or a quarter when
    the kept workspace holds it (with the KV cache) through the update; on a CPU always."""
    model4, plain = models
    gib = 2**30
    assert four_bit.resident_fits(copy=6 * gib, left=12 * gib) and not four_bit.resident_fits(6 * gib, 12 * gib, kept=True)
    assert four_bit.resident_fits(copy=3 * gib, left=12 * gib, kept=True)
    for model, kept in ((model4, True), (model4, False), (plain, True)):
        decoder = CompactDecoder(model, four_bit="auto", keep_workspace=kept)
        assert decoder.four_bit == "resident"
    with pytest.raises(ValueError, match="four_bit"):
        CompactDecoder(model4, four_bit="fast")


@pytest.mark.parametrize("dtype,tol,grad_tol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 3e-2, 0.1)])
def test_fused_lora_add_on_4bit_layers_equals_pefts_branch(dtype, tol, grad_tol, monkeypatch):
    """LoraSettings.fused_4bit: the adapter term added by one addmm gives peft's outputs and gradients: in fp32 to
    rounding; over a bf16 base to bf16 rounding (the adapter weights and z rounded to bf16, as autocast runs them:
    on this tiny network with large adapters the gradients then differ by up to ~5% of their largest entry). With
    the adapters disabled both run the base layer alone."""
    import pickle

    from peft.tuners.lora.bnb import Linear4bit

    from scgrpo.models import fuse_4bit_lora_adds

    model = quantize_linears(tiny("qwen2", 64).to(dtype))
    model.is_loaded_in_4bit = True  # (as transformers marks a model it loads in 4 bits: peft's 4-bit LoRA layers)
    peft_model = with_lora(model)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()  # fp32 adapters over a 16-bit base, as get_peft_model makes them
    fused = copy.deepcopy(peft_model)
    assert fuse_4bit_lora_adds(fused) == 2 * 7  # every projection of the 2 blocks
    assert fuse_4bit_lora_adds(fused) == 0  # (already fused)
    layer = fused.base_model.model.model.layers[0].self_attn.q_proj
    assert pickle.loads(pickle.dumps(layer)).__class__ is type(layer)
    ids = torch.randint(3, 64, (2, 9))
    outputs = []
    for m in (peft_model, fused):
        m.train()
        with monkeypatch.context() as patch:
            if m is fused:  # peft's forward must not run: the fused path does it all
                patch.setattr(Linear4bit, "forward", lambda *a, **k: pytest.fail("peft's forward ran"))
            logits = m(input_ids=ids).logits.float()
            assert layer(torch.randn(3, 32, dtype=dtype)).dtype == dtype
        (logits.pow(2).mean()).backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        with torch.no_grad(), m.disable_adapter():
            base = m(input_ids=ids).logits.float()
        outputs.append((logits.detach(), grads, base))
    (ref, ref_grads, ref_base), (out, grads, base) = outputs
    assert set(grads) == set(ref_grads) and len(grads) == 2 * 7 * 2
    scale = ref.abs().max()
    assert float((out - ref).abs().max()) <= tol * scale
    assert float((ref - ref_base).abs().max()) > 10 * tol * scale  # (the adapters change the outputs)
    assert torch.equal(base, ref_base)  # adapters disabled: the base layer alone, as peft runs it
    for name, g in ref_grads.items():
        assert float((grads[name] - g).abs().max()) <= grad_tol * float(g.abs().max()) + 1e-12, name


def test_fused_lora_add_of_one_bf16_layer_is_within_a_rounding_step_of_pefts():
    """One bf16 4-bit layer with an ordinary adapter (B ~ N(0, 0.02)): the fused term differs from peft's by at most
    two bf16 steps of the output's size (the roundings of A, z and the sum), with dropout in train mode too."""
    from scgrpo.models import fuse_4bit_lora_adds
    from tests.test_lora_fused import assert_one_layer_within_two_rounding_steps

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(256, 384).to(torch.bfloat16))
    layer = bnb.nn.Linear4bit(256, 384, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.weight = packed(block[0].weight.data)
    layer.bias = torch.nn.Parameter(block[0].bias.data.clone(), requires_grad=False)
    block[0] = layer
    block.is_loaded_in_4bit = True
    assert_one_layer_within_two_rounding_steps(block, fuse_4bit_lora_adds)
