"""The Triton kernel compiled on a CUDA GPU, at real sizes, against a float64 reference (skipped without CUDA).

Run on the H200 with: ``python -m pytest tests/test_kernel_gpu.py -q`` (the command and result are recorded in
``docs/forward-ladder.md``).
"""

from __future__ import annotations

import pytest
import torch

from flashlab.core.numerics import tolerance
from flashlab.host.attention import flash_attention
from flashlab.reference.torch_float64 import attention_float64

pytestmark = pytest.mark.gpu

LSE_TOL = 1e-3


def make(b, hq, hk, nq, nk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.float32).to(dtype)
        for h, n in ((hq, nq), (hk, nk), (hk, nk))
    ]


def check(q, k, v, causal=False, window=None, scale=None, num_splits=None):
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # poison the allocator's cache: unwritten -> NaN
    o, lse = flash_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True, num_splits=num_splits)
    ro, rlse = attention_float64(q, k, v, causal, window, scale)
    assert torch.isfinite(o).all()
    err = ((o.double() - ro).norm() / ro.norm().clamp_min(1e-300)).item()
    assert err < tolerance(q.dtype), f"relative error {err:.2e} over {tolerance(q.dtype):.0e} for {q.dtype}"
    empty = torch.isneginf(rlse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (o[empty] == 0).all()
    if (~empty).any():
        assert (lse.double()[~empty] - rlse[~empty]).abs().max().item() < LSE_TOL


CASES = [
    # b, hq, hk, nq, nk, d, causal, window
    (2, 16, 16, 1024, 1024, 128, False, None),
    (2, 16, 16, 1024, 1024, 128, True, None),
    (1, 32, 32, 2048, 2048, 64, True, None),
    (3, 8, 2, 1000, 1537, 80, True, None),
    (2, 12, 4, 777, 333, 96, False, None),
    (1, 4, 1, 1500, 700, 160, True, None),
    (1, 4, 4, 513, 513, 256, False, None),
    (2, 6, 3, 999, 999, 24, False, (100, 17)),
    (1, 8, 8, 2049, 2049, 128, True, (256, None)),
    (1, 2, 2, 1, 4000, 128, True, None),
    (1, 2, 1, 300, 100, 40, True, None),
    # decode (split-KV path): one or a few query rows, long caches, GQA
    (4, 32, 4, 1, 32768, 128, True, None),
    (1, 32, 4, 4, 5001, 128, True, None),
    (2, 16, 1, 1, 70000, 64, False, None),
    (1, 8, 2, 1, 9000, 96, True, (2000, None)),
    (3, 12, 12, 16, 777, 256, True, None),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(str(x) for x in c))
def test_matches_reference_on_gpu(case, dtype):
    b, hq, hk, nq, nk, d, causal, window = case
    q, k, v = make(b, hq, hk, nq, nk, d, dtype, seed=hash(case) % 1000)
    check(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("num_splits", [1, 7])
def test_forced_splits_on_gpu(num_splits):
    q, k, v = make(2, 8, 2, 333, 2049, 128, torch.bfloat16, seed=num_splits)
    check(q, k, v, causal=True, window=(500, None), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [9, 49, 256])
def test_merge_tree_is_exact_and_repeatable_on_gpu(num_splits):
    # One launch merges every chunk (groups, then the groups); its counters must be back at zero after each
    # launch, or the next launch of the same plan would merge early or never: 20 repeats give the same bits.
    q, k, v = make(2, 16, 2, 1, num_splits * 128 - 37, 128, torch.bfloat16, seed=num_splits)
    check(q, k, v, num_splits=num_splits)
    first = flash_attention(q, k, v, num_splits=num_splits)
    for _ in range(20):
        assert torch.equal(flash_attention(q, k, v, num_splits=num_splits), first)


def test_non_contiguous_on_gpu():
    qkv = torch.randn(2, 1000, 3, 8, 128, device="cuda", dtype=torch.bfloat16)  # (B, N, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D) views
    check(q, k, v, causal=True)


def test_hidden_tiles_are_never_loaded_on_gpu():
    q, k, v = make(1, 4, 2, 64, 4096, 128, torch.bfloat16, seed=1)
    ref = flash_attention(q, k, v, causal=True, window=(100, None))
    k[:, :, :3584], v[:, :, :3584] = float("nan"), float("nan")
    o = flash_attention(q, k, v, causal=True, window=(100, None))
    assert torch.equal(o, ref)


def test_gpu_compiles_after_a_cpu_run_in_the_same_process():
    # A CPU call runs Triton's interpreter, which patches triton.language; a GPU compile afterwards must still
    # work. D = 152 and Nq = 3 are used by no other test, so both kernels below compile fresh in this process.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, n, 152, generator=g).to(torch.bfloat16) for n in (3, 50, 50))
    k, v = k[:, :2], v[:, :2]
    flash_attention(q, k, v)  # interpreter
    qg, kg, vg = make(1, 4, 2, 3, 700, 152, torch.bfloat16, seed=4)
    check(qg, kg, vg)  # split-KV kernels, compiled now
    qg, kg, vg = make(1, 4, 4, 300, 300, 152, torch.bfloat16, seed=5)
    check(qg, kg, vg, causal=True)  # prefill kernel, compiled now
