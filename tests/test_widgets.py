"""The sequence-length explorer in the kernel: set its controls as a learner would, read what it now shows.

Expected numbers are the lesson's (as it prints them) or computed here from its formulas -- n x n x bytes for a
score matrix, 4 n^2 d for the FLOPs, four passes for naive traffic, 4 n d bytes for flash -- never taken from the
code under test.
"""

from __future__ import annotations

import re

import pytest

from flashlab.widgets import SEQ_LENS, explorer


def _text(widget) -> str:
    """The readout's text as a browser shows it: tags stripped, entities decoded."""
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", widget.value))


@pytest.fixture
def ex():
    return explorer()


def test_starts_at_the_lessons_8k_case(ex):
    assert ex.seq_len.value == 8192
    score = _text(ex.readouts["score-memory"])
    # 8,192^2 x 2 B = 134,217,728 B per head; x 64 heads = 8.59 GB per layer; x 80 layers = 687 GB
    assert "134 MB per head" in score
    assert "8.59 GB per layer" in score
    assert "687 GB whole model" in score
    traffic = _text(ex.readouts["traffic"])
    assert "naive 2.75 TB" in traffic  # 4 x 134 MB x 64 x 80
    assert "flash 42.9 GB" in traffic  # 4 x 8,192 x 128 x 2 B = 8.39 MB per head, x 64 x 80
    assert "64× less" in traffic
    assert "176 TFLOP" in _text(ex.readouts["flops"])
    naive = _text(ex.readouts["naive-bounds"])
    assert "memory 0.916 s" in naive and "compute 0.352 s" in naive  # 2.75 TB / 3 TB/s, 176 TFLOP / 500 TFLOP/s
    assert "memory-bound" in naive
    assert "compute-bound" in _text(ex.readouts["flash-bounds"])


@pytest.mark.parametrize(
    ("n", "per_head"),
    # n^2 x 2 B: 524,288 B; the lesson's 537 MB at 16K and 2.1 GB at 32K; 34,359,738,368 B at 128K
    [(512, "524 kB"), (16384, "537 MB"), (32768, "2.15 GB"), (131072, "34.4 GB")],
)
def test_moving_the_slider_changes_the_score_memory(ex, n, per_head):
    before = ex.readouts["score-memory"].value
    ex.seq_len.value = n
    assert f"{per_head} per head" in _text(ex.readouts["score-memory"])
    assert ex.readouts["score-memory"].value != before
    assert ex.cost.n == n


def test_flash_point_moves_right_on_the_roofline_as_n_grows(ex):
    # intensity = 4 n^2 d / (4 n d x 2 B) = n / 2 FLOP per byte for flash; naive stays at d / 2 = 64
    for n in (1024, 4096):
        ex.seq_len.value = n
        svg = ex.readouts["plot"].value
        assert f"flash: {n // 2:,} FLOP/B" in svg
        assert "naive: 64 FLOP/B" in svg
        assert svg.count("<svg") == 2


def test_the_gpu_picker_changes_the_time_bounds(ex):
    before = _text(ex.readouts["naive-bounds"])
    ex.gpu.value = "h100-sxm"
    after = _text(ex.readouts["naive-bounds"])
    assert after != before
    # 2.749 TB / 3.35 TB/s = 0.821 s of memory time on an H100 SXM (its datasheet bandwidth)
    assert "memory 0.821 s" in after
    assert "h100-sxm" in ex.readouts["plot"].value


def test_the_model_picker_changes_heads_and_layers(ex):
    ex.model.value = "llama-3-8b"  # 32 query heads, 32 layers
    score = _text(ex.readouts["score-memory"])
    assert "134 MB per head" in score
    assert "4.29 GB per layer" in score  # 134,217,728 x 32
    assert "137 GB whole model" in score  # x 32 layers


def test_the_dtype_choice_scales_the_bytes(ex):
    ex.dtype.value = 4
    assert "268 MB per head" in _text(ex.readouts["score-memory"])  # 8,192^2 x 4 B
    ex.dtype.value = 1
    assert "67.1 MB per head" in _text(ex.readouts["score-memory"])
    assert "176 TFLOP" in _text(ex.readouts["flops"])  # the FLOPs do not depend on the element size


def test_slider_is_log_scale_from_512_to_128k(ex):
    assert SEQ_LENS[0] == 512 and SEQ_LENS[-1] == 128 * 1024
    assert all(b == 2 * a for a, b in zip(SEQ_LENS, SEQ_LENS[1:], strict=False))
    assert [label for label, _ in ex.seq_len.options][:3] == ["512", "1K", "2K"]
    assert "flashlab-seq-len" in ex.seq_len._dom_classes
    for name in ("score-memory", "traffic", "flops", "naive-bounds", "flash-bounds", "plot"):
        assert f"flashlab-{name}" in ex.readouts[name]._dom_classes
    assert "flashlab-explorer" in ex._dom_classes


def test_layout_has_fixed_sizes(ex):
    # nothing jumps as values change: every readout and the plot have a fixed width and height
    for w in ex.readouts.values():
        assert w.layout.width and w.layout.height


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 1000}, "seq_len"),
        ({"gpu": "no-such-gpu"}, "unknown GPU"),
        ({"model": "no-such-model"}, "unknown model"),
        ({"dtype_bytes": 3}, "dtype_bytes"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        explorer(**kwargs)
