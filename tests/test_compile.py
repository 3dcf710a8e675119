"""``torch.compile(fullgraph=True)`` over functions that call flashlab's kernels: one graph, the kernel one opaque
operator in it (``flashlab.host.custom_ops``), the output equal to eager.

On CPU the compiled graph runs with the "aot_eager" backend (AOT autograd, then eager ops): it traces exactly what
inductor would be handed. Inductor itself took 26 s to compile this one small function on a 2-core CPU against
1.7 s for aot_eager, and adds nothing here, since the attention node is opaque to it. The GPU test compiles with
inductor in ``mode="reduce-overhead"`` (CUDA graphs) on the H200.
"""

from __future__ import annotations

import pytest
import torch
from test_kvcache import paged_case

from flashlab import flash_attention, flash_attention_with_kvcache
from flashlab.host import custom_ops as op
from flashlab.host.autograd import LSE_NOT_DIFFERENTIABLE
from flashlab.reference.torch_float64 import attention_float64

CPU_BACKEND = "aot_eager"


def qkv(b, hq, hk, nq, nk, d, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d))
    return [torch.randn(*s, generator=g).to(dtype).to(device) for s in shapes]


def graph_targets(fn, *args):
    """Compile ``fn`` with fullgraph=True through a backend that records the graph's call targets, then run it."""
    seen = []

    def recording_backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=recording_backend, fullgraph=True)(*args)
    return out, seen


@pytest.mark.parametrize(
    "nq, nk, causal, window",
    [(20, 30, True, None), (1, 300, False, None), (3, 70, True, (16, None)), (9, 9, False, (None, 2))],
    ids=["prefill-causal", "decode", "decode-window", "right-window"],
)
def test_fullgraph_compile_equals_eager(nq, nk, causal, window):
    def block(q, k, v):  # attention inside a little model: ops on both sides of the kernel
        o = flash_attention(q * 1.0, k, v, causal=causal, window=window)
        return torch.nn.functional.gelu(o) + q

    q, k, v = qkv(1, 4, 2, nq, nk, 32)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=CPU_BACKEND, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), rtol=0, atol=0)


def test_new_values_reuse_the_compiled_graph():
    from torch._dynamo.utils import counters

    def block(q, k, v):
        return flash_attention(q, k, v, causal=True) + 1.0

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend=CPU_BACKEND, fullgraph=True)
    for seed in range(3):  # same shapes, new values: one graph, no recompilation
        q, k, v = qkv(1, 4, 2, 3, 40, 16, seed=seed)
        torch.testing.assert_close(compiled(q, k, v), block(q, k, v), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1


def test_the_kernel_is_one_operator_in_the_graph():
    q, k, v = qkv(2, 2, 1, 5, 40, 16)
    out, targets = graph_targets(lambda q, k, v: flash_attention(q, k, v, return_lse=True), q, k, v)
    assert sum("flashlab.attention_forward" in t for t in targets) == 1, targets
    o, lse = out
    ro, rlse = attention_float64(q, k, v)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5)


def test_paged_cache_compiles_and_checks_values_at_run_time():
    q, kc, vc, seqlens, table = paged_case(0, b=2, hq=4, hk=2, nq=1, d=16, bs=16, dtype=torch.float32, max_len=50)

    def step(q, kc, vc, seqlens, table):
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True)

    out, targets = graph_targets(step, q, kc, vc, seqlens, table)
    assert any("flashlab.attention_with_kvcache" in t for t in targets), targets
    torch.testing.assert_close(out, step(q, kc, vc, seqlens, table), rtol=0, atol=0)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=CPU_BACKEND, fullgraph=True)
    compiled(q, kc, vc, seqlens, table)
    with pytest.raises(ValueError, match="cache_seqlens"):  # the traced call cannot read it; the operator does
        compiled(q, kc, vc, torch.tensor([1, 10**6], dtype=torch.int32), table)


def test_operator_registration_passes_opcheck():
    q, k, v = qkv(1, 2, 1, 3, 20, 16)
    torch.library.opcheck(
        op.attention_forward, (q, k, v, True, -1, -1, None, None), test_utils=("test_schema", "test_faketensor")
    )


def test_paged_operator_registration_passes_opcheck():
    q, kc, vc, seqlens, table = paged_case(2, b=2, hq=2, hk=1, nq=1, d=16, bs=16, dtype=torch.float32, max_len=30)
    args = (q, kc, vc, seqlens, table, True, -1, -1, None, True)
    torch.library.opcheck(op.attention_with_kvcache, args, test_utils=("test_schema", "test_faketensor"))


def test_window_encoding_round_trips():
    for window in [None, (3, None), (None, 4), (0, 0), (5, 7)]:
        assert op.ints_to_window(*op.window_to_ints(window)) == window
    assert op.ints_to_window(*op.window_to_ints((None, None))) is None  # unbounded both sides: no window


def test_backward_through_the_operator():
    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 2, 24, 40, 16, seed=1))
    o, _ = torch.ops.flashlab.attention_forward(q, k, v, True, -1, -1, None, None)
    do = torch.randn_like(o)
    o.backward(do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ro, _ = attention_float64(qd, kd, vd, causal=True)
    ro.backward(do.double())
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_compiled_backward_runs_the_backward_rung_it_names(monkeypatch):
    # backward_rung reaches the compiled graph's backward operator: the Hopper rung's kernels run there (the
    # interpreter runs them on CPU), and the gradients equal float64 autograd
    from flashlab.kernels.backward import rung2_hopper

    ran = []
    real = rung2_hopper.attention_backward
    monkeypatch.setattr(rung2_hopper, "attention_backward", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    q, k, v = (x.requires_grad_() for x in qkv(1, 4, 2, 24, 40, 16, dtype=torch.bfloat16, seed=2))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True, backward_rung="hopper").float().square().sum()

    torch._dynamo.reset()
    torch.compile(loss, backend=CPU_BACKEND, fullgraph=True)(q, k, v).backward()
    assert ran == [1]
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    attention_float64(qd, kd, vd, causal=True)[0].square().sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert float((got.double() - want).norm() / want.norm()) < 3e-2


@pytest.mark.parametrize("path", ["eager", "operator", "compiled"])
def test_a_gradient_through_lse_is_the_same_error_on_every_path(path):
    # lse is not differentiable: a loss that uses it must fail in the backward pass, never drop that part of the
    # gradient silently -- in eager autograd, through the registered operator, and in a compiled graph
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, 20, 30, 16, seed=2))

    def loss(q, k, v):
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
        return o.sum() + lse.sum()

    if path == "operator":
        o, lse = torch.ops.flashlab.attention_forward(q, k, v, True, -1, -1, None, None)
        total = o.sum() + lse.sum()
    elif path == "compiled":
        torch._dynamo.reset()
        total = torch.compile(loss, backend=CPU_BACKEND, fullgraph=True)(q, k, v)
    else:
        total = loss(q, k, v)
    with pytest.raises(RuntimeError, match="not differentiable") as error:
        total.backward()
    assert LSE_NOT_DIFFERENTIABLE in str(error.value)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    (o.sum() + 0 * lse.detach().sum()).backward()  # a detached lse is fine
    assert q.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("nq", [1, 512])
def test_reduce_overhead_compile_on_gpu(nq):
    def block(q, k, v):
        return flash_attention(q, k, v, causal=True) * 2.0

    q, k, v = qkv(2, 16, 4, nq, 4096, 128, torch.bfloat16, device="cuda")
    expected = block(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, CUDA-graph recording, replay
        out = compiled(q, k, v)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.gpu
def test_reduce_overhead_paged_decode_on_gpu():
    case = paged_case(1, b=8, hq=64, hk=8, nq=1, d=128, bs=16, dtype=torch.bfloat16, max_len=4096, zero=False)
    q, kc, vc, seqlens, table = (x.cuda() for x in case)

    def step(q, kc, vc, seqlens, table):
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table)

    expected = step(q, kc, vc, seqlens, table)
    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = compiled(q, kc, vc, seqlens, table)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
