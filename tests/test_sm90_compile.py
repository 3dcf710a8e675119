"""The decode kernels compile for Hopper (sm_90) on a machine without a GPU.

Triton's interpreter runs the kernels' Python on CPU tensors, but it never lowers them: a construct the compiler
refuses (a compile-time branch inside a runtime one, an atomic on an unsupported type) would pass every CPU test
and fail on the first GPU call. Here Triton's own compiler and the ptxas it ships build each kernel for sm_90 with
the arguments the host engine passes, the tiles a GPU launch takes (``flashlab.kernels.configs``' defaults) and the
constexprs of a GPU launch. Skipped where this Triton cannot compile ahead of time.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton

from flashlab.kernels import configs
from flashlab.kernels.decode import kvcache, split_kv
from flashlab.kernels.device import dot_precision, dot_upcast, kernel_band


def compiled_for_sm90(kernel, args, constexprs, options):
    """``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` function) compiled for sm_90 on this machine: ``args`` its
    non-constexpr arguments in order, ``constexprs`` by name (a constexpr with a default may be left out),
    ``options`` (num_warps, num_stages, maxnreg). Returns the compiled kernel; skipped where this Triton cannot."""
    import triton

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import mangle_type
    except ImportError as error:
        pytest.skip(f"this Triton cannot compile ahead of time here: {error}")
    source_type = ASTSource
    if type(kernel).__name__ == "GluonJITFunction":
        try:
            from triton.experimental.gluon._runtime import GluonASTSource as source_type
        except ImportError as error:
            pytest.skip(f"this Triton cannot compile Gluon ahead of time here: {error}")
    signature, constants, attrs = {}, {}, {}
    values = iter(args)
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params, strict=True)):
        if param.is_constexpr:
            value = constexprs[name] if name in constexprs or not param.has_default else param.default
            signature[name], constants[(i,)] = "constexpr", value
        else:
            value = next(values)
            signature[name] = mangle_type(value)
            # as a GPU launch specialises: tensors (allocated 16-byte aligned) and integers divisible by 16, unless
            # the kernel says not to; what lets the compiler vectorise loads
            specialised = name not in kernel.do_not_specialize and name not in kernel.do_not_specialize_on_alignment
            if specialised and (isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    assert next(values, None) is None, "more arguments than the kernel takes"
    try:
        return triton.compile(source_type(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options=options)  # fmt: skip
    except RuntimeError as error:
        if "ptxas" in str(error) and "not found" in str(error).lower():
            pytest.skip(f"no ptxas here: {error}")
        raise


def compile_sm90(kernel, args, constexprs, options):
    """``compiled_for_sm90``'s kernel as its PTX, checked to be lowered to sm_90 machine code."""
    compiled = compiled_for_sm90(kernel, args, constexprs, options)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and compiled.asm.get("cubin"), "not lowered to sm_90 machine code"
    return ptx


def sass(compiled) -> list[tuple[int, str]]:
    """A compiled kernel's machine code as ``(address, instruction)`` pairs, read with the cuobjdump Triton ships;
    skipped where it ships none."""
    import os
    import subprocess
    import tempfile

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("this Triton ships no cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    lines = (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line) for line in text.splitlines())
    return [(int(m.group(1), 16), m.group(2).strip()) for m in lines if m]


def exponentials_between_waits(instructions):
    """For each step of a wgmma loop: the exponentials (``MUFU.EX2``) the machine code runs after a wait that
    leaves the newest product in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and before the wait for it (``0x0``):
    the element-wise work that runs while that product is on the tensor cores."""
    counts, inside = [], None
    for op in instructions:
        if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"):
            inside = 0
        elif op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") and inside is not None:
            counts.append(inside)
            inside = None
        elif inside is not None and op.startswith("MUFU.EX2"):
            inside += 1
    return counts


def gpu_meta(meta, dtype):
    """A CPU-built argument object's constexprs as a GPU launch has them (no upcast, the GPU's dot precision)."""
    return {**meta, "DOT_PRECISION": dot_precision(dtype, True), "DOT_UPCAST": dot_upcast(dtype, True)}


def default_tiles(dtype):
    """The tiles a GPU launch takes where no tuned table has the bucket: the decode kernels' first default."""
    block_n, warps, stages = configs.DECODE_DEFAULTS["fp32" if dtype == torch.float32 else "16-bit"][0]
    return {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}


def split_config(meta, tiles):
    config = dict(meta)
    options = {"num_warps": config.pop("num_warps", tiles["num_warps"]),
               "num_stages": config.pop("num_stages", tiles["num_stages"])}  # fmt: skip
    config.setdefault("BLOCK_N", tiles["BLOCK_N"])
    return config, options


@pytest.mark.parametrize("page_size", [0, 16, 256])
@pytest.mark.parametrize("window", [None, (64, 0)])
def test_kvcache_kernel_compiles_for_hopper(page_size, window):
    """The paged kernel, with its error record and its scan of the band's skipped entries."""
    b, hq, hk, d, nq, capacity = 2, 8, 2, 128, 1, 1024
    dtype = torch.bfloat16
    q = torch.empty(b, hq, nq, d, dtype=dtype)
    if page_size:
        pool = b * capacity // page_size
        cache = torch.empty(pool, page_size, hk, d, dtype=dtype)
        table = torch.zeros(b, capacity // page_size, dtype=torch.int32)
    else:
        cache = torch.empty(b, capacity, hk, d, dtype=dtype)
        table = torch.zeros(b, dtype=torch.int32)
    _, win_left, win_right, qk_scale, _ = kernel_band(nq, capacity, d, True, window, None)
    args = kvcache.KVCacheArguments(q, cache, cache, table, page_size, capacity, win_left, win_right, qk_scale)
    seqlens = torch.zeros(b, dtype=torch.int32)
    work = torch.empty(8, dtype=torch.float32)
    errors = torch.zeros(kvcache.ERROR_RECORD_INTS, dtype=torch.int32)
    counters = torch.zeros(4, dtype=torch.int32)
    tensors = (q, cache, cache, table, seqlens, seqlens, seqlens, seqlens, seqlens, work, work, q, work, counters,
               errors)  # fmt: skip
    tiles = default_tiles(dtype)
    constexprs, options = split_config(gpu_meta(args.meta, dtype), tiles)
    ptx = compile_sm90(kvcache.kvcache_partial, (*tensors, *args.scalars, *args.tune), constexprs, options)
    assert "atom" in ptx  # the error record is claimed with an atomic (and the merge counters)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_kv_kernel_compiles_for_hopper(dtype):
    """Split-KV with its lengths left unspecialised: one binary for every length of a bucket."""
    b, hq, hk, d, nq, nk = 1, 32, 8, 128, 1, 4001
    q = torch.empty(b, hq, nq, d, dtype=dtype)
    k = torch.empty(b, hk, nk, d, dtype=dtype)
    offset, win_left, win_right, qk_scale, _ = kernel_band(nq, nk, d, False, None, None)
    args = split_kv.SplitArguments(q, k, k, q, offset, win_left, win_right, qk_scale, 8)
    work = torch.empty(8, dtype=torch.float32)
    counters = torch.zeros(4, dtype=torch.int32)
    tensors = (q, k, k, work, work, q, work, counters)
    tiles = default_tiles(dtype)
    constexprs, options = split_config(gpu_meta(args.meta, dtype), tiles)
    ptx = compile_sm90(split_kv.split_kv_partial, (*tensors, *args.scalars, *args.tune), constexprs, options)
    assert "atom" in ptx  # the chunks' merge counters


@pytest.mark.parametrize("page_size", [0, 16])
def test_ragged_kvcache_kernel_compiles_for_hopper(page_size):
    """The paged kernel with packed query rows (``RAGGED_Q``): offsets read on the device, an early exit for row
    blocks past a sequence's rows."""
    b, hq, hk, d, max_seqlen_q, total_q, capacity = 3, 8, 2, 128, 64, 70, 1024
    dtype = torch.bfloat16
    q = torch.empty(total_q, hq, d, dtype=dtype)
    if page_size:
        cache = torch.empty(b * capacity // page_size, page_size, hk, d, dtype=dtype)
        table = torch.zeros(b, capacity // page_size, dtype=torch.int32)
    else:
        cache = torch.empty(b, capacity, hk, d, dtype=dtype)
        table = torch.zeros(b, dtype=torch.int32)
    _, win_left, win_right, qk_scale, _ = kernel_band(max_seqlen_q, capacity, d, True, None, None)
    args = kvcache.KVCacheArguments(q, cache, cache, table, page_size, capacity, win_left, win_right, qk_scale,
                                    ragged=(b, max_seqlen_q))  # fmt: skip
    assert args.meta["RAGGED_Q"] and args.grid[2] > 1  # several blocks of rows: some exit in a short sequence
    seqlens, cu_seqlens_q = torch.zeros(b, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32)
    work = torch.empty(8, dtype=torch.float32)
    errors = torch.zeros(kvcache.ERROR_RECORD_INTS, dtype=torch.int32)
    counters = torch.zeros(4, dtype=torch.int32)
    tensors = (q, cache, cache, table, seqlens, seqlens, seqlens, cu_seqlens_q, seqlens, work, work, q, work,
               counters, errors)  # fmt: skip
    constexprs, options = split_config(gpu_meta(args.meta, dtype), default_tiles(dtype))
    ptx = compile_sm90(kvcache.kvcache_partial, (*tensors, *args.scalars, *args.tune), constexprs, options)
    assert "atom" in ptx


def test_the_row_block_order_compiles_for_hopper():
    """The rank sort that orders a long ragged launch's (sequence, row block) pairs (``ORDERED``), with the
    constexprs of a GPU launch of the mixed batch's tall blocks."""
    b, rows, capacity = 64, 1760 * 4, 32768
    row_blocks = -(-rows // kvcache.TALL_BLOCK_M)
    seqlens, cu = torch.zeros(b, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32)
    order = torch.zeros(b * row_blocks, dtype=torch.int32)
    _, win_left, win_right, _, _ = kernel_band(1760, capacity, 128, True, None, None)
    args = (cu, seqlens, order, b * row_blocks, row_blocks, 4, capacity, win_left, win_right)
    constexprs = dict(BLOCK_M=kvcache.TALL_BLOCK_M, SHORT_M=kvcache.SHORT_BLOCK_M, BLOCK=kvcache.ORDER_BLOCK)
    ptx = compile_sm90(kvcache._order_row_blocks, args, constexprs, {"num_warps": 4, "num_stages": 2})
    assert "st.global" in ptx


@pytest.mark.parametrize("page_size", [0, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_8bit_kvcache_kernel_compiles_for_hopper(page_size, dtype):
    """The paged kernel reading a float8 e4m3 cache (``KV_SCALED``): 8-bit loads widened to float16 whatever q's
    16-bit dtype, the dots on float16 operands, the descales' report."""
    b, hq, hk, d, nq, capacity = 2, 8, 2, 128, 1, 1024
    q = torch.empty(b, hq, nq, d, dtype=dtype)
    if page_size:
        cache = torch.empty(b * capacity // page_size, page_size, hk, d, dtype=torch.float8_e4m3fn)
        table = torch.zeros(b, capacity // page_size, dtype=torch.int32)
    else:
        cache = torch.empty(b, capacity, hk, d, dtype=torch.float8_e4m3fn)
        table = torch.zeros(b, dtype=torch.int32)
    descale = torch.ones(b, hk, dtype=torch.float32)
    _, win_left, win_right, qk_scale, _ = kernel_band(nq, capacity, d, False, None, None)
    args = kvcache.KVCacheArguments(q, cache, cache, table, page_size, capacity, win_left, win_right, qk_scale,
                                    descales=(descale, descale))  # fmt: skip
    assert args.meta["KV_SCALED"]
    seqlens = torch.zeros(b, dtype=torch.int32)
    work = torch.empty(8, dtype=torch.float32)
    errors = torch.zeros(kvcache.ERROR_RECORD_INTS, dtype=torch.int32)
    counters = torch.zeros(4, dtype=torch.int32)
    tensors = (q, cache, cache, table, seqlens, descale, descale, seqlens, seqlens, work, work, q, work, counters,
               errors)  # fmt: skip
    constexprs, options = split_config(gpu_meta(args.meta, dtype), default_tiles(dtype))
    ptx = compile_sm90(kvcache.kvcache_partial, (*tensors, *args.scalars, *args.tune), constexprs, options)
    assert "atom" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx  # e4m3 widened by the hardware's conversion, two at a time
    assert "mma" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx  # float16 operands
    # and nothing more per loaded value: widening on to bfloat16 would take one more conversion per value, and
    # those conversions (not the halved bytes) would bound the loop
    assert "cvt.rn.bf16.f16" not in ptx and "cvt.bf16.f16" not in ptx
    # V widened before it is transposed into the dot's operand layout: 16-bit transposed ldmatrix, never shared
    # memory read a byte at a time (one instruction per value: that, not the halved bytes, would bound the loop)
    assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_varlen_boundary_check_compiles_for_hopper(dtype):
    """The device check of ``flash_attention_varlen``'s boundaries (``varlen._check_boundaries``): its error record
    written with system-scope atomics, its NaN fill of 16- and 32-bit outputs."""
    from flashlab.kernels import varlen

    b = 5
    cu = torch.zeros(b + 1, dtype=torch.int32)
    safe = torch.zeros(2 * (b + 1), dtype=torch.int32)
    errors = torch.zeros(kvcache.ERROR_RECORD_INTS, dtype=torch.int32)
    o, lse = torch.empty(64, 4, 16, dtype=dtype), torch.empty(4, 64)
    args = (cu, cu, safe, errors, o, lse, o, o.numel(), lse.numel(), 0, b, 64, 64, 32, 32)
    ptx = compile_sm90(varlen.check_boundaries, args, {"BLOCK": varlen.CHECK_BLOCK, "FILL": varlen.FILL_BLOCK},
                       {"num_warps": 4, "num_stages": 1})  # fmt: skip
    assert "atom" in ptx and ".sys" in ptx  # the record claimed and published where the host reads it


def test_the_fp8_forwards_descale_check_compiles_for_hopper():
    """The FP8 forward's device check of its descales (``fp8_forward._check_descales``): the interpreter runs
    Python and never asks whether a kernel may read a module's constant; the compiler does (only constexprs)."""
    from flashlab.kernels import fp8_forward

    scales = torch.ones(3, 2, dtype=torch.float32)
    errors = torch.zeros(kvcache.ERROR_RECORD_INTS, dtype=torch.int32)
    args = (scales, scales, scales, errors, scales.numel(), 2)
    ptx = compile_sm90(fp8_forward._check_descales, args, {"BLOCK": fp8_forward.CHECK_BLOCK},
                       {"num_warps": 4, "num_stages": 1})  # fmt: skip
    assert "atom" in ptx and ".sys" in ptx  # the record claimed and published where the host reads it


@pytest.mark.parametrize("d, causal", [(128, False), (64, True), (256, True)])
def test_the_fp8_forward_compiles_to_8_bit_tensor_core_products(d, causal):
    """The FP8 forward for sm_90 with the tiles a GPU launch takes: both products are wgmma on e4m3 operands
    (P rounded to e4m3 in registers), nothing widened to 16 bits first."""
    from flashlab.kernels import fp8_forward
    from flashlab.kernels.device import block_d

    b, hq, hk, n = 1, 4, 2, 1024
    q = torch.empty(b, hq, n, d, dtype=torch.float8_e4m3fn)
    k = torch.empty(b, hk, n, d, dtype=torch.float8_e4m3fn)
    o, lse = torch.empty(b, hq, n, d, dtype=torch.bfloat16), torch.empty(b, hq, n)
    vt = fp8_forward.transposed_v(k)  # V as the kernel reads it: (B, Hk, D, Nk), keys contiguous
    scales = torch.ones(b, hk)
    offset, win_left, win_right, sm_scale_log2, _ = kernel_band(n, n, d, causal, None, None)
    args = (q, k, vt, o, lse, scales, scales, scales, *q.stride()[:3], *k.stride()[:3], *vt.stride()[:3],
            *o.stride()[:3], hq, hk, hq // hk, n, n, offset, win_left, win_right, sm_scale_log2)  # fmt: skip
    bm, bn, warps, stages = fp8_forward.GPU_TILES[d]
    constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, UPCAST=False)
    ptx = compile_sm90(fp8_forward.attn_fwd_fp8, args, constexprs, {"num_warps": warps, "num_stages": stages})
    assert "e4m3.e4m3" in ptx and "wgmma.mma_async" in ptx  # 8-bit operands on Hopper's tensor cores
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # P rounded to e4m3, two at a time
    assert ".f16.f16" not in ptx and ".bf16.bf16" not in ptx  # no 16-bit product anywhere
    assert "st.shared.b8" not in ptx and "st.shared.u8" not in ptx  # V^T's tile not transposed a byte at a time


@pytest.mark.parametrize("d, causal", [(128, False), (256, True)])
def test_the_fp8_forwards_copy_engine_kernel_compiles_for_hopper(d, causal):
    """The Hopper FP8 kernel (``attn_fwd_fp8_tma``): tiles by the tensor-memory engine's bulk copies, a
    warp-specialised loop, both products on e4m3 operands."""
    from flashlab.kernels import fp8_forward
    from flashlab.kernels.device import block_d

    if not hasattr(triton.language, "make_tensor_descriptor"):
        pytest.skip("this Triton has no device-side tensor descriptors")
    b, hq, hk, n = 1, 4, 2, 1024
    q = torch.empty(b, hq, n, d, dtype=torch.float8_e4m3fn)
    k = torch.empty(b, hk, n, d, dtype=torch.float8_e4m3fn)
    vt = fp8_forward.transposed_v(k)
    o, lse = torch.empty(b, hq, n, d, dtype=torch.bfloat16), torch.empty(b, hq, n)
    scales = torch.ones(b, hk)
    offset, win_left, win_right, sm_scale_log2, _ = kernel_band(n, n, d, causal, None, None)
    args = (q, k, vt, o, lse, scales, scales, scales, hq, hk, hq // hk, n, n, vt.shape[3], offset, win_left,
            win_right, sm_scale_log2)  # fmt: skip
    bm, bn, warps, stages = fp8_forward.TMA_TILES[d]
    constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d(d), BLOCK_M=bm, BLOCK_N=bn, MASK_LEFT=False, MASK_RIGHT=causal,
                      EVEN_M=True, WARP_SPECIALIZE=True)  # fmt: skip
    ptx = compile_sm90(fp8_forward.attn_fwd_fp8_tma, args, constexprs, {"num_warps": warps, "num_stages": stages})
    assert "e4m3.e4m3" in ptx and "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # the copy engine's tile loads
    assert "setmaxnreg" in ptx  # warp-specialised: the copying warps hand their registers to the computing ones
    assert "st.shared.b8" not in ptx


@pytest.mark.parametrize("d, causal", [(64, False), (128, True)])
def test_the_backward_kernels_compile_for_hopper_with_the_tiles_a_launch_picks(d, causal):
    """The backward's dK/dV and dQ kernels with their lengths unspecialised and the tiles a GPU launch without a
    tuned table takes (``configs.BACKWARD_DEFAULTS``): every product on Hopper's tensor cores."""
    from flashlab.kernels.backward import rung1_two_pass as two_pass

    b, hq, hk, n = 1, 8, 2, 1001
    q = torch.empty(b, hq, n, d, dtype=torch.bfloat16)
    k = torch.empty(b, hk, n, d, dtype=torch.bfloat16)
    lse = torch.empty(b, hq, n)
    args = two_pass.backward_arguments(q, q, k, k, q, lse, causal, None, None)
    for name, kernel, values in (("dkdv", two_pass._bwd_dkdv, args.dkdv_args),
                                 ("dq", two_pass._bwd_dq, args.dq_args)):  # fmt: skip
        key = configs.bucket(two_pass.CONFIG_KERNELS[name], dtype=torch.bfloat16, head_dim=d,
                             mask="causal" if causal else "none", group=1, nq=n, nk=n)  # fmt: skip
        tiles = configs.default_config(key[0], key, 232448)
        constexprs = {**gpu_meta(args.common, torch.bfloat16), "BLOCK_M": tiles["BLOCK_M"], "BLOCK_N": tiles["BLOCK_N"]}
        options = {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
        ptx = compile_sm90(kernel, (*values, *args.tune), constexprs, options)
        assert "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx, name  # 16-bit products on the tensor cores


@pytest.mark.parametrize("d, causal", [(64, True), (128, False), (128, True), (256, True)])
def test_the_hopper_backward_compiles_to_copy_engine_tiles_and_specialised_warps(d, causal):
    """The backward's Hopper rung as a GPU launch compiles it: every tile by the copy engine's bulk copies, no
    pointer load of Q, K, V, dO or the row statistics; warp-specialised at D <= 128 (the copying warps hand their
    registers to the computing ones), eight plain warps at D = 256."""
    from flashlab.kernels.backward import rung2_hopper

    if not hasattr(triton.language, "make_tensor_descriptor"):
        pytest.skip("this Triton has no device-side tensor descriptors")
    b, hq, hk, n = 1, 8, 2, 1001
    q = torch.empty(b, hq, n, d, dtype=torch.bfloat16)
    k = torch.empty(b, hk, n, d, dtype=torch.bfloat16)
    rows = -(-n // rung2_hopper.ROW_ALIGN) * rung2_hopper.ROW_ALIGN
    stats = torch.empty(b * hq, rows)
    offset, win_left, win_right, qk_scale, _ = kernel_band(n, n, d, causal, None, None)
    sizes = (hq, hq // hk, n, n, rows, offset, win_left, win_right)
    dkdv_args = (q, k, k, q, k, k, stats, stats, stats, stats, d, d, d, d, d, *sizes, qk_scale, 0.1)
    dq_args = (q, k, k, q, q, stats, stats, d, d, d, d, d, *sizes, qk_scale, 0.1)
    common = gpu_meta(dict(HEAD_DIM=d, BLOCK_D=d), torch.bfloat16)
    for name, kernel, args, flags in (
        (
            "dkdv",
            rung2_hopper.bwd_dkdv_hopper,
            dkdv_args,
            dict(HIDE_BEFORE=causal, HIDE_AFTER=False, DQ_ATOMIC=False, DQ_ORDERED=False),
        ),
        ("dq", rung2_hopper.bwd_dq_hopper, dq_args, dict(MASK_LEFT=False, MASK_RIGHT=True, REVERSE_M=causal)),
    ):
        tiles = rung2_hopper.tiles(name, d)
        options = {"num_warps": tiles.pop("num_warps"), "num_stages": tiles.pop("num_stages")}
        ptx = compile_sm90(kernel, args, {**common, **tiles, **flags}, options)
        assert "cp.async.bulk.tensor" in ptx and "ld.global" not in ptx, name  # every tile by the copy engine
        assert "wgmma.mma_async" in ptx, name
        assert ("setmaxnreg" in ptx) == (d <= 128) == tiles["WARP_SPECIALIZE"], name


@pytest.mark.parametrize("ordered", [False, True], ids=["atomic_dq", "ordered_dq"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_dq_in_loop_rungs_keep_their_adds_on_eight_plain_warps(d, ordered):
    """Rungs 3 and 4: the dK/dV loop with dQ added in (``DQ_ATOMIC``) at their tiles (``ATOMIC_TILES``), not
    warp-specialised (on Triton 3.6 the specialising pass compiled rung 3's adds away at four warps). Rung 3: the
    float32 atomic adds are in the sm_90 code, four floats at a time. Rung 4 (``DQ_ORDERED``): no float atomics,
    the turn read with acquire and passed on with release, the earlier parts read past the L1 cache."""
    from flashlab.kernels.backward import rung2_hopper

    if not hasattr(triton.language, "make_tensor_descriptor"):
        pytest.skip("this Triton has no device-side tensor descriptors")
    b, hq, hk, n = 1, 8, 2, 1001
    q = torch.empty(b, hq, n, d, dtype=torch.bfloat16)
    k = torch.empty(b, hk, n, d, dtype=torch.bfloat16)
    rows = -(-n // rung2_hopper.ROW_ALIGN) * rung2_hopper.ROW_ALIGN
    stats, acc = torch.empty(b * hq, rows), torch.empty(b * hq, rows, d)
    locks = torch.zeros(b * hq, rows // 16, dtype=torch.int32)
    offset, win_left, win_right, qk_scale, _ = kernel_band(n, n, d, True, None, None)
    args = (q, k, k, q, k, k, stats, stats, acc, locks, d, d, d, d, d, hq, hq // hk, n, n, rows, offset, win_left,
            win_right, qk_scale, 0.1)  # fmt: skip
    tiles = rung2_hopper.tiles("dkdv_atomic", d)
    options = {"num_warps": tiles.pop("num_warps"), "num_stages": tiles.pop("num_stages")}
    assert options["num_warps"] == 8
    constexprs = {**gpu_meta(dict(HEAD_DIM=d, BLOCK_D=d), torch.bfloat16), **tiles, "WARP_SPECIALIZE": False,
                  "HIDE_BEFORE": True, "HIDE_AFTER": False, "DQ_ATOMIC": True, "DQ_ORDERED": ordered}  # fmt: skip
    ptx = compile_sm90(rung2_hopper.bwd_dkdv_hopper, args, constexprs, options)
    adds = re.findall(r"\b(?:atom|red)\.global\.[\w.]*add[\w.]*f32", ptx)
    if ordered:
        assert not adds and "acquire" in ptx and "release" in ptx and ".cg." in ptx
    else:
        assert adds and all(".v4." in a or ".v2." in a for a in adds), adds  # vectorised float32 adds
    assert "setmaxnreg" not in ptx
    assert "cp.async.bulk.tensor" in ptx
