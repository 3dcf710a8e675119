"""The GPU and model catalogues: every entry complete, sourced and plausible; the data reachable from the package."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from flashlab.calculators.catalog import DATA, GPUS, MODELS, as_gpu, as_model, gpu_from_dict

REAL_GPUS = ["h100-sxm", "h200-sxm", "a100-80gb-sxm", "b200", "rtx-4090", "l4"]
GPU_FIGURES = ["hbm_bandwidth_TB_s", "dense_fp16_TFLOP_s", "sm_count", "smem_per_sm_KiB", "l2_MiB"]


def _raw(name: str) -> dict:
    return json.loads((ROOT / "flashlab" / "calculators" / "data" / name).read_text(encoding="utf-8"))


def test_catalogues_are_package_data_that_every_install_carries():
    # read through importlib.resources from inside the package, so a wheel carries them with no special case
    assert (DATA / "gpus.json").is_file() and (DATA / "models.json").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"calculators/data/*.json"' in pyproject and "data-files" not in pyproject


def test_the_brief_gpus_and_the_lesson_gpu_are_there():
    for name in [*REAL_GPUS, "lesson-gpu"]:
        assert name in GPUS
    lesson = GPUS["lesson-gpu"]
    assert lesson.hbm_bandwidth == 3e12 and lesson.tensor_flops == 500e12


@pytest.mark.parametrize("name", REAL_GPUS)
def test_every_real_gpu_has_every_figure_with_a_source(name):
    entry = _raw("gpus.json")[name]
    for figure in GPU_FIGURES:
        assert entry.get(figure), f"{name} lacks {figure}"
        assert len(entry["sources"].get(figure, "")) > 10, f"{name}: {figure} has no source"
    assert entry["display_name"] and entry["note"]


@pytest.mark.parametrize("name", REAL_GPUS)
def test_gpu_figures_are_plausible(name):
    gpu = GPUS[name]
    assert 0.2e12 <= gpu.hbm_bandwidth <= 10e12  # L4's 300 GB/s .. B200's 8 TB/s
    assert 100e12 <= gpu.tensor_flops <= 3000e12  # dense fp16, not the 2:4-sparse figure
    assert 100 <= gpu.ridge_point <= 500  # FLOP per byte
    assert 40 <= gpu.sm_count <= 200
    assert 64 * 1024 <= gpu.smem_per_sm <= 256 * 1024
    assert 16 * 2**20 <= gpu.l2_bytes <= 256 * 2**20


def test_known_figures_in_si_units():
    h100 = GPUS["h100-sxm"]
    assert h100.hbm_bandwidth == 3.35e12
    assert h100.smem_per_sm == 228 * 1024
    assert h100.l2_bytes == 50 * 2**20
    assert round(h100.ridge_point) == 295
    # dense is half of the datasheet's sparsity figure
    assert GPUS["a100-80gb-sxm"].tensor_flops == 312e12
    assert GPUS["l4"].tensor_flops == 242e12 / 2


def test_the_lesson_model_and_real_ones_are_there_with_sources():
    raw = _raw("models.json")
    for name in ["lesson-70b", "llama-3-8b", "llama-3-70b", "mistral-7b", "deepseek-v2"]:
        assert name in MODELS
        assert len(raw[name]["source"]) > 10, f"{name} has no source"
    m = MODELS["lesson-70b"]
    assert (m.query_heads, m.kv_heads, m.layers, m.head_dim) == (64, 8, 80, 128)
    assert any(m.attention == "mla" for m in MODELS.values())
    v2 = MODELS["deepseek-v2"]
    assert (v2.kv_lora_rank, v2.rope_head_dim, v2.layers, v2.query_heads) == (512, 64, 60, 128)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_shapes_are_consistent(name):
    m = MODELS[name]
    assert m.query_heads % m.kv_heads == 0
    assert m.attention in ("mha", "gqa", "mla")
    assert 1 <= m.layers <= 200 and m.head_dim in (64, 80, 96, 112, 128, 192, 256)


def test_gqa_models_cache_less_than_their_mha_equivalent():
    for m in MODELS.values():
        if m.attention == "gqa":
            assert m.kv_elements_per_token * (m.query_heads // m.kv_heads) == 2 * m.query_heads * m.head_dim * m.layers


def test_as_gpu_and_as_model_accept_names_objects_and_dicts():
    assert as_gpu("h100-sxm") is GPUS["h100-sxm"]
    assert as_gpu(GPUS["l4"]) is GPUS["l4"]
    assert as_gpu({"hbm_bandwidth": 1e12, "tensor_flops": 1e14}).name == "custom-gpu"
    assert as_model("llama-3-8b") is MODELS["llama-3-8b"]
    assert as_model({"layers": 2, "query_heads": 4, "kv_heads": 2, "head_dim": 8}).kv_heads == 2


def test_a_catalogue_entry_round_trips_through_its_dict():
    raw = _raw("gpus.json")["rtx-4090"]
    assert gpu_from_dict(raw, "rtx-4090") == GPUS["rtx-4090"]


def test_same_field_in_two_units_is_rejected():
    with pytest.raises(ValueError, match="given twice"):
        gpu_from_dict({"hbm_bandwidth": 3e12, "hbm_bandwidth_TB_s": 3, "tensor_flops": 1e12})


@pytest.mark.parametrize(
    "entry,names",
    [
        ({"hbm_bandwidth_TB_s": 10**400, "dense_fp16_TFLOP_s": 989}, "hbm_bandwidth_TB_s"),
        ({"hbm_bandwidth": 3.35e12, "tensor_flops": 10**400}, "tensor_flops"),
        ({"hbm_bandwidth": 3.35e12, "tensor_flops": 1e15, "memory_GB": 1e300}, "memory_bytes"),
    ],
)
def test_gpu_figures_past_the_largest_float_are_a_value_error(entry, names):
    # the roofline divides these as floats: a figure past 1.8e308 is refused by name, never an OverflowError later
    with pytest.raises(ValueError, match=names):
        gpu_from_dict(entry)


def test_a_special_function_rate_where_given_has_a_source_and_reads_as_exponentials_a_second():
    given = {name: e for name, e in _raw("gpus.json").items() if isinstance(e, dict) and "special_function_T_s" in e}
    assert {"h100-sxm", "h200-sxm"} <= set(given)
    for name, entry in given.items():
        assert len(entry["sources"].get("special_function_T_s", "")) > 10, f"{name}: no source"
        assert GPUS[name].exp_rate == entry["special_function_T_s"] * 1e12
