"""flashlab.calculators.roofline reproduces every figure the lesson prints, to the digits it prints them.

The expected values below are typed in from the lesson's text, never computed by the code under test. The lesson
uses decimal units (134 MB = 134 x 10^6 B, 2.75 TB = 2.75 x 10^12 B) except for on-chip tiles, where "32 KB" is
32 KiB = 32,768 B (a 128 x 128 fp16 tile) and "160 KB" is 160 x 1,024 B.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashlab.calculators.roofline import (
    GPU,
    GPUS,
    MODELS,
    Model,
    attention_flops,
    decode_read_time,
    end_to_end_speedup,
    flash_attention_traffic,
    flash_block_sizes,
    flash_io_accesses,
    format_bytes,
    format_flops,
    format_seconds,
    kv_cache_bytes,
    kv_cache_bytes_per_token,
    model_attention_flops,
    model_flash_traffic,
    model_naive_traffic,
    model_score_matrix_bytes,
    naive_attention_traffic,
    prefill_cost,
    score_matrix_bytes,
    tile_sram_bytes,
    time_bounds,
)

N, D = 8192, 128  # the lesson's prompt length and head dim
KiB = 1024


# --- one head --------------------------------------------------------------------------------------------------------


def test_score_matrix_one_head_8k_fp16_is_134_mb():
    assert score_matrix_bytes(8192) == 134_217_728
    assert round(score_matrix_bytes(8192) / 1e6) == 134


def test_score_matrix_quadruples_when_context_doubles():
    assert round(score_matrix_bytes(16_384) / 1e6) == 537  # "16K tokens is 537 MB per head"
    assert round(score_matrix_bytes(32_768) / 1e9, 1) == 2.1  # "32K is 2.1 GB"
    assert score_matrix_bytes(2 * 1023) == 4 * score_matrix_bytes(1023)


def test_score_matrix_other_dtypes_and_odd_lengths():
    assert score_matrix_bytes(1823, dtype_bytes=4) == 1823 * 1823 * 4
    assert score_matrix_bytes(781, dtype_bytes=1) == 781 * 781
    assert score_matrix_bytes(1) == 2


def test_naive_traffic_four_passes_is_537_mb():
    assert naive_attention_traffic(N, D) == 4 * 134_217_728
    assert round(naive_attention_traffic(N, D) / 1e6) == 537


def test_naive_traffic_can_include_q_k_v_o():
    without = naive_attention_traffic(N, D)
    with_qkvo = naive_attention_traffic(N, D, include_qkvo=True)
    assert with_qkvo - without == 4 * N * D * 2  # read Q, K, V and write O: 8.4 MB more
    assert naive_attention_traffic(1823, 97, passes=2) == 2 * 1823 * 1823 * 2


def test_flash_traffic_is_8_4_mb_and_64x_less():
    assert flash_attention_traffic(N, D) == 8_388_608
    assert round(flash_attention_traffic(N, D) / 1e6, 1) == 8.4
    assert naive_attention_traffic(N, D) / flash_attention_traffic(N, D) == 64
    assert naive_attention_traffic(N, D) // flash_attention_traffic(N, D) == N // D  # the factor n / d


def test_flops_one_head_8k_is_34_4_gflop():
    assert attention_flops(N, D) == 4 * N * N * D
    assert round(attention_flops(N, D) / 1e9, 1) == 34.4
    assert attention_flops(N, D, causal=True) == attention_flops(N, D) // 2
    assert attention_flops(1823, 97) == 4 * 1823 * 1823 * 97


def test_flops_with_a_different_value_dim():
    # MLA-style: q/k are 192 wide, v is 128 wide -> 2 n^2 (192 + 128)
    assert attention_flops(100, 192, dv=128) == 2 * 100 * 100 * (192 + 128)


# --- the whole model ---------------------------------------------------------------------------------------------


def test_all_score_matrices_at_once_would_be_687_gb():
    total = model_score_matrix_bytes(N, "lesson-70b")
    assert total == 134_217_728 * 64 * 80
    assert round(total / 1e9) == 687


def test_score_traffic_34_4_gb_per_layer_and_2_75_tb_per_prompt():
    assert round(model_naive_traffic(N, "lesson-70b", per="layer") / 1e9, 1) == 34.4
    assert round(model_naive_traffic(N, "lesson-70b") / 1e12, 2) == 2.75
    assert model_naive_traffic(N, "lesson-70b", per="head") == naive_attention_traffic(N, D)


def test_prompt_flops_is_176_tflop():
    assert round(model_attention_flops(N, "lesson-70b") / 1e12) == 176
    assert model_attention_flops(N, "lesson-70b", per="layer") == 64 * attention_flops(N, D)


def test_lesson_roofline_0_92_s_of_traffic_vs_0_35_s_of_maths():
    bounds = time_bounds(model_attention_flops(N, "lesson-70b"), model_naive_traffic(N, "lesson-70b"), "lesson-gpu")
    assert round(bounds.memory_s, 2) == 0.92
    assert round(bounds.compute_s, 2) == 0.35
    assert bounds.bound == "memory"
    assert bounds.time_s == bounds.memory_s
    assert bounds.tensor_core_busy < 0.4  # the tensor cores wait more than half the time
    assert bounds.ridge_point == pytest.approx(500e12 / 3e12)
    assert bounds.arithmetic_intensity == pytest.approx(64.0)  # 4 n^2 d FLOPs / 8 n^2 B = d / 2
    assert bounds.arithmetic_intensity < bounds.ridge_point


def test_flash_moves_64x_less_and_becomes_compute_bound():
    cost = prefill_cost(N, "lesson-70b", "lesson-gpu")
    assert cost.traffic_ratio == 64
    assert round(cost.score_matrix_bytes / 1e6) == 134
    assert round(cost.score_matrices_per_model / 1e9) == 687
    assert round(cost.naive.memory_s, 2) == 0.92
    assert cost.flash.bound == "compute"
    assert cost.flash.compute_s == cost.naive.compute_s  # same FLOPs: the algorithm is unchanged


def test_whole_model_flash_traffic():
    assert model_flash_traffic(N, "lesson-70b") == 8_388_608 * 64 * 80


def test_causal_halves_the_work_not_the_lesson_traffic():
    full, causal = prefill_cost(N, causal=False), prefill_cost(N, causal=True)
    assert causal.flops * 2 == full.flops
    assert causal.naive_traffic == full.naive_traffic


def test_compute_bound_when_intensity_above_ridge():
    bounds = time_bounds(1e15, 1e9, "h100-sxm")
    assert bounds.bound == "compute"
    assert bounds.tensor_core_busy == 1.0


# --- the FlashAttention paper's IO count ------------------------------------------------------------------------


def test_block_sizes_follow_algorithm_1():
    # M = 100 KiB / 2 B = 51,200 elements; B_c = ceil(51,200 / 512) = 100; B_r = min(100, 128) = 100
    assert flash_block_sizes(128, 100 * KiB) == (100, 100)
    # M = 228 KiB / 2 B = 116,736; B_c = ceil(116,736 / 512) = 228; B_r = min(228, 128) = 128
    assert flash_block_sizes(128, 228 * KiB) == (128, 228)
    assert flash_block_sizes(97, 4 * 97 * 2) == (1, 1)  # exactly one row of Q, K, V, O


def test_flash_io_count_matches_algorithm_1_by_hand():
    n, d, sram = 1000, 64, 64 * KiB  # M = 32,768 elements, B_c = 128, T_c = ceil(1000 / 128) = 8
    elements = (n * d + 2 * n) + 2 * n * d + 8 * (3 * n * d + 4 * n)
    assert flash_io_accesses(n, d, sram) == elements * 2


def test_flash_io_falls_as_one_over_sram_size():
    # Theta(n^2 d^2 / M): doubling M (while T_c stays well above 1) nearly halves the traffic
    small, large = flash_io_accesses(N, D, 32 * KiB), flash_io_accesses(N, D, 64 * KiB)
    assert 1.9 < small / large < 2.05
    # ... and for small M it approaches 12 n^2 d^2 / M elements
    m = 16 * KiB // 2
    assert flash_io_accesses(N, D, 16 * KiB) / 2 == pytest.approx(12 * N**2 * D**2 / m, rel=0.02)


def test_flash_io_flattens_once_one_block_holds_all_keys():
    huge = 4 * N * D * 2  # B_c = n: one K/V block
    assert flash_io_accesses(N, D, huge) == flash_io_accesses(N, D, 4 * huge)
    assert flash_io_accesses(N, D, huge) < 2 * flash_attention_traffic(N, D)
    # always far below the naive count for realistic SRAM
    assert flash_io_accesses(N, D, 100 * KiB) < naive_attention_traffic(N, D)


def test_flash_io_rejects_sram_smaller_than_one_row_each():
    with pytest.raises(ValueError, match="4 d"):
        flash_io_accesses(N, D, 4 * D * 2 - 1)


# --- decode, Amdahl, the tile ---------------------------------------------------------------------------------------


def test_kv_cache_lesson_70b_is_327_680_bytes_per_token():
    assert kv_cache_bytes_per_token("lesson-70b") == 327_680
    assert kv_cache_bytes_per_token(MODELS["lesson-70b"], dtype_bytes=1) == 163_840


def test_kv_cache_128k_tokens_is_41_9_gb():
    assert kv_cache_bytes("lesson-70b", 128_000) == 327_680 * 128_000
    assert round(kv_cache_bytes("lesson-70b", 128_000) / 1e9, 1) == 41.9
    assert kv_cache_bytes("lesson-70b", 1000, batch=3) == 3 * 327_680_000


def test_decode_reads_the_cache_in_1_6_ms_over_8_gpus():
    t = decode_read_time("lesson-70b", 128_000, gpus=8, bandwidth=3.3e12)  # 41.9 GB / 26.4 TB/s
    assert round(t * 1e3, 1) == 1.6
    # an H100 SXM's 3.35 TB/s gives the same 1.6 ms
    assert round(decode_read_time("lesson-70b", 128_000, gpus=8, gpu="h100-sxm") * 1e3, 1) == 1.6
    assert decode_read_time("lesson-70b", 128_000, gpus=1, bandwidth=3.3e12) == pytest.approx(8 * t)
    # an 8-bit cache: 163,840 B a token, 163,840 x 128,000 = 20.97 GB, / 26.4 TB/s = 0.794 ms: half the read
    t8 = decode_read_time("lesson-70b", 128_000, gpus=8, bandwidth=3.3e12, dtype_bytes=1)
    assert t8 == pytest.approx(163_840 * 128_000 / 26.4e12, rel=1e-12) and round(t8 * 1e3, 3) == 0.794
    assert t8 == pytest.approx(t / 2, rel=1e-12)


def test_end_to_end_speedup_30_percent_at_2x_is_1_18x():
    assert round(end_to_end_speedup(0.3, 2), 2) == 1.18
    assert end_to_end_speedup(1.0, 2) == 2.0
    assert end_to_end_speedup(0.5, 1) == 1.0
    assert end_to_end_speedup(0.3, 1e12) == pytest.approx(1 / 0.7)  # Amdahl's ceiling


def test_tile_footprint_128_is_160_kib():
    assert tile_sram_bytes(128, 128, 128) == 163_840 == 160 * KiB
    # its parts: Q, K, V tiles 32 KiB each in fp16 (96 KiB), the fp32 score tile 64 KiB
    assert tile_sram_bytes(128, 128, 128) - 128 * 128 * 4 == 96 * KiB
    assert tile_sram_bytes(64, 32, 97) == (64 + 2 * 32) * 97 * 2 + 64 * 32 * 4
    assert tile_sram_bytes(128, 128, 128, include_output=True) == 160 * KiB + 64 * KiB


def test_tile_fits_h100_shared_memory_but_not_an_rtx_4090s():
    assert tile_sram_bytes(128, 128, 128) <= GPUS["h100-sxm"].smem_per_sm
    assert tile_sram_bytes(128, 128, 128) > GPUS["rtx-4090"].smem_per_sm


# --- custom GPUs and models -----------------------------------------------------------------------------------------


def test_custom_gpu_as_dict_in_datasheet_units_or_si():
    datasheet = {"name": "my-gpu", "hbm_bandwidth_TB_s": 3.0, "dense_fp16_TFLOP_s": 500}
    si = {"hbm_bandwidth": 3e12, "tensor_flops": 500e12}
    for gpu in (datasheet, si, GPU(name="mine", hbm_bandwidth=3e12, tensor_flops=500e12)):
        b = time_bounds(176e12, 2.75e12, gpu)
        assert round(b.memory_s, 2) == 0.92 and round(b.compute_s, 2) == 0.35


def test_custom_model_as_dict_or_dataclass():
    as_dict = {"name": "mine", "layers": 80, "query_heads": 64, "kv_heads": 8, "head_dim": 128}
    assert kv_cache_bytes_per_token(as_dict) == 327_680
    assert kv_cache_bytes_per_token(Model(**as_dict)) == 327_680
    # kv_heads left out means plain multi-head attention
    mha = {"layers": 2, "query_heads": 3, "head_dim": 5}
    assert kv_cache_bytes_per_token(mha) == 2 * 3 * 5 * 2 * 2
    assert round(model_score_matrix_bytes(N, as_dict) / 1e9) == 687


def test_mla_cache_is_latent_plus_rope_per_layer():
    assert kv_cache_bytes_per_token("deepseek-v2") == (512 + 64) * 60 * 2
    # its ~6-bit cache against DeepSeek 67B's fp16 GQA cache: the paper's 93.3 % reduction
    reduction = 1 - kv_cache_bytes_per_token("deepseek-v2", 0.75) / kv_cache_bytes_per_token("deepseek-llm-67b")
    assert round(100 * reduction, 1) == 93.3


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: score_matrix_bytes(0), ValueError, "n .*at least 1"),
        (lambda: score_matrix_bytes(-5), ValueError, "at least 1"),
        (lambda: score_matrix_bytes(8192.0), TypeError, "integer"),
        (lambda: score_matrix_bytes("8192"), TypeError, "integer"),
        (lambda: score_matrix_bytes(True), TypeError, "integer"),
        (lambda: score_matrix_bytes(8, dtype_bytes=0), ValueError, "dtype_bytes"),
        (lambda: score_matrix_bytes(8, dtype_bytes=math.nan), ValueError, "dtype_bytes"),
        (lambda: naive_attention_traffic(8, 0), ValueError, "head dim"),
        (lambda: naive_attention_traffic(8, 8, include_qkvo="yes"), TypeError, "include_qkvo"),
        (lambda: attention_flops(8, 8, causal=1), TypeError, "causal"),
        (lambda: time_bounds(1e12, 0, "lesson-gpu"), ValueError, "nbytes"),
        (lambda: time_bounds(1e12, 1e9, "a100"), ValueError, "unknown GPU 'a100'"),
        (lambda: time_bounds(1e12, 1e9, 3e12), TypeError, "gpu must be"),
        (lambda: time_bounds(1e12, 1e9, {"hbm_bandwidth_TB_s": 3}), ValueError, "tensor_flops"),
        (lambda: time_bounds(1e12, 1e9, {"bandwidth": 3e12, "tensor_flops": 1}), ValueError, "unknown GPU field"),
        (lambda: time_bounds(1e12, 1e9, {"hbm_bandwidth": -3e12, "tensor_flops": 1e12}), ValueError, "positive"),
        (lambda: kv_cache_bytes_per_token("llama-70b"), ValueError, "unknown model 'llama-70b'"),
        (
            lambda: kv_cache_bytes_per_token({"layers": 8, "query_heads": 6, "kv_heads": 4, "head_dim": 8}),
            ValueError,
            "multiple",
        ),
        (lambda: kv_cache_bytes_per_token({"layers": 8, "heads": 6}), ValueError, "unknown model field"),
        (
            lambda: kv_cache_bytes_per_token({"layers": 8, "query_heads": 8, "head_dim": 8, "attention": "mla"}),
            TypeError,
            "kv_lora_rank",
        ),
        (lambda: kv_cache_bytes("lesson-70b", 0), ValueError, "context"),
        (lambda: decode_read_time("lesson-70b", 1000, gpus=0), ValueError, "gpus"),
        (lambda: model_naive_traffic(N, "lesson-70b", per="gpu"), ValueError, "per must be"),
        (lambda: end_to_end_speedup(1.3, 2), ValueError, "fraction"),
        (lambda: end_to_end_speedup(0.3, 0), ValueError, "kernel_speedup"),
        (lambda: tile_sram_bytes(128, 0, 128), ValueError, "block_n"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_message(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- printing like the lesson ---------------------------------------------------------------------------------------


def test_formatting_matches_the_lesson():
    assert format_bytes(score_matrix_bytes(N)) == "134 MB"
    assert format_bytes(naive_attention_traffic(N, D)) == "537 MB"
    assert format_bytes(model_score_matrix_bytes(N, "lesson-70b")) == "687 GB"
    assert format_bytes(model_naive_traffic(N, "lesson-70b")) == "2.75 TB"
    assert format_bytes(flash_attention_traffic(N, D), digits=2) == "8.4 MB"
    assert format_flops(attention_flops(N, D)) == "34.4 GFLOP"
    assert format_flops(model_attention_flops(N, "lesson-70b")) == "176 TFLOP"
    assert format_seconds(decode_read_time("lesson-70b", 128_000, gpus=8, bandwidth=3.3e12), digits=2) == "1.6 ms"
    assert format_seconds(0.9163, digits=2) == "0.92 s"
    assert format_bytes(0) == "0 B" and format_bytes(512) == "512 B"


# --- properties over awkward shapes ---------------------------------------------------------------------------------

lengths = st.integers(min_value=1, max_value=200_000)
head_dims = st.integers(min_value=1, max_value=512)


@given(n=lengths, d=head_dims, dtype_bytes=st.sampled_from([1, 2, 4]))
def test_naive_over_flash_is_n_over_d(n, d, dtype_bytes):
    ratio = naive_attention_traffic(n, d, dtype_bytes) / flash_attention_traffic(n, d, dtype_bytes)
    assert ratio == pytest.approx(n / d)


@given(n=lengths, d=head_dims)
def test_naive_intensity_is_d_over_2_whatever_n(n, d):
    assert attention_flops(n, d) / naive_attention_traffic(n, d) == pytest.approx(d / 2)


@given(n=st.integers(1, 50_000), d=st.integers(1, 300), kib=st.integers(1, 4096))
def test_more_sram_never_means_more_traffic(n, d, kib):
    sram = max(kib * KiB, 4 * d * 2)
    assert flash_io_accesses(n, d, 2 * sram) <= flash_io_accesses(n, d, sram)
    assert flash_io_accesses(n, d, sram) >= flash_attention_traffic(n, d)  # never below reading everything once


# --- NumPy numbers are the same numbers -------------------------------------------------------------------------------

INT_TYPES = [int, np.int32, np.int64]


@pytest.mark.parametrize("as_int", INT_TYPES)
def test_numpy_integers_give_the_exact_python_answer(as_int):
    # NumPy integers wrap around silently: np.int32(8192) ** 2 * 2 * 128 * 4 is 0 in int32. Every calculator
    # must give the exact answer whatever integer type comes in. The expected values are written out by hand.
    n8k, n32k, n10m = as_int(8192), as_int(32768), as_int(10_000_000)
    assert attention_flops(n8k, as_int(128)) == 4 * 8192**2 * 128 == 34_359_738_368
    assert naive_attention_traffic(n32k, as_int(128)) == 4 * 32768**2 * 2 == 8_589_934_592
    assert score_matrix_bytes(as_int(65536)) == 65536**2 * 2
    assert flash_attention_traffic(n32k, as_int(128)) == 4 * 32768 * 128 * 2
    assert model_score_matrix_bytes(n8k, "lesson-70b") == 8192**2 * 2 * 64 * 80
    assert model_naive_traffic(n32k, "lesson-70b") == 4 * 32768**2 * 2 * 64 * 80
    assert model_attention_flops(n32k, "lesson-70b") == 4 * 32768**2 * 128 * 64 * 80
    cost = prefill_cost(n10m)
    assert cost.flops == 4 * 10**14 * 128 * 64 * 80
    assert cost.naive_traffic == 4 * 10**14 * 2 * 64 * 80
    assert cost.flash_traffic == 4 * 10**7 * 128 * 2 * 64 * 80
    assert isinstance(cost.n, int) and cost.traffic_ratio == pytest.approx(10**7 / 128)
    assert kv_cache_bytes("lesson-70b", as_int(128_000), batch=as_int(64)) == 327_680 * 128_000 * 64
    assert tile_sram_bytes(as_int(128), as_int(128), as_int(128)) == 163_840
    assert flash_io_accesses(n32k, as_int(128), as_int(100 * KiB)) == flash_io_accesses(32768, 128, 100 * KiB)
    assert flash_block_sizes(as_int(64), as_int(48 * KiB)) == flash_block_sizes(64, 48 * KiB)
    bounds = time_bounds(attention_flops(n32k, as_int(128)), naive_attention_traffic(n32k, as_int(128)), "h100-sxm")
    assert bounds.flops == 4 * 32768**2 * 128 and bounds.nbytes == 4 * 32768**2 * 2
    assert time_bounds(np.int64(10**15), np.float32(2.0**40)) == time_bounds(10**15, 2**40)
    t = decode_read_time("lesson-70b", as_int(128_000), gpus=as_int(8), bandwidth=np.float32(3.3e12))
    assert t == pytest.approx(327_680 * 128_000 / (8 * 3.3e12))


def test_prefill_cost_at_ten_million_tokens_in_int64_is_exact():
    assert prefill_cost(np.int64(10**7)) == prefill_cost(10**7)


def test_numpy_integers_in_a_model_dict_are_exact():
    model = {"name": "np-model", "layers": np.int32(80), "query_heads": np.int32(64), "head_dim": np.int32(128)}
    assert model_attention_flops(np.int32(32768), model) == 4 * 32768**2 * 128 * 64 * 80
    assert kv_cache_bytes(model, np.int32(2**20), batch=np.int32(1024)) == 2 * 64 * 128 * 80 * 2 * 2**20 * 1024


@pytest.mark.parametrize("dtype_bytes", [np.float32(0.5), np.int64(2), np.float64(0.75)])
def test_numpy_dtype_bytes_are_accepted(dtype_bytes):
    assert kv_cache_bytes_per_token("lesson-70b", dtype_bytes) == 163_840 * float(dtype_bytes)


def test_numbers_too_large_for_a_float_are_a_value_error():
    with pytest.raises(ValueError, match="too large"):
        end_to_end_speedup(10**400, 2)
    with pytest.raises(ValueError, match="kernel_speedup"):
        end_to_end_speedup(0.5, float("inf"))


# --- Amdahl: a share of 0 is a share ---------------------------------------------------------------------------------


def test_end_to_end_speedup_accepts_every_share_from_0_to_1():
    assert end_to_end_speedup(0.0, 2) == 1.0  # nothing got faster
    assert end_to_end_speedup(0, 5) == 1.0
    assert end_to_end_speedup(np.float32(0.5), np.int64(3)) == pytest.approx(1 / (0.5 + 0.5 / 3))
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="fraction"):
            end_to_end_speedup(bad, 2)
    with pytest.raises(TypeError, match="attention_share"):
        end_to_end_speedup("0.3", 2)


# --- printing: rounding carries into the next unit -------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, text",
    [
        (lambda: format_bytes(999_999), "1.00 MB"),
        (lambda: format_bytes(999_499), "999 kB"),
        (lambda: format_bytes(10**6), "1.00 MB"),
        (lambda: format_bytes(999.6), "1.00 kB"),
        (lambda: format_bytes(999_999_999_999), "1.00 TB"),
        (lambda: format_bytes(np.int64(134_217_728)), "134 MB"),
        (lambda: format_bytes(9_960_000, digits=2), "10 MB"),
        (lambda: format_flops(999_999e9), "1.00 PFLOP"),
        (lambda: format_seconds(0.0999999), "0.100 s"),
        (lambda: format_seconds(999.9999e-6), "1.00 ms"),
        (lambda: format_seconds(0.00159), "1.59 ms"),
    ],
)
def test_rounding_carries_into_the_next_unit(call, text):
    assert call() == text


def test_the_long_request_is_128000_tokens_as_the_lesson_counts_it():
    from flashlab.calculators.roofline import LONG_REQUEST_TOKENS

    assert LONG_REQUEST_TOKENS == 128_000
    assert round(kv_cache_bytes("lesson-70b", LONG_REQUEST_TOKENS) / 1e9, 1) == 41.9  # the lesson's figure
    mha = {"name": "lesson-70b-mha", "layers": 80, "query_heads": 64, "head_dim": 128}
    assert format_bytes(kv_cache_bytes(mha, LONG_REQUEST_TOKENS)) == "336 GB"  # 2 x 64 x 128 x 80 x 2 B x 128,000


def test_notebooks_take_each_shared_figure_from_one_source():
    # one figure, one source: the long request is LONG_REQUEST_TOKENS in every notebook that sizes it (it was
    # 131,072 in one table and 128,000 elsewhere), and the prefill ratios come from one named recording
    import json
    from pathlib import Path

    notebooks = Path(__file__).resolve().parents[1] / "notebooks"

    def code(name):
        cells = json.loads(next(notebooks.glob(f"{name}_*.ipynb")).read_text())["cells"]
        return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")

    for name in ("06", "07"):
        src = code(name)
        assert "LONG_REQUEST_TOKENS" in src
        for typed in ("128 * 1024", "131_072", "131072", "128_000", "2**17"):
            assert typed not in src, f"notebook {name} types the long request as {typed}"
    for name, recording in (("04", "h200-ladder-bf16-2026-12-02-all-rungs.json"), ("05", "h200-bf16-2026-11-29.json")):
        assert recording in code(name), f"notebook {name} must name the prefill recording {recording}"


# --- no OverflowError at any size: exact ints, or a ValueError naming the argument and the limit ---------------------

HUGE = 10**400  # past the largest float (about 1.8e308)


@pytest.mark.parametrize(
    "call",
    [
        lambda: score_matrix_bytes(HUGE, 0.5),
        lambda: naive_attention_traffic(HUGE, 128, 0.75, include_qkvo=True),
        lambda: flash_attention_traffic(HUGE, 128, 0.5),
        lambda: flash_block_sizes(128, HUGE),
        lambda: flash_io_accesses(HUGE, 128, 228 * 1024),
        lambda: flash_io_accesses(1024, 128, HUGE),
        lambda: attention_flops(HUGE, 128),
        lambda: model_score_matrix_bytes(HUGE, "lesson-70b", 0.5),
        lambda: model_naive_traffic(HUGE, "lesson-70b", 0.5),
        lambda: model_flash_traffic(HUGE, "lesson-70b", 0.5),
        lambda: kv_cache_bytes("lesson-70b", HUGE, 0.5, batch=HUGE),
        lambda: tile_sram_bytes(HUGE, HUGE, 128, 0.5, 4.0, include_output=True),
        lambda: end_to_end_speedup(0.5, HUGE),
        lambda: decode_read_time("lesson-70b", 1000, bandwidth=HUGE),
    ],
)
def test_calculators_stay_exact_past_the_largest_float(call):
    assert call() is not None  # no OverflowError


def test_exact_answers_past_the_largest_float():
    assert score_matrix_bytes(HUGE, 0.5) == HUGE * HUGE // 2
    assert kv_cache_bytes("lesson-70b", HUGE, 0.5) == 81_920 * HUGE  # 163,840 numbers a token, half a byte each
    assert flash_block_sizes(128, HUGE) == (128, -(-HUGE // 2 // 512))  # M = HUGE / 2 elements, B_c = ceil(M / 4d)
    assert end_to_end_speedup(0.5, HUGE) == 2.0  # 1 / (0.5 + 0.5 / HUGE)


@pytest.mark.parametrize(
    "call,names",
    [
        (lambda: time_bounds(HUGE, 1e9), "flops"),
        (lambda: time_bounds(1e12, HUGE), "nbytes"),
        (lambda: prefill_cost(HUGE), "n = 1.000e+400"),
        (lambda: decode_read_time("lesson-70b", HUGE), "context=1.000e+400"),
        (lambda: decode_read_time("lesson-70b", 1000, batch=HUGE), "batch=1"),
        (lambda: end_to_end_speedup(1.0, HUGE), "kernel_speedup=1.000e+400"),
        (lambda: time_bounds(1e12, 1e9, {"hbm_bandwidth": HUGE, "tensor_flops": 1e12}), "hbm_bandwidth"),
        (lambda: time_bounds(1e12, 1e9, {"hbm_bandwidth_TB_s": HUGE, "dense_fp16_TFLOP_s": 1}), "hbm_bandwidth_TB_s"),
        (lambda: format_bytes(HUGE), "nbytes"),
        (lambda: format_flops(HUGE), "flops"),
        (lambda: format_seconds(HUGE), "seconds"),
    ],
)
def test_results_past_the_largest_float_name_the_argument_and_the_limit(call, names):
    with pytest.raises(ValueError, match="1.8e\\+308") as e:
        call()
    assert names in str(e.value)


@pytest.mark.parametrize("fmt", [format_bytes, format_flops, format_seconds])
@pytest.mark.parametrize(
    "value,error,match",
    [
        (-1, ValueError, "at least 0"),
        (-2.5e9, ValueError, "at least 0"),
        (True, TypeError, "must be a number"),
        (False, TypeError, "must be a number"),
        ("12", TypeError, "must be a number"),
        (None, TypeError, "must be a number"),
        (float("nan"), ValueError, "NaN"),
        (float("inf"), ValueError, "finite"),
    ],
)
def test_formatting_refuses_what_is_not_a_size(fmt, value, error, match):
    with pytest.raises(error, match=match):
        fmt(value)


def test_formatting_refuses_more_digits_than_a_float_holds():
    with pytest.raises(ValueError, match="at most 17"):
        format_bytes(1e9, digits=18)
    assert format_bytes(0) == "0 B" and format_bytes(np.float32(2.5e9)) == "2.50 GB"


# --- the exponentials beside the products ---------------------------------------------------------------------------


def test_eight_bit_products_leave_the_exponentials_as_long_as_the_products():
    from flashlab.calculators.roofline import exp_to_matmul_time

    # H100 SXM: 989.4 TFLOP/s dense 16-bit, 3.9e12 exponentials/s (the FlashAttention-3 paper's two figures).
    # One score: 4 d FLOPs of products, one exponential. Typed in: 989.4e12 / (4 * 128 * 3.9e12) = 0.4955.
    assert exp_to_matmul_time(128, "h100-sxm") == pytest.approx(0.4955, abs=1e-4)
    # the teaching point: eight bits halve the products' time, not the exponentials', so at d = 128 the two become
    # equal, and at d = 64 the exponentials take twice as long as the 8-bit products
    assert exp_to_matmul_time(128, "h100-sxm", operand_bits=8) == pytest.approx(1.0, abs=0.01)
    assert exp_to_matmul_time(64, "h100-sxm", operand_bits=8) == pytest.approx(1.98, abs=0.01)
    assert exp_to_matmul_time(256, "h200-sxm", operand_bits=8) < 1 < exp_to_matmul_time(64, "h200-sxm", 16) * 2


@pytest.mark.parametrize("bad, message", [(dict(d=0), "head dim"), (dict(operand_bits=4), "operand_bits"),
                                          (dict(gpu="l4"), "special-function")])  # fmt: skip
def test_the_exponential_ratio_names_what_is_wrong(bad, message):
    from flashlab.calculators.roofline import exp_to_matmul_time

    with pytest.raises(ValueError, match=message):
        exp_to_matmul_time(**{"d": 128, **bad})
