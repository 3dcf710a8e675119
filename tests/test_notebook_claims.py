"""The checks of what notebooks say about speed (``notebook_claims``) fail on the mistakes they exist to catch.

Each case builds a small notebook (or an executed notebook's text) that gets one thing wrong -- an older
recording, a typed ratio, a legend entry the data does not have, words stronger than the ratio -- and expects the
check to refuse it; the same checks pass on the real notebooks in ``tests/test_notebooks.py``.
"""

from __future__ import annotations

import nbformat
import notebook_claims as claims
import pytest


def notebook(*cells):
    """A notebook of ("md" | "code", source) cells; code cells may carry outputs as a third item."""
    nb = nbformat.v4.new_notebook()
    for kind, source, *outputs in cells:
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source)
            cell.outputs = outputs[0] if outputs else []
            nb.cells.append(cell)
    return nb


def printed(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def shown_markdown(text):
    return nbformat.v4.new_output("display_data", data={"text/markdown": text, "text/plain": "<Markdown>"})


def test_the_newest_ladder_recording_is_the_one_notebooks_04_and_05_draw():
    kind = claims.prefill_with(*claims.LADDER_RUNGS, "sdpa_flash", "sdpa_cudnn")
    assert claims.newest_of_kind(kind) == claims.LADDER


def test_an_older_recording_is_refused():
    older = notebook(("code", 'RECORDING = RESULTS / "h200-bf16-2026-11-29.json"'))
    with pytest.raises(AssertionError, match="names"):
        claims.check_source("04_triton_kernel.ipynb", older)


def test_a_ratio_typed_into_markdown_is_refused():
    nb = notebook(("md", "The kernel is 1.6x faster than cuDNN."), ("code", f'RECORDING = "{claims.LADDER}"'))
    with pytest.raises(AssertionError, match="types ratios"):
        claims.check_source("04_triton_kernel.ipynb", nb)


@pytest.mark.parametrize("prose", ["a `1 x n` row", "0 × NaN is NaN", "tiles of 128x128"])
def test_shapes_and_products_are_not_ratios(prose):
    assert not claims.TYPED_RATIO.findall(prose)


def notebook_04_text(cudnn_words="level with", fa2_geomean=None):
    """What notebook 04 prints and says for the ladder recording, computed here; optionally with a wrong part."""
    data = claims.load(claims.LADDER)
    fa2, cudnn = claims.ratios(data, "flashlab", "sdpa_flash"), claims.ratios(data, "flashlab", "sdpa_cudnn")
    g_fa2 = claims.geomean(fa2) if fa2_geomean is None else fa2_geomean
    g_cudnn = claims.geomean(cudnn)
    lines = [
        f"flashlab / FlashAttention-2: geometric mean {claims.geomean(fa2):.2f}x, cells from {min(fa2):.2f}x to "
        f"{max(fa2):.2f}x, over 20 cells",
        f"flashlab / cuDNN: geometric mean {g_cudnn:.2f}x, cells from {min(cudnn):.2f}x to {max(cudnn):.2f}x",
    ]
    said = (
        f"ahead of PyTorch's FlashAttention-2 backend ({g_fa2:.2f}x geometric mean, {min(fa2):.2f}x in its slowest "
        f"cell) and {cudnn_words} its cuDNN backend ({g_cudnn:.2f}x geometric mean, from {min(cudnn):.2f}x to "
        f"{max(cudnn):.2f}x), over 20 cells."
    )
    return "\n".join(lines) + "\n" + said, said


def test_notebook_04s_computed_prose_passes():
    claims.check_04(*notebook_04_text())


def test_notebook_04_may_not_call_a_level_kernel_behind():
    with pytest.raises(AssertionError, match="level with"):
        claims.check_04(*notebook_04_text(cudnn_words="behind"))


def test_notebook_04_may_not_quote_a_ratio_the_recording_does_not_give():
    with pytest.raises(AssertionError, match="quotes"):
        claims.check_04(*notebook_04_text(fa2_geomean=2.0))


def decode_text(legend):
    data = claims.load(claims.newest_of_kind(claims.bench_file("decode")))
    lengths = sorted({r["seq_len"] for r in claims.ok_rows(data, backend="flashlab")})
    return f"cache lengths: {', '.join(f'{n // 1024}K' for n in lengths)} tokens\nlegend: {legend}\n"


def test_notebook_06s_legend_matches_the_recording():
    claims.check_06(decode_text("measured copy bandwidth, flashlab, sdpa_flash, sdpa_cudnn"), "")


def test_notebook_06_may_not_draw_naive_attention_the_recording_does_not_hold():
    with pytest.raises(AssertionError, match="legend lists"):
        claims.check_06(decode_text("flashlab, sdpa_flash, sdpa_cudnn, naive"), "")


@pytest.mark.parametrize(
    "said, ok",
    [
        ("the naive run is the faster one, by 1.6x (13.0 s against 21.0 s).", True),
        ("the naive run is by far the faster one, 2x (13.0 s against 21.0 s).", False),  # the wording
        ("the naive run is the faster one, by 2x (13.0 s against 21.0 s).", False),  # 2x printed for 1.6
        ("the naive run is by far the faster one, 17x (1.1 s against 19.2 s).", True),
        ("the naive run is about as fast as the kernel's run (within 10 %) (10.0 s against 10.5 s).", True),
    ],
)
def test_notebook_09s_words_follow_its_ratio(said, ok):
    markdown = f"On this toy and this CPU {said}"
    if ok:
        claims.check_09(markdown, markdown)
    else:
        with pytest.raises(AssertionError):
            claims.check_09(markdown, markdown)


def test_a_notebook_that_does_not_name_its_recording_is_refused():
    nb = notebook(("code", "results = load()", [printed("recorded on NVIDIA H200")]))
    with pytest.raises(AssertionError, match="does not say it drew"):
        claims.check_executed("08_exactness.ipynb", nb)


def test_executed_text_reads_printed_and_displayed_markdown():
    nb = notebook(("code", "x", [printed("geometric mean 1.01x\n"), shown_markdown("level with cuDNN")]))
    text, markdown = claims.executed_text(nb)
    assert "geometric mean 1.01x" in text and "level with cuDNN" in text and markdown == "level with cuDNN"


GATE_LINES = (
    "gate random: 8-bit cache 0.039 < 0.0625 -> passes\n"
    "gate outlier keys: 8-bit cache 0.197 >= 0.0625 -> fails\n"
    "gate outlier values: 8-bit cache 0.035 < 0.0625 -> passes\n"
)
GATE_SENTENCE = "On this gate the 8-bit cache passes with random and outlier values and fails with outlier keys."


@pytest.mark.parametrize(
    "lines, sentence, ok",
    [
        (GATE_LINES, GATE_SENTENCE, True),
        (GATE_LINES.replace("0.197 >= 0.0625 -> fails", "0.050 < 0.0625 -> passes"), GATE_SENTENCE, False),
        (GATE_LINES.replace("0.039 < 0.0625", "0.090 < 0.0625"), GATE_SENTENCE, False),  # a sign the number belies
        (GATE_LINES, GATE_SENTENCE.replace("fails with outlier keys", "fails with no case"), False),
    ],
    ids=["consistent", "outlier_keys_pass", "wrong_sign", "sentence_disagrees"],
)
def test_notebook_08s_gate_words_follow_its_verdicts(lines, sentence, ok):
    text, markdown = claims.executed_text(notebook(("code", "x", [printed(lines), shown_markdown(sentence)])))
    if ok:
        claims.check_08(text, markdown)
    else:
        with pytest.raises(AssertionError):
            claims.check_08(text, markdown)


def test_notebook_09_may_not_call_a_slower_rung_ahead():
    # the recording's atomic_dq runs behind two_pass; a sentence that says otherwise is refused, and so is a line
    # that prints a ratio the recording does not give
    lines = "\n".join(
        f"D = 128, {label}: {x}x two_pass's speed (geo-mean over 10 cells)"
        for label, x in (
            ("two_pass", "1.00"),
            ("hopper", "1.30"),
            ("atomic_dq", "0.71"),
            ("ordered_dq", "0.27"),
            ("FlashAttention-2", "0.89"),
            ("cuDNN", "1.54"),
        )  # fmt: skip
    )
    said = ("`hopper` is ahead of `two_pass`; `atomic_dq`, with five multiplies where `two_pass` does seven, is {} it; "
            "and `ordered_dq` is behind it.")  # fmt: skip
    claims.check_09_ladder(lines, said.format("behind"))
    with pytest.raises(AssertionError, match="should display"):
        claims.check_09_ladder(lines, said.format("ahead of"))
    with pytest.raises(AssertionError, match="should print"):
        claims.check_09_ladder(lines.replace("atomic_dq: 0.71x", "atomic_dq: 0.91x"), said.format("behind"))
