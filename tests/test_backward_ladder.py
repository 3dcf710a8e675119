"""The backward's ladder (``flashlab.kernels.backward``): its registry and choice, and every rung's gradients on
the CPU (Triton's interpreter, descriptors and all) against float64 ``torch.autograd`` on the same awkward cases:
odd lengths, Nq != Nk, grouped-query heads, head dims that are not powers of two, causal and window masks, rows
that see no key, negative scales, 16-bit dtypes -- and determinism. The Hopper rung's layout facts (its lse and
delta padded to whole tiles) are checked where it writes them. The compiled kernels are in
``tests/test_sm90_compile.py`` (for sm_90) and ``tests/test_backward_gpu.py`` (on a GPU)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.host.attention import flash_attention
from flashlab.kernels import backward
from flashlab.kernels.backward import rung1_two_pass, rung2_hopper
from flashlab.kernels.device import CPU_CONFIG
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads

RUNGS = backward.names()[:4]  # the rungs Triton's interpreter runs (the one_pass rungs are Gluon: a GPU only)


def make_inputs(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in
                 ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d), (b, hq, nq, d)))  # fmt: skip


def rung_grads(rung, q, k, v, do, causal=False, window=None, scale=None):
    """The rung's gradients from the float64 forward's o and lse (rounded as a kernel's forward leaves them)."""
    o, lse = attention_float64(q, k, v, causal=causal, window=window, scale=scale)
    return backward.rung_named(rung).attention_backward(do, q, k, v, o.to(q.dtype), lse.float(), causal, window,
                                                        scale)  # fmt: skip


def check(rung, q, k, v, do, causal=False, window=None, scale=None):
    grads = rung_grads(rung, q, k, v, do, causal, window, scale)
    refs = attention_float64_grads(q, k, v, do, causal, window, scale)
    tol = grad_tolerance(q.dtype)
    for name, x, ref, like in zip("qkv", grads, refs, (q, k, v), strict=True):
        assert x.shape == like.shape and x.dtype == like.dtype, f"{rung} d{name}: {x.shape} {x.dtype}"
        err = relative_error(x, ref)
        assert err <= tol, f"{rung} d{name}: relative error {err:.2e} over {tol:.0e} for {q.dtype}"
    return grads


def random_case(seed):
    rng = np.random.default_rng(500 + seed)
    hk = int(rng.integers(1, 3))
    group = int(rng.choice([1, 2, 3]))
    nq, nk = (int(x) for x in rng.integers(1, 45, size=2))
    d = int(rng.choice([16, 24, 40]))
    causal = bool(rng.integers(0, 2))
    window = None
    if rng.random() < 0.4:
        window = (int(rng.integers(0, 20)), None if causal else int(rng.integers(0, 20)))
    scale = None if rng.random() < 0.7 else float(rng.choice([-0.4, 0.05, 0.9]))
    dtype = (torch.float16, torch.bfloat16)[seed % 2]
    return dict(b=int(rng.integers(1, 3)), hq=hk * group, hk=hk, nq=nq, nk=nk, d=d, dtype=dtype), causal, window, scale


# ----------------------------------------------------------------------------------------------------------------
# The registry and the choice
# ----------------------------------------------------------------------------------------------------------------


def test_the_rungs_run_slowest_first_and_say_what_each_removes():
    assert backward.names() == ("two_pass", "hopper", "atomic_dq", "ordered_dq", "one_pass_atomic", "one_pass")
    assert backward.BACKWARD_RUNGS[0].unavailable is backward.runs_everywhere  # the floor runs everywhere
    assert all(r.removes and r.load().attention_backward for r in backward.BACKWARD_RUNGS)
    assert [r.deterministic for r in backward.BACKWARD_RUNGS] == [True, True, False, True, False, True]


def test_the_gluon_rung_says_why_it_cannot_run_on_the_cpu_and_the_floor_runs():
    q, k, v, do = make_inputs(1, 2, 2, 8, 8, 64, torch.bfloat16, seed=0)
    assert "GPU only" in backward.rung_named("one_pass_atomic").unavailable(q, k, v, do)
    assert "GPU only" in backward.rung_named("one_pass").unavailable(q, k, v, do)
    assert backward.select(None, q, k, v, do)[0].name == "two_pass"
    chosen, note = backward.select("one_pass", q, k, v, do)
    assert chosen.name == "ordered_dq" and "'one_pass'" in note and "GPU only" in note  # the highest that runs


def test_an_unknown_name_is_an_error_that_lists_the_rungs():
    with pytest.raises(ValueError, match="two_pass, hopper"):
        backward.rung_named("fast")
    with pytest.raises(TypeError):
        backward.rung_named(2)
    q, k, v, _ = make_inputs(1, 2, 2, 8, 8, 16, torch.float16, seed=0)
    with pytest.raises(ValueError, match="unknown backward_rung"):
        flash_attention(q, k, v, backward_rung="fast")


def test_the_default_is_the_floor_except_where_a_rung_measured_faster():
    q, k, v, do = make_inputs(1, 2, 2, 8, 8, 16, torch.bfloat16, seed=0)
    assert rung2_hopper.unavailable(q, k, v, do) is None  # the interpreter runs it ...
    assert backward.select(None, q, k, v, do) == (backward.rung_named("two_pass"), None)  # ... not by default
    # on a GPU, the hopper rung where it measured faster: the head dims that pad to 128, not 64 or 256
    assert [d for d in (32, 64, 72, 80, 96, 128, 160, 256) if rung2_hopper.prefers_head_dim(d)] == [72, 80, 96, 128]
    assert not backward.rung_named("ordered_dq").preferred(q, k, v, do)  # measured slower than rung 1
    assert backward.select("hopper", q, k, v, do) == (backward.rung_named("hopper"), None)
    assert backward.select("atomic_dq", q, k, v, do) == (backward.rung_named("atomic_dq"), None)  # named: it runs
    # not deterministic: never the default, even where it is preferred
    atomic = backward.rung_named("atomic_dq")
    preferred = backward.BackwardRung(atomic.name, atomic.removes, atomic.module, atomic.unavailable, None, False)
    assert backward.select(None, q, k, v, do, rungs=(*backward.BACKWARD_RUNGS[:2], preferred))[0].name == "two_pass"


def test_a_named_rung_that_cannot_run_says_why_and_the_floor_runs():
    q, k, v, do = make_inputs(1, 2, 2, 8, 8, 16, torch.float32, seed=0)
    chosen, note = backward.select("hopper", q, k, v, do)
    assert chosen.name == "two_pass" and "16-bit inputs only" in note and "'hopper'" in note
    assert backward.select("atomic_dq", q, k, v, do)[0].name == "two_pass"
    x = make_inputs(1, 2, 2, 8, 16, 16, torch.float16, seed=0)[1]
    heads_last = x.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory: heads not stacked
    assert "rows of heads one after another" in rung2_hopper.unavailable(heads_last, x, x, x)
    qf, kf, vf = (x.detach().requires_grad_() for x in (q, k, v))
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        flash_attention(qf, kf, vf, backward_rung="hopper").backward(do)
    assert torch.isfinite(qf.grad).all()


# ----------------------------------------------------------------------------------------------------------------
# Every rung against float64, on the same cases
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_match_float64_autograd(rung, seed):
    shape, causal, window, scale = random_case(seed)
    check(rung, *make_inputs(**shape, seed=seed), causal, window, scale)


@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_loop_step_across_tiles_with_gqa(rung, dtype):
    # 3 query tiles x 3 key tiles of the CPU config, ragged at both ends, causal with Nq != Nk, 3 query heads per
    # K/V head: the band's edges, the group's flat loop and the tiles that run past a head's last row
    nq, nk = 2 * CPU_CONFIG["BLOCK_M"] + 5, 2 * CPU_CONFIG["BLOCK_N"] + 9
    check(rung, *make_inputs(1, 3, 1, nq, nk, 16, dtype, seed=3), causal=True)
    check(rung, *make_inputs(2, 4, 2, nq, nk, 24, dtype, seed=4), window=(7, 3))


@pytest.mark.parametrize("rung", RUNGS)
def test_negative_scales_and_rows_that_see_no_key(rung):
    q, k, v, do = make_inputs(1, 2, 2, 17, 23, 24, torch.float16, seed=6)
    check(rung, q, k, v, do, scale=-0.3)
    check(rung, q, k, v, do, causal=True, scale=-1.2)
    q, k, v, do = make_inputs(1, 2, 1, 30, 12, 16, torch.bfloat16, seed=7)  # causal, Nq > Nk: 18 rows see nothing
    dq, _, _ = check(rung, q, k, v, do, causal=True)
    assert (dq[:, :, : 30 - 12] == 0).all()


@pytest.mark.parametrize("rung", RUNGS)
def test_two_runs_are_bit_identical(rung):
    q, k, v, do = make_inputs(2, 4, 2, 37, 29, 24, torch.bfloat16, seed=9)
    first = rung_grads(rung, q, k, v, do, causal=True)
    second = rung_grads(rung, q, k, v, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_named_rung_runs_through_autograd_and_a_strided_do_is_copied():
    q, k, v, do = make_inputs(1, 4, 2, 21, 33, 16, torch.bfloat16, seed=10)
    leaves = [tuple(x.detach().requires_grad_() for x in (q, k, v)) for _ in RUNGS]
    do_t = do.transpose(2, 3).contiguous().transpose(2, 3)  # the same dO with a strided last dim
    assert do_t.stride(-1) != 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the Hopper rung runs here: no fallback warning
        for rung, (qg, kg, vg) in zip(RUNGS, leaves, strict=True):
            flash_attention(qg, kg, vg, causal=True, backward_rung=rung).backward(do_t)
    refs = attention_float64_grads(q, k, v, do, causal=True)
    for qg, kg, vg in leaves:
        for x, ref in zip((qg.grad, kg.grad, vg.grad), refs, strict=True):
            assert relative_error(x, ref) <= grad_tolerance(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------------
# The Hopper rung's row statistics, padded to whole tiles
# ----------------------------------------------------------------------------------------------------------------


def test_the_preprocess_pads_delta_with_zeros_and_the_lse_with_plus_infinity():
    # a tile of query rows that runs past its head's last row reads rows ROWS > NQ: there lse2 must be +inf (P = 0)
    # and delta 0, so those rows add nothing to dK and dV without a mask
    from flashlab.kernels import softmax_step
    from flashlab.kernels.interpreter import interpreted, interpreted_language

    b, hq, nq, d, rows = 1, 2, 20, 16, 32
    o, do = (torch.randn(b, hq, nq, d) for _ in range(2))
    lse = torch.randn(b, hq, nq)
    lse[0, 1, 3] = float("-inf")  # a row that saw no key
    delta, lse2 = (torch.full((b * hq, rows), 7.0) for _ in range(2))
    args = (o, do, lse, delta, lse2, *o.stride()[:3], *do.stride()[:3], *lse.stride(), hq, nq, rows)
    with interpreted_language(softmax_step):
        interpreted(rung1_two_pass.bwd_preprocess)[(rows // 16, b * hq)](*args, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=16)
    want_delta = (o * do).sum(-1).reshape(b * hq, nq)
    torch.testing.assert_close(delta[:, :nq], want_delta)
    torch.testing.assert_close(lse2[0, :nq], lse[0, 0] * math.log2(math.e))
    assert lse2[1, 3] == float("inf")  # no key: P = 0, never NaN
    assert (delta[:, nq:] == 0).all() and (lse2[:, nq:] == float("inf")).all()
    assert rung2_hopper.ROW_ALIGN % max(max(t[0] for t in c.values()) for c in rung2_hopper.GPU_TILES.values()) == 0


def test_the_ordered_adds_sum_dq_in_the_key_tiles_order():
    # on the interpreter the programs run one after another, lower key tiles first, so rung 3's atomic adds land in
    # key-tile order too: rung 4's turns must give exactly that sum (a wrong turn would wait for ever or reorder it)
    q, k, v, do = make_inputs(1, 4, 2, 45, 61, 24, torch.bfloat16, seed=11)  # 4 key tiles, a GQA group of 2
    for causal, window in ((True, None), (False, (9, 20)), (False, None)):
        atomic = rung_grads("atomic_dq", q, k, v, do, causal, window)
        ordered = rung_grads("ordered_dq", q, k, v, do, causal, window)
        assert all(torch.equal(a, b) for a, b in zip(atomic, ordered, strict=True)), (causal, window)
