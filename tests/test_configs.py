"""The tile configs looked up by bucket (``flashlab.kernels.configs``): buckets, tables, the nearest bucket, the
defaults that fit shared memory, and the CPU path left as it was. The GPU cases at the end check that a plain
launch compiles the picked config only (no autotuning) and still equals the float64 reference."""

from __future__ import annotations

import json

import pytest
import torch

from flashlab.kernels import configs
from flashlab.kernels.backward import rung1_two_pass as two_pass
from flashlab.kernels.decode import kvcache, split_kv
from flashlab.kernels.device import kernel_band
from flashlab.kernels.ladder import rung1_lesson_loop, rung2_skip_split, rung3_hopper

H200_SMEM = 232448  # shared memory one block may opt into on an H200 (sm_90: 227 KB)
SMALL_SMEM = 101376  # a consumer card's (sm_86/sm_89: 99 KB)
TINY_SMEM = 40000  # less than most configs need: the fallbacks must take over


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv(configs.AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    configs.clear_cache()
    yield
    configs.clear_cache()


def key(kernel="split_kv", dtype="bfloat16", head_dim=128, mask="none", group=8, nq=1, nk=4096, **extra):
    return configs.bucket(kernel, dtype=dtype, head_dim=head_dim, mask=mask, group=group, nq=nq, nk=nk, **extra)


def entry(kernel="split_kv", config=None, **fields):
    k = key(kernel, **fields)
    extra = dict(k[7])
    doc = dict(zip(("kernel", "dtype", "head_dim", "mask", "group", "nq", "nk"), k[:7], strict=True), extra=extra)
    doc["config"] = config or {"BLOCK_N": 128, "num_warps": 8, "num_ctas": 1, "num_stages": 3}
    return doc


def table_doc(entries, version=configs.TABLE_VERSION):
    return dict(version=version, family="nvidia-test", gpu="NVIDIA Test", torch="2.11.0", triton="3.6.0",
                date="2026-12-03T00:00:00Z", command="python -m flashlab.tune", entries=entries)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------------------------


def test_lengths_round_up_to_a_power_of_two_and_clamp():
    assert [configs.length_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025, 5000)] == [1, 2, 4, 1024, 1024, 2048, 8192]
    assert configs.length_bucket(10**7) == configs.LENGTH_BUCKETS[-1] == 131072
    assert set(configs.LENGTH_BUCKETS) == {2**i for i in range(18)}


def test_a_bucket_pads_head_dims_and_groups():
    assert key(head_dim=80) == key(head_dim=128) != key(head_dim=64)
    assert key(group=6) == key(group=8) != key(group=4)
    assert key(group=1000)[4] == configs.MAX_GROUP_BUCKET
    assert key("skip_split", group=8) == key("skip_split", group=1)  # a prefill tile does not depend on the group
    assert key(nk=3000) == key(nk=4096) != key(nk=4097)
    assert key(dtype=torch.float16) == key(dtype="float16") != key(dtype="bfloat16")
    k = key("kvcache", page_size=16)
    assert k[7] == (("page_size", 16),) and key("kvcache")[7] == (("page_size", 0),)
    assert key("kvcache", page_size=100) == key("kvcache", page_size=128)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(kernel="flash"), "kernel must be one of"),
        (dict(mask="sliding"), "mask must be one of"),
        (dict(dtype=torch.int8), "dtype must be one of"),
        (dict(nk=0), "lengths must be >= 1"),
        (dict(group=0), "head_dim and group must be >= 1"),
        (dict(page_size=16), "takes no bucket field 'page_size'"),
        (dict(kernel="kvcache", page_size=-1), "page_size must be >= 0"),
    ],
)
def test_a_bad_bucket_argument_is_named(bad, message):
    with pytest.raises(ValueError, match=message):
        key(**bad)


@pytest.mark.parametrize(
    "nq, nk, causal, window, expected",
    [
        (1, 4096, False, None, "none"),
        (1, 4096, True, None, "none"),  # a decode query sees its whole cache
        (300, 300, True, None, "causal"),
        (300, 500, True, None, "causal"),
        (300, 300, False, None, "none"),
        (300, 300, True, (64, None), "window"),
        (1, 4096, True, (1000, None), "window"),
        (1, 500, True, (1000, None), "none"),  # the window is wider than the cache
    ],
)
def test_mask_kind_says_what_the_band_hides(nq, nk, causal, window, expected):
    offset, win_left, win_right, _, _ = kernel_band(nq, nk, 64, causal, window, None)
    assert configs.mask_kind(nq, nk, offset, win_left, win_right) == expected


def test_launch_fields_read_the_launch():
    q = torch.empty(2, 32, 7, 96, dtype=torch.float16)
    band = kernel_band(7, 900, 96, True, None, None)[:3]
    fields = configs.launch_fields(q, 8, 900, *band)
    assert fields == dict(device=q.device, dtype=torch.float16, head_dim=96, mask="causal", group=4, nq=7, nk=900)


def test_device_family_names():
    assert configs.family_of_name("NVIDIA H200") == "nvidia-h200"
    assert configs.family_of_name("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert configs.family_of_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert configs.device_family("cpu") == configs.device_family(torch.empty(1)) == "cpu"
    assert configs.table_path("nvidia-h200") == configs.TUNED_DIR / "nvidia-h200.json"


def test_autotune_is_an_opt_in(monkeypatch):
    assert not configs.autotune_enabled()
    monkeypatch.setenv(configs.AUTOTUNE_ENV, "0")
    assert not configs.autotune_enabled()
    monkeypatch.setenv(configs.AUTOTUNE_ENV, "1")
    assert configs.autotune_enabled()


# ----------------------------------------------------------------------------------------------------------------
# Tables and the lookup
# ----------------------------------------------------------------------------------------------------------------


def test_a_table_round_trips_and_keys_by_bucket(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table_doc([entry(nk=4096), entry("kvcache", nk=8192, page_size=256)])))
    table = configs.load_table(path)
    assert set(table) == {key(nk=4096), key("kvcache", nk=8192, page_size=256)}
    assert configs.load_table(tmp_path / "missing.json") == {}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("triton"), "missing field 'triton'"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d["entries"][0].pop("config"), "entry 0 needs the fields"),
        (lambda d: d["entries"][0].update(nk=5000), "is not a bucket"),
        (lambda d: d["entries"][0].update(mask="sliding"), "mask must be one of"),
        (lambda d: d["entries"][0].update(config={"num_warps": 4}), "needs at least BLOCK_N"),
    ],
)
def test_a_bad_table_is_a_clear_error(change, message):
    doc = table_doc([entry()])
    change(doc)
    with pytest.raises(ValueError, match=message):
        configs.check_table(doc, source="t.json")


def test_the_nearest_length_bucket_of_the_same_signature():
    near, far = {"BLOCK_N": 64, "num_warps": 4}, {"BLOCK_N": 128, "num_warps": 8}
    table = configs.check_table(table_doc([entry(nk=1024, config=near), entry(nk=65536, config=far)]))
    assert configs.nearest_entry(table, key(nk=1024)) == near
    assert configs.nearest_entry(table, key(nk=4096)) == near  # 2 powers of two away, against 4
    assert configs.nearest_entry(table, key(nk=32768)) == far
    assert configs.nearest_entry(table, key(nk=8192)) == far  # a tie (3 and 3): the longer
    # another group, dtype, head dim, mask or kernel is not the same signature
    for other in (dict(group=4), dict(dtype="float16"), dict(head_dim=64), dict(mask="window"), dict(nq=2)):
        found = configs.nearest_entry(table, key(**other))
        assert found == (near if "nq" in other else None), other


def test_lookup_falls_back_to_the_default():
    table = configs.check_table(table_doc([entry(nk=1024)]))
    assert configs.lookup(table, key(nk=1024), H200_SMEM)["num_warps"] == 8
    missing = key("skip_split", nq=4096, nk=4096)
    assert configs.lookup(table, missing, H200_SMEM) == configs.default_config("skip_split", missing, H200_SMEM)


def fake_gpu(monkeypatch, name="NVIDIA Test", smem=H200_SMEM):
    """pick() on "cuda:0" without a GPU: the device's name and shared memory, and a count of table reads."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(configs, "smem_limit", lambda index: smem)
    reads = []
    real = configs.table_for

    def counted(family):
        reads.append(family)
        return real(family)

    monkeypatch.setattr(configs, "table_for", counted)
    return reads


def pick(kernel="split_kv", device="cuda:0", **fields):
    args = dict(dtype=torch.bfloat16, head_dim=128, mask="none", group=8, nq=1, nk=4096) | fields
    return configs.pick(kernel, device=device, **args)


def test_pick_reads_the_family_table_once_per_bucket(monkeypatch, tmp_path):
    reads = fake_gpu(monkeypatch)
    tuned = {"BLOCK_N": 128, "num_warps": 8, "num_ctas": 1, "num_stages": 3}
    path = tmp_path / "nvidia-test.json"
    path.write_text(json.dumps(table_doc([entry(nk=4096, config=tuned)])))
    monkeypatch.setattr(configs, "TUNED_DIR", tmp_path)
    assert pick(nk=3000) == tuned
    assert pick(nk=4000) == tuned and reads == ["nvidia-test"]  # same bucket: from the cache
    assert pick(nk=8000) == tuned and reads == ["nvidia-test"] * 2  # a new bucket: the nearest one's config
    got = pick(nk=3000)
    got["BLOCK_N"] = 1  # each call hands out its own dict
    assert pick(nk=3000) == tuned
    assert pick(group=4) == configs.default_config("split_kv", key(group=4), H200_SMEM)


def test_the_configs_env_names_another_table(monkeypatch, tmp_path):
    fake_gpu(monkeypatch)
    tuned = {"BLOCK_N": 32, "num_warps": 4, "num_ctas": 1, "num_stages": 1}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(table_doc([entry(config=tuned)])))
    monkeypatch.setenv(configs.TABLE_ENV, str(path))
    assert pick() == tuned
    monkeypatch.setenv(configs.TABLE_ENV, str(tmp_path / "nothing.json"))
    configs.clear_cache()
    with pytest.raises(FileNotFoundError, match="no such table file"):
        pick()


def test_on_cpu_pick_is_the_interpreter_config(monkeypatch, tmp_path):
    # a table never changes what the interpreter runs
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(table_doc([entry()])))
    monkeypatch.setattr(configs, "TUNED_DIR", tmp_path)
    assert pick(device="cpu") == {"BLOCK_N": 16}
    assert pick("skip_split", device=torch.device("cpu"), nq=300, nk=300) == {"BLOCK_M": 16, "BLOCK_N": 16}
    assert pick("hopper", device="cpu", nq=300, nk=300) == {"BLOCK_M": 16, "BLOCK_N": 16, "WARP_SPECIALIZE": False}


def test_pick_is_a_dict_lookup_after_the_first_call(monkeypatch):
    fake_gpu(monkeypatch)
    pick()
    before = configs._bucket_config.cache_info()
    for nk in range(3000, 3100):
        pick(nk=nk)
    after = configs._bucket_config.cache_info()
    assert after.misses == before.misses and after.hits == before.hits + 100
    assert after.maxsize == configs.CACHE_SIZE


# ----------------------------------------------------------------------------------------------------------------
# The defaults: the kernels' own spaces, pruned as the kernels prune them
# ----------------------------------------------------------------------------------------------------------------

PREFILL_MODULES = {"skip_split": rung2_skip_split, "lesson_loop": rung1_lesson_loop, "hopper": rung3_hopper}


@pytest.mark.parametrize("kernel", sorted(PREFILL_MODULES))
def test_prefill_defaults_are_the_kernels_spaces_then_fallbacks(kernel):
    module = PREFILL_MODULES[kernel]
    assert set(configs.PREFILL_DEFAULTS[kernel]) == set(module.TUNING_SPACE)
    for cls, tiles in configs.PREFILL_DEFAULTS[kernel].items():
        assert tiles == list(module.TUNING_SPACE[cls]) + list(module.FALLBACK_SPACE), cls


def test_backward_defaults_are_the_kernels_spaces_measured_pick_first_then_fallbacks():
    for name, kernel in two_pass.CONFIG_KERNELS.items():
        space = two_pass.TUNING_SPACE[name]
        assert set(configs.BACKWARD_DEFAULTS[kernel]) == set(space)
        for cls, tiles in configs.BACKWARD_DEFAULTS[kernel].items():
            own = len(space[cls])
            assert sorted(tiles[:own]) == sorted(space[cls]) and tiles[own:] == two_pass.FALLBACK_SPACE, cls
    # what the autotuner chose at every length of the H200's backward grid (bf16, docs/backward.md) comes first
    assert configs.BACKWARD_DEFAULTS["backward_dkdv"]["d<=64"][0] == (64, 64, 4, 3)
    assert configs.BACKWARD_DEFAULTS["backward_dq"]["d=128"][0] == (128, 64, 8, 2)


def test_decode_defaults_are_in_the_decode_spaces():
    last_resort = (32, 4, 1)
    assert configs.DECODE_DEFAULTS["16-bit"][0] == split_kv.TUNING_SPACE[0] == (64, 4, 2)
    assert set(configs.DECODE_DEFAULTS["16-bit"]) <= set(split_kv.TUNING_SPACE) & set(kvcache.TUNING_SPACE) | {
        last_resort
    }
    assert set(configs.DECODE_DEFAULTS["fp32"]) == set(split_kv.FP32_TUNING_SPACE) | {last_resort}
    assert all(tiles[-1] == last_resort for tiles in configs.DECODE_DEFAULTS.values())


def kernel_prune(kernel, dtype, head_dim, group, nq, smem, monkeypatch):
    """What the kernel's own pruning keeps of its autotuner's configs, as (tile, num_warps, num_stages) tuples,
    on a GPU with ``smem`` bytes of shared memory a block."""
    from flashlab.kernels.device import block_d

    backward = dict.fromkeys(configs.BACKWARD_KERNELS, two_pass)
    module = {"split_kv": split_kv, "kvcache": split_kv, **PREFILL_MODULES, **backward}[kernel]
    monkeypatch.setattr(module, "smem_limit", lambda index: smem)
    monkeypatch.setattr(module, "device_index", lambda x: 0)
    q = torch.empty(1, dtype=dtype)
    if kernel in configs.DECODE_KERNELS:
        tuned = split_kv.split_kv_partial_tuned if kernel == "split_kv" else kvcache.kvcache_partial_tuned
        named = {"Q": q, "BLOCK_M": split_kv.packed_block_m(group * nq), "BLOCK_D": block_d(head_dim)}
        kept = split_kv.prune_configs(tuned.configs, named)
        return {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
    if kernel in configs.BACKWARD_KERNELS:
        name = {v: k for k, v in two_pass.CONFIG_KERNELS.items()}[kernel]
        tuned = two_pass._bwd_dkdv_tuned if name == "dkdv" else two_pass._bwd_dq_tuned
        kept = two_pass._pruner(name)(tuned.configs, {"Q": q, "BLOCK_D": block_d(head_dim)})
        return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
    tuned = {
        "skip_split": rung2_skip_split.attn_fwd_tuned,
        "lesson_loop": rung1_lesson_loop.lesson_loop_fwd_tuned,
        "hopper": rung3_hopper.hopper_fwd_tuned,
    }[kernel]
    kept = module.prune_configs(tuned.configs, {"Q": q, "BLOCK_D": block_d(head_dim)})
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}


def tile_of(kernel, config):
    if kernel in configs.DECODE_KERNELS:
        return config["BLOCK_N"], config["num_warps"], config["num_stages"]
    return config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]


@pytest.mark.parametrize("smem", [H200_SMEM, SMALL_SMEM, TINY_SMEM])
@pytest.mark.parametrize("kernel", configs.KERNELS)
def test_each_default_survives_the_kernels_own_pruning(kernel, smem, monkeypatch):
    dtypes = (torch.bfloat16,) if kernel == "hopper" else (torch.bfloat16, torch.float32)
    nqs = (1, 16) if kernel in configs.DECODE_KERNELS else (4096,)
    for dtype in dtypes:
        for head_dim in (32, 64, 96, 128, 256):
            for group, nq in [(g, n) for g in (1, 8) for n in nqs]:
                k = key(kernel, dtype=dtype, head_dim=head_dim, group=group, nq=nq, nk=8192)
                config = configs.default_config(kernel, k, smem)
                kept = kernel_prune(kernel, dtype, head_dim, group, nq, smem, monkeypatch)
                assert tile_of(kernel, config) in kept, (dtype, head_dim, group, nq, config, kept)
                if kernel == "hopper":
                    assert config["WARP_SPECIALIZE"] == (config["num_warps"] == rung3_hopper.WARP_SPECIALIZED_WARPS)


def test_the_default_shrinks_with_shared_memory():
    k = key("skip_split", nq=4096, nk=4096, head_dim=128)
    assert tile_of("skip_split", configs.default_config("skip_split", k, H200_SMEM)) == (128, 64, 8, 3)
    small = tile_of("skip_split", configs.default_config("skip_split", k, TINY_SMEM))
    assert small in rung2_skip_split.FALLBACK_SPACE


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: the plain launches compile the picked config alone, and equal the reference
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("nk", [1000, 5000])
def test_split_kv_launch_takes_the_pick_not_the_autotuner(nk):
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 16, 1, 128, device="cuda", generator=g).to(torch.bfloat16)
    k, v = torch.randn(2, 2, 4, nk, 128, device="cuda", generator=g).to(torch.bfloat16).unbind(0)
    o = torch.empty_like(q)
    lse = torch.empty(2, 16, 1, device="cuda")
    tuned_before = len(split_kv.split_kv_partial_tuned.cache)
    offset, win_left, win_right, qk_scale, _ = kernel_band(1, nk, 128, False, None, None)
    split_kv.launch(q, k, v, o, lse, offset, win_left, win_right, qk_scale)
    assert len(split_kv.split_kv_partial_tuned.cache) == tuned_before  # the autotuner did not run
    expected, _ = attention_float64(q, k, v)
    torch.testing.assert_close(o.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("rung", ["skip_split", "lesson_loop", "hopper"])
def test_prefill_launch_takes_the_pick_not_the_autotuner(rung):
    from flashlab.reference.torch_float64 import attention_float64

    module = PREFILL_MODULES[rung]
    tuned = {"skip_split": "attn_fwd_tuned", "lesson_loop": "lesson_loop_fwd_tuned", "hopper": "hopper_fwd_tuned"}
    autotuner = getattr(module, tuned[rung])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = torch.randn(3, 1, 8, 1500, 128, device="cuda", generator=g).to(torch.bfloat16).unbind(0)
    o = torch.empty_like(q)
    lse = torch.empty(1, 8, 1500, device="cuda")
    band = kernel_band(1500, 1500, 128, True, None, None)[:4]
    before = len(autotuner.cache)
    module.launch(q, k, v, o, lse, True, None, band)
    assert len(autotuner.cache) == before
    torch.testing.assert_close(o.double(), attention_float64(q, k, v, causal=True)[0], rtol=2e-2, atol=2e-2)
