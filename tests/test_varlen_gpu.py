"""``flash_attention_varlen`` compiled on a CUDA GPU, at training and serving sizes, against float64 per sequence
(skipped without CUDA).

Run on the H200 with: ``python -m pytest tests/test_varlen_gpu.py -q``. Ragged batches of a few thousand tokens
with empty and one-token sequences among them, 32 query / 8 KV heads at D = 64 and 128, causal and sliding-window
masks; the gradients; the packed call against ``flash_attention`` run sequence by sequence; bit-identical reruns;
and ``torch.compile`` with inductor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_varlen import check_forward, packed_case, sequence, varlen_attention_float64, varlen_grads_float64

from flashlab import flash_attention, flash_attention_varlen
from flashlab.core.numerics import grad_tolerance, relative_error, tolerance

pytestmark = pytest.mark.gpu


def ragged_lengths(seed, b, most):
    rng = np.random.default_rng(seed)
    lq = rng.integers(1, most, size=b).tolist()
    lk = [n + int(rng.integers(0, most // 4)) for n in lq]  # keys: a cached prefix before the new queries
    lq[1], lk[2], lq[3], lk[3] = 0, 0, 1, 1
    return lq, lk


def on_gpu(*xs):
    return [x.cuda() for x in xs]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (512, None))])
def test_forward_equals_float64_per_sequence(dtype, d, causal, window):
    lq, lk = ragged_lengths(d, 8, 1500)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 32, 8, d, dtype, seed=1))
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, window=window,
                                    return_lse=True)  # fmt: skip
    ref = varlen_attention_float64(*(x.cpu() for x in (q, k, v, cu_q, cu_k)), causal, window)
    check_forward(o.cpu(), lse.cpu(), *ref, cu_q.cpu(), dtype)


@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64),
                                      (torch.float32, 128)])  # fmt: skip
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (150, 40))])
def test_gradients_equal_float64_per_sequence(dtype, d, causal, window):
    """At D = 128 in 16 bits the copy-engine kernels (``flashlab.kernels.varlen.hopper``), elsewhere the pointer
    kernels; a first sequence of no rows and no keys among the others."""
    lq, lk = ragged_lengths(3, 5, 700)
    lq[0], lk[0] = 0, 0
    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, 8, 2, d, dtype, seed=2)
    qg, kg, vg = (x.cuda().requires_grad_() for x in (q, k, v))
    o = flash_attention_varlen(qg, kg, vg, cu_q.cuda(), cu_k.cuda(), max(lq), max(lk), causal=causal, window=window)
    o.backward(do.cuda())
    refs = varlen_grads_float64(q, k, v, do, cu_q, cu_k, causal, window)
    for name, x, ref in zip("qkv", (qg.grad, kg.grad, vg.grad), refs, strict=True):
        err = relative_error(x.cpu(), ref)
        assert err <= grad_tolerance(dtype), f"d{name}: relative error {err:.2e} for {dtype}"


def test_packed_equals_flash_attention_per_sequence():
    lq, lk = ragged_lengths(5, 16, 2048)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 32, 8, 128, torch.bfloat16, seed=3))
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    for b in range(len(lq)):
        if lq[b] == 0 or lk[b] == 0:
            continue
        ref = flash_attention(sequence(q, cu_q, b), sequence(k, cu_k, b), sequence(v, cu_k, b), causal=True)
        err = relative_error(sequence(o, cu_q, b).float(), ref.float())
        assert err <= tolerance(torch.bfloat16), f"sequence {b}: {err:.2e}"


def test_two_runs_are_bit_identical():
    lq, lk = ragged_lengths(7, 6, 1000)
    q, k, v, do, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 16, 4, 128, torch.bfloat16, seed=4))
    runs = []
    for _ in range(2):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o = flash_attention_varlen(qg, kg, vg, cu_q, cu_k, max(lq), max(lk), causal=True)
        o.backward(do)
        runs.append((o, qg.grad, kg.grad, vg.grad))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_inductor_compile_equals_eager():
    lq, lk = ragged_lengths(9, 4, 600)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 8, 2, 64, torch.bfloat16, seed=5))

    def block(q, k, v):
        o = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), True)
        return o, torch.nn.functional.gelu(o) + q

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    (o_compiled, y_compiled), (o_eager, y_eager) = compiled(q, k, v), block(q, k, v)
    # the attention operator itself gives the same bits; inductor fuses gelu and the add around it into one
    # kernel that rounds to bf16 once, where eager rounds after each, so the block agrees to bf16's rounding
    torch.testing.assert_close(o_compiled, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(y_compiled, y_eager, rtol=1.6e-2, atol=1.6e-2)


def test_bad_boundaries_are_raised_by_a_later_call_and_give_nan():
    """The default check runs on the device: the faulty call returns at once, its output NaN; the error is raised by
    ``check_kvcache_errors`` (which waits for the GPU) or by the next checked call after the launch has finished.
    An entry far outside the tensors reads nothing there (the next launches run)."""
    from flashlab import check_kvcache_errors

    lq, lk = ragged_lengths(5, 6, 400)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 8, 2, 64, torch.bfloat16, seed=5))
    good = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk))
    far = cu_k.clone()
    far[2] = 2**30  # a decrease after it, and rows far past the packed keys
    o = flash_attention_varlen(q, k, v, cu_q, far, max(lq), max(lk))
    torch.cuda.synchronize()
    assert torch.isnan(o).all()
    with pytest.raises(ValueError, match=r"an earlier flash_attention_varlen call on cuda:\d met bad boundaries: "
                                         r"cu_seqlens_k must not decrease: entry 3"):  # fmt: skip
        check_kvcache_errors()
    again = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk))
    assert torch.equal(again, good)
    flash_attention_varlen(q, k, v, cu_q, far, max(lq), max(lk))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="an earlier flash_attention_varlen call"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk))


def test_a_varlen_call_is_captured_in_a_cuda_graph():
    """No host read of the boundaries: the default call can be captured and replayed, new boundaries and all."""
    lq, lk = ragged_lengths(6, 6, 300)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 8, 2, 64, torch.bfloat16, seed=6))
    expect = flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 500)  # compiles, and makes the error record
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 500)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    lq2 = [lq[1], lq[0], *lq[2:]]  # the same rows cut into other sequences
    lk2 = [lk[1], lk[0], *lk[2:]]
    cu_q.copy_(torch.tensor([0, *np.cumsum(lq2)], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, *np.cumsum(lk2)], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 500))


@pytest.mark.parametrize("d", [64, 128])
def test_calls_with_new_lengths_launch_directly_and_give_the_jits_bits(monkeypatch, d):
    """A training loop's batches: new lengths every step, one binary per kernel. After its first calls each of the
    five varlen kernels (the boundary check, the forward, the backward's three) runs from a checked direct launch
    of the host engine (no Triton JIT per launch), and every step gives the bits launches through the JIT give. At
    D = 128 the forward and the backward's two loops are the copy-engine kernels, whose direct launches pass their
    descriptors' global scratch."""
    from flashlab.host import plan as plans
    from flashlab.host import varlen as host_varlen
    from flashlab.kernels import varlen as kernels
    from flashlab.kernels.varlen import hopper as varlen_hopper

    def jit_only(jit_function, grid, args, kwargs, runtime, outputs):
        jit_function[grid](*args, **kwargs)

    def step(q, k, v, do, cu_q, cu_k, lq, lk):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o = flash_attention_varlen(qg, kg, vg, cu_q, cu_k, max(lq), max(lk), causal=True)
        o.backward(do)
        return o, qg.grad, kg.grad, vg.grad

    for seed in range(5):
        lq, lk = ragged_lengths(20 + seed, 6, 700)
        case = on_gpu(*packed_case(lq, lk, 16, 4, d, torch.bfloat16, seed=seed))
        planned = step(*case, lq, lk)
        with monkeypatch.context() as patch:
            patch.setattr(host_varlen, "planned_launch", jit_only)
            through_jit = step(*case, lq, lk)
        for a, b in zip(planned, through_jit, strict=True):
            assert torch.equal(a, b), seed
    if d == 64:
        forward, dkdv, dq = kernels.attn_fwd_varlen, kernels.bwd_dkdv_varlen, kernels.bwd_dq_varlen
    else:  # the copy engine's kernels, their descriptors' scratch passed by the direct launch
        forward, dkdv, dq = (varlen_hopper.attn_fwd_varlen_hopper, varlen_hopper.bwd_dkdv_varlen_hopper,
                             varlen_hopper.bwd_dq_varlen_hopper)  # fmt: skip
    jit_functions = (kernels.check_boundaries, forward, kernels.bwd_preprocess_varlen, dkdv, dq)
    for fn in jit_functions:
        states = [p.state for key, p in plans.PLANS.items() if p.path == "planned" and key[0] is fn]
        assert plans.CHECKED in states, (fn, states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (300, None)), (False, (200, 50))])
def test_the_copy_engine_kernel_equals_float64_per_sequence(dtype, d, causal, window):
    """``flashlab.kernels.varlen.hopper`` (what D = 128 runs by default) under each of rung 3's tile configs, a
    first sequence of no rows among empty and one-token ones, o starting as NaN (every row written, none twice)."""
    from flashlab.kernels.device import kernel_band
    from flashlab.kernels.ladder import rung3_hopper
    from flashlab.kernels.varlen import hopper as varlen_hopper

    lq, lk = ragged_lengths(d + 7, 9, 900)
    lq[0], lk[0] = 0, 0
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 16, 4, d, dtype, seed=8))
    ref = varlen_attention_float64(*(x.cpu() for x in (q, k, v, cu_q, cu_k)), causal, window)
    band = kernel_band(max(lq), max(lk), d, causal, window, None)[1:4]
    for bm, bn, warps, stages in rung3_hopper.TUNING_SPACE["d=128" if d == 128 else "d<=64"]:
        o = torch.full_like(q, float("nan"))
        lse = torch.empty(16, q.shape[0], device="cuda")
        config = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        varlen_hopper.launch(q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal, window, band, config=config)
        check_forward(o.cpu(), lse.cpu(), *ref, cu_q.cpu(), dtype)


def test_head_dim_128_runs_the_copy_engine_kernel_and_its_graph_replays(monkeypatch):
    """At D = 128 (16-bit) the default call runs the copy-engine kernel; captured in a CUDA graph (its descriptors'
    scratch in the graph's memory) it replays new boundaries right, as the pointer kernel does at D = 64."""
    from flashlab.kernels.varlen import hopper as varlen_hopper

    calls = []
    launch = varlen_hopper.launch
    monkeypatch.setattr(varlen_hopper, "launch", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    lq, lk = ragged_lengths(9, 6, 300)
    q, k, v, _, cu_q, cu_k = on_gpu(*packed_case(lq, lk, 8, 2, 128, torch.bfloat16, seed=9))
    expect = flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 500, causal=True)
    assert calls, "D = 128 must run flashlab.kernels.varlen.hopper"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 400, 500, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
    lq2, lk2 = [lq[1], lq[0], *lq[2:]], [lk[1], lk[0], *lk[2:]]  # the same rows cut into other sequences
    cu_q.copy_(torch.tensor([0, *np.cumsum(lq2)], dtype=torch.int32))
    cu_k.copy_(torch.tensor([0, *np.cumsum(lk2)], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref = varlen_attention_float64(*(x.cpu() for x in (q, k, v, cu_q, cu_k)), True)
    for b in range(len(lq2)):  # the replay's answer is the new batch's
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if rows.stop > rows.start:
            assert relative_error(out[rows].cpu(), ref[0][rows]) <= tolerance(torch.bfloat16), b
