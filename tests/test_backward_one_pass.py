"""The backward's Gluon rung (``rung5_one_pass``) compiled for sm_90 on this machine (Triton's compiler and the
ptxas it ships; no GPU): the facts its speed rests on, which a change could silently lose. Its gradients are
checked against float64 autograd on a GPU (``tests/test_backward_gpu.py``, every rung of the ladder); Gluon has no
interpreter path."""

from __future__ import annotations

import re

import pytest
import torch
from test_sm90_compile import compiled_for_sm90, exponentials_between_waits, sass

from flashlab.kernels import gluon_hopper
from flashlab.kernels.backward import rung5_one_pass as one_pass

needs_gluon = pytest.mark.skipif(one_pass.GLUON_ERROR is not None, reason=str(one_pass.GLUON_ERROR))


def sm90_ptx(d, masked, ordered=False, n=2048, **variant):
    """The rung's kernel for head dim ``d`` (``masked``: a causal or windowed call; ``ordered``: rung 6;
    ``variant``: ``constexprs``' step variants) as PTX for sm_90, its arguments specialised as a GPU launch
    specialises them (``compiled_for_sm90``), checked to be lowered to sm_90 machine code."""
    compiled = sm90_compiled(d, masked, ordered, n, **variant)
    assert ".target sm_90" in compiled.asm["ptx"] and compiled.asm.get("cubin"), "not lowered to sm_90 machine code"
    return compiled.asm["ptx"]


def sm90_compiled(d, masked, ordered=False, n=2048, **variant):
    b, h = 16384 // n, 2048 // d
    x = torch.empty(b, h, n, d, dtype=torch.bfloat16)
    stats = torch.empty(b * h, n)
    descriptors = [gluon_hopper.descriptor(x, rows) for rows in (one_pass.BLOCK_M, one_pass.BLOCK_M, one_pass.BLOCK_N,
                                                                  one_pass.BLOCK_N)]  # fmt: skip
    descriptors.append(one_pass.dq_descriptor(torch.empty(b * h, n, d), variant.get("dq_own_keys", False)))
    locks = torch.empty(4, dtype=torch.int32)
    args = [*descriptors, stats, stats, stats, x, locks, x, x, h, 1, n, n, n, 0, n + 1, n + 1, 1, 0.18, 0.125, -0.125]
    meta = one_pass.constexprs(d, masked, None, ordered, **variant)
    options = {"num_warps": meta.pop("num_warps")}
    return compiled_for_sm90(one_pass.bwd_one_pass, args, meta, options)


@needs_gluon
@pytest.mark.parametrize("d, masked", [(64, True), (128, False)])
def test_one_loop_step_issues_five_products_and_keeps_its_vector_adds(d, masked):
    # Per consumer warpgroup and query tile: S^T and dP^T (K = D, in steps of 16), dV and dK (K = the tile's 64
    # query rows), dQ (K = the program's 128 keys): two warpgroups' worth of each. Seven products (the two-pass
    # rungs') would add two more of the first kind; Triton's own pass dropped the atomic adds (rung 3), so they are
    # counted here: four floats an instruction, 64 x D/2 floats a warpgroup over 128 threads.
    ptx = sm90_ptx(d, masked)
    k = 16
    per_wg = 2 * (d // k) + 2 * (one_pass.BLOCK_M // k) + one_pass.BLOCK_N // k
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == one_pass.NUM_WG * per_wg
    adds = re.findall(r"(?:atom|red)\.global\.gpu\.relaxed\.add\.v4\.f32", ptx)  # red: Triton >= 3.7
    assert len(adds) == one_pass.NUM_WG * one_pass.BLOCK_M * (d // 2) // (128 * 4)
    assert "setmaxnreg" in ptx  # the loader warp hands its registers to the consumers


@needs_gluon
@pytest.mark.parametrize("d, masked", [(64, False), (128, True)])
def test_the_ordered_adds_wait_for_their_turn_and_pass_it_on(d, masked):
    # rung 6: no float atomics at all; the turn read with acquire (a load that sees the previous turn's stores)
    # and passed on with release (after them), once per consumer warpgroup; the parts loaded past L1 and stored
    ptx = sm90_ptx(d, masked, ordered=True)
    assert not re.findall(r"(?:atom|red)\.global\S*\.f32", ptx)
    assert len(re.findall(r"ld\.global\.gpu\.acquire\.b32|atom\.global\.gpu\.acquire\S*", ptx)) >= one_pass.NUM_WG
    assert len(re.findall(r"atom\.global\.gpu\.release\.exch\.b32", ptx)) == one_pass.NUM_WG
    assert re.findall(r"ld\.global\.cg\.v4", ptx)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == one_pass.NUM_WG * (2 * (d // 16) + 2 * 4 + 8)


@needs_gluon
@pytest.mark.parametrize("d, masked", [(64, False), (128, True)])
def test_the_bulk_add_variant_sends_dq_by_the_copy_engine_and_stages_the_statistics(d, masked):
    # dQ's half leaves as one cp.reduce.async.bulk.tensor add a warpgroup and step, no float atomics from the
    # threads; lse and delta are loaded by the loader warp (one load each a step) and read from shared memory
    plain = sm90_ptx(d, masked, stats_smem=False, dq_bulk=False)
    ptx = sm90_ptx(d, masked, stats_smem=True, dq_bulk=True)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\S*\.add", ptx)) == one_pass.NUM_WG
    assert not re.findall(r"(?:atom|red)\.global\S*\.f32", ptx)
    assert not re.findall(r"cp\.reduce\.async\.bulk", plain)
    products = len(re.findall(r"wgmma\.mma_async", plain))
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == products  # the same five products a step
    # the statistics: the consumers' loads of lse and delta (a value per query column a thread holds) are gone;
    # the loader warp's remain, BLOCK_M / 32 of each a thread
    loads = r"ld\.global\S*\.(?:b32|f32)"
    assert len(re.findall(loads, ptx)) == 2 * one_pass.BLOCK_M // 32 < len(re.findall(loads, plain))


@needs_gluon
@pytest.mark.parametrize("d, masked", [(64, True), (128, False)])
def test_with_dq_over_its_own_keys_each_warpgroup_adds_a_whole_tile_and_meets_no_other(d, masked):
    # dQ = dS K over the warpgroup's own 64 keys (K = 64 in steps of 16), all D columns: one bulk add of a
    # (BLOCK_M, D) tile a warpgroup and step; the two warpgroups' mbarrier meeting over dS (ds_ready, ds_free) is
    # gone, so the kernel arrives on fewer barriers than the version that meets
    met = sm90_ptx(d, masked, stats_smem=True, dq_bulk=True)
    own = sm90_ptx(d, masked, stats_smem=True, dq_own_keys=True)
    k = 16
    per_wg = 2 * (d // k) + 2 * (one_pass.BLOCK_M // k) + one_pass.WG_KEYS // k
    assert len(re.findall(r"wgmma\.mma_async", own)) == one_pass.NUM_WG * per_wg
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\S*\.add", own)) == one_pass.NUM_WG
    assert not re.findall(r"(?:atom|red)\.global\S*\.f32", own)
    arrives = r"mbarrier\.arrive\S*"
    assert len(re.findall(arrives, own)) < len(re.findall(arrives, met))


@needs_gluon
@pytest.mark.parametrize("d", [64, 128])
def test_with_the_late_wait_the_exponentials_run_under_the_dp_product(d):
    # Sᵀ's exponentials, 64 x BLOCK_M of them a warpgroup (32 a thread), between the two waits: the dPᵀ product is
    # still on the tensor cores while they run
    compiled = sm90_compiled(d, False, stats_smem=True, dq_bulk=True, dp_late_wait=True)
    per_thread = one_pass.WG_KEYS * one_pass.BLOCK_M // 128
    counts = exponentials_between_waits([op for _, op in sass(compiled)])
    assert counts and all(c == per_thread for c in counts), counts
