"""``flash_attention_varlen`` compiled: under ``torch.compile(fullgraph=True)`` it is one opaque operator
(``torch.ops.flashlab.attention_varlen``) with the same output and gradients as eager, and its kernel compiles for
Hopper (sm_90) ahead of time, without a GPU.

On CPU the graph runs with the "aot_eager" backend, as in ``tests/test_compile.py`` (what inductor would be handed,
without inductor's long CPU compile).
"""

from __future__ import annotations

import pytest
import torch
from test_compile import CPU_BACKEND, graph_targets
from test_sm90_compile import compile_sm90, gpu_meta
from test_varlen import packed_case

from flashlab import flash_attention_varlen
from flashlab.host import varlen as host_varlen
from flashlab.kernels import configs, varlen
from flashlab.kernels.device import block_d, dot_precision, dot_upcast, kernel_band


def block(q, k, v, cu_q, cu_k, causal=True, window=None):  # attention inside a little model: ops on both sides
    o = flash_attention_varlen(q * 1.0, k, v, cu_q, cu_k, 7, 9, causal=causal, window=window)
    return torch.nn.functional.gelu(o) + q


@pytest.mark.parametrize("causal, window", [(True, None), (False, (3, 1))], ids=["causal", "window"])
def test_fullgraph_compile_is_one_operator_and_equals_eager(causal, window):
    q, k, v, _, cu_q, cu_k = packed_case([7, 0, 3], [9, 2, 3], 2, 1, 16)
    out, targets = graph_targets(block, q, k, v, cu_q, cu_k, causal, window)
    assert "flashlab.attention_varlen" in targets
    torch.testing.assert_close(out, block(q, k, v, cu_q, cu_k, causal, window), rtol=0, atol=0)


def test_compiled_gradients_equal_eager():
    q, k, v, do, cu_q, cu_k = packed_case([7, 1], [9, 4], 2, 1, 16, seed=2)

    def grads(fn):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        fn(qg, kg, vg, cu_q, cu_k).backward(do)
        return qg.grad, kg.grad, vg.grad

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=CPU_BACKEND, fullgraph=True)
    for eager, traced in zip(grads(block), grads(compiled), strict=True):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


def test_new_lengths_run_through_the_compiled_function():
    """Batches of other lengths and max_seqlen values (symbolic ints once dynamo sees them change) equal eager."""

    def packed_block(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_attention_varlen(q * 1.0, k, v, cu_q, cu_k, max_q, max_k, causal=True) + q

    torch._dynamo.reset()
    compiled = torch.compile(packed_block, backend=CPU_BACKEND, fullgraph=True)
    for lq, lk in (([7, 0, 3], [9, 2, 3]), ([5, 4], [6, 8]), ([2, 9, 1], [3, 9, 4])):
        q, k, v, _, cu_q, cu_k = packed_case(lq, lk, 2, 1, 16)
        args = (q, k, v, cu_q, cu_k, max(lq), max(lk))
        torch.testing.assert_close(compiled(*args), packed_block(*args), rtol=0, atol=0)


def test_boundary_checks_run_inside_the_compiled_operator():
    q, k, v, _, cu_q, cu_k = packed_case([7, 3], [9, 3], 2, 1, 16)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=CPU_BACKEND, fullgraph=True)
    bad = torch.tensor([0, 8, 10], dtype=torch.int32)  # a first sequence of 8 rows, more than max_seqlen_q = 7
    with pytest.raises(ValueError, match="more than max_seqlen_q = 7"):
        compiled(q, k, v, bad, cu_k)


# 16-bit only: an fp32 build (exact dots as FMAs over the whole tile) takes several times as long to compile
@pytest.mark.parametrize("dtype, d, causal, window", [(torch.bfloat16, 128, True, None), (torch.float16, 64, False,
                         (256, 0))])  # fmt: skip
def test_varlen_kernel_compiles_for_hopper(dtype, d, causal, window):
    """The kernel with the tiles a GPU launch takes where no tuned table has the bucket."""
    b, hq, hk, max_q, max_k = 3, 8, 2, 1000, 3000
    q = torch.empty(b * max_q, hq, d, dtype=dtype)
    k = torch.empty(b * max_k, hk, d, dtype=dtype)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    _, win_left, win_right, qk_scale, _ = kernel_band(max_q, max_k, d, causal, window, None)
    tensors = (q, k, k, q, torch.empty(8, dtype=torch.float32), cu, cu, cu)
    scalars = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(0), k.stride(1), q.stride(0), q.stride(1))
    scalars += (hq, hq // hk, b * max_q, win_left, win_right, qk_scale)
    name = configs.dtype_name(dtype)
    bm, bn, warps, stages = configs.PREFILL_DEFAULTS["skip_split"][configs.head_dim_class("skip_split", name, d)][0]
    meta = dict(HEAD_DIM=d, BLOCK_D=block_d(d), DOT_PRECISION=dot_precision(dtype, False),
                DOT_UPCAST=dot_upcast(dtype, False), REVERSE_M=causal, COUNT_TILES=False)  # fmt: skip
    constexprs = {**gpu_meta(meta, dtype), "BLOCK_M": bm, "BLOCK_N": bn}
    ptx = compile_sm90(varlen.attn_fwd_varlen, (*tensors, *scalars), constexprs,
                       {"num_warps": warps, "num_stages": stages})  # fmt: skip
    assert "mma" in ptx  # the two dots run on the tensor cores


@pytest.mark.parametrize("causal, window", [(True, None), (False, (256, 0))], ids=["causal", "window"])
def test_the_copy_engine_varlen_kernel_compiles_warp_specialised(causal, window):
    """``flashlab.kernels.varlen.hopper`` at D = 128 with rung 3's warp-specialised tiles: the loads before the
    loop (the boundaries, each program's search for its sequence) leave the specialisation on (producer and
    consumer warpgroups trade registers: ``setmaxnreg``), the tiles come by the copy engine, the products by wgmma."""
    from flashlab.kernels.varlen import hopper as varlen_hopper

    b, hq, hk, d, total = 32, 16, 4, 128, 16384
    q = torch.empty(total, hq, d, dtype=torch.bfloat16)
    k = torch.empty(total, hk, d, dtype=torch.bfloat16)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    _, win_left, win_right, qk_scale, _ = kernel_band(2048, 2048, d, causal, window, None)
    args = (q, k, k, q, torch.empty(hq, total), cu, cu, q.stride(0), k.stride(0), k.stride(0), q.stride(0), hq,
            hq // hk, total, total, b, win_left, win_right, qk_scale)  # fmt: skip
    meta = dict(HEAD_DIM=d, DOT_PRECISION="tf32", DOT_UPCAST=False, REVERSE_M=causal, MASK_LEFT=window is not None,
                CU_BLOCK=varlen_hopper.CU_BLOCK, BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True)  # fmt: skip
    ptx = compile_sm90(varlen_hopper._attn_fwd_varlen_hopper, args, meta, {"num_warps": 4, "num_stages": 2})
    assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 64)])
def test_varlen_backward_kernels_compile_for_hopper(dtype, d):
    """Preprocess, dK/dV and dQ with the tiles ``flashlab.host.varlen.backward_config`` gives an H200 (its shared
    memory), under the default schedule and the other grid orders and group split."""
    b, hq, hk, max_q, max_k = 3, 8, 2, 1000, 3000
    q = torch.empty(b * max_q, hq, d, dtype=dtype)
    k = torch.empty(b * max_k, hk, d, dtype=dtype)
    stats = torch.empty(hq, b * max_q, dtype=torch.float32)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    _, win_left, win_right, qk_scale, _ = kernel_band(max_q, max_k, d, True, None, None)
    meta = gpu_meta(dict(HEAD_DIM=d, BLOCK_D=block_d(d), DOT_PRECISION="ieee", DOT_UPCAST=False), dtype)
    h200_smem = 232448  # bytes of shared memory one block may opt into on an H200 (sm_90)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(0), k.stride(1), q.stride(0), q.stride(1))

    pre = (q, q, stats, stats, stats, cu, q.stride(0), q.stride(1), q.stride(0), q.stride(1), hq, b * max_q, b * max_q)
    pre_meta = {"HEAD_DIM": d, "BLOCK_D": block_d(d), "BLOCK_M": varlen.PREPROCESS_BLOCK_M}
    for aligned in (False, True):  # the statistics at each sequence's rows, or laid out for the copy engine
        compile_sm90(varlen.bwd_preprocess_varlen, pre, {**pre_meta, "ALIGNED_STATS": aligned},
                     {"num_warps": 4, "num_stages": 1})  # fmt: skip
    launches = {
        "dkdv": (varlen.bwd_dkdv_varlen, (q, k, k, q, k, k, stats, stats, cu, cu, *strides, k.stride(0), k.stride(1),
                                          0, hq, hk, hq // hk, b * max_q, win_left, win_right, qk_scale, 0.1)),
        "dq": (varlen.bwd_dq_varlen, (q, k, k, q, q, stats, stats, cu, cu, *strides, q.stride(0), q.stride(1), hq,
                                      hq // hk, b * max_q, win_left, win_right, qk_scale, 0.1)),
    }  # fmt: skip
    for kernel, (fn, args) in launches.items():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(host_varlen, "smem_limit", lambda index: h200_smem)
            patch.setattr(host_varlen, "device_index", lambda x: 0)
            config = host_varlen.backward_config(kernel, q)
        options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
        other = {"dkdv": {"TILE_MAJOR": True, "GROUP_SPLIT": 2}, "dq": {"TILE_MAJOR": True, "FROM_END": True}}[kernel]
        for schedule in (varlen.SCHEDULE_DEFAULTS[kernel], other):
            ptx = compile_sm90(fn, args, {**meta, **config, **schedule}, options)
            assert "mma" in ptx, (kernel, schedule)  # the tensor cores


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_copy_engine_varlen_backward_compiles_warp_specialised(causal):
    """The dK/dV and dQ kernels of ``flashlab.kernels.varlen.hopper`` with their GPU tiles (``BACKWARD_TILES``):
    warp-specialised (``setmaxnreg``), the tiles and the statistics by the copy engine, the products by wgmma."""
    from flashlab.kernels.varlen import hopper

    b, hq, hk, d, total = 32, 16, 4, 128, 16384
    q = torch.empty(total, hq, d, dtype=torch.bfloat16)
    k = torch.empty(total, hk, d, dtype=torch.bfloat16)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    stats = torch.empty(hq, hopper.stats_stride(total, b))
    _, win_left, win_right, qk_scale, _ = kernel_band(2048, 2048, d, causal, None, None)
    sizes = (hq, hq // hk, total, total, b, stats.stride(0), win_left, win_right, qk_scale)
    strides = (q.stride(0), k.stride(0), k.stride(0), q.stride(0))
    common = dict(HEAD_DIM=d, DOT_PRECISION="tf32", DOT_UPCAST=False, CU_BLOCK=hopper.CU_BLOCK, WARP_SPECIALIZE=True)
    kernels = {
        "dkdv": (hopper.bwd_dkdv_varlen_hopper, (q, k, k, q, k, k, stats, stats, cu, cu, *strides, k.stride(0),
                                                  *sizes, 0.1), dict(common, HIDE_BEFORE=causal, HIDE_AFTER=False)),
        "dq": (hopper.bwd_dq_varlen_hopper, (q, k, k, q, q, stats, stats, cu, cu, *strides, q.stride(0), *sizes, 0.1),
               dict(common, MASK_LEFT=False, MASK_RIGHT=causal, REVERSE_M=causal)),
    }  # fmt: skip
    for name, (fn, args, meta) in kernels.items():
        bm, bn, warps, stages = hopper.BACKWARD_TILES[name]
        ptx = compile_sm90(fn, args, {**meta, "BLOCK_M": bm, "BLOCK_N": bn}, {"num_warps": warps, "num_stages": stages})
        assert "setmaxnreg" in ptx and "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx, name
