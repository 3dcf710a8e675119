"""Exercises for notebook 02 (score matrix and traffic): count the bytes, then ask the roofline which bound wins.

The lesson's figures: one head's 8,192-token fp16 score matrix is 134,217,728 B; naive attention moves it four
times (537 MB); FlashAttention reads Q, K, V and writes O once (8.4 MB at d = 128), 64x less. For the whole 8K
prompt of a 64-head, 80-layer model: 2.75 TB of score traffic against 176 TFLOP, 0.92 s of memory time against
0.35 s of arithmetic on a GPU with 3 TB/s and 500 TFLOP/s.

The third exercise reads a recorded table of per-kernel HBM bytes (what ``python -m flashlab.bench --mode
traffic`` measures) the way the counters show eager PyTorch's naive attention: Q K^T, a separate multiply by the
scale, a causal masked_fill when there is a mask, softmax, P V.
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_int, expect_number, unpack

EXERCISES = [
    Exercise(
        id="02.attention_traffic",
        title="score-matrix bytes, and naive vs flash HBM traffic for one head",
        signature="n, d, dtype_bytes=2",
        imports="",
        doc="""
        Bytes for one attention head at sequence length n and head dimension d, elements of dtype_bytes each.

        Returns (score_bytes, naive_bytes, flash_bytes), three ints:
        score_bytes  the n x n score matrix S
        naive_bytes  the unfused version's traffic in the lesson's simplified count: write S, read S,
                     write P, read P (leave out the Q, K, V, O reads and writes)
        flash_bytes  FlashAttention's traffic: read Q, K and V and write O once, each n x d

        The lesson: attention_traffic(8192, 128) == (134_217_728, 536_870_912, 8_388_608).
        """,
    ),
    Exercise(
        id="02.roofline_bound",
        title="which roofline bound wins: memory time or compute time",
        signature="flops, nbytes, bandwidth, peak_flops",
        imports="",
        doc="""
        The roofline: an operation needs at least nbytes / bandwidth seconds to move its bytes and
        flops / peak_flops seconds to do its arithmetic; the larger of the two is its time.

        flops       float   floating-point operations
        nbytes      float   bytes moved to and from HBM
        bandwidth   float   HBM bandwidth, bytes per second
        peak_flops  float   arithmetic throughput, FLOP per second

        Returns (seconds, bound): the larger time, and "memory" or "compute" for whichever bound it is.
        The lesson's 8K prompt: 2.75 TB and 176 TFLOP on 3 TB/s and 500 TFLOP/s gives (0.92, "memory").
        """,
    ),
    Exercise(
        id="02.naive_kernel_passes",
        title="name each kernel of a recorded naive-attention call, and predict the next length's bytes",
        signature="kernels, n, n_next",
        imports="",
        doc="""
        A recorded table of one naive attention call in eager PyTorch, kernel by kernel in launch order, at
        sequence length n (the kernels that build a causal mask are left out):

        kernels  list of dicts, one per kernel: {"kernel": its name (str), "read": bytes read from HBM,
                 "write": bytes written to HBM}
        n        int, the length the table was recorded at
        n_next   int, another length

        Returns (passes, predicted):
        passes     list of str, one per kernel, each one of "QK^T", "scale", "mask", "softmax", "PV".
                   QK^T is the first matrix multiply: it reads the small Q and K and writes the n x n S.
                   PV is the last: it reads P and the small V and writes the small O. Every kernel between
                   them reads and writes a whole n x n matrix: the multiply by the scale comes first,
                   softmax last, and a causal mask's masked_fill (if there is one) in between.
        predicted  float, the total HBM bytes (read + write, every kernel) of the same call at length n_next.
                   Bytes of n x n matrices grow as n^2; the reads of Q, K, V and the write of O grow as n.

        Use only the table: the head dim, the number of heads and the bytes per element are not given.
        """,
    ),
]


@graded("02.attention_traffic", 2)
def test_traffic_lesson(answer):
    """the lesson's head at 8,192 tokens, d = 128, fp16: 134,217,728 B / 537 MB / 8.4 MB"""
    s, naive, flash = unpack(answer(8192, 128, 2), 3, "attention_traffic(8192, 128, 2)")
    expect_int(s, 134_217_728, "score_bytes at 8,192 tokens fp16", hints={"counted bits, not bytes": 8.0})
    expect_int(naive, 536_870_912, "naive_bytes at 8,192 tokens", hints={"count four passes over S": 0.25})
    expect_int(flash, 8_388_608, "flash_bytes at 8,192 tokens, d = 128")


@graded("02.attention_traffic", 1)
def test_traffic_default_dtype(answer):
    """dtype_bytes defaults to 2 (fp16/bf16)"""
    s, _, _ = unpack(answer(4096, 64), 3, "attention_traffic(4096, 64)")
    expect_int(s, 4096 * 4096 * 2, "score_bytes at 4,096 tokens with the default dtype")


@graded("02.attention_traffic", 2)
def test_traffic_random(answer):
    """fresh random lengths, head dims and dtypes (1, 2 or 4 bytes)"""
    rng = np.random.default_rng()
    for _ in range(5):
        n, d, b = int(rng.integers(100, 40_000)), int(rng.integers(16, 257)), int(rng.choice([1, 2, 4]))
        s, naive, flash = unpack(answer(n, d, b), 3, f"attention_traffic({n}, {d}, {b})")
        expect_int(s, n * n * b, f"score_bytes for n = {n}, {b}-byte elements")
        expect_int(naive, 4 * n * n * b, f"naive_bytes for n = {n}, {b}-byte elements")
        expect_int(flash, 4 * n * d * b, f"flash_bytes for n = {n}, d = {d}, {b}-byte elements")


@graded("02.attention_traffic", 1)
def test_traffic_ratio(answer):
    """the saving is n / d: 64x at 8K tokens and d = 128, and it grows with n"""
    rng = np.random.default_rng()
    n, d = int(rng.integers(1000, 30000)), int(rng.choice([64, 80, 96, 128]))
    _, naive, flash = unpack(answer(n, d, 2), 3, f"attention_traffic({n}, {d}, 2)")
    expect_number(float(naive) / float(flash), n / d, f"naive / flash traffic at n = {n}, d = {d}")


def _lesson_prompt():
    n, d, heads, layers = 8192, 128, 64, 80
    return 4 * n * n * d * heads * layers, 4 * n * n * 2 * heads * layers


@graded("02.roofline_bound", 2)
def test_bound_lesson(answer):
    """the lesson's 8K prompt on 3 TB/s and 500 TFLOP/s: memory-bound, 0.92 s"""
    flops, nbytes = _lesson_prompt()
    t, bound = unpack(answer(flops, nbytes, 3e12, 500e12), 2, "roofline_bound(...)")
    assert bound == "memory", f"bound for the lesson's prompt: got {bound!r}, expected 'memory'"
    t = expect_number(t, nbytes / 3e12, "time for the lesson's prompt", hints={"took the smaller time": 0.38})
    assert round(t, 2) == 0.92


@graded("02.roofline_bound", 1)
def test_bound_flash(answer):
    """with FlashAttention's traffic the same prompt becomes compute-bound: 0.35 s"""
    flops, _ = _lesson_prompt()
    nbytes = 4 * 8192 * 128 * 2 * 64 * 80
    t, bound = unpack(answer(flops, nbytes, 3e12, 500e12), 2, "roofline_bound(...)")
    assert bound == "compute", f"bound with flash traffic: got {bound!r}, expected 'compute'"
    assert round(float(t), 2) == 0.35, f"time with flash traffic: got {float(t):.4g} s, expected 0.35 s"


@graded("02.roofline_bound", 2)
def test_bound_random(answer):
    """fresh random operations on random GPUs, both sides of the ridge point"""
    rng = np.random.default_rng()
    for _ in range(6):
        flops, nbytes = 10 ** rng.uniform(9, 15), 10 ** rng.uniform(7, 13)
        bw, peak = 10 ** rng.uniform(11.5, 12.8), 10 ** rng.uniform(13.5, 15.3)
        t_mem, t_cmp = nbytes / bw, flops / peak
        if abs(np.log(t_mem / t_cmp)) < 0.01:
            continue
        t, bound = unpack(answer(flops, nbytes, bw, peak), 2, "roofline_bound(...)")
        want = "memory" if t_mem > t_cmp else "compute"
        what = f"{flops:.3g} FLOP, {nbytes:.3g} B on {bw:.3g} B/s and {peak:.3g} FLOP/s"
        assert bound == want, f"bound for {what}: got {bound!r}, expected {want!r}"
        expect_number(t, max(t_mem, t_cmp), f"time for {what}")


# -- 02.naive_kernel_passes: a recorded table of eager naive attention's kernels ---------------------------------

_GEMM = ["nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "nvjet_tst_128x64_64x8_1x2_h_bz_NNT",
         "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
         "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128_32x3_nn_align8"]  # fmt: skip
_SCALE = ["void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<c10::BFloat16, "
          "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float>>, std::array<char *, 2>>",
          "void at::native::elementwise_kernel<128, 2, MulFunctor<float>>"]  # fmt: skip
_MASK = ["void at::native::masked_fill_kernel<bool>(at::TensorIterator &, const c10::Scalar &)",
         "void at::native::vectorized_elementwise_kernel<4, where_kernel_impl<c10::BFloat16>>"]  # fmt: skip
_SOFTMAX = [
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, c10::BFloat16>",
    "void at::native::(anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 11>",
]


def _recorded_table(n, d, heads, elem, causal, rng, noise=0.003):
    """A table like a recording of eager naive attention at length n, with the exact parts it was made from:
    returns (kernels, passes, quadratic bytes, linear bytes). Small measurement noise on every entry."""
    s = heads * n * n * elem  # one n x n matrix per head, every head
    x = heads * n * d * elem  # one of Q, K, V, O
    m = heads * n * n  # the boolean mask, read by masked_fill
    plan = [("QK^T", _GEMM, (0, 2 * x), (s, 0)), ("scale", _SCALE, (s, 0), (s, 0))]
    if causal:
        plan.append(("mask", _MASK, (s + m, 0), (s, 0)))
    plan += [("softmax", _SOFTMAX, (s, 0), (s, 0)), ("PV", _GEMM, (s, x), (0, x))]
    kernels, quadratic, linear = [], 0.0, 0.0
    for _name, family, (read_sq, read_lin), (write_sq, write_lin) in plan:
        wobble = 1 + rng.uniform(-noise, noise, size=2)
        kernels.append(dict(kernel=str(rng.choice(family)), read=float((read_sq + read_lin) * wobble[0]),
                            write=float((write_sq + write_lin) * wobble[1])))  # fmt: skip
        quadratic += read_sq + write_sq
        linear += read_lin + write_lin
    return kernels, [p[0] for p in plan], quadratic, linear


def _expect_passes(got, want, what):
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        raise AssertionError(f"{what}: expected a list of {len(want)} pass names; got {got!r}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            raise AssertionError(f"{what}: kernel {i} is {w!r}; you named it {g!r} (the passes, in order: {want})")


def _expect_prediction(got, quadratic, linear, n, n_next, what):
    r = n_next / n
    want = quadratic * r**2 + linear * r
    hints = {
        "you scaled every byte as n^2: Q, K, V and O grow only as n": (quadratic + linear) * r**2 / want,
        "you scaled every byte as n: the n x n passes grow as n^2": (quadratic + linear) * r / want,
        "the bytes did not change with the length": (quadratic + linear) / want,
    }
    expect_number(got, want, what, rel=0.02, hints=hints)


@graded("02.naive_kernel_passes", 2)
def test_passes_lesson_case(answer):
    """the lesson's head at 8K, d = 128, 16 heads in bf16: four kernels, and their bytes at 16K"""
    rng = np.random.default_rng(8192)
    kernels, want, quad, lin = _recorded_table(8192, 128, 16, 2, False, rng)
    passes, predicted = unpack(answer(kernels, 8192, 16384), 2, "naive_kernel_passes(table at 8K, 8192, 16384)")
    _expect_passes(passes, want, "passes at 8K")
    _expect_prediction(predicted, quad, lin, 8192, 16384, "predicted bytes at 16K")


@graded("02.naive_kernel_passes", 1)
def test_passes_causal(answer):
    """a causal call has a masked_fill between the scale and softmax"""
    rng = np.random.default_rng()
    n = int(rng.integers(300, 5000))
    kernels, want, quad, lin = _recorded_table(n, 64, 32, 2, True, rng)
    passes, predicted = unpack(answer(kernels, n, 2 * n), 2, f"naive_kernel_passes(causal table, {n}, {2 * n})")
    _expect_passes(passes, want, f"passes of a causal call at n = {n}")
    _expect_prediction(predicted, quad, lin, n, 2 * n, f"predicted bytes at n = {2 * n}")


@graded("02.naive_kernel_passes", 3)
def test_passes_random_tables(answer):
    """fresh random lengths, head dims, head counts, dtypes and masks; shorter lengths too"""
    rng = np.random.default_rng()
    for i in range(7):
        n, d = int(rng.integers(128, 4000)), int(rng.choice([64, 96, 128, 256]))
        heads, elem, causal = int(rng.integers(1, 40)), int(rng.choice([2, 4])), bool(rng.integers(2))
        n_next = int(n * rng.choice([0.5, 1.5, 2, 3, 4]))
        if i == 0:  # a short sequence, where Q, K, V and O are a quarter of the bytes: their n-scaling shows
            n, d, n_next = 256, 128, 1024
        kernels, want, quad, lin = _recorded_table(n, d, heads, elem, causal, rng)
        what = f"table at n = {n} (d = {d}, {heads} heads, {elem}-byte elements, causal={causal})"
        passes, predicted = unpack(answer(kernels, n, n_next), 2, f"naive_kernel_passes({what}, {n}, {n_next})")
        _expect_passes(passes, want, f"passes of the {what}")
        _expect_prediction(predicted, quad, lin, n, n_next, f"predicted bytes at n = {n_next} from the {what}")


# One call recorded on an NVIDIA H200 (data/results/h200-traffic-bf16-2026-12-01.json, ncu 2025.3.1): naive attention
# at n = 8,192, d = 128, 16 heads, bf16, no mask, kernel by kernel; and the same call's total HBM bytes at 16,384.
_H200_8K = [
    ('nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT',
     104_699_136, 2_118_265_088),
    ('void at::vectorized_elementwise_kernel<8, at::AUnaryFunctor<c10::BFloat16, c10::BFloat16, c10::B'
     'Float16, binary_internal::MulFunctor<float>>, std::array<char *, 2>>(int, T2, T3)',
     2_147_535_360, 2_121_362_944),
    ('void at::<unnamed>::cunn_SoftMaxForwardReg<c10::BFloat16, float, c10::BFloat16, at::<unnamed>::S'
     'oftMaxForwardEpilogue, long, 8>(T3 *, const T1 *, T5)',
     2_147_565_824, 2_126_821_120),
    ('nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN',
     2_202_699_008, 28_057_344),
]  # fmt: skip
_H200_16K_TOTAL = 52_000_259_584


@graded("02.naive_kernel_passes", 1)
def test_passes_h200_recording(answer):
    """a real recording: the H200's four kernels at 8K, and the bytes it measured at 16K (within 3 %)"""
    kernels = [dict(kernel=name, read=float(read), write=float(write)) for name, read, write in _H200_8K]
    passes, predicted = unpack(answer(kernels, 8192, 16384), 2, "naive_kernel_passes(the H200's table, 8192, 16384)")
    _expect_passes(passes, ["QK^T", "scale", "softmax", "PV"], "passes of the H200's kernels at 8K")
    expect_number(predicted, _H200_16K_TOTAL, "predicted bytes at 16K against the H200's measurement", rel=0.03,
                  hints={"the bytes did not change with the length": 0.25})  # fmt: skip
