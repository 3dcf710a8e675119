"""Regression test with a tolerance: today's outputs against outputs recorded earlier, on the same fixed inputs.

A regression test asks "did this change?", not "is this right?" (the reference tests ask that). It keeps a few
outputs of ``flashlab.reference.attention`` (float64 NumPy) and of ``flashlab.flash_attention`` (the Triton
kernel, here through the CPU interpreter) in ``tests/data/regression_attention.json`` and compares each new run
with them -- by relative error against ``flashlab.core.numerics.TOLERANCE`` for the dtype, never with ``==``.

Why not equality: the last bits of a floating-point result depend on the order of its additions, and that order
belongs to the libraries (NumPy's BLAS, Triton's code generation, PyTorch's kernels), not to you. An upgrade
that reorders a sum moves the last bits of every output and means nothing; a bug (a rescale forgotten, a mask off
by one) moves them by far more than the dtype's tolerance.

When this test fails after an upgrade:

1. Read the message: it says which case, by how much, and against which tolerance. A miss of many times the
   tolerance is a real change; look at the code before blaming the library.
2. Check correctness first: ``test_the_recording_was_right`` and the reference tests compare the outputs with
   the float64 reference. If today's outputs still match the reference within the tolerance and only the
   recording disagrees, the recording is what is stale.
3. Re-record, in a commit of its own that names the versions that moved the bits:
   ``python tests/test_regression.py --record`` (the file stamps the NumPy, torch and Triton versions).

Never widen the tolerance to make this pass; the tolerance is the dtype's, shared by the whole package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # so that `python tests/test_regression.py --record` finds flashlab

from flashlab.core.numerics import TOLERANCE, relative_error  # noqa: E402
from flashlab.reference import attention as reference_attention  # noqa: E402

RECORDING = HERE / "data" / "regression_attention.json"

# Fixed inputs: (name, seed, (B, H, N, D), causal, window, dtype of the kernel run). Tiny: the kernel runs in
# Triton's interpreter on a CPU.
CASES = [
    ("plain-fp32", 0, (1, 2, 19, 16), False, None, "float32"),
    ("causal-fp16", 1, (1, 2, 33, 32), True, None, "float16"),
    ("window-fp32", 2, (1, 2, 24, 16), False, (5, 0), "float32"),
]


def inputs(seed, shape):
    """q, k, v in float64 from NumPy's default generator (PCG64) on a fixed seed. Shapes (B, H, N, D)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape) for _ in range(3))


def kept_rows(n):
    return sorted({0, n // 2, n - 1})  # first, middle and last query row of every head: enough to catch a change


def run_case(seed, shape, causal, window, dtype):
    """The outputs a recording keeps: the reference's and the kernel's rows and log-sum-exps, as float64 arrays."""
    import torch

    import flashlab

    q, k, v = inputs(seed, shape)
    rows = kept_rows(shape[2])
    ref_o, ref_lse = reference_attention(q, k, v, causal=causal, window=window)  # (B, H, N, D), (B, H, N)
    tq, tk, tv = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))
    with torch.no_grad():
        o, lse = flashlab.flash_attention(tq, tk, tv, causal=causal, window=window, return_lse=True)
    return {
        "inputs_sum": [float(x.sum()) for x in (q, k, v)],
        "reference_o": ref_o[:, :, rows, :],
        "reference_lse": ref_lse,
        "kernel_o": o.double().numpy()[:, :, rows, :],
        "kernel_lse": lse.double().numpy(),
    }


def load_recording():
    data = json.loads(RECORDING.read_text())
    return data["meta"], {
        c["name"]: {k: np.array(v) if isinstance(v, list) else v for k, v in c.items()} for c in data["cases"]
    }


def assert_matches_recording(what, now, recorded, dtype):
    """``now`` equals ``recorded`` up to the rounding of ``dtype``: relative error within ``TOLERANCE[dtype]``."""
    err = relative_error(now, recorded)
    assert err <= TOLERANCE[dtype], (
        f"{what}: relative error {err:.2e} against the recording, tolerance {TOLERANCE[dtype]:.0e} for {dtype} "
        f"({err / TOLERANCE[dtype]:.1f}x the tolerance). See this module's docstring before re-recording."
    )


@pytest.fixture(scope="module")
def recording():
    return load_recording()


@pytest.mark.parametrize("name,seed,shape,causal,window,dtype", CASES, ids=[c[0] for c in CASES])
def test_outputs_match_the_recording(recording, name, seed, shape, causal, window, dtype):
    meta, cases = recording
    rec = cases[name]
    now = run_case(seed, shape, causal, window, dtype)
    # the inputs first: if NumPy's generator ever changed its stream, the inputs moved, not the kernel
    np.testing.assert_allclose(now["inputs_sum"], rec["inputs_sum"], rtol=1e-12, err_msg=f"{name}: inputs changed")
    assert_matches_recording(f"{name} reference o", now["reference_o"], rec["reference_o"], "float64")
    assert_matches_recording(f"{name} reference lse", now["reference_lse"], rec["reference_lse"], "float64")
    assert_matches_recording(f"{name} kernel o ({dtype})", now["kernel_o"], rec["kernel_o"], dtype)
    assert_matches_recording(f"{name} kernel lse ({dtype})", now["kernel_lse"], rec["kernel_lse"], dtype)


def test_the_recording_was_right(recording):
    # a recording is only worth keeping if it matched the float64 reference when it was made
    meta, cases = recording
    assert {c[0] for c in CASES} == set(cases)
    for name, seed, shape, causal, window, dtype in CASES:  # the recording says what problem it holds
        rec = cases[name]
        assert (rec["seed"], list(rec["shape"]), rec["causal"], rec["dtype"]) == (seed, list(shape), causal, dtype)
        assert list(rec["rows"]) == kept_rows(shape[2])
        assert (None if rec["window"] is None else tuple(rec["window"].tolist())) == window
    for name, *_, dtype in CASES:
        rec = cases[name]
        assert_matches_recording(f"{name} recorded kernel o", rec["kernel_o"], rec["reference_o"], dtype)
        assert_matches_recording(f"{name} recorded kernel lse", rec["kernel_lse"], rec["reference_lse"], dtype)
    for key in ("numpy", "torch", "triton", "date", "command"):
        assert meta[key]


def test_the_comparison_passes_last_bit_changes_and_fails_real_ones(recording):
    _, cases = recording
    rec = cases["plain-fp32"]["kernel_o"].astype(np.float32)
    last_bits = np.nextafter(rec, np.float32(np.inf))  # every element one float32 step up: a reordered sum
    assert not np.array_equal(last_bits, rec)  # equality would call this a regression
    assert_matches_recording("one float32 step", last_bits, rec, "float32")
    with pytest.raises(AssertionError, match="times the tolerance|x the tolerance"):
        assert_matches_recording("a 1% error", rec * 1.01, rec, "float32")  # a real bug is caught


def record():
    """Write the recording from this environment (run from the repository root)."""
    import platform
    from datetime import datetime, timezone

    import torch
    import triton

    cases = []
    for name, seed, shape, causal, window, dtype in CASES:
        out = run_case(seed, shape, causal, window, dtype)
        problem = dict(
            seed=seed, shape=list(shape), causal=causal, window=window, dtype=dtype, rows=kept_rows(shape[2])
        )
        cases.append({"name": name, **problem, **{k: np.asarray(v).tolist() for k, v in out.items()}})
    meta = {
        "about": "outputs of flashlab.reference.attention and flashlab.flash_attention on fixed inputs "
        "(tests/test_regression.py CASES), kept rows only; compared with a tolerance, never with ==",
        "numpy": np.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python tests/test_regression.py --record",
    }
    RECORDING.parent.mkdir(parents=True, exist_ok=True)
    RECORDING.write_text(json.dumps({"meta": meta, "cases": cases}) + "\n")
    print(f"wrote {RECORDING}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        raise SystemExit(
            "usage: python tests/test_regression.py --record   (re-records the outputs; read the docstring)"
        )
    record()
