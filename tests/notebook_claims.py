"""What the notebooks say about speed, checked against the recordings they draw.

A notebook that shows recorded GPU results names the file it loads, loads the newest recording of its kind in
``data/results/``, and states no speed in its Markdown: every ratio a reader is told is printed by a cell, and
where a sentence says how one kernel compares with another, a cell writes that sentence from the ratio it
computed. ``tests/test_notebooks.py`` executes each notebook once and hands the executed copy to
``check_executed``; the expected values here are computed from the recording's JSON with plain arithmetic, not by
the package or the notebook under test.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from conftest import ROOT

RESULTS = ROOT / "data" / "results"
RECORDING_NAME = re.compile(r"h[12]00-[\w.-]+?\.(?:json|csv)")  # a recording of an H200 or an H100
RATIO = re.compile(r"(\d+(?:\.\d+)?)\s*[x×](?![\w])")
# a ratio typed into Markdown: "1.6x", "2×" (not "1 x n", a shape, nor "0 × NaN", a product)
TYPED_RATIO = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[x×](?![\w])")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ok_rows(data: dict, **match) -> list[dict]:
    return [r for r in data.get("rows", []) if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def ratios(data: dict, fast: str, other: str) -> list[float]:
    """Time of ``other`` over time of ``fast`` per cell where both were checked and timed (above 1: fast is)."""

    def cell(r):
        return (r["dtype"], r["head_dim"], r["causal"], r["seq_len"], r["batch"])

    mine = {cell(r): r["time_ms"] for r in ok_rows(data, backend=fast)}
    theirs = {cell(r): r["time_ms"] for r in ok_rows(data, backend=other)}
    return [theirs[c] / mine[c] for c in mine if c in theirs]


# -- kinds of recording: a predicate on a file's JSON


def bench_file(mode: str, kv_dtype: str | None = None):
    """A benchmark recording of ``mode`` made on a GPU; decode runs of an 8-bit cache only when ``kv_dtype`` says
    (as ``flashlab.bench.newest_gpu_results`` picks them)."""

    def kind(data):
        meta = data.get("meta", {}) if isinstance(data, dict) else {}
        config = meta.get("config") or {}
        return (meta.get("tool") == "flashlab.bench" and bool(meta.get("is_cuda_gpu")) and config.get("mode") == mode
                and config.get("kv_dtype") == kv_dtype)  # fmt: skip

    return kind


def prefill_with(*backends: str, dtype: str = "bf16"):
    """A prefill run of the benchmark's grid (one K/V head per query head) in ``dtype`` holding ``backends``."""
    is_bench = bench_file("prefill")

    def kind(data):
        if not is_bench(data):
            return False
        config = data["meta"]["config"]
        timed = {r["backend"] for r in ok_rows(data)}
        return config.get("dtypes") == [dtype] and config.get("gqa", 1) == 1 and set(backends) <= timed

    return kind


def traffic_file(data) -> bool:
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return meta.get("tool") == "flashlab.bench" and meta.get("mode") == "traffic" and bool(meta.get("is_cuda_gpu"))


def made_by(tool: str):
    return lambda data: isinstance(data, dict) and data.get("meta", {}).get("tool") == tool


def newest_of_kind(kind) -> str | None:
    """The file name of the newest recording in data/results/ that is of ``kind`` (by its stamp's date)."""
    found = []
    for path in RESULTS.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if kind(data):
            found.append((data["meta"]["date"], path.name))
    return max(found)[1] if found else None


@dataclass
class Drawn:
    """A recording a notebook draws: its file, or None where the notebook picks the newest of its kind itself."""

    kind: object
    name: str | None = None

    def expected(self) -> str | None:
        return newest_of_kind(self.kind)


BACKWARD_LADDER = "h100-backward-ladder-bf16-2026-12-06.json"  # every backward rung beside SDPA's, one run
ONE_PASS = "h100-backward-one-pass-2026-12-06.json"  # the Gluon backward rungs beside hopper and cuDNN, one run
ONE_PASS_BACKENDS = ("backward_hopper", "backward_one_pass_atomic", "backward_one_pass", "sdpa_cudnn")
BACKWARD_RUNGS = ("backward_two_pass", "backward_hopper", "backward_atomic_dq", "backward_ordered_dq")
EIGHT_BIT = "h200-decode-fp8-2026-12-04.json"  # an 8-bit paged cache beside the 16-bit one, one run
LADDER = "h200-ladder-bf16-2026-12-02-all-rungs.json"  # every rung of the ladder and SDPA's kernels, one run
FULL_GRID = "h200-bf16-2026-11-29.json"  # the whole grid, naive attention and every SDPA kernel included
SDPA_KERNELS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
LADDER_RUNGS = ("flashlab_lesson_loop", "flashlab_skip_split", "flashlab_hopper", "flashlab_overlap")


@dataclass
class Claims:
    drawn: list[Drawn]
    checks: list = field(default_factory=list)  # callables (executed notebook text, markdown outputs) -> None


def executed_text(nb) -> tuple[str, str]:
    """Everything the executed notebook printed or displayed as text, and the Markdown its cells displayed."""
    printed, markdown = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                printed.append(out.get("text", ""))
            data = out.get("data", {})
            if "text/markdown" in data:
                markdown.append(data["text/markdown"])
            elif "text/plain" in data and "image/png" not in data:
                printed.append(data["text/plain"])
    return "\n".join(printed + markdown), "\n".join(markdown)


def standing(ratio: float) -> str:
    """Notebook 04's words for a speed ratio: within 5 % of 1 is level."""
    return "level with" if abs(ratio - 1) <= 0.05 else ("ahead of" if ratio > 1 else "behind")


def check_04(text: str, markdown: str) -> None:
    data = load(LADDER)
    expected = set()
    for other, name in (("sdpa_flash", "FlashAttention-2"), ("sdpa_cudnn", "cuDNN")):
        r = ratios(data, "flashlab", other)
        g = geomean(r)
        quoted = {f"{g:.2f}", f"{min(r):.2f}"} | ({f"{max(r):.2f}"} if other == "sdpa_cudnn" else set())
        expected |= quoted
        words = f"{standing(g)} PyTorch's {name}" if other == "sdpa_flash" else f"{standing(g)} its {name}"
        assert words in markdown, f"notebook 04 should say the default kernel is '{words}' ({g:.3f}x): {markdown!r}"
        line = f"flashlab / {name}: geometric mean {g:.2f}x, cells from {min(r):.2f}x to {max(r):.2f}x"
        assert line in text, f"notebook 04 should print {line!r}"
    said = set(RATIO.findall(markdown))
    assert said == expected, f"notebook 04's prose quotes {sorted(said)}; the recording gives {sorted(expected)}"


def check_05(text: str, markdown: str) -> None:
    data = load(FULL_GRID)
    for other, label in (("sdpa_flash", "SDPA FlashAttention-2"), ("sdpa_cudnn", "SDPA cuDNN")):
        r = ratios(data, "flashlab", other)
        line = f"flashlab / {label}: geo-mean {geomean(r):.2f}x over {len(r)} cells, lowest {min(r):.2f}x"
        assert line in text, f"notebook 05 should print {line!r}"
    ladder = load(LADDER)
    for lower, upper in zip(LADDER_RUNGS, LADDER_RUNGS[1:], strict=False):
        r = ratios(ladder, upper, lower)
        if r:
            assert f"{upper} over {lower}" in text, f"notebook 05 should print the step from {lower} to {upper}"


DECODE_KERNELS = ("flashlab", "sdpa_flash", "sdpa_cudnn", "naive")  # the bars notebook 06 may draw


def check_06(text: str, markdown: str) -> None:
    data = load(newest_of_kind(bench_file("decode")))
    legend = re.search(r"^legend: (.*)$", text, re.MULTILINE)
    assert legend, "notebook 06 should print its decode plot's legend"
    drawn = {e.strip() for e in legend.group(1).split(",")} - {"measured copy bandwidth"}
    recorded = {b for b in DECODE_KERNELS if ok_rows(data, backend=b)}
    assert drawn == recorded, f"notebook 06's legend lists {sorted(drawn)}; the recording has {sorted(recorded)}"
    lengths = sorted({r["seq_len"] for r in ok_rows(data, backend="flashlab")})
    line = f"cache lengths: {', '.join(f'{n // 1024}K' for n in lengths)} tokens"
    assert line in text, f"notebook 06 should print {line!r}"


def slower_words(ratio: float) -> str:
    """Notebook 09's words for how much longer the kernel's CPU run took than naive attention's."""
    if ratio < 1 / 1.1:
        return "the slower one: the kernel's run took"
    if ratio <= 1.1:
        return "about as fast as"
    return "the faster one, by" if ratio < 3 else "by far the faster one"


def check_09(text: str, markdown: str) -> None:
    said = re.search(r"the naive run is (.*) \((\d+\.\d) s against (\d+\.\d) s\)", markdown)
    assert said, f"notebook 09 should say how the two CPU runs compare, with their times: {markdown!r}"
    naive_s, flash_s = float(said.group(2)), float(said.group(3))
    ratio = flash_s / naive_s
    words = slower_words(ratio)
    assert said.group(1).startswith(words), f"for {flash_s} s against {naive_s} s notebook 09 should say {words!r}"
    for quoted in RATIO.findall(said.group(1)):  # printed to 2 significant digits from the unrounded times
        low, high = (flash_s - 0.05) / (naive_s + 0.05), (flash_s + 0.05) / (naive_s - 0.05)
        assert low * 0.95 <= float(quoted) <= high * 1.05, f"notebook 09 quotes {quoted}x for {ratio:.3f}x"


def backward_ladder_file(data) -> bool:
    """A backward run of the benchmark holding every rung of the backward's ladder and SDPA's two kernels."""
    return bench_file("backward")(data) and set(BACKWARD_RUNGS) | {"sdpa_flash", "sdpa_cudnn"} <= {
        r["backend"] for r in ok_rows(data)
    }


def speed_over(data, base: str, backends) -> dict[str, tuple[float, int]]:
    """Each backend's speed over ``base`` at D = 128 in a backward recording: the geo-mean, cell by cell, of
    ``base``'s time over its own, with the number of cells."""

    def times(backend):
        return {(r["causal"], r["seq_len"]): r["time_ms"] for r in ok_rows(data, backend=backend, head_dim=128)}

    floor, speed = times(base), {}
    for name in backends:
        mine = times(name)
        speed[name] = geomean(floor[c] / mine[c] for c in mine), len(mine)
    return speed


def check_09_ladder(text: str, markdown: str) -> None:
    """Each backend's speed over two_pass at D = 128 as printed (geo-mean of two_pass's time over its own, cell by
    cell), and the displayed sentence's words for the three rungs above two_pass."""
    labels = {**{r: r.removeprefix("backward_") for r in BACKWARD_RUNGS}, "sdpa_flash": "FlashAttention-2",
              "sdpa_cudnn": "cuDNN"}  # fmt: skip
    speed = speed_over(load(BACKWARD_LADDER), "backward_two_pass", labels)
    for name, label in labels.items():
        line = f"D = 128, {label}: {speed[name][0]:.2f}x two_pass's speed (geo-mean over {speed[name][1]} cells)"
        assert line in text, f"notebook 09 should print {line!r}"
    words = [standing(speed[r][0]) for r in BACKWARD_RUNGS[1:]]
    sentence = (f"`hopper` is {words[0]} `two_pass`; `atomic_dq`, with five multiplies where `two_pass` does seven, "
                f"is {words[1]} it; and `ordered_dq` is {words[2]} it.")  # fmt: skip
    assert sentence in markdown, f"notebook 09 should display {sentence!r}"


def one_pass_file(data) -> bool:
    """A backward run of the benchmark holding the Gluon rungs, hopper and cuDNN."""
    return bench_file("backward")(data) and set(ONE_PASS_BACKENDS) <= {r["backend"] for r in ok_rows(data)}


def check_09_one_pass(text: str, markdown: str) -> None:
    """The Gluon rungs' and cuDNN's speed over hopper at D = 128 as printed (geo-mean of hopper's time over each's,
    cell by cell), and the displayed sentence's words for the two rungs."""
    speed = speed_over(load(ONE_PASS), "backward_hopper", ONE_PASS_BACKENDS[1:])
    for name, (ratio, cells) in speed.items():
        line = f"D = 128, {name.removeprefix('backward_')}: {ratio:.2f}x hopper's speed (geo-mean over {cells} cells)"
        assert line in text, f"notebook 09 should print {line!r}"
    sentence = (f"`one_pass_atomic`, with five multiplies where `hopper` does seven, is "
                f"{standing(speed['backward_one_pass_atomic'][0])} `hopper`, and `one_pass` is "
                f"{standing(speed['backward_one_pass'][0])} it.")  # fmt: skip
    assert sentence in markdown, f"notebook 09 should display {sentence!r}"


# Notebook 08's 8-bit cache: what its prose says of each case of the evaluation gate
GATE_SAID = {"random": "passes", "outlier keys": "fails", "outlier values": "passes"}


def check_08(text: str, markdown: str) -> None:
    verdicts = {}
    for line in re.finditer(r"^gate ([\w ]+): 8-bit cache ([\d.]+) (<|>=) ([\d.]+) -> (passes|fails)$", text,
                            re.MULTILINE):  # fmt: skip
        case, error, sign, tol, verdict = line.groups()
        assert (float(error) < float(tol)) == (sign == "<") == (verdict == "passes"), f"notebook 08 prints {line[0]!r}"
        verdicts[case] = verdict
    assert verdicts == GATE_SAID, f"notebook 08's prose says {GATE_SAID}; its cells found {verdicts}"
    passed = " and ".join(c for c, v in verdicts.items() if v == "passes")
    failed = " and ".join(c for c, v in verdicts.items() if v == "fails")
    sentence = f"the 8-bit cache passes with {passed} and fails with {failed}"
    assert sentence in markdown, f"notebook 08 should display {sentence!r}"


def check_08_bytes(text: str, markdown: str) -> None:
    """What half the bytes buys: each cell's times as the recording has them, and the prose's reading of them (the
    8-bit step faster than the 16-bit one, slower than the 16-bit step's bandwidth would make it)."""
    data = load(EIGHT_BIT)
    by = {(r["backend"], r["batch"], r["seq_len"]): r for r in ok_rows(data)}
    printed = re.findall(r"^B = (\d+), ([\d,]+) keys: 16-bit ([\d.]+) us, 8-bit ([\d.]+) us \(([\d.]+)x\), "
                         r"promised ([\d.]+) us \(([\d.]+)x\)$", text, re.MULTILINE)  # fmt: skip
    cells = {(b, n) for name, b, n in by if name == "paged256" and ("paged256_fp8", b, n) in by}
    assert len(printed) == len(cells), f"notebook 08 should print one line per recorded cell ({len(cells)})"
    for b, n, t16, t8, _, promised, _ in printed:
        sixteen, eight = (by[name, int(b), int(n.replace(",", ""))] for name in ("paged256", "paged256_fp8"))
        assert float(t16) == round(sixteen["time_ms"] * 1e3, 1) and float(t8) == round(eight["time_ms"] * 1e3, 1)
        assert float(promised) < float(t8) < float(t16), f"notebook 08's prose does not fit B = {b}, {n} keys"


CLAIMS = {
    "02_score_matrix_and_traffic.ipynb": Claims([Drawn(traffic_file)]),
    "04_triton_kernel.ipynb": Claims(
        [Drawn(prefill_with("flashlab", "sdpa_flash", "sdpa_cudnn"), LADDER)],
        [check_04],
    ),
    "05_timing_on_gpu.ipynb": Claims(
        [
            Drawn(prefill_with("naive", "flashlab", *SDPA_KERNELS), FULL_GRID),
            Drawn(prefill_with(*LADDER_RUNGS, "sdpa_flash", "sdpa_cudnn"), LADDER),
            Drawn(traffic_file),
        ],
        [check_05],
    ),
    "06_decode.ipynb": Claims([Drawn(bench_file("decode"))], [check_06]),
    "07_paged_gqa_mla.ipynb": Claims([Drawn(bench_file("decode"))]),
    "08_exactness.ipynb": Claims(
        [Drawn(made_by("flashlab.sdpa"), "h200-sdpa-backends.json"), Drawn(bench_file("decode", "fp8"), EIGHT_BIT)],
        [check_08, check_08_bytes],
    ),
    "10_longer_than_one_gpu.ipynb": Claims([Drawn(prefill_with("flashlab", "sdpa_flash", "sdpa_cudnn"), LADDER)]),
    "09_backward.ipynb": Claims(
        [
            Drawn(made_by("scripts/backward_memory.py"), "h200-backward-memory.json"),
            Drawn(backward_ladder_file, BACKWARD_LADDER),
            Drawn(one_pass_file, ONE_PASS),
        ],
        [check_09, check_09_ladder, check_09_one_pass],
    ),
}


def named_in_code(nb) -> set[str]:
    """The recordings a notebook's code names."""
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    return set(RECORDING_NAME.findall(code))


def check_source(name: str, nb) -> None:
    """Before running: the files the code names are the newest of their kinds, and Markdown types no ratio."""
    claims = CLAIMS.get(name, Claims([]))
    fixed = {d.name for d in claims.drawn if d.name}
    assert named_in_code(nb) == fixed, f"{name}'s code names {sorted(named_in_code(nb))}; expected {sorted(fixed)}"
    for d in claims.drawn:
        newest = d.expected()
        assert newest is not None, f"{name} draws a recording of a kind data/results/ does not hold"
        assert d.name in (None, newest), f"{name} draws {d.name}; the newest recording of its kind is {newest}"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            typed = TYPED_RATIO.findall(cell.source)
            assert not typed, f"{name} cell {i} types ratios into its prose ({typed}); print them from a cell"


def check_executed(name: str, nb) -> None:
    """After running: the notebook names every recording it drew, and its claims match the recordings."""
    claims = CLAIMS.get(name)
    if claims is None:
        return
    text, markdown = executed_text(nb)
    for d in claims.drawn:
        newest = d.expected()
        assert newest in text or Path(newest).stem in text, f"{name} does not say it drew {newest}"
    for check in claims.checks:
        check(text, markdown)
