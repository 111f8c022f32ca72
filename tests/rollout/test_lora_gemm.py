"""The LoRA-epilogue matmul against ``x W^T + round(x A^T) up + b`` (fp32; on a GPU, or on CPU under Triton's
interpreter: ``TRITON_INTERPRET=1``, which ``tests/rollout/test_kernels.py`` sets in its subprocess run)."""

from __future__ import annotations

import pytest
import torch

from scgrpo.rollout import kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")
@pytest.mark.parametrize("m,n,k,r,bias", [(5, 96, 80, 24, True), (64, 130, 64, 16, False), (70, 64, 200, 48, True)])
def test_lora_gemm_equals_the_unfused_computation(m, n, k, r, bias):
    from scgrpo.rollout.lora_gemm import lora_gemm

    torch.manual_seed(0)
    x, w = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE)
    a, up = torch.randn(r, k, device=DEVICE), torch.randn(r, n, device=DEVICE)
    b = torch.randn(n, device=DEVICE) if bias else None
    expected = x @ w.t() + (x @ a.t()) @ up + (b if bias else 0)
    got = lora_gemm(x, w, a, up, b, block_m=16, block_n=32, block_k=32)  # edges: partial tiles on every axis
    assert torch.allclose(got, expected, atol=2e-4, rtol=1e-5), (got - expected).abs().max()


@pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")
def test_lora_gemm_reads_row_strided_inputs_and_rejects_mismatched_shapes():
    from scgrpo.rollout.lora_gemm import lora_gemm

    torch.manual_seed(1)
    wide = torch.randn(9, 50, device=DEVICE)
    x = wide[:, 3:43]  # rows of a wider tensor: row stride 50, K 40
    w, a, up = torch.randn(17, 40, device=DEVICE), torch.randn(3, 40, device=DEVICE), torch.randn(3, 17, device=DEVICE)
    got = lora_gemm(x, w, a, up, block_m=16, block_n=16, block_k=16)
    assert torch.allclose(got, x @ w.t() + (x @ a.t()) @ up, atol=2e-4)
    with pytest.raises(ValueError, match="shapes"):
        lora_gemm(x, w, a, up.t().contiguous())
