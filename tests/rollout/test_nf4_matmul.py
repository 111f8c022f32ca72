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
@pytest.mark.parametrize("rows,cols,m,nested,blocksize,split", [
    (96, 128, 5, True, 64, None), (80, 192, 17, False, 64, None), (64, 64, 1, True, 64, None),
    (96, 256, 5, True, 64, 1), (80, 192, 3, True, 64, 3), (40, 192, 4, False, 128, None), (40, 192, 4, True, 128, 3),
    (40, 256, 4, True, 128, 2)])
def test_fused_nf4_matmul_multiplies_by_bitsandbytes_values(rows, cols, m, nested, blocksize, split):
    """Rows not a multiple of the tile, inputs of 1 to 17 rows, with and without double quantisation, rows cut into
    runs summed afterwards or not, rows of whole blocks (one scale a row a step: blocks of 64, and of 128 over rows of
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
    got = nf4_matmul_t(x, d, split=split)
    assert got.shape == (rows, m)
    if split is None:
        assert nf4_matmul.splits(rows, cols) == (2 if cols % 128 == 0 else 1)  # (few rows: every run it can cut)
    torch.testing.assert_close(got, w @ x.t(), rtol=1e-5, atol=1e-5)
    assert float((w @ x.t()).abs().max()) > 0.1  # (a non-trivial product)
    out = torch.zeros(rows + 3, m, device=DEVICE)
    nf4_matmul_t(x, d, out[2 : 2 + rows], split=split)  # into rows of a larger output, the others untouched
    assert torch.equal(out[2 : 2 + rows], got) and (out[:2] == 0).all() and (out[2 + rows :] == 0).all()


@runs
def test_a_streamed_projection_with_the_fused_kernel_gives_the_dequantizing_one(monkeypatch):
    """Two nf4 weights and adapter rows through streamed_matmul: the fused kernel's output is the dequantize-then-
    multiply one's, to summation order."""
    first, second = _weight(48, 128, True, seed=2), _weight(80, 128, False, seed=3)
    dequantizers = [Dequantizer(first), Dequantizer(second)]
    plan = four_bit.chunk_plan(dequantizers, 1 << 30)
    scratch = torch.empty(max(d.rows for d in dequantizers) * 128, device=DEVICE)
    torch.manual_seed(4)
    x, lora_a, bias = torch.randn(6, 128, device=DEVICE), torch.randn(4, 128, device=DEVICE), torch.randn(132, device=DEVICE)
    want = streamed_matmul(x, dequantizers, plan, scratch, lora_a, bias)
    monkeypatch.setattr(four_bit, "STREAM_KERNEL", "fused")
    scratch.fill_(float("nan"))  # the fused kernel never reads the scratch
    got = streamed_matmul(x, dequantizers, plan, scratch, lora_a, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
