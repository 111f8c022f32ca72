"""The Triton decode-attention kernel (fp32): against PyTorch's attention with the rotation, cache write and LoRA
term done separately, and inside the compact engine against Hugging Face's ``generate``. Runs on a GPU, or on
CPU under Triton's interpreter (``TRITON_INTERPRET=1``, which Triton reads at import: the test at the end runs
this module and ``test_norms.py`` so in a subprocess wherever Triton is installed, started when collection ends)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from scgrpo.rollout import kernels
from scgrpo.rollout.compact import CompactDecoder
from scgrpo.rollout.layers import rotate
from scgrpo.rollout.slots import SlotDecoder
from tests.rollout.test_compact import batch, hf_greedy, tiny, tok, with_lora  # noqa: F401

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
runs = pytest.mark.skipif(not kernels.usable(DEVICE), reason="needs Triton on a GPU, or TRITON_INTERPRET=1")
NEW = 6 if kernels.INTERPRET else 12  # tokens the engine tests decode (the interpreter takes ~0.1 s a launch)


def rope(length: int, dim: int):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(length).float()[:, None] * inv
    emb = torch.cat([angles, angles], -1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


def reference(qkv, lens, cache, cos, sin, heads, rotated=False):
    """Per row: rotation, cache write at the row's position, attention over its first pos + 1 entries."""
    cache = cache.clone()
    _, s, kv, _, dim = cache.shape
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], -1)
    q, k, v = q.view(s, heads, dim), k.view(s, kv, dim), v.view(s, kv, dim)
    if not rotated:
        c, n = cos[lens].unsqueeze(1), sin[lens].unsqueeze(1)
        q, k = rotate(q, c, n), rotate(k, c, n)
    rows = []
    for i in range(s):
        p = int(lens[i])
        cache[0, i, :, p], cache[1, i, :, p] = k[i], v[i]
        keys = cache[0, i, :, : p + 1].repeat_interleave(heads // kv, 0)
        values = cache[1, i, :, : p + 1].repeat_interleave(heads // kv, 0)
        rows.append(F.scaled_dot_product_attention(q[i].unsqueeze(1), keys, values, scale=dim ** -0.5).reshape(-1))
    return torch.stack(rows), cache


@runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,dim,rotated,splits", [(6, 2, 64, False, 1), (4, 4, 32, False, 1), (8, 2, 32, True, 1),
                                                          (6, 2, 64, False, 4)])
def test_decode_attention_equals_pytorch_attention(heads, kv, dim, rotated, splits, dtype):
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("bf16 on a GPU (the interpreter's bf16 products are not exact)")
    torch.manual_seed(0)
    slots, length = 5, 150  # rows of 0, 3, 64 (a block boundary), 100, 149 cached entries
    lens = torch.tensor([0, 3, 64, 100, 149], device=DEVICE)
    qkv = torch.randn(slots, (heads + 2 * kv) * dim, device=DEVICE).to(dtype)
    cache = torch.randn(2, slots, kv, length, dim, device=DEVICE).to(dtype)
    cos, sin = rope(length, dim)
    # the reference in fp32 from the same (rounded) inputs; bf16 differs by the kernel's roundings of q, k, p
    expected, expected_cache = reference(qkv.float(), lens, cache.float(), cos, sin, heads, rotated)
    got = kernels.decode_attention(qkv, lens, cache, cos.to(dtype), sin.to(dtype), heads, dim ** -0.5,
                                   rotate=not rotated, launch=dict(splits=splits))
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert torch.allclose(got.float(), expected, **tol), (got.float() - expected).abs().max()
    assert torch.allclose(cache.float(), expected_cache, **tol)  # k, v written at each row's position only


@runs
@pytest.mark.parametrize("launch", [dict(block_n=32, num_warps=2, num_stages=1), dict(block_n=128, num_warps=8),
                                    dict(block_n=64, num_warps=2, splits=4)]
                         + ([] if kernels.INTERPRET else [dict(block_n=32, splits=3)]))  # (the CPU interpreter is slow)
def test_decode_attention_reads_strided_rows_under_any_launch_setting(launch):
    torch.manual_seed(1)
    heads, kv, dim = 4, 2, 32
    out = (heads + 2 * kv) * dim
    wide = torch.randn(3, out + 40, device=DEVICE)  # rows of a wider tensor: a row stride other than the width
    lens = torch.tensor([5, 0, 140], device=DEVICE)
    cache = torch.randn(2, 3, kv, 160, dim, device=DEVICE)
    cos, sin = rope(160, dim)
    expected, _ = reference(wide[:, :out].contiguous(), lens, cache, cos, sin, heads)
    scratch: dict = {}  # (kept between launches, as a decoder keeps it)
    for _ in range(2):  # split rows: the merging program leaves the arrival counters at zero for the next launch
        got = kernels.decode_attention(wide[:, :out], lens, cache.clone(), cos, sin, heads, dim ** -0.5, launch=launch,
                                       scratch=scratch)
        assert torch.allclose(got, expected, atol=2e-5)
    assert all(int(counters.abs().sum()) == 0 for _, _, counters in scratch.values())
    assert len(scratch) == (launch.get("splits", 1) > 1)  # one shape, kept once (split launches only)



def prefill_reference(qkv, lengths, slots, cache, cos, sin, heads, t):
    """Per row: rotation at positions 0 .. T - 1, its real tokens' keys and values into its slot, causal attention
    over them (a padding position attends to every real token before it; a row of no tokens gives zeros)."""
    cache = cache.clone()
    _, _, kv, _, dim = cache.shape
    n = lengths.shape[0]
    q, k, v = qkv.split([heads * dim, kv * dim, kv * dim], -1)
    q, k, v = q.view(n, t, heads, dim), k.view(n, t, kv, dim), v.view(n, t, kv, dim)
    c, s = cos[:t].unsqueeze(1), sin[:t].unsqueeze(1)
    q, k = rotate(q, c, s), rotate(k, c, s)
    outs = []
    for i in range(n):
        m = int(lengths[i])
        if m == 0:
            outs.append(torch.zeros(t, heads * dim, device=qkv.device))
            continue
        cache[0, int(slots[i]), :, :m] = k[i, :m].transpose(0, 1)
        cache[1, int(slots[i]), :, :m] = v[i, :m].transpose(0, 1)
        keys = k[i].transpose(0, 1).repeat_interleave(heads // kv, 0)  # [heads, T, D]
        values = v[i].transpose(0, 1).repeat_interleave(heads // kv, 0)
        pos = torch.arange(t, device=qkv.device)
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] < int(lengths[i]))
        attn = F.scaled_dot_product_attention(q[i].transpose(0, 1), keys, values, attn_mask=visible,
                                              scale=dim ** -0.5)  # [heads, T, D]
        outs.append(attn.transpose(0, 1).reshape(t, heads * dim))
    return torch.cat(outs), cache


@runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,dim,t", [(6, 2, 64, 70), (4, 4, 32, 64), (3, 1, 32, 9)])
def test_prefill_attention_equals_pytorch_attention(heads, kv, dim, t, dtype):
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip("bf16 on a GPU (the interpreter's bf16 products are not exact)")
    torch.manual_seed(0)
    # full, one token, padded, past a block, none (a padding row: writes nothing, even into another row's slot)
    lengths = torch.tensor([t, 1, max(1, t - 5), min(t, 65), 0], device=DEVICE)
    slots = torch.tensor([4, 0, 2, 1, 4], device=DEVICE)  # (slot 3 is another row's: left as it was)
    out = (heads + 2 * kv) * dim
    wide = torch.randn(5 * t, out + 24, device=DEVICE).to(dtype)  # rows of a wider tensor (LoRA's z after them)
    cache = torch.randn(2, 5, kv, t + 16, dim, device=DEVICE).to(dtype)
    cos, sin = rope(t + 16, dim)
    expected, expected_cache = prefill_reference(wide[:, :out].float(), lengths, slots, cache.float(), cos, sin,
                                                 heads, t)
    got = kernels.prefill_attention(wide[:, :out], lengths, slots, cache, cos.to(dtype), sin.to(dtype), heads,
                                    dim ** -0.5, block=32 if t < 64 else 64)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    # padding positions have no reference (a padding row: zeros)
    real = torch.cat([torch.arange(t, device=DEVICE) < max(int(n), t * (n == 0)) for n in lengths])
    assert torch.allclose(got.float()[real], expected[real], **tol), (got.float()[real] - expected[real]).abs().max()
    assert torch.isfinite(got.float()).all()
    assert torch.allclose(cache.float(), expected_cache, **tol)  # each row's real positions in its slot only


@runs
def test_prefill_attention_rejects_shapes_it_cannot_take():
    cache = torch.zeros(2, 2, 1, 8, 32, device=DEVICE)
    cos = torch.zeros(8, 32, device=DEVICE)
    lengths = torch.tensor([3, 3], device=DEVICE)
    with pytest.raises(ValueError, match="T <= the cache length"):
        kernels.prefill_attention(torch.zeros(2 * 9, 4 * 32, device=DEVICE), lengths, torch.arange(2, device=DEVICE),
                                  cache, cos, cos, 2, 0.1)
    with pytest.raises(ValueError, match=r"\[N T, \.\.\.\] rows"):
        kernels.prefill_attention(torch.zeros(7, 4 * 32, device=DEVICE), lengths, torch.arange(2, device=DEVICE),
                                  cache, cos, cos, 2, 0.1)


@runs
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_engine_with_the_kernel_equals_generate(family, tok, batch):
    model = tiny(family, len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                 **({"head_dim": 32} if family == "qwen3" else {})).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = CompactDecoder(model)
    assert decoder.fused_attention
    tokens = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model, batch, NEW))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs on a GPU")
def test_recorded_prefills_equal_generate_for_every_shape(tok, batch):
    """Prefills replayed from CUDA graphs (rows padded to a power of two, positions to a bucket) give the tokens
    of the Hugging Face model, call after call; a shape seen before records nothing."""
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    sampler = SlotDecoder(CompactDecoder(model), [], 2, NEW, greedy=True)
    texts = ["hello there", "a", "what is 2+2? answer:", "zzz", "The quick brown fox", "1 2 3 4 5 6 7 8"]
    recorded = []
    for chosen in (texts, texts[:3], texts[1:2] * 5, texts, texts[:3]):
        enc = {k: v.to(DEVICE) for k, v in tok(chosen, return_tensors="pt", padding=True).items()}
        tokens = sampler(enc["input_ids"], enc["attention_mask"])[0]
        assert torch.equal(tokens, hf_greedy(model, enc, NEW))
        recorded.append(len(sampler._prefills))
    assert sampler.decoder.prefill_kernels  # (no silent fallback to the eager layers)
    assert recorded[3:] == [recorded[2]] * 2 and recorded[2] >= 2  # the repeated shapes replayed


@runs
def test_the_kernel_with_unmerged_lora_equals_the_merged_model(tok, batch):
    model = with_lora(tiny("llama", len(tok), hidden_size=64, num_attention_heads=2, num_key_value_heads=1)).to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = CompactDecoder(model)
    assert decoder.fused_attention and decoder.layers[0].qkv.up is not None  # LoRA added before the kernel
    unmerged = SlotDecoder(decoder, [], 2, NEW, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    merged = model.merge_and_unload()
    assert torch.equal(unmerged, hf_greedy(merged, batch, NEW))


@runs
def test_head_sizes_the_kernel_cannot_take_decode_through_pytorch_attention(tok, batch):
    with pytest.raises(ValueError, match="power of two"):
        kernels.decode_attention(torch.zeros(1, 4 * 96, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
                                 torch.zeros(2, 1, 1, 8, 96, device=DEVICE), torch.zeros(8, 96, device=DEVICE),
                                 torch.zeros(8, 96, device=DEVICE), 2, 0.1)
    model = tiny("llama", len(tok), hidden_size=192, num_attention_heads=2, num_key_value_heads=1).to(DEVICE)  # D 96
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    decoder = CompactDecoder(model)
    assert not decoder.fused_attention
    tokens = SlotDecoder(decoder, [], 2, 8, greedy=True)(batch["input_ids"], batch["attention_mask"])[0]
    assert torch.equal(tokens, hf_greedy(model, batch, 8))


INTERPRETED = not kernels.AVAILABLE or kernels.INTERPRET or DEVICE.type == "cuda"
TRITON = kernels.triton.__version__ if kernels.AVAILABLE else None
INTERPRETER_TESTED = "3.6."
"""The Triton whose interpreter runs the kernels (the GPU image's; 3.9's rejects a mask that ands a scalar condition
with a tensor, which the kernels do and its compiler takes)"""
_background: dict = {}


def start_interpreter_run() -> None:
    """Starts this module and ``test_norms.py`` under Triton's interpreter in a subprocess (the conftest calls it
    once collection is done, so that the single-threaded interpreter runs beside the rest of the suite)."""
    if INTERPRETED or "run" in _background or not TRITON.startswith(INTERPRETER_TESTED):
        return
    # one thread: the interpreter is single-threaded Python, and the suite beside it keeps the other core
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    files = [__file__] + [os.path.join(os.path.dirname(__file__), f) for f in ("test_norms.py", "test_nf4_matmul.py")]
    _background["run"] = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "not interpreter", *files],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_interpreter_run() -> None:
    run = _background.pop("run", None)
    if run is not None and run.poll() is None:
        run.kill()
        run.wait()


@pytest.mark.skipif(INTERPRETED, reason="Triton not installed, or the tests above already ran the kernel")
@pytest.mark.skipif(not INTERPRETED and not TRITON.startswith(INTERPRETER_TESTED),
                    reason=f"Triton {TRITON}: the kernels run under the interpreter of Triton {INTERPRETER_TESTED}x")
def test_the_kernels_under_the_interpreter():
    start_interpreter_run()  # (already started when the whole suite runs)
    run = _background["run"]
    try:
        stdout, _ = run.communicate(timeout=600)
    finally:
        stop_interpreter_run()
    skips = [line for line in stdout.splitlines() if line.startswith("SKIPPED")]
    # everything ran but the cases that need a GPU (bf16 arithmetic, compiled code between the kernels)
    assert run.returncode == 0 and " passed" in stdout, stdout[-3000:]
    assert skips and all("on a GPU" in line for line in skips), skips
