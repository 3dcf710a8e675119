"""flashlab.sdpa on CPU: the SDPA backend probe, its tolerance check, its table and its command line."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import ROOT
from flashlab import sdpa
from flashlab.sdpa import (
    BACKENDS,
    TOLERANCE,
    backend_reasons,
    format_table,
    probe_sdpa_backends,
    relative_error,
    selected_sdpa_backend,
)

SMALL = dict(device="cpu", head_dims=(16, 24), seq_len=19, heads=2)


@pytest.fixture(scope="module")
def cpu_rows():
    return probe_sdpa_backends(dtypes=("float16", "float32"), **SMALL)


def test_relative_error_values():
    ref = np.array([3.0, 4.0])  # norm 5
    assert relative_error(ref, ref) == 0.0
    assert relative_error(np.array([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert relative_error(torch.tensor([3.0, 4.5], dtype=torch.float16), ref) == pytest.approx(0.1)
    assert relative_error(np.array([0.0, 1.0]), np.zeros(2)) == 1.0  # a zero reference: the absolute error
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros(3), np.zeros(2))


def test_tolerances_sit_above_the_unit_roundoff_of_each_dtype():
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        eps = torch.finfo(dtype).eps / 2  # unit roundoff
        assert eps < TOLERANCE[name] < 100 * max(eps, 2**-11)
    assert TOLERANCE["float64"] <= 1e-10


def test_probe_rows_cover_every_combination(cpu_rows):
    assert len(cpu_rows) == 2 * 2 * 2 * len(BACKENDS)  # dtypes x head dims x causal x backends
    combos = {(r["dtype"], r["head_dim"], r["causal"], r["backend"]) for r in cpu_rows}
    assert len(combos) == len(cpu_rows)
    for r in cpu_rows:
        assert set(r) == {
            "dtype",
            "head_dim",
            "causal",
            "backend",
            "selected",
            "status",
            "rel_error",
            "tolerance",
            "error",
            "reasons",
        }
        assert r["status"] in ("ran", "wrong", "raised")
        assert r["selected"] is None or r["selected"] in SDPBackend.__members__


def test_math_backend_runs_everywhere_and_matches_the_reference(cpu_rows):
    math_rows = [r for r in cpu_rows if r["backend"] == "MATH"]
    assert math_rows and all(r["status"] == "ran" for r in math_rows)
    for r in math_rows:
        assert 0 < r["rel_error"] <= TOLERANCE[r["dtype"]]
        assert r["error"] is None
    # float16 is visibly less exact than float32
    err = {r["dtype"]: r["rel_error"] for r in math_rows if r["head_dim"] == 16 and not r["causal"]}
    assert err["float16"] > 100 * err["float32"]


def test_cuda_only_backends_raise_on_cpu_with_a_reason(cpu_rows):
    for r in cpu_rows:
        if r["backend"] in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
            assert r["status"] == "raised" and r["rel_error"] is None
            assert r["error"] and "\n" not in r["error"]
            assert any("CUDA" in line for line in r["reasons"])


def test_selected_backend_on_cpu_is_one_that_runs(cpu_rows):
    for r in cpu_rows:
        if r["selected"] is not None and r["backend"] == r["selected"]:
            assert r["status"] == "ran"
    q = torch.randn(1, 2, 8, 16)
    name = selected_sdpa_backend(q, q, q)
    assert name is None or name in ("MATH", "FLASH_ATTENTION")


def test_a_wrong_kernel_is_reported_as_wrong(monkeypatch):
    real = sdpa.F.scaled_dot_product_attention

    def off_by_a_bit(q, k, v, is_causal=False):
        return real(q, k, v, is_causal=is_causal) * 1.01

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", off_by_a_bit)
    rows = probe_sdpa_backends(
        dtypes=("float32",),
        head_dims=(16,),
        causal=(False,),
        backends=("MATH",),
        **{k: v for k, v in SMALL.items() if k != "head_dims"},
    )
    assert rows[0]["status"] == "wrong"
    assert rows[0]["rel_error"] == pytest.approx(0.01, rel=1e-3)


def test_probe_checks_the_causal_mask(monkeypatch):
    # a backend that ignores is_causal must fail the causal rows
    real = sdpa.F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", lambda q, k, v, is_causal=False: real(q, k, v))
    rows = probe_sdpa_backends(dtypes=("float32",), causal=(False, True), backends=("MATH",), **SMALL)
    assert {r["causal"]: r["status"] for r in rows if r["head_dim"] == 16} == {False: "ran", True: "wrong"}


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dtypes=("int8",)), TypeError, "unsupported dtype"),
        (dict(dtypes=(torch.int32,)), TypeError, "unsupported dtype"),
        (dict(backends=("FAST",)), ValueError, "unknown SDPA backend"),
        (dict(backends=("ERROR",)), ValueError, "unknown SDPA backend"),
        (dict(head_dims=(0,)), ValueError, "head dims"),
        (dict(seq_len=0), ValueError, "seq_len"),
        (dict(heads=1.5), ValueError, "heads"),
    ],
)
def test_probe_bad_arguments(kwargs, error, match):
    args = dict(device="cpu", head_dims=(16,), seq_len=4, heads=1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        probe_sdpa_backends(**args)


def test_format_table(cpu_rows):
    table = format_table(cpu_rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * 2 * 2  # header, rule, one line per dtype / head dim / causal
    for b in BACKENDS:
        assert b in lines[0]
    assert "raised" in table and "ran " in table


def test_command_line_writes_a_stamped_json(tmp_path, capsys):
    out = tmp_path / "sub" / "probe.json"
    args = ["--out", str(out), "--device", "cpu", "--dtypes", "float32", "--head-dims", "16,40"]
    assert sdpa.main([*args, "--causal", "yes", "--seq-len", "7", "--heads", "1"]) == 0
    data = json.loads(out.read_text())
    meta = data["meta"]
    for key in ("device_name", "torch", "triton", "cuda", "date", "command", "python"):
        assert key in meta
    assert meta["tool"] == "flashlab.sdpa" and meta["torch"] == torch.__version__
    assert "--head-dims 16,40" in meta["command"]
    assert meta["problem"] == {"batch": 1, "heads": 1, "seq_len": 7, "seed": 0}
    assert len(data["rows"]) == 2 * len(BACKENDS)
    assert all(r["causal"] is True and r["dtype"] == "float32" for r in data["rows"])
    printed = capsys.readouterr().out
    assert "MATH" in printed and f"wrote {out}" in printed


def test_command_line_help(capsys):
    with pytest.raises(SystemExit) as exc:
        sdpa.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--device", "--dtypes", "--head-dims", "--causal", "--seq-len"):
        assert flag in text


# What SDPA warned, in order, when one backend was pinned on an H200 with head dim 512 in fp16 (torch 2.11): each
# fused backend's checks run again under its own header, and the two the pin switched off say "runtime disabled".
H200_D512_FLASH_PINNED = [
    "Memory efficient kernel not used because: (Triggered internally at sdp_utils.cpp:1.)",
    "Memory Efficient attention has been runtime disabled. (Triggered internally at sdp_utils_cpp.h:552.)",
    "Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:2.)",
    "Flash attention requires q,k,v to have the same last dimension and to be less than or equal to 256. Got "
    "Query.size(-1): 512, Key.size(-1): 512, Value.size(-1): 512 instead. (Triggered internally at sdp_utils.cpp:180.)",
    "cuDNN attention kernel not used because: (Triggered internally at sdp_utils.cpp:3.)",
    "cuDNN attention has been runtime disabled. (Triggered internally at sdp_utils.cpp:706.)",
]
H200_D512_CUDNN_PINNED = [
    "Memory efficient kernel not used because:",
    "Memory Efficient attention has been runtime disabled.",
    "Flash attention kernel not used because:",
    "Flash attention has been runtime disabled.",
    "cuDNN attention kernel not used because:",
    "head_dim should be no more than 256 (Triggered internally at sdp_utils.cpp:522.)",
]
H200_FP32_FLASH_PINNED = [
    "Memory efficient kernel not used because:",
    "Memory Efficient attention has been runtime disabled.",
    "Flash attention kernel not used because:",
    "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, Key dtype: "
    "float, and Value dtype: float instead.",
    "cuDNN attention kernel not used because:",
    "cuDNN attention has been runtime disabled.",
]


def test_each_backend_gets_only_the_reasons_under_its_own_header():
    flash = backend_reasons("FLASH_ATTENTION", H200_D512_FLASH_PINNED)
    assert len(flash) == 1 and flash[0].startswith("Flash attention requires q,k,v to have the same last dimension")
    assert flash[0].endswith("instead.")  # PyTorch's "(Triggered internally at ...)" suffix is dropped
    assert backend_reasons("CUDNN_ATTENTION", H200_D512_CUDNN_PINNED) == ["head_dim should be no more than 256"]
    fp32 = backend_reasons("FLASH_ATTENTION", H200_FP32_FLASH_PINNED)
    assert fp32 == [H200_FP32_FLASH_PINNED[3]]
    # a backend the pin switched off is never blamed for its own "runtime disabled" line, nor for another's reason
    assert backend_reasons("EFFICIENT_ATTENTION", H200_D512_FLASH_PINNED) == [
        "Memory Efficient attention has been runtime disabled."
    ]
    assert backend_reasons("MATH", H200_D512_FLASH_PINNED) == []


def test_reasons_recorded_without_headers_drop_lines_about_other_backends():
    headerless = [m for m in H200_D512_FLASH_PINNED if "not used because" not in m]
    flash = backend_reasons("FLASH_ATTENTION", headerless)
    assert len(flash) == 1 and "less than or equal to 256" in flash[0]
    assert not any("cudnn" in r.lower() or "runtime disabled" in r for r in flash)
    cudnn = [m for m in H200_D512_CUDNN_PINNED if "not used because" not in m]
    assert backend_reasons("CUDNN_ATTENTION", cudnn) == ["head_dim should be no more than 256"]
    assert backend_reasons("FLASH_ATTENTION", ["x", "x", ""]) == ["x"]  # deduplicated, blanks dropped


def test_a_real_cpu_refusal_is_attributed_to_the_pinned_backend():
    # PyTorch's CPU flash kernel needs q, k and v to share a head dim; give v another one and pin it
    q = k = torch.randn(1, 1, 5, 16)
    v = torch.randn(1, 1, 5, 24)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    flash = backend_reasons("FLASH_ATTENTION", caught)
    assert len(flash) == 1 and flash[0].startswith("Flash attention requires q,k,v to have the same last dimension")
    assert backend_reasons("MATH", caught) == []


def test_cpu_flash_backend_runs_float32(cpu_rows):
    # on CPU, FLASH_ATTENTION is PyTorch's C++ kernel, which takes float32 (the CUDA kernel takes fp16/bf16 only)
    flash32 = [r for r in cpu_rows if r["backend"] == "FLASH_ATTENTION" and r["dtype"] == "float32"]
    assert flash32 and all(r["status"] == "ran" for r in flash32)


RECORDED = ROOT / "data" / "results" / "h200-sdpa-backends.json"


@pytest.mark.skipif(not RECORDED.exists(), reason="no recorded GPU probe committed yet")
def test_recorded_gpu_probe_is_stamped_and_readable():
    # notebook 08 shows this file on machines without a GPU: it must say what produced it, and parse as a table
    data = json.loads(RECORDED.read_text())
    meta = data["meta"]
    assert meta["tool"] == "flashlab.sdpa" and meta["is_cuda_gpu"] is True
    for key in ("device_name", "torch", "triton", "cuda", "date", "command"):
        assert meta[key], key
    assert data["rows"] and {r["backend"] for r in data["rows"]} >= {"MATH", "FLASH_ATTENTION"}
    assert all(r["status"] in ("ran", "wrong", "raised") for r in data["rows"])
    assert format_table(data["rows"])
    for r in data["rows"]:  # read through backend_reasons, every refusal keeps a reason of its own backend
        if r["status"] == "raised" and r["backend"] != "MATH":
            mine = backend_reasons(r["backend"], r["reasons"])
            assert mine, (r["dtype"], r["head_dim"], r["backend"])
            assert not any("runtime disabled" in line for line in mine)


@pytest.mark.gpu
def test_on_cuda_each_refusal_names_only_its_own_backend():
    # head dim 512: FlashAttention-2 and cuDNN refuse it; fp32: FlashAttention-2 refuses the dtype
    rows = probe_sdpa_backends(device="cuda", dtypes=("float16", "float32"), head_dims=(64, 512), seq_len=64, heads=2)
    for r in rows:
        assert not any("runtime disabled" in line for line in r["reasons"]), r
        if r["status"] == "raised" and r["backend"] == "FLASH_ATTENTION":
            assert r["reasons"] and not any("cudnn" in line.lower() for line in r["reasons"]), r
    flash = {(r["dtype"], r["head_dim"]): r for r in rows if r["backend"] == "FLASH_ATTENTION"}
    assert flash[("float16", 64)]["status"] == "ran"
    assert flash[("float16", 512)]["status"] == "raised" and "256" in " ".join(flash[("float16", 512)]["reasons"])
    assert flash[("float32", 64)]["status"] == "raised"
