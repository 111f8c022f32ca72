"""The Triton kernels between the decode step's matmuls (:mod:`scgrpo.rollout.norms`) and the projection with its
LoRA term inside (:mod:`scgrpo.rollout.lora_matmul`), in fp32: the add-and-norm with LoRA terms against the same
sums in PyTorch, the gated activation, the LoRA matmul against its two products, the prefill built from them
against the eager layers, and the decode step against Hugging Face's ``generate`` (LoRA unmerged, in the matmuls
or after them, updated in place, against the merged model; Qwen2's biases). Runs on a GPU, or on CPU under Triton's interpreter (``tests/rollout/test_kernels.py`` runs this
module so in a subprocess)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scgrpo.rollout import kernels, lora_matmul, norms
from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.layers import rms_norm
from scgrpo.rollout.slots import SlotDecoder
from tests.rollout.test_compact import _forward_states, batch, hf_greedy, tiny, tok, with_lora  # noqa: F401

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")
NEW = 3 if kernels.INTERPRET else 12


ROWS_1, ROWS_4 = dict(block_m=1, num_warps=1), dict(block_m=4, num_warps=2)


@pytest.mark.parametrize("launch,r,with_y", [(ROWS_1, 5, True), (ROWS_4, 5, True), (ROWS_4, 0, True), (ROWS_1, 0, False)])
def test_add_norm_equals_the_sums_in_pytorch(launch, r, with_y):
    torch.manual_seed(0)
    m, d = 19, 72  # rows not a multiple of the rows a program takes, width not a power of two
    x = torch.randn(m, d, device=DEVICE)
    y = torch.randn(m, d + r, device=DEVICE) if with_y else None
    up = torch.randn(r, d, device=DEVICE) if r else None
    weight = torch.rand(d, device=DEVICE) + 0.5
    x_new, h = norms.add_norm(x, y, up, weight, 1e-5, launch=launch)

    expected_x = x
    if with_y:
        expected_x = x + y[:, :d] + (y[:, d:] @ up if r else 0)
    assert h.shape == (m, d)
    assert torch.allclose(x_new, expected_x, atol=1e-5)
    assert (x_new is x) == (not with_y)
    assert torch.allclose(h, rms_norm(expected_x, weight, 1e-5), atol=1e-5, rtol=1e-5)


def test_add_norm_rejects_a_y_of_the_wrong_width_and_an_up_without_y():
    x, up, w = torch.zeros(2, 8, device=DEVICE), torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="ranks"):
        norms.add_norm(x, torch.zeros(2, 10, device=DEVICE), up, w, 1e-5)
    with pytest.raises(ValueError, match="without"):
        norms.add_norm(x, None, up, w, 1e-5)


def _small_ints(*shape, scale=1.0):
    """bf16 values whose products and sums are exact in fp32 in any order."""
    return (torch.randint(-3, 4, shape, device=DEVICE).float() * scale).to(torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
@pytest.mark.parametrize("rows", [19, 64, 512])
def test_add_norm_in_bf16_rounds_as_the_model_does(rows):
    """x + y bit for bit against PyTorch doing peft's and Hugging Face's operations in bf16 (the base output plus
    the fp32 LoRA term rounded once, then the residual add), for each kernel setting; the norm's output but for
    rare single roundings."""
    torch.manual_seed(0)
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)
    d, r = 576, 16
    x, y = torch.randn(rows, d, **bf16), torch.randn(rows, d + r, **bf16)
    y[:, d:] = _small_ints(rows, r)
    up = _small_ints(r, d, scale=2 ** -6)
    weight = torch.rand(d, **bf16) + 0.5
    expected_x = x + (y[:, :d].float() + y[:, d:].float() @ up.float()).to(torch.bfloat16)
    expected_h = rms_norm(expected_x, weight, 1e-5)
    for launch in (None, dict(block_m=1, num_warps=4), dict(block_m=4, num_warps=8)):
        x_new, h = norms.add_norm(x, y, up, weight, 1e-5, launch=launch)
        assert torch.equal(x_new, expected_x), launch
        # the norm's fp32 sum of squares in another order: a rare rounding of h one step apart, no more
        assert (h != expected_h).float().mean() < 1e-3, launch
        assert torch.allclose(h.float(), expected_h.float(), rtol=2 ** -7, atol=0), launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks,launch", [((0, 0), dict(block=32)), ((3, 5), None), ((4, 0), dict(block_m=16, block=64))])
def test_silu_mul_equals_pytorch(dtype, ranks, launch):
    """silu(gate + z_g (s B_g)^T) * (up + z_u (s B_u)^T), each sum rounded once, as peft's fp32 adapters add."""
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
    torch.manual_seed(0)
    m, inner, r = 7, 100, sum(ranks)
    gate_up = torch.randn(m, 2 * inner + r, device=DEVICE).to(dtype)
    lora = None
    if r:
        gate_up[:, 2 * inner:] = _small_ints(m, r).to(dtype)
        lora = torch.zeros(r, 2 * inner, device=DEVICE, dtype=dtype)  # block-diagonal, as Projection.up
        lora[: ranks[0], :inner] = _small_ints(ranks[0], inner, scale=2 ** -6).to(dtype)
        lora[ranks[0]:, inner:] = _small_ints(ranks[1], inner, scale=2 ** -6).to(dtype)
    base = gate_up[:, : 2 * inner].float()
    if r:
        base = base + gate_up[:, 2 * inner:].float() @ lora.float()
    gate, up = base.to(dtype).chunk(2, -1)
    got, expected = norms.silu_mul(gate_up, lora, ranks, launch=launch), F.silu(gate) * up
    assert torch.equal(got, expected) if dtype == torch.bfloat16 else torch.allclose(got, expected, atol=1e-6)


def test_silu_mul_rejects_ranks_that_do_not_fit():
    gate_up = torch.zeros(2, 2 * 8 + 3, device=DEVICE)
    with pytest.raises(ValueError, match="up"):
        norms.silu_mul(gate_up, torch.zeros(3, 16, device=DEVICE), (2, 2))
    with pytest.raises(ValueError, match="up"):
        norms.silu_mul(gate_up, None, (2, 1))


@pytest.mark.parametrize("launch", [None, dict(block_m=32, block=32, num_warps=2)])
def test_lora_add_adds_each_layers_term_in_place(launch):
    """q/k/v's block-diagonal B's: each output column gets its own layer's ranks' term; z's columns stay."""
    torch.manual_seed(3)
    m, sizes, ranks = 19, (40, 24, 24), (3, 0, 5)
    out, r = sum(sizes), sum(ranks)
    y = torch.randn(m, out + r, device=DEVICE)
    up = torch.zeros(r, out, device=DEVICE)
    up[:3, :40], up[3:, 64:] = torch.randn(3, 40, device=DEVICE), torch.randn(5, 24, device=DEVICE)
    expected = torch.cat([y[:, :out] + y[:, out:] @ up, y[:, out:]], dim=1)
    got = norms.lora_add(y, up, launch=launch)
    assert got is y and torch.allclose(y, expected, atol=1e-5)
    with pytest.raises(ValueError, match="out"):
        norms.lora_add(y[:, :-1], up)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
def test_lora_add_in_bf16_rounds_the_sum_once():
    torch.manual_seed(3)
    y = torch.randn(64, 96 + 16, device=DEVICE, dtype=torch.bfloat16)
    y[:, 96:] = _small_ints(64, 16)
    up = _small_ints(16, 96, scale=2 ** -6)
    expected = (y[:, :96].float() + y[:, 96:].float() @ up.float()).to(torch.bfloat16)
    assert torch.equal(norms.lora_add(y, up)[:, :96], expected)


def _lora_projection(sizes, ranks, k, bias, dtype=torch.float32):
    """A fused projection's tensors as :class:`~scgrpo.rollout.projection.Projection` lays them out: ``[W; A]``,
    the block-diagonal scaled B^T's, and its ``blocks``."""
    out, r = sum(sizes), sum(ranks)
    weight = torch.randn(out + r, k, device=DEVICE, dtype=dtype)
    up = torch.zeros(r, out, device=DEVICE, dtype=dtype)
    blocks, start, col = [], 0, 0
    for size, rank in zip(sizes, ranks):
        up[col:col + rank, start:start + size] = torch.randn(rank, size, device=DEVICE, dtype=dtype)
        blocks.append((start, start + size, tuple(range(col, col + rank))))
        start, col = start + size, col + rank
    b = torch.randn(out + r, device=DEVICE, dtype=dtype) if bias else None
    return weight, b, up, tuple(blocks)


@pytest.mark.parametrize("launch,bias", [
    (dict(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=1), True),  # q, k, v each own ranks
    (dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=1), False),  # 96 not a multiple: all ranks
    # W's rows and the A rows as one operand of one dot a step, split after the loop
    (dict(block_m=16, block_n=32, block_k=32, num_warps=2, num_stages=1, one_dot=True), True),
    (dict(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=1, one_dot=True), False),  # all ranks
])
def test_lora_matmul_equals_the_two_products_in_pytorch(launch, bias):
    torch.manual_seed(5)
    m, k, sizes, ranks = 19, 72, (64, 32, 32), (3, 2, 5)
    out = sum(sizes)
    weight, b, up, blocks = _lora_projection(sizes, ranks, k, bias)
    x = torch.randn(m, k, device=DEVICE)
    expected = x @ weight[:out].t() + x @ weight[out:].t() @ up + (b[:out] if bias else 0)
    got = lora_matmul.lora_matmul(x, weight, b, up, blocks, launch=launch)
    assert got.shape == (m, out) and torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    plain = lora_matmul.lora_matmul(x, weight[:out], None, None, launch=launch)  # no adapters: the base alone
    assert torch.allclose(plain, x @ weight[:out].t(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="weight"):
        lora_matmul.lora_matmul(x[:, :-1], weight, b, up)


def test_lora_matmul_reads_each_layers_own_ranks_only_where_they_are_laid_out_so():
    qkv = ((0, 64, (0, 1, 2)), (64, 96, ()), (96, 128, (3, 4)))
    assert lora_matmul.rank_spans(5, qkv, 32) == ([64, 96], [3, 0, 2], True)
    assert lora_matmul.rank_spans(4, ((0, 64, (0, 1)), (64, 128, (2, 3))), 32) == ([64, 128], [2, 2, 0], True)
    everything = ([0, 0], [5, 0, 0], False)
    assert lora_matmul.rank_spans(5, qkv, 64) == everything  # 96 is not on a tile boundary
    for blocks in (((0, 64, (1, 2, 3)), (64, 96, ()), (96, 128, (4, 0))),  # not consecutive from 0
                   ((0, 64, (0, 1, 2)), (64, 96, ()), (96, 128, (2, 3))),  # overlapping
                   ((0, 64, (0, 1, 2)), (64, 96, ()), (96, 128, (4,)))):  # a gap
        assert lora_matmul.rank_spans(5, blocks, 32) == everything
    assert lora_matmul.rank_spans(5, ((0, 64, (0, 1, 2, 3, 4)),), 32) == everything  # one layer


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bf16 on a GPU (the interpreter's bf16 arithmetic is not exact)")
@pytest.mark.parametrize("one_dot", [False, True])
def test_lora_matmul_in_bf16_rounds_as_the_two_launches_do(one_dot):
    """The base (with bias) rounded, z rounded, the LoRA term added in fp32, the sum rounded once: the same bits
    as the matmul followed by :func:`norms.lora_add`."""
    torch.manual_seed(5)
    sizes, ranks = (576, 192, 192), (16, 16, 16)
    weight, b, up, blocks = _lora_projection(sizes, ranks, 576, True, torch.bfloat16)
    # integers: every sum exact in fp32 in any order, many of them too wide for bf16 (so the roundings show)
    weight, b = _small_ints(*weight.shape), _small_ints(*b.shape)
    b[960:] = 0  # (a projection has no bias on its A rows)
    up = torch.where(up != 0, _small_ints(*up.shape, scale=2 ** -4), 0)
    x = _small_ints(64, 576, scale=4)
    two = norms.lora_add(F.linear(x, weight, b), up)[:, :960]
    assert torch.equal(lora_matmul.lora_matmul(x, weight, b, up, blocks, launch=dict(one_dot=one_dot)), two)


def _decoder(model, **kwargs):
    decoder = CompactDecoder(model, block_kernels=True, **kwargs)
    assert decoder.block_kernels
    return decoder


def test_scaled_copy_writes_each_view_with_its_own_strides_and_nothing_else():
    torch.manual_seed(0)
    up = torch.zeros(7, 12, device=DEVICE)  # a block-diagonal up: B's [out, r] into transposed blocks
    weight = torch.zeros(10, 6, device=DEVICE)  # rows of A
    b1, b2 = torch.randn(5, 3, device=DEVICE), torch.randn(7, 4, device=DEVICE)
    a = torch.randn(6, 2, device=DEVICE).t()  # a non-contiguous source
    wide = torch.randn(3, 1100, device=DEVICE)  # more elements than one program's block
    far = torch.zeros(3, 1100, device=DEVICE)
    norms.scaled_copy([(up[0:3, 0:5].t(), b1, 2.0), (up[3:7, 5:12].t(), b2, -0.5), (weight[4:6], a, 1.0),
                       (far, wide, 3.0)])
    expected = torch.zeros(7, 12, device=DEVICE)
    expected[0:3, 0:5], expected[3:7, 5:12] = 2.0 * b1.t(), -0.5 * b2.t()
    assert torch.equal(up, expected)
    assert torch.equal(weight[4:6], a) and not weight[:4].any() and not weight[6:].any()
    assert torch.equal(far, 3.0 * wide)
    tables: dict = {}  # a kept table follows the values in place, and is rebuilt for another tensor
    norms.scaled_copy([(up[0:3, 0:5].t(), b1, 2.0)], tables=tables)
    b1.mul_(-1.0)
    norms.scaled_copy([(up[0:3, 0:5].t(), b1, 2.0)], tables=tables)
    assert torch.equal(up[0:3, 0:5], 2.0 * b1.t()) and len(tables) == 1
    other = torch.randn(5, 3, device=DEVICE)
    norms.scaled_copy([(up[0:3, 0:5].t(), other, 2.0)], tables=tables)
    assert torch.equal(up[0:3, 0:5], 2.0 * other.t())


def test_scaled_copy_rounds_fp32_adapters_once_into_the_model_dtype():
    torch.manual_seed(0)
    src = torch.randn(9, 4, device=DEVICE)
    if DEVICE.type != "cuda":  # (the interpreter's bf16 rounding is not the GPU's: products bf16 holds exactly)
        src = torch.randint(-20, 21, (9, 4), device=DEVICE).float()
    dst = torch.zeros(4, 9, dtype=torch.bfloat16, device=DEVICE)
    norms.scaled_copy([(dst.t(), src, 0.75)])
    assert torch.equal(dst.t(), (src * 0.75).to(torch.bfloat16))
    with pytest.raises(ValueError, match="same shape"):
        norms.scaled_copy([(dst, src, 1.0)])


@pytest.mark.parametrize("compile_layers", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="compiled LoRA-free norms between the kernels on a GPU"))])
def test_the_block_kernels_with_unmerged_lora_equal_the_merged_model(tok, batch, compile_layers, monkeypatch):
    """The LoRA terms inside the matmuls but down's (128 inputs, over :attr:`lora_matmul_width`), which the next
    add-and-norm adds (every term inside: the test below; every term after: the failing-kernel test). With
    compile on, the add-and-norms and the gated activation without LoRA terms are compiled."""
    model = with_lora(tiny("llama", len(tok), hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1)).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model, compile_layers=compile_layers)
    assert (decoder._plain_norm is not None) == compile_layers
    decoder.lora_matmul_width = 64
    widths = set()
    inside = lora_matmul.lora_matmul
    monkeypatch.setattr(lora_matmul, "lora_matmul", lambda x, *a, **k: widths.add(x.shape[1]) or inside(x, *a, **k))
    qkv = decoder.layers[0].qkv
    assert qkv.ranks == (4, 4, 4) and qkv.up.shape == (12, 128) and qkv.weight.shape == (128 + 12, 64)
    sampler = SlotDecoder(decoder, [], 2, NEW, greedy=True)
    before, before_up = qkv.weight.clone(), qkv.up.clone()
    with torch.no_grad():  # the optimiser's step: the next rollout follows the new adapters, same storage
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param) * 0.5)
    tensors = lambda: [t.data_ptr() for layer in decoder.layers  # noqa: E731
                       for t in (layer.qkv.weight, layer.qkv.up, layer.o.weight, layer.o.up, layer.gate_up.up)]
    pointers = tensors()
    decoder.refresh()
    assert tensors() == pointers
    updated = sampler(batch["input_ids"], batch["attention_mask"])[0]
    assert decoder.prefill_kernels and not decoder.compile_failed  # (no silent fallback)
    assert widths == {64}  # (q/k/v, o and gate/up's inputs)
    keeping = SlotDecoder(decoder, [], 2, NEW, greedy=True, keep_states=True)  # the states the head read, kept
    assert torch.equal(keeping(batch["input_ids"], batch["attention_mask"])[0], updated)
    torch.testing.assert_close(keeping.states, _forward_states(model, batch, updated).cpu(), atol=1e-4, rtol=1e-4)
    merged = model.merge_and_unload()
    assert torch.equal(updated, hf_greedy(merged, batch, NEW))
    assert torch.equal(qkv.weight, before) and not torch.equal(qkv.up, before_up)  # only the B's moved


def test_some_layers_adapted_with_their_own_ranks_equal_the_merged_model(tok, batch):
    from peft import LoraConfig, get_peft_model

    base = tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                        rank_pattern={"v_proj": 2, "down_proj": 6}, init_lora_weights=False)
    model = get_peft_model(base, config).to(DEVICE).eval()
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)
    layer = decoder.layers[0]
    assert layer.qkv.ranks == (4, 0, 2) and layer.o.up is None and layer.gate_up.ranks == (4, 0)
    assert layer.down.up.shape[0] == 6
    tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model.merge_and_unload(), batch, NEW))


def _random_biases(model):
    with torch.no_grad():  # (Hugging Face initialises biases to zero: a test of them needs others)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
    return model


@pytest.mark.parametrize("family,adapters", [("llama", "all"), ("llama", None), ("qwen2", "some")])
def test_the_prefill_with_block_kernels_equals_the_eager_layers(tok, family, adapters):
    """Logits and cache entries of right-padded prompts of three lengths: LoRA on every projection, none, or some
    (Qwen2, with q/k/v biases)."""
    from peft import LoraConfig, get_peft_model

    model = _random_biases(tiny(family, len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1))
    if adapters == "all":
        model = with_lora(model)
    elif adapters == "some":
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "up_proj"],
                                                 init_lora_weights=False)).eval()
    model = model.to(DEVICE)
    decoder = _decoder(model)
    torch.manual_seed(4)
    ids = torch.randint(3, len(tok), (3, 7), device=DEVICE)
    lengths = torch.tensor([7, 2, 5], device=DEVICE)
    slots = torch.tensor([2, 0, 3], device=DEVICE)
    caches = []
    for kernels_on in (True, False):
        decoder.prefill_kernels = kernels_on
        cache = decoder.new_cache(4, 16)
        caches.append((decoder.prefill(ids, lengths, slots, cache), cache))
        assert decoder.prefill_kernels == kernels_on  # (a failing kernel would have fallen back)
    (got, got_cache), (expected, expected_cache) = caches
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    for row, n in zip(slots.tolist(), lengths.tolist()):  # each prompt's own entries (padding's are unread)
        assert torch.allclose(got_cache[:, :, row, :, :n], expected_cache[:, :, row, :, :n], atol=1e-5)


@pytest.mark.parametrize("failing", ["add_norm", "lora_matmul"])
def test_a_failing_kernel_falls_back_to_a_path_that_computes_the_same(tok, batch, monkeypatch, caplog, failing):
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(norms if failing == "add_norm" else lora_matmul, failing, broken)
    with caplog.at_level("WARNING", logger="scgrpo.rollout.compact"):
        tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    if failing == "add_norm":  # every block kernel off: the uncompiled step, the eager prefill
        assert decoder.compile_failed and not decoder.block_kernels and not decoder.prefill_kernels
        assert "block kernels failed (RuntimeError: out of resources" in caplog.text
        assert "the prefill's block kernels failed (RuntimeError" in caplog.text
    else:  # only the LoRA matmul off (at its first failure): the terms added by the kernels after the matmuls
        # (every layer's: this is the test of that path with adapters on every projection)
        assert decoder.block_kernels and not decoder.compile_failed and decoder.lora_matmul_rows == 0
        assert caplog.text.count("LoRA matmul kernel failed (RuntimeError: out of resources") == 1
    assert torch.equal(tokens, hf_greedy(model.merge_and_unload(), batch, NEW))


def test_a_failing_adapter_copy_kernel_falls_back_to_pytorchs_copies_for_good(tok, monkeypatch, caplog):
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    decoder = _decoder(model)
    buffers = lambda: [t.clone() for layer in decoder.layers  # noqa: E731
                       for p in (layer.qkv, layer.o, layer.gate_up, layer.down) for t in (p.weight, p.up)]
    with torch.no_grad():  # the optimiser's step
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.5)
    decoder.refresh()
    by_kernel = buffers()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(-1.0)

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(norms, "scaled_copy", broken)
    with caplog.at_level("WARNING", logger="scgrpo.rollout.projection"):
        decoder.refresh()
        decoder.refresh()
    assert not decoder.copy_kernel and caplog.text.count("adapter copy kernel failed (RuntimeError") == 1
    flipped = buffers()
    assert all(torch.equal(f, -b) for f, b in zip(flipped[1::2], by_kernel[1::2]))  # the B blocks: negated
    monkeypatch.undo()
    decoder.copy_kernel = True
    decoder.refresh()
    assert decoder.copy_kernel and all(torch.equal(a, b) for a, b in zip(buffers(), flipped))


def test_the_block_kernels_with_biases_equal_generate(tok, batch):
    model = _random_biases(tiny("qwen2", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1))
    model = model.to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = _decoder(model)
    assert decoder.layers[0].qkv.up is None and decoder.layers[0].qkv.bias is not None
    tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model, batch, NEW))


def test_qwen3_keeps_the_compiled_step(tok):
    model = tiny("qwen3", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    decoder = CompactDecoder(model.to(DEVICE), block_kernels=True)
    assert not decoder.block_kernels
