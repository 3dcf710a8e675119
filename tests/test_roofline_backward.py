"""The backward-pass calculators in flashlab.calculators.roofline, against numbers worked out by hand here.

Per head at the lesson's n = 8,192, d = 128, fp16 (2 bytes), with n^2 = 67,108,864 and n d = 1,048,576:
- backward FLOPs: 5 multiplies x 2 n^2 d = 10 x 67,108,864 x 128 = 85,899,345,920 (forward: 34,359,738,368);
- unfused backward traffic: 7 passes x 134,217,728 B = 939,524,096 B;
- fused backward traffic: 8 n d x 2 B = 16,777,216 B, plus lse and delta 3 x 8,192 x 4 B = 98,304 B;
- saved for the backward: unfused (n^2 + 3 n d) x 2 B = 140,509,184 B; fused 4 n d x 2 B + 8,192 x 4 B = 8,421,376 B.
"""

from __future__ import annotations

import pytest

from flashlab.calculators.roofline import (
    attention_backward_flops,
    flash_attention_backward_traffic,
    flash_saved_for_backward_bytes,
    naive_attention_backward_traffic,
    naive_saved_for_backward_bytes,
)


def test_backward_flops_is_five_matmuls_two_and_a_half_times_the_forward():
    assert attention_backward_flops(8192, 128) == 85_899_345_920
    assert attention_backward_flops(8192, 128, causal=True) == 42_949_672_960
    assert attention_backward_flops(3, 5) == 10 * 9 * 5  # 450: odd sizes stay exact integers
    assert attention_backward_flops(1000, 64) / 4 / 1000**2 / 64 == 2.5  # 2.5 x (4 n^2 d)


def test_naive_backward_traffic_is_seven_passes_over_n_squared():
    assert naive_attention_backward_traffic(8192, 128) == 939_524_096
    assert naive_attention_backward_traffic(8192, 128, passes=5) == 671_088_640
    # with Q, K, V, dO read and dQ, dK, dV written: 7 x 1,048,576 x 2 B = 14,680,064 B more
    assert naive_attention_backward_traffic(8192, 128, include_qkvo=True) == 939_524_096 + 14_680_064
    assert naive_attention_backward_traffic(100, 8, dtype_bytes=4) == 7 * 100 * 100 * 4  # 280,000


def test_flash_backward_traffic_reads_inputs_once_and_recomputation_is_free():
    assert flash_attention_backward_traffic(8192, 128) == 16_777_216 + 98_304
    assert flash_attention_backward_traffic(100, 8, dtype_bytes=4) == 8 * 800 * 4 + 3 * 100 * 4  # 26,800
    # 8K: 939.5 MB against 16.9 MB, about 56x less
    assert 55 < naive_attention_backward_traffic(8192, 128) / flash_attention_backward_traffic(8192, 128) < 56


def test_training_memory_grows_as_n_squared_unfused_and_as_n_fused():
    assert naive_saved_for_backward_bytes(8192, 128) == 140_509_184
    assert flash_saved_for_backward_bytes(8192, 128) == 8_421_376
    # doubling n: the n^2 term quadruples, the fused count exactly doubles
    assert naive_saved_for_backward_bytes(16_384, 128) == (268_435_456 + 6_291_456) * 2  # 549,453,824
    assert flash_saved_for_backward_bytes(16_384, 128) == 2 * 8_421_376


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: attention_backward_flops(0, 64), "n"),
        (lambda: attention_backward_flops(64, 64, causal="yes"), "causal"),
        (lambda: naive_attention_backward_traffic(64, 64, passes=0), "passes"),
        (lambda: flash_attention_backward_traffic(64, 64, stat_bytes=0), "stat_bytes"),
        (lambda: naive_saved_for_backward_bytes(64, 0), "d"),
        (lambda: flash_saved_for_backward_bytes(64, 64, dtype_bytes=-2), "dtype_bytes"),
    ],
)
def test_bad_input_is_rejected(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
