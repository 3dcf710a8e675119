"""The Triton kernel on the CPU (Triton's interpreter) against the float64 reference.

Small, awkward shapes: odd lengths, Nq != Nk, grouped-query heads, head dims that are not powers of two, causal and
window masks, rows that see no key, non-contiguous inputs, every dtype. Error: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from flashlab.core.numerics import relative_error, tolerance
from flashlab.host.attention import flash_attention
from flashlab.kernels.device import CPU_CONFIG
from flashlab.reference import attention
from flashlab.reference.torch_float64 import attention_float64

LSE_TOL = 1e-4  # lse is computed in fp32 from exact products of the (rounded) inputs; relative where |lse| > 1


def make_qkv(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, nk, d, generator=g).to(dtype)
    return q, k, v


def check_against_reference(q, k, v, causal=False, window=None, scale=None):
    o, lse = flash_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True)
    return check_outputs(q, k, v, o, lse, causal=causal, window=window, scale=scale)


def check_outputs(q, k, v, o, lse, causal=False, window=None, scale=None):
    """``check_against_reference`` for an ``(o, lse)`` already computed from q, k, v (by any path)."""
    ro, rlse = attention(
        q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=causal, window=window, scale=scale
    )
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    o, lse = o.double().numpy(), lse.double().numpy()
    assert np.isfinite(o).all()
    err = np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-300)
    assert err < tolerance(q.dtype), f"relative error {err:.2e} over {tolerance(q.dtype):.0e} for {q.dtype}"
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


LAYOUTS = ("contiguous", "slice", "every_other_row", "heads_last", "expanded", "strided_head_dim")


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (B, H, N, D) held in memory another way: a slice of a larger tensor, every other row of one, the
    (B, N, H, D) layout seen as (B, H, N, D), expanded from one batch entry and one head (stride 0; the values then
    repeat), or with a strided head dim. The same values, except ``expanded``'s repetition."""
    b, h, n, d = x.shape
    if layout == "contiguous":
        return x
    if layout == "slice":  # offset into a larger buffer along every dim
        big = torch.zeros(b + 1, h + 1, n + 3, d + 8, dtype=x.dtype)
        big[1:, 1:, 2 : 2 + n, 8:] = x
        return big[1:, 1:, 2 : 2 + n, 8:]
    if layout == "every_other_row":
        big = torch.zeros(b, h, 2 * n, d, dtype=x.dtype)
        big[:, :, ::2] = x
        return big[:, :, ::2]
    if layout == "heads_last":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "expanded":
        return x[:1, :1].expand(b, h, n, d)
    if layout == "strided_head_dim":
        big = torch.zeros(b, h, n, 2 * d, dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    raise ValueError(layout)


def random_layout_case(seed):
    """A random case of ``random_case`` with q, k and v in random memory layouts, a scale that is negative in half
    the cases, and a path: prefill, split-KV (``num_splits``) or the default choice (split-KV at Nq <= 16)."""
    rng = np.random.default_rng(1000 + seed)
    shape, causal, window = random_case(seed)
    layouts = [LAYOUTS[int(i)] for i in rng.integers(0, len(LAYOUTS), size=3)]
    layouts[0] = LAYOUTS[1 + seed % (len(LAYOUTS) - 1)]  # q is never contiguous: every other layout in turn
    scale = [None, -0.5, -1.3, 0.7][seed % 4] if seed % 2 else float(-rng.uniform(0.1, 1.5))
    num_splits = [None, None, min(3, shape["nk"])][seed % 3]
    return shape, causal, window, layouts, scale, num_splits


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_and_negative_scales_match_float64(seed):
    # q a slice, a strided or an expanded view with a negative scale: the launch must read q through the strides of
    # the tensor it launches on (-q), on prefill and on split-KV
    shape, causal, window, layouts, scale, num_splits = random_layout_case(seed)
    q, k, v = (laid_out(x, lay) for x, lay in zip(make_qkv(**shape, seed=seed), layouts, strict=True))
    o, lse = flash_attention(q, k, v, causal, window, scale, return_lse=True, num_splits=num_splits)
    ro, rlse = attention_float64(q, k, v, causal=causal, window=window, scale=scale)
    assert torch.isfinite(o).all(), f"non-finite outputs with layouts {layouts}, scale {scale}"
    err = relative_error(o, ro)
    assert err < tolerance(q.dtype), f"relative error {err:.2e} with layouts {layouts}, scale {scale}"
    empty = torch.isneginf(rlse)
    assert torch.equal(torch.isneginf(lse), empty)
    if (~empty).any():
        gap = (lse.double() - rlse)[~empty].abs() / rlse[~empty].abs().clamp(min=1.0)
        assert float(gap.max()) < LSE_TOL, f"lse off by {float(gap.max()):.2e} with layouts {layouts}"


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("sparse", ["to_sparse", "to_sparse_csr"])
def test_a_sparse_tensor_is_a_clear_type_error_naming_it(name, sparse):
    qkv = dict(zip("qkv", make_qkv(1, 2, 2, 8, 8, 16, torch.float32, seed=1), strict=True))
    with warnings.catch_warnings():  # torch calls its CSR layout beta when one is made
        warnings.simplefilter("ignore", UserWarning)
        qkv[name] = getattr(qkv[name], sparse)()
    with pytest.raises(TypeError, match=f"{name} must be a dense"):
        flash_attention(**qkv)


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


def test_hidden_tiles_do_not_change_a_bit_of_the_output():
    # NaN keys/values in whole tiles that the window hides from every query: the loop bounds skip them, and had a
    # masked stage loaded them it would still replace their scores by -inf and ignore their values; a tile run
    # through the unmasked stage by mistake would turn the output into NaN (0 * NaN).
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
    from flashlab.kernels.interpreter import language_objects

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


def test_calls_from_several_threads_at_once_are_correct_and_leave_triton_language_as_it_was():
    # Triton's interpreter patches triton.language while it runs; two threads interleaving their patches and
    # restores would corrupt it (crashes mid-run, or patches left behind). Three threads of small causal calls,
    # prefill and split-KV mixed: every result equals the reference, and the language is as it was after.
    import threading

    from flashlab.kernels.interpreter import language_objects

    objects = language_objects()
    before = [dict(vars(obj)) for obj in objects]
    cases = [make_qkv(1, 2, 1, nq, 24, 16, torch.float32, seed=40 + i) for i, nq in enumerate((20, 3, 17))]
    errors, results = [], {}

    def work(i):
        try:
            for _ in range(2):
                results[i] = check_against_reference(*cases[i], causal=True)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the main thread
            errors.append((i, repr(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]
    for obj, saved in zip(objects, before, strict=True):
        now = vars(obj)
        changed = [name for name, value in saved.items() if now.get(name) is not value]
        assert not changed, f"{getattr(obj, '__name__', obj)}: {changed[:5]} still patched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "nq, nk, causal, window",
    [(40, 40, True, None), (24, 45, True, None), (40, 50, False, (5, 3)), (33, 40, False, (None, 0))],
)
def test_inf_and_nan_in_hidden_v_rows_do_not_reach_rows_that_cannot_see_them(dtype, nq, nk, causal, window):
    # The diagonal tiles are computed with an element mask: the hidden keys get p = 0, but a plain P @ V gives
    # 0 * inf = NaN and would spread a bad V row to every row of the tile. Rows that cannot see the bad keys must
    # equal the clean result bit for bit; rows that can see them are not finite, as in the float64 reference
    # (which entries are NaN or inf may differ: a masked tile makes such a row NaN as a whole).
    q, k, v = make_qkv(1, 2, 1, nq, nk, 32, dtype, seed=21)
    v_bad = v.clone()
    v_bad[0, 0, nk - 1] = float("nan")  # past the diagonal / right edge of most rows: stage 2
    v_bad[0, 0, nk - 3, 5] = float("inf")
    v_bad[0, 0, nk - 5, 7] = float("-inf")
    if window is not None and window[0] is not None:
        v_bad[0, 0, 3, 2] = float("nan")  # left of every row's window, inside a tile cut by the left edge: stage 0
    o_clean = flash_attention(q, k, v, causal=causal, window=window)
    o = flash_attention(q, k, v_bad, causal=causal, window=window).double().numpy()
    ref, _ = attention(q.double().numpy(), k.double().numpy(), v_bad.double().numpy(), causal=causal, window=window)
    clean_rows = np.isfinite(ref).all(axis=-1)  # (B, H, Nq)
    np.testing.assert_array_equal(np.isfinite(o).all(axis=-1), clean_rows)
    assert clean_rows.any() and (~clean_rows).any()
    np.testing.assert_array_equal(o[clean_rows], o_clean.double().numpy()[clean_rows])


@pytest.mark.parametrize("scale", [1e39, -1e39, 10**400, 3e38])
def test_scale_beyond_float32_is_a_clear_value_error(scale):
    # the kernels multiply the scores by scale * log2(e) in float32: 1e39 would silently become inf, then NaN
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, seed=22)
    with pytest.raises(ValueError, match="scale"):
        flash_attention(q, k, v, scale=scale)


def test_numpy_numbers_are_accepted_where_a_number_is_meant():
    q, k, v = make_qkv(1, 2, 1, 20, 27, 16, torch.float32, seed=23)
    expected = flash_attention(q, k, v, window=(3, 2), scale=0.125)
    got = flash_attention(q, k, v, window=(np.int64(3), np.int32(2)), scale=np.float32(0.125))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    check_against_reference(q, k, v, window=(np.int64(3), np.int64(2)), scale=np.float64(0.2))


@pytest.mark.parametrize("side", [2**63, 2**63 - 1, 2**64 + 5, 10**30])
def test_window_sides_beyond_int64_mean_unbounded(side):
    # a window side wider than the score matrix reaches every key: it is exactly the unbounded side, at any size,
    # not an OverflowError from deep inside the launch (nor a band wrapped around by int64 arithmetic)
    q, k, v = make_qkv(1, 1, 1, 20, 30, 16, torch.float32, seed=24)
    for window, same in (((side, 0), (None, 0)), ((4, side), (4, None)), ((side, side), (None, None))):
        torch.testing.assert_close(flash_attention(q, k, v, window=window), flash_attention(q, k, v, window=same))
        torch.testing.assert_close(
            flash_attention(q[:, :, :2], k, v, window=window), flash_attention(q[:, :, :2], k, v, window=same)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "nq, nk, causal, window",
    [(1000, 1000, True, None), (777, 1500, False, (300, 40)), (2, 6000, True, None), (4, 6000, False, (2000, 0))],
)
def test_gpu_hidden_non_finite_v_rows_do_not_leak(dtype, nq, nk, causal, window):
    # the compiled kernels (prefill for nq = 1000/777, split-KV for nq = 2/4): the same contract as on CPU
    from flashlab.core.masking import visible_mask

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, h, n, 128, device="cuda", generator=g).to(dtype) for h, n in ((8, nq), (2, nk), (2, nk)))
    bad = [nk - 1, nk - 1 - nq // 4]  # past the diagonal / right edge of the first rows
    v_bad = v.clone()
    v_bad[:, :, bad[0]] = float("nan")
    v_bad[:, :, bad[1], 3] = float("inf")
    if window is not None:  # left of every row's window, in the same 16-key group as the first visible key
        first_visible = nk - nq - window[0]
        bad.append(first_visible // 16 * 16 if first_visible % 16 else first_visible - 1)
        v_bad[:, :, bad[2], 5] = float("-inf")
    o_clean = flash_attention(q, k, v, causal=causal, window=window)
    o = flash_attention(q, k, v_bad, causal=causal, window=window)
    sees_bad = torch.from_numpy(visible_mask(nq, nk, causal, window)[:, bad].any(axis=1)).cuda()  # (Nq,)
    assert (~sees_bad).any()
    # Rows that see no bad value stay finite and right. The Hopper rungs find a tile with a non-finite value and
    # redo it in their repair pass, in another tile order, so those rows may differ from the clean run in the last
    # bits (rungs 1-2 guard the masked tiles and give the same bits).
    assert torch.isfinite(o[:, :, ~sees_bad]).all()
    torch.testing.assert_close(o[:, :, ~sees_bad], o_clean[:, :, ~sees_bad], rtol=0, atol=2e-2)
    assert not torch.isfinite(o[:, :, sees_bad]).all(dim=-1).any()  # every row that sees a bad value shows it


def test_device_function_calls_inside_a_launch_do_not_patch_the_language_again():
    # Triton's interpreter re-patched triton.language (through inspect.getmembers) at every device-function call
    # of a running kernel, a quarter of a CPU call's time; flashlab's CPU path patches once per kernel launch.
    from triton.runtime import interpreter

    real, patched = interpreter._patch_lang, []

    def counting(fn):
        patched.append(fn.__name__)
        return real(fn)

    interpreter._patch_lang = counting
    try:
        q, k, v = make_qkv(1, 2, 1, 40, 70, 16, torch.float32, seed=14)
        check_against_reference(q, k, v, causal=True)  # a few key tiles: tl.max, tl.sum... called per tile
    finally:
        interpreter._patch_lang = real
    assert 1 <= len(patched) <= 3, patched  # the launch's own (and a repair pass's), not one per device call
