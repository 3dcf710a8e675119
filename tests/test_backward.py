"""The backward kernels on the CPU (Triton's interpreter) against float64 ``torch.autograd``.

Gradients of ``flash_attention`` for q, k and v compared with autograd through the float64 materialised attention
(``flashlab.reference.torch_float64``) on small, awkward shapes: odd lengths, Nq != Nk, grouped-query heads, head
dims that are not powers of two, causal and window masks, rows that see no key, strided inputs and upstream
gradients, custom and negative scales, every dtype. Error: ||grad - ref|| / ||ref|| per tensor, against
``flashlab.core.numerics.GRAD_TOLERANCE``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_kernel import laid_out, random_layout_case

from flashlab.core.masking import visible_mask
from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.host.attention import flash_attention
from flashlab.kernels.backward.rung1_two_pass import attention_backward
from flashlab.kernels.device import CPU_CONFIG
from flashlab.reference.torch_float64 import attention_float64_grads

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    do = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    return q, k, v, do


def flash_grads(q, k, v, do, causal=False, window=None, scale=None, **kwargs):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, causal=causal, window=window, scale=scale, **kwargs)
    o.backward(do)
    return q.grad, k.grad, v.grad


def check_grads(q, k, v, do, causal=False, window=None, scale=None, **kwargs):
    grads = flash_grads(q, k, v, do, causal, window, scale, **kwargs)
    refs = attention_float64_grads(q, k, v, do, causal, window, scale)
    tol = grad_tolerance(q.dtype)
    for name, x, ref, like in zip("qkv", grads, refs, (q, k, v), strict=True):
        assert x.shape == like.shape and x.dtype == like.dtype, f"d{name}: {x.shape} {x.dtype}"
        assert torch.isfinite(x).all(), f"d{name} is not finite"
        err = relative_error(x, ref)
        assert err <= tol, f"d{name}: relative error {err:.2e} over {tol:.0e} for {q.dtype}"
    return grads, refs


def random_case(seed):
    rng = np.random.default_rng(seed)
    hk = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 3]))
    nq, nk = (int(x) for x in rng.integers(1, 45, size=2))
    d = int(rng.choice([16, 24, 40]))
    causal = bool(rng.integers(0, 2))
    window = None
    if rng.random() < 0.4:
        window = (int(rng.integers(0, 20)), None if causal else int(rng.integers(0, 20)))
    scale = None if rng.random() < 0.7 else float(rng.choice([-0.4, 0.05, 0.9]))
    shape = dict(b=int(rng.integers(1, 3)), hq=hk * group, hk=hk, nq=nq, nk=nk, d=d, dtype=DTYPES[seed % 3])
    return shape, causal, window, scale


@pytest.mark.parametrize("seed", range(9))
def test_random_shapes_match_float64_autograd(seed):
    shape, causal, window, scale = random_case(seed)
    q, k, v, do = make_inputs(**shape, seed=seed)
    check_grads(q, k, v, do, causal, window, scale)


@pytest.mark.parametrize("seed", range(8))
def test_random_layouts_and_negative_scales_match_float64_autograd(seed):
    # q, k and v slices, strided or expanded views with a negative scale: the forward launches on -q and its
    # output, lse and so the gradients must be those of the call on contiguous copies
    shape, causal, window, layouts, scale, _ = random_layout_case(seed)
    shape["nq"], shape["nk"] = min(shape["nq"], 40), min(shape["nk"], 40)  # the interpreter's backward is slow
    q, k, v, do = make_inputs(**shape, seed=seed)
    q, k, v = (laid_out(x, lay) for x, lay in zip((q, k, v), layouts, strict=True))
    check_grads(q, k, v, do, causal, window, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_across_tiles_with_gqa(dtype):
    # 3 query tiles x 3 key tiles of the CPU config, ragged at both ends, causal with Nq != Nk, 3 query heads per
    # K/V head: every stage of both loops and the group sum of dK/dV run
    nq, nk = 2 * CPU_CONFIG["BLOCK_M"] + 5, 2 * CPU_CONFIG["BLOCK_N"] + 9
    q, k, v, do = make_inputs(1, 3, 1, nq, nk, 16, dtype, seed=3)
    check_grads(q, k, v, do, causal=True)


def test_head_dim_80_with_a_window():
    q, k, v, do = make_inputs(1, 2, 1, 21, 26, 80, torch.float32, seed=4)
    check_grads(q, k, v, do, window=(6, 3))


def test_strided_inputs_and_strided_upstream_gradient():
    b, h, n, d = 1, 2, 19, 16
    g = torch.Generator().manual_seed(5)
    base = torch.randn(b, n, 3, h, d, generator=g)  # a packed (B, N, 3, H, D) qkv: every view strided
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(b, h, d, n, generator=g).transpose(2, 3)  # (B, H, N, D) with a strided last dim
    assert not q.is_contiguous() and do.stride(-1) != 1
    check_grads(q, k, v, do, causal=True)


def test_negative_scale():
    q, k, v, do = make_inputs(1, 2, 2, 17, 23, 24, torch.float32, seed=6)
    check_grads(q, k, v, do, scale=-0.3)
    check_grads(q, k, v, do, causal=True, scale=-1.2)


def test_rows_that_see_no_key_get_zero_gradient():
    # causal with Nq > Nk: the first Nq - Nk query rows see no key (lse = -inf), so their dq is exactly zero
    nq, nk = 30, 12
    q, k, v, do = make_inputs(1, 2, 1, nq, nk, 16, torch.float32, seed=7)
    (dq, dk, dv), _ = check_grads(q, k, v, do, causal=True)
    empty = torch.as_tensor(~visible_mask(nq, nk, causal=True).any(1))
    assert empty.sum() == nq - nk
    assert (dq[:, :, empty] == 0).all()
    # a single head where the only real rows see nothing at all: zeros everywhere, no NaN from lse = -inf
    q, k, v, do = make_inputs(1, 1, 1, 3, 1, 16, torch.bfloat16, seed=8)
    dq, dk, dv = flash_grads(q, k, v, do, causal=True, window=(None, 0))
    assert (dq[:, :, :2] == 0).all() and all(torch.isfinite(x).all() for x in (dq, dk, dv))


def test_two_runs_are_bit_identical():
    q, k, v, do = make_inputs(2, 4, 2, 37, 29, 24, torch.bfloat16, seed=9)
    first = flash_grads(q, k, v, do, causal=True)
    second = flash_grads(q, k, v, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_backpropagating_through_lse_raises():
    q, k, v, _ = make_inputs(1, 2, 1, 9, 11, 16, torch.float32, seed=10)
    q.requires_grad_()
    o, lse = flash_attention(q, k, v, return_lse=True)
    with pytest.raises(RuntimeError, match="lse .*not differentiable"):
        (o.sum() + lse.sum()).backward()
    # the outputs stay usable: a loss built from o alone backpropagates
    o, lse = flash_attention(q, k, v, return_lse=True)
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v, do = make_inputs(1, 2, 1, 12, 14, 16, torch.float32, seed=11)
    k.requires_grad_()
    o = flash_attention(q, k, v)
    o.backward(do)
    assert q.grad is None and v.grad is None
    ref = attention_float64_grads(q, k, v, do)[1]
    assert relative_error(k.grad, ref) <= grad_tolerance(torch.float32)


@pytest.mark.parametrize("num_splits", [None, 2])
def test_decode_sized_calls_with_grad_take_the_prefill_kernel(num_splits):
    # 3 query rows against 40 keys would take the split-KV path; with a gradient they run the prefill kernel
    q, k, v, do = make_inputs(1, 4, 2, 3, 40, 16, torch.bfloat16, seed=12)
    check_grads(q, k, v, do, num_splits=num_splits)


def test_the_reference_gradients_equal_autograd_of_the_visible_mask():
    # attention_float64_grads (the reference above) against autograd through softmax with visible_mask directly
    q, k, v, do = (x.double() for x in make_inputs(1, 2, 1, 7, 5, 16, torch.float32, seed=13))
    window = (1, None)
    refs = attention_float64_grads(q, k, v, do, True, window)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    s = (qq @ kk.transpose(-1, -2)) / math.sqrt(16)
    s = s.masked_fill(~torch.as_tensor(visible_mask(7, 5, True, window)), float("-inf"))
    (torch.softmax(s, -1).nan_to_num(0.0) @ vv).backward(do)
    for ref, x in zip(refs, (qq, kk, vv), strict=True):
        assert torch.allclose(ref, x.grad, rtol=1e-12, atol=1e-12)


def test_attention_backward_rejects_mismatched_arguments():
    q, k, v, do = make_inputs(1, 2, 1, 8, 8, 16, torch.float32, seed=14)
    o, lse = flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="do and o must have q's shape"):
        attention_backward(do[:, :, :4], q, k, v, o, lse, False, None, None)
    with pytest.raises(TypeError, match="lse must be float32"):
        attention_backward(do, q, k, v, o, lse.double(), False, None, None)
    with pytest.raises(TypeError, match="do and o must have q's dtype"):
        attention_backward(do.half(), q, k, v, o, lse, False, None, None)
