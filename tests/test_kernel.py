"""The Triton kernel on the CPU (Triton's interpreter) against the float64 reference.

Small, awkward shapes: odd lengths, Nq != Nk, grouped-query heads, head dims that are not powers of two, causal and
window masks, rows that see no key, non-contiguous inputs, every dtype. Error: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashlab.kernels.forward import flash_attention
from flashlab.kernels.runtime import CPU_CONFIG
from flashlab.reference import attention

# ||out - ref|| / ||ref|| allowed per dtype: fp32 runs exact fp32 dots; fp16/bf16 round P and O to 16 bits.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
LSE_TOL = 1e-4  # lse is computed in fp32 from exact products of the (rounded) inputs; relative where |lse| > 1


def make_qkv(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    return q, k, v


def check_against_reference(q, k, v, causal=False, window=None, scale=None):
    o, lse = flash_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True)
    ro, rlse = attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=causal, window=window, scale=scale
    )
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    o, lse = o.double().numpy(), lse.double().numpy()
    assert np.isfinite(o).all()
    err = np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-300)
    assert err < TOL[q.dtype], f"relative error {err:.2e} over {TOL[q.dtype]:.0e} for {q.dtype}"
    empty = np.isneginf(rlse)
    assert np.array_equal(np.isneginf(lse), empty), "lse must be -inf exactly on rows that see no key"
    assert (o[empty] == 0).all(), "rows that see no key must be zeros"
    if (~empty).any():
        gap = np.abs(lse[~empty] - rlse[~empty]) / np.maximum(1.0, np.abs(rlse[~empty]))  # relative where |lse| > 1
        assert gap.max() < LSE_TOL
    return err


def random_case(seed):
    rng = np.random.default_rng(seed)
    hk = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 3]))
    nq, nk = (int(x) for x in rng.integers(1, 70, size=2))
    d = int(rng.choice([16, 24, 40, 64, 80]))
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    causal = bool(rng.integers(0, 2))
    window = None
    if rng.random() < 0.4:
        window = (int(rng.integers(0, 40)), None if causal else int(rng.integers(0, 40)))
    return dict(b=int(rng.integers(1, 3)), hq=hk * group, hk=hk, nq=nq, nk=nk, d=d, dtype=dtype), causal, window


@pytest.mark.parametrize("seed", range(24))
def test_random_shapes_match_reference(seed):
    shape, causal, window = random_case(seed)
    q, k, v = make_qkv(**shape, seed=seed)
    check_against_reference(q, k, v, causal=causal, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_every_dtype_crossing_many_tiles(dtype, causal):
    # 3 query tiles x 5 key tiles of the CPU config, with ragged last tiles on both sides
    nq, nk = 2 * CPU_CONFIG["BLOCK_M"] + 5, 4 * CPU_CONFIG["BLOCK_N"] + 3
    q, k, v = make_qkv(1, 4, 2, nq, nk, 48, dtype, seed=7)
    check_against_reference(q, k, v, causal=causal)


def test_sliding_window_both_sides_and_custom_scale():
    q, k, v = make_qkv(2, 2, 1, 50, 61, 32, torch.float32, seed=3)
    check_against_reference(q, k, v, window=(5, 9), scale=0.3)
    check_against_reference(q, k, v, causal=True, window=(12, None))


def test_negative_and_zero_scale():
    # a negative scale turns the row max into a row min: the kernel must not overflow exp2 on wide score ranges
    q, k, v = make_qkv(1, 2, 2, 40, 50, 64, torch.float32, seed=13)
    check_against_reference(q * 30, k, v, scale=-1.0)
    check_against_reference(q, k, v, causal=True, scale=0.0)


def test_rows_that_see_no_key_give_zeros_and_minus_inf():
    # causal with Nq > Nk, bottom-right aligned: the first Nq - Nk query rows see nothing
    q, k, v = make_qkv(1, 2, 2, 40, 17, 16, torch.float16, seed=4)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert (o[:, :, :23] == 0).all() and torch.isneginf(lse[:, :, :23]).all()
    assert torch.isfinite(lse[:, :, 23:]).all()
    check_against_reference(q, k, v, causal=True)


def test_one_query_one_key():
    q, k, v = make_qkv(1, 1, 1, 1, 1, 16, torch.float32, seed=5)
    o = flash_attention(q, k, v)
    torch.testing.assert_close(o, v)  # softmax over one key is 1: the output is that key's value


def test_non_contiguous_inputs():
    # (B, N, H, D) storage viewed as (B, H, N, D), as a model's fused QKV projection gives it
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 37, 3, 4, 40, generator=g)  # (B, N, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, N, D), strided
    assert not q.is_contiguous()
    check_against_reference(q, k, v, causal=True)
    # a head dim that is itself strided (every other element) is accepted too
    wide = torch.randn(1, 2, 29, 64, generator=g)
    check_against_reference(wide[..., ::2], wide[..., 1::2], wide[..., ::2])


def test_hidden_tiles_are_never_loaded():
    # NaN keys/values in whole tiles that the window hides from every query: a kernel that loaded them would
    # turn the output into NaN (0 * NaN); skipping them keeps it finite and equal to the reference.
    q, k, v = make_qkv(1, 2, 1, 8, 200, 32, torch.float32, seed=8)
    ref = flash_attention(q, k, v, causal=True, window=(20, None))
    k[:, :, :128], v[:, :, :128] = float("nan"), float("nan")
    o = flash_attention(q, k, v, causal=True, window=(20, None))
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_gqa_equals_repeated_heads():
    q, k, v = make_qkv(1, 6, 2, 21, 33, 24, torch.float32, seed=9)
    o = flash_attention(q, k, v, causal=True)
    o_rep = flash_attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=True)
    torch.testing.assert_close(o, o_rep, rtol=1e-6, atol=1e-6)


def test_return_lse_false_gives_only_the_output():
    q, k, v = make_qkv(1, 1, 1, 9, 9, 16, torch.float32, seed=10)
    assert isinstance(flash_attention(q, k, v), torch.Tensor)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda q, k, v: (q.numpy(), k, v), TypeError, "q must be a torch.Tensor"),
        (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "float16, bfloat16 and float32"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "same dtype"),
        (lambda q, k, v: (q[0], k[0], v[0]), ValueError, "must have 4 dims"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, "is empty"),
        (lambda q, k, v: (q[:, :3], k[:, :2], v[:, :2]), ValueError, "multiple of key/value heads"),
        (lambda q, k, v: (q, k[:, :, :5], v), ValueError, "k and v must agree"),
        (lambda q, k, v: (q, k[..., :16], v), ValueError, "same head dim D"),
        (lambda q, k, v: (q, k, v[..., :16]), ValueError, "v must have the same head dim"),
        (lambda q, k, v: (q[..., :20], k[..., :20], v[..., :20]), ValueError, "head dim 20 is not supported"),
        (lambda q, k, v: (q[..., :8], k[..., :8], v[..., :8]), ValueError, "head dim 8 is not supported"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, error, message):
    q, k, v = make_qkv(1, 4, 2, 10, 12, 32, torch.float32, seed=11)
    with pytest.raises(error, match=message):
        flash_attention(*make(q, k, v))


def test_bad_arguments_raise_clear_errors():
    q, k, v = make_qkv(1, 2, 2, 10, 12, 32, torch.float32, seed=12)
    with pytest.raises(ValueError, match="window must be a pair"):
        flash_attention(q, k, v, window=5)
    with pytest.raises(ValueError, match="window left must be an int >= 0"):
        flash_attention(q, k, v, window=(-1, 2))
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match="scale must be finite"):
        flash_attention(q, k, v, scale=float("inf"))
    with pytest.raises(TypeError, match="scale must be a number"):
        flash_attention(q, k, v, scale="0.1")
    with pytest.raises(ValueError, match="must be on the same device"):
        flash_attention(q.detach(), k, v.to("meta"))


def test_cpu_runs_leave_triton_language_as_they_found_it():
    # Triton's interpreter patches triton.language while it runs, and its nested device-function calls never
    # undo their patches; left in place they break any later GPU compile in the same process. flashlab's CPU
    # path snapshots and restores them: every attribute that existed before is the same object afterwards, and
    # no class gained one.
    from flashlab.kernels.runtime import language_objects

    objects = language_objects()
    before = [dict(vars(obj)) for obj in objects]
    q, k, v = make_qkv(1, 2, 1, 20, 40, 16, torch.bfloat16, seed=13)
    flash_attention(q, k, v, causal=True)  # the prefill kernel
    flash_attention(q[:, :, :2], k, v, num_splits=2)  # the split-KV kernels
    for obj, saved in zip(objects, before, strict=True):
        now = vars(obj)
        changed = [name for name, value in saved.items() if now.get(name) is not value]
        assert not changed, f"{getattr(obj, '__name__', obj)}: {changed[:5]} still patched"
        if isinstance(obj, type):
            added = sorted(set(now) - set(saved))
            assert not added, f"class {obj.__name__} gained {added[:5]}"
