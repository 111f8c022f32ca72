"""The fused nf4 matmul (codes read inside the matmul) against bitsandbytes' dequantization and a matmul, and the
streamed projection with it. Runs on a GPU, or on CPU under Triton's interpreter (run by test_kernels.py's
interpreter subprocess, beside test_norms.py)."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from scgrpo.rollout import four_bit, kernels  # noqa: E402
from scgrpo.rollout.four_bit import Dequantizer, streamed_matmul  # noqa: E402
from tests.rollout.test_four_bit import flat_dequantized, packed  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
runs = pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")


def _weight(rows: int, cols: int, nested: bool, seed: int = 0, blocksize: int = 64):
    torch.manual_seed(seed)
    weight = packed(torch.randn(rows, cols) * 0.05, nested=nested, blocksize=blocksize)
    return weight.to(DEVICE) if DEVICE.type == "cuda" else weight


@runs
@pytest.mark.parametrize("lookup,order", [
    ("table", "xw"), ("pairs", "xw"), ("registers", "xw"),
    pytest.param("registers", "wx", marks=pytest.mark.skipif(DEVICE.type == "cuda", reason="races on a GPU (ORDERS)"))])
@pytest.mark.parametrize("rows,cols,m,nested,blocksize,split", [
    (96, 128, 5, True, 64, None), (80, 192, 17, False, 64, None), (64, 64, 1, True, 64, None),
    (96, 256, 5, True, 64, 1), (80, 192, 3, True, 64, 3), (40, 192, 4, False, 128, None), (40, 192, 4, True, 128, 3),
    (40, 256, 4, True, 128, 2), (96, 512, 5, True, 64, None), (40, 128, 100, True, 64, None)])
def test_fused_nf4_matmul_multiplies_by_bitsandbytes_values(rows, cols, m, nested, blocksize, split, lookup, order):
    """Rows not a multiple of the tile, inputs of 1 to 17 rows and of 100 (two blocks of rows), with and without double quantisation, rows cut into
    runs summed afterwards or not, codes looked up in memory a code or a byte, or a 32-bit word at a time (in
    registers on a GPU; the interpreter reads the same words and assembles their values the same way), as x W^T
    or W x^T, into rows of a transposed output or columns of a row-major one, rows of whole blocks (one scale a row a step: blocks of 64, and of 128 over rows of
    256) or not (blocks of 128 over rows of 192): W x^T with W as bitsandbytes dequantizes it (written out by hand), to fp32 summation order (the kernel's
    only difference)."""
    from scgrpo.rollout import nf4_matmul
    from scgrpo.rollout.nf4_matmul import nf4_matmul_t, supported

    weight = _weight(rows, cols, nested, blocksize=blocksize)
    d = Dequantizer(weight)
    assert supported(d, DEVICE)
    torch.manual_seed(1)
    x = torch.randn(m, cols, device=DEVICE)  # fp32 here: exact products under the interpreter
    assert d.dtype == torch.float32  # (quantized from fp32: it dequantizes to fp32)
    w = flat_dequantized(weight.data.cpu(), d.state).to(DEVICE).float()
    got = nf4_matmul_t(x, d, split=split, lookup=lookup, order=order)
    assert got.shape == (rows, m)
    if split is None:
        step = nf4_matmul.BLOCK_K if cols % nf4_matmul.BLOCK_K == 0 else nf4_matmul.STEP  # (what the launch takes)
        assert nf4_matmul.splits(rows, cols, -(-m // 64), block_k=step) == (4 if cols == 512 else 1)
    torch.testing.assert_close(got, w @ x.t(), rtol=1e-5, atol=1e-5)
    assert float((w @ x.t()).abs().max()) > 0.1  # (a non-trivial product)
    out = torch.zeros(rows + 3, m, device=DEVICE)
    nf4_matmul_t(x, d, out[2 : 2 + rows], split=split, lookup=lookup, order=order)  # into rows of a larger output, the others untouched
    assert torch.equal(out[2 : 2 + rows], got) and (out[:2] == 0).all() and (out[2 + rows :] == 0).all()
    wide = torch.zeros(m, rows + 5, device=DEVICE)  # into columns of a row-major output, the others untouched
    nf4_matmul_t(x, d, wide[:, 3 : 3 + rows].t(), split=split, lookup=lookup, order=order)
    assert torch.equal(wide[:, 3 : 3 + rows], got.t()) and (wide[:, :3] == 0).all() and (wide[:, 3 + rows :] == 0).all()
    sparse = torch.zeros(m, 2 * rows, device=DEVICE)  # (neither stride 1: every other column)
    nf4_matmul_t(x, d, sparse[:, ::2].t(), split=split, lookup=lookup, order=order)
    assert torch.equal(sparse[:, ::2], got.t()) and (sparse[:, 1::2] == 0).all()


@runs
def test_a_streamed_projection_with_the_fused_kernel_gives_the_dequantizing_one(monkeypatch):
    """Two nf4 weights and adapter rows through streamed_matmul: the fused kernel's output is the dequantize-then-
    multiply one's, to summation order; an input of more than FUSED_ROWS rows is dequantized and multiplied."""
    first, second = _weight(48, 128, True, seed=2), _weight(80, 128, False, seed=3)
    dequantizers = [Dequantizer(first), Dequantizer(second)]
    plan = four_bit.chunk_plan(dequantizers, 1 << 30)
    scratch = torch.empty(max(d.rows for d in dequantizers) * 128, device=DEVICE)
    torch.manual_seed(4)
    x, lora_a, bias = torch.randn(6, 128, device=DEVICE), torch.randn(4, 128, device=DEVICE), torch.randn(132, device=DEVICE)
    assert four_bit.STREAM_KERNEL == "fused"  # (the default)
    monkeypatch.setattr(four_bit, "STREAM_KERNEL", "dequantize")
    want = streamed_matmul(x, dequantizers, plan, scratch, lora_a, bias)
    monkeypatch.setattr(four_bit, "STREAM_KERNEL", "fused")
    scratch.fill_(float("nan"))  # the fused kernel never reads the scratch
    got = streamed_matmul(x, dequantizers, plan, scratch, lora_a, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    from scgrpo.rollout import nf4_matmul

    long_rows = [Dequantizer(_weight(48, 512, True, seed=9)), Dequantizer(_weight(16, 512, False, seed=10))]
    long_plan = four_bit.chunk_plan(long_rows, 1 << 30)
    long_x, long_a = torch.randn(6, 512, device=DEVICE), torch.randn(4, 512, device=DEVICE)
    monkeypatch.setattr(four_bit, "STREAM_KERNEL", "dequantize")
    long_want = streamed_matmul(long_x, long_rows, long_plan, torch.empty(48 * 512, device=DEVICE), long_a, None)
    monkeypatch.setattr(four_bit, "STREAM_KERNEL", "fused")
    strides, kernel = [], nf4_matmul.nf4_matmul_t
    monkeypatch.setattr(nf4_matmul, "nf4_matmul_t", lambda x, d, out_t, **k: strides.append(out_t.stride()) or
                        kernel(x, d, out_t, **k))
    long_got = streamed_matmul(long_x, long_rows, long_plan, torch.full((48 * 512,), float("nan"), device=DEVICE),
                               long_a, None)
    torch.testing.assert_close(long_got, long_want, rtol=1e-5, atol=1e-5)  # (rows of 512: runs summed, split 4)
    assert strides == [(1, 68), (1, 68)]  # columns of the row-major output, no transposed one to copy
    assert nf4_matmul.splits(48, 512, 1, nf4_matmul.BLOCK_N, nf4_matmul.BLOCK_K) > 1

    many = torch.randn(four_bit.FUSED_ROWS + 1, 128, device=DEVICE)  # (a prefill's rows: dequantized, then cuBLAS)
    monkeypatch.setattr(nf4_matmul, "nf4_matmul_t", lambda *a, **k: pytest.fail("the fused kernel ran"))
    w = torch.cat([flat_dequantized(first.data.cpu(), dequantizers[0].state),
                   flat_dequantized(second.data.cpu(), dequantizers[1].state), lora_a.cpu()]).to(DEVICE).float()
    torch.testing.assert_close(streamed_matmul(many, dequantizers, plan, scratch, lora_a, bias),
                               many @ w.t() + bias, rtol=1e-4, atol=1e-4)


@runs
@pytest.mark.parametrize("block_k", [128, 256])
def test_steps_of_several_blocks_spread_each_block_scale_over_its_weights(block_k):
    """A step of K longer than a block: each weight multiplied by its own block's scale."""
    from scgrpo.rollout.nf4_matmul import nf4_matmul_t

    weight = _weight(24, 512, True, seed=5)
    d = Dequantizer(weight)
    torch.manual_seed(6)
    x = torch.randn(3, 512, device=DEVICE)
    w = flat_dequantized(weight.data.cpu(), d.state).to(DEVICE).float()
    for lookup in ("pairs", "registers"):
        torch.testing.assert_close(nf4_matmul_t(x, d, block_k=block_k, lookup=lookup), w @ x.t(), rtol=1e-5, atol=1e-5)


@runs
def test_a_tuned_split_gives_way_where_it_does_not_fit_and_misaligned_codes_are_looked_up_by_bytes(monkeypatch):
    """A shape's tuned split is dropped, and :func:`splits` decides, where the row's length takes the shortest step
    or the input has several blocks of rows; codes not on 4-byte boundaries take the "pairs" look-up."""
    from scgrpo.rollout import nf4_matmul

    weight = _weight(40, 192, True, seed=7)
    d = Dequantizer(weight)
    w = flat_dequantized(weight.data.cpu(), d.state).to(DEVICE).float()
    torch.manual_seed(8)
    monkeypatch.setattr(nf4_matmul, "TUNED", {"40x192": {"block_k": 128, "split": 4}})  # (192: not whole 512s)
    asked = []
    original = nf4_matmul.splits
    monkeypatch.setattr(nf4_matmul, "splits", lambda *a, **k: asked.append(a) or original(*a, **k))
    for m in (3, 100):
        x = torch.randn(m, 192, device=DEVICE)
        torch.testing.assert_close(nf4_matmul.nf4_matmul_t(x, d), w @ x.t(), rtol=1e-5, atol=1e-5)
    assert [a[2:5] for a in asked] == [(1, nf4_matmul.BLOCK_N, nf4_matmul.STEP), (2, nf4_matmul.BLOCK_N, nf4_matmul.STEP)]
    monkeypatch.setattr(nf4_matmul, "TUNED", {"40x192": {"block_k": 64, "split": 3}})
    asked.clear()
    x = torch.randn(100, 192, device=DEVICE)
    torch.testing.assert_close(nf4_matmul.nf4_matmul_t(x, d), w @ x.t(), rtol=1e-5, atol=1e-5)
    assert len(asked) == 1  # (two blocks of rows: not the tuned split of one)
    nf4_matmul.nf4_matmul_t(x[:64], d)
    assert len(asked) == 1  # (one block: the tuned split)
    shifted = torch.empty(d.packed.numel() + 1, dtype=d.packed.dtype, device=DEVICE)[1:]
    shifted.copy_(d.packed)
    aligned = d.packed
    d.packed = shifted
    assert d.packed.data_ptr() % 4 and not nf4_matmul.registers_usable(d)
    torch.testing.assert_close(nf4_matmul.nf4_matmul_t(x[:5], d, lookup="registers"), w @ x[:5].t(), rtol=1e-5,
                               atol=1e-5)
    d.packed = aligned
    assert nf4_matmul.registers_usable(d)


def test_launch_settings_take_what_is_given_then_the_tuned_shape_then_the_defaults(monkeypatch):
    from scgrpo.rollout import nf4_matmul

    monkeypatch.setattr(nf4_matmul, "TUNED", {"64x128": {"block_n": 32, "lookup": "pairs", "num_stages": 5}})
    tuned = nf4_matmul.launch_settings(64, 128, num_stages=2)
    assert tuned["block_n"] == 32 and tuned["lookup"] == "pairs" and tuned["num_stages"] == 2
    assert tuned["order"] == nf4_matmul.ORDER == "xw"  # (the product whose weight tile is not a register operand)
    assert tuned["num_warps"] == nf4_matmul.NUM_WARPS and tuned["split"] is None
    other = nf4_matmul.launch_settings(64, 256)
    assert other["block_n"] == nf4_matmul.BLOCK_N and other["lookup"] == nf4_matmul.LOOKUP


@runs
def test_an_unknown_lookup_or_order_or_a_step_that_does_not_divide_a_row_is_refused():
    from scgrpo.rollout.nf4_matmul import nf4_matmul_t

    d = Dequantizer(_weight(16, 64, True))
    with pytest.raises(ValueError, match="lookup 'lut'"):
        nf4_matmul_t(torch.randn(2, 64, device=DEVICE), d, lookup="lut")
    with pytest.raises(ValueError, match="order 'wxw'"):
        nf4_matmul_t(torch.randn(2, 64, device=DEVICE), d, order="wxw")
    longer = Dequantizer(_weight(16, 192, True))  # (the default step of 128 gives way to 64; one asked for does not)
    with pytest.raises(ValueError, match="does not cut into 1 runs of whole 128-weight steps"):
        nf4_matmul_t(torch.randn(2, 192, device=DEVICE), longer, block_k=128)
