"""The compiled backward kernels on a CUDA GPU against float64 ``torch.autograd``, at real sizes.

dq, dk, dv of ``flash_attention`` against autograd through the float64 materialised attention
(``attention_float64_grads``) on a subset of K/V heads (dK and dV need every query row, so rows cannot be sampled),
and the determinism the backward promises: bit-identical gradients run after run -- for every rung of the
backward's ladder (``flashlab.kernels.backward``) on the cases it runs.
"""

from __future__ import annotations

import pytest
import torch

from flashlab.core.numerics import grad_tolerance, relative_error
from flashlab.host.attention import flash_attention
from flashlab.kernels import backward
from flashlab.reference.torch_float64 import attention_float64_grads, query_heads

pytestmark = pytest.mark.gpu


def make_inputs(b, hq, hk, nq, nk, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype),
        torch.randn(b, hk, nk, d, device="cuda", generator=g).to(dtype),
        torch.randn(b, hk, nk, d, device="cuda", generator=g).to(dtype),
        torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype),
    )


def flash_grads(q, k, v, do, causal=False, window=None, scale=None, rung=None):
    if rung is not None:
        why = backward.rung_named(rung).unavailable(q, k, v, do)
        if why is not None:
            pytest.skip(f"backward rung {rung}: {why}")
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, causal=causal, window=window, scale=scale, backward_rung=rung)
    return torch.autograd.grad(o, (q, k, v), do)


CASES = [  # b, hq, hk, nq, nk, d, dtype, causal, window, scale
    (2, 8, 8, 1024, 1024, 128, torch.bfloat16, False, None, None),
    (1, 8, 2, 2048, 2048, 128, torch.bfloat16, True, None, None),
    (1, 4, 4, 4096, 4096, 128, torch.float16, True, None, None),
    (1, 4, 1, 3000, 3000, 128, torch.bfloat16, False, (700, 0), None),
    (2, 8, 4, 1500, 1111, 64, torch.float16, True, None, -0.125),
    (1, 4, 2, 1000, 1777, 80, torch.bfloat16, False, (256, 64), None),
    (1, 2, 2, 1023, 1023, 128, torch.float32, True, None, None),
    (1, 2, 1, 600, 600, 256, torch.bfloat16, False, None, None),
    (1, 8, 2, 5, 3000, 128, torch.bfloat16, False, None, None),  # decode-sized, with a gradient
]


@pytest.mark.parametrize("rung", backward.names())
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))
def test_gradients_match_float64_autograd(case, rung):
    b, hq, hk, nq, nk, d, dtype, causal, window, scale = case
    q, k, v, do = make_inputs(b, hq, hk, nq, nk, d, dtype, seed=nq + nk + d)
    grads = flash_grads(q, k, v, do, causal, window, scale, rung)
    kv_heads = [0, hk - 1] if hk > 1 else [0]
    refs = attention_float64_grads(q, k, v, do, causal, window, scale, batch=[b - 1], kv_heads=kv_heads)
    heads = query_heads(kv_heads, hq // hk)
    got = (grads[0][[b - 1]][:, heads], grads[1][[b - 1]][:, kv_heads], grads[2][[b - 1]][:, kv_heads])
    tol = grad_tolerance(dtype)
    for name, x, ref in zip("qkv", got, refs, strict=True):
        assert torch.isfinite(x).all(), f"d{name} is not finite"
        err = relative_error(x, ref)
        assert err <= tol, f"d{name}: relative error {err:.2e} over {tol:.0e}"


ONE_PASS_VARIANTS = {  # rung 5's step variants (rung5_one_pass.STATS_SMEM, DQ_BULK, DQ_OWN_KEYS, DP_LATE_WAIT);
    # rung 6 with the first
    "stats": dict(stats_smem=True, dq_bulk=False),
    "bulk": dict(stats_smem=False, dq_bulk=True),
    "stats-bulk": dict(stats_smem=True, dq_bulk=True),
    "own-keys": dict(stats_smem=True, dq_own_keys=True),
    "late-wait": dict(stats_smem=True, dq_bulk=True, dp_late_wait=True),
    "ordered-stats": dict(ordered=True, stats_smem=True),
}


@pytest.mark.parametrize("variant", ONE_PASS_VARIANTS)
@pytest.mark.parametrize("case", [c for c in CASES if c[5] in (64, 128) and c[6] != torch.float32],
                         ids=lambda c: "-".join(str(x).removeprefix("torch.") for x in c))  # fmt: skip
def test_the_one_pass_step_variants_match_float64_autograd(case, variant):
    from flashlab.kernels.backward import rung5_one_pass

    b, hq, hk, nq, nk, d, dtype, causal, window, scale = case
    q, k, v, do = make_inputs(b, hq, hk, nq, nk, d, dtype, seed=nq + nk + d)
    why = rung5_one_pass.unavailable(q, k, v, do)
    if why is not None:
        pytest.skip(why)
    o, lse = flash_attention(q, k, v, causal=causal, window=window, scale=scale, return_lse=True)
    grads = rung5_one_pass.run_backward(do, q, k, v, o, lse, causal, window, scale, **ONE_PASS_VARIANTS[variant])
    kv_heads = [0, hk - 1] if hk > 1 else [0]
    refs = attention_float64_grads(q, k, v, do, causal, window, scale, batch=[b - 1], kv_heads=kv_heads)
    heads = query_heads(kv_heads, hq // hk)
    got = (grads[0][[b - 1]][:, heads], grads[1][[b - 1]][:, kv_heads], grads[2][[b - 1]][:, kv_heads])
    for name, x, ref in zip("qkv", got, refs, strict=True):
        assert torch.isfinite(x).all(), f"d{name} is not finite"
        err = relative_error(x, ref)
        assert err <= grad_tolerance(dtype), f"d{name}: relative error {err:.2e}"


@pytest.mark.parametrize("rung", [r.name for r in backward.BACKWARD_RUNGS if r.deterministic])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_are_bit_identical_run_after_run(causal, rung):
    q, k, v, do = make_inputs(2, 16, 4, 2048, 2048, 128, torch.bfloat16, seed=1)
    first = flash_grads(q, k, v, do, causal, rung=rung)
    for _ in range(3):
        again = flash_grads(q, k, v, do, causal, rung=rung)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("causal", [False, True])
def test_the_atomic_dq_rung_keeps_dk_and_dv_bit_identical_and_dq_within_rounding(causal):
    # its dQ is summed by atomic adds in arrival order: bit-identical is not promised, closeness is; dK and dV are
    # still written once each
    q, k, v, do = make_inputs(2, 16, 4, 2048, 2048, 128, torch.bfloat16, seed=1)
    first = flash_grads(q, k, v, do, causal, rung="atomic_dq")
    floor = flash_grads(q, k, v, do, causal, rung="two_pass")
    for _ in range(3):
        again = flash_grads(q, k, v, do, causal, rung="atomic_dq")
        assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])
        assert relative_error(again[0], first[0]) < 1e-2
    assert relative_error(first[0], floor[0]) < 1e-2


def test_the_default_backward_runs_the_hopper_rung_where_it_measured_faster():
    # padded to 128 on a Hopper GPU: the hopper rung, bit for bit; at D = 64: rung 1, bit for bit
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the hopper rung needs a Hopper GPU or newer")
    for d, rung in ((128, "hopper"), (96, "hopper"), (64, "two_pass")):
        q, k, v, do = make_inputs(1, 8, 2, 1000, 1000, d, torch.bfloat16, seed=d)
        assert backward.select(None, q, k, v, do)[0].name == rung
        default, named = flash_grads(q, k, v, do, True), flash_grads(q, k, v, do, True, rung=rung)
        assert all(torch.equal(a, b) for a, b in zip(default, named, strict=True)), d
