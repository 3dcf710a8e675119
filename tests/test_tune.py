"""``python -m flashlab.tune``: the buckets it plans, its argument checks, its launches and float64 check (run on
CPU through the interpreter at tiny sizes), and on a GPU the table it writes, which launches then read."""

from __future__ import annotations

import json

import pytest
import torch

from flashlab import tune
from flashlab.kernels import configs


def plan(**changes):
    args = dict(kernels=tune.DEFAULT_KERNELS, dtypes=None, head_dims=tune.DEFAULT_HEAD_DIMS,
                groups=tune.DEFAULT_GROUPS, masks=None, kv_lengths=tune.DEFAULT_KV_LENGTHS,
                lengths=tune.DEFAULT_LENGTHS, page_sizes=tune.DEFAULT_PAGE_SIZES)  # fmt: skip
    return tune.plan_shapes(**(args | changes))


def test_the_default_set_covers_the_brief_buckets():
    shapes = plan()
    by_kernel = {k: [s for s in shapes if s.kernel == k] for k in tune.DEFAULT_KERNELS}
    # decode: 2 dtypes x 2 head dims x 3 groups x 8 lengths, the KV cache twice (contiguous, 256-token pages)
    assert len(by_kernel["split_kv"]) == 2 * 2 * 3 * 8
    assert len(by_kernel["kvcache"]) == 2 * 2 * 3 * 8 * 2
    # prefill: skip_split fp32 and bf16, hopper bf16; 2 head dims x 2 masks x 3 lengths
    assert len(by_kernel["skip_split"]) == 2 * 2 * 2 * 3 and len(by_kernel["hopper"]) == 2 * 2 * 3
    assert {s.nk for s in by_kernel["split_kv"]} == {2**i for i in range(10, 18)}
    assert {s.dtype for s in by_kernel["hopper"]} == {"bfloat16"}
    # the backward: bf16, the prefill buckets (2 head dims x 2 masks x 3 lengths), each of its two kernels
    assert len(by_kernel["backward_dkdv"]) == len(by_kernel["backward_dq"]) == 2 * 2 * 3
    assert {s.dtype for s in by_kernel["backward_dq"]} == {"bfloat16"}
    assert len({s.key() for s in shapes}) == len(shapes)  # one shape per bucket


def test_plan_drops_what_has_no_bucket_of_its_own():
    # a decode query's causal band hides nothing: the "none" bucket, tuned once
    assert len(plan(kernels=("split_kv",), masks=("none", "causal"))) == len(plan(kernels=("split_kv",)))
    assert plan(kernels=("hopper",), dtypes=("float32",)) == []  # 16-bit only
    small = plan(kernels=("kvcache",), page_sizes=(16,), dtypes=("bfloat16", "float32"))
    assert {s.dtype for s in small} == {"float32"}  # 16-bit inputs in small pages run a fixed config
    windows = plan(kernels=("split_kv",), masks=("window",), kv_lengths=(4096,), groups=(1,), head_dims=(64,))
    assert [s.key()[3] for s in windows] == ["window", "window"]


def test_a_shape_keys_the_bucket_its_launch_picks():
    s = tune.Shape("kvcache", "bfloat16", 128, "none", 8, 1, 1024, page_size=4096)
    assert s.capacity == 4096 and s.key()[6] == 4096  # the band covers the pages' capacity
    assert tune.Shape("kvcache", "bfloat16", 128, "none", 8, 1, 1024, page_size=256).key()[6] == 1024
    prefill = tune.Shape("skip_split", "float32", 64, "causal", 1, 1024, 1024)
    assert prefill.key() == configs.bucket("skip_split", dtype="float32", head_dim=64, mask="causal", group=1,
                                           nq=1024, nk=1024)  # fmt: skip
    assert prefill.sizes() == (tune.PREFILL_TOKENS // 1024, tune.MODEL_DIM // 64, tune.MODEL_DIM // 64)


def test_dry_run_lists_the_buckets(capsys):
    assert tune.main(["--dry-run", "--kernels", "split_kv", "--kv-lengths", "1k,4k", "--groups", "8"]) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "8 buckets (split_kv 8)"  # 2 dtypes x 2 head dims x 2 lengths
    assert all(line.startswith("split_kv ") and "Hq=64 Hk=8" in line for line in lines[:-1])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kernels", "flash"], "kernels must be among"),
        (["--dtypes", "int8"], "dtypes must be among"),
        (["--head-dims", "65"], "multiples of 8 from 16 to 256"),
        (["--head-dims", "512"], "multiples of 8 from 16 to 256"),
        (["--kv-lengths", "3000"], "powers of two"),
        (["--lengths", "1m"], "comma-separated whole numbers"),
        (["--groups", "3"], "powers of two"),
        (["--page-sizes", "16"], "multiples of 16 from 128"),
        (["--masks", "sliding"], "masks must be among"),
        (["--rep-ms", "0"], "above 0"),
        (["--kernels", "hopper", "--dtypes", "fp32"], "leave no bucket to tune"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune.main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        tune.main(["--kernels", "split_kv"])
    assert exit_.value.code == 2
    assert "tuning needs a CUDA GPU" in capsys.readouterr().err


def test_the_output_file_is_not_replaced_without_overwrite(tmp_path):
    path = tmp_path / "t.json"
    assert tune.output_problem(path, False) is None
    path.write_text("{}")
    assert "already exists; pass --overwrite" in tune.output_problem(path, False)
    assert tune.output_problem(path, True) is None
    assert "is a folder" in tune.output_problem(tmp_path, True)
    assert "ends in .json" in tune.output_problem(tmp_path / "t.txt", False)


def test_autotuning_switches_the_launches_to_the_autotuners_and_back(monkeypatch):
    monkeypatch.delenv(configs.AUTOTUNE_ENV, raising=False)
    tuners = tune.autotuners()
    before = [dict(t.__dict__) for t in tuners.values()]
    with tune.autotuning(1.0, 2.0):
        assert configs.autotune_enabled()
        assert all(t.__dict__["do_bench"].keywords == {"warmup": 1.0, "rep": 2.0} for t in tuners.values())
    assert not configs.autotune_enabled()
    assert [dict(t.__dict__) for t in tuners.values()] == before


TINY = [
    tune.Shape("split_kv", "float32", 16, "none", 2, 1, 200),
    tune.Shape("split_kv", "bfloat16", 24, "window", 2, 1, 200),
    tune.Shape("kvcache", "float32", 16, "none", 2, 1, 100),
    tune.Shape("kvcache", "float32", 16, "causal", 2, 1, 100, page_size=32),
    tune.Shape("skip_split", "float32", 16, "causal", 1, 40, 40),
    tune.Shape("lesson_loop", "float32", 16, "window", 1, 40, 40),
]


@pytest.mark.parametrize("shape", TINY, ids=lambda s: f"{s.kernel}-{s.mask}-{s.page_size}")
def test_the_launches_equal_float64_on_the_interpreter(shape, monkeypatch):
    # the same launches and check a GPU tuning run makes, at sizes the interpreter runs quickly
    monkeypatch.setattr(tune, "DECODE_BATCH", 2)
    monkeypatch.setattr(tune, "DECODE_KV_HEADS", 1)
    monkeypatch.setattr(tune, "PREFILL_TOKENS", 80)  # B = 2
    monkeypatch.setattr(tune, "MODEL_DIM", 32)  # H = 2
    q, k, v = tune.inputs(shape, "cpu")
    o, lse = tune.launch(shape, q, k, v)
    tune.check(shape, q, k, v, o)
    o[0, 0, -1] += 1.0  # the check can fail: one wrong row of the sample
    with pytest.raises(RuntimeError, match="relative error"):
        tune.check(shape, q, k, v, o)


@pytest.mark.parametrize("kernel, mask", [("backward_dkdv", "causal"), ("backward_dq", "window")])
def test_the_backward_launch_equals_float64_on_the_interpreter(kernel, mask, monkeypatch):
    monkeypatch.setattr(tune, "PREFILL_TOKENS", 80)  # B = 2
    monkeypatch.setattr(tune, "MODEL_DIM", 32)  # H = 2
    shape = tune.Shape(kernel, "float32", 16, mask, 1, 40, 40)
    q, k, v = tune.inputs(shape, "cpu")
    grads, do = tune.launch_backward(shape, q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    tune.check_backward(shape, q, k, v, do, grads)
    grads[1][0, 0, 3] += 0.5  # the check can fail: one wrong key row of dK in the checked head
    with pytest.raises(RuntimeError, match="dk relative error"):
        tune.check_backward(shape, q, k, v, do, grads)


def test_table_entries_are_what_configs_reads():
    picked = {"BLOCK_N": 64, "num_warps": 4, "num_ctas": 1, "num_stages": 2}
    entries = [tune.table_entry(s, picked) for s in plan(kernels=("kvcache", "skip_split"), head_dims=(64,))]
    doc = dict(version=configs.TABLE_VERSION, family="x", gpu="X", torch="t", triton="t", date="d", entries=entries)
    table = configs.check_table(doc)
    assert set(table) == {s.key() for s in plan(kernels=("kvcache", "skip_split"), head_dims=(64,))}


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: a tuning run writes a table that the launches then read
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_tuned_table_is_what_the_launches_read(tmp_path, monkeypatch, capsys):
    out = tmp_path / "gpu.json"
    argv = ["--kernels", "split_kv,skip_split", "--dtypes", "bf16", "--head-dims", "64", "--groups", "4"]
    argv += ["--kv-lengths", "4k", "--lengths", "1k", "--masks", "none", "--out", str(out), "--no-progress"]
    doc = tune.main(argv)
    assert json.loads(out.read_text()) == doc and len(doc["entries"]) == 2
    assert doc["gpu"] == torch.cuda.get_device_name() and doc["triton"]
    with pytest.raises(SystemExit):  # the file is there now
        tune.main(argv)
    assert "already exists" in capsys.readouterr().err

    monkeypatch.setenv(configs.TABLE_ENV, str(out))
    monkeypatch.delenv(configs.AUTOTUNE_ENV, raising=False)
    configs.clear_cache()
    picks = []
    real = configs.pick
    monkeypatch.setattr(configs, "pick", lambda *a, **kw: picks.append(real(*a, **kw)) or picks[-1])
    for shape, entry in zip(tune.plan_shapes(("split_kv", "skip_split"), ("bfloat16",), (64,), (4,), ("none",),
                                             (4096,), (1024,), (0,)), doc["entries"], strict=True):  # fmt: skip
        q, k, v = tune.inputs(shape, "cuda")
        tune.launch(shape, q, k, v)
        assert picks[-1] == entry["config"], shape.label()
    configs.clear_cache()


def test_update_keeps_the_buckets_it_does_not_tune(tmp_path):
    old_config = {"BLOCK_N": 32, "num_warps": 4, "num_ctas": 1, "num_stages": 1}
    new_config = {"BLOCK_N": 128, "num_warps": 8, "num_ctas": 1, "num_stages": 3}
    shapes = plan(kernels=("split_kv",), head_dims=(64,), dtypes=("bfloat16",), groups=(1,), kv_lengths=(1024, 2048))
    header = dict(version=configs.TABLE_VERSION, family="x", gpu="X", torch="a", triton="b", date="d1", command="c1")
    old = {**header, "entries": [tune.table_entry(s, old_config) for s in shapes]}
    new = {**header, "date": "d2", "command": "c2", "entries": [tune.table_entry(shapes[1], new_config)]}
    merged = tune.updated_table(old, new)
    table = configs.check_table(merged)
    assert table == {shapes[0].key(): old_config, shapes[1].key(): new_config}
    assert merged["date"] == "d2" and [r["command"] for r in merged["earlier_runs"]] == ["c1"]
    path = tmp_path / "t.json"
    assert "does not exist" in tune.output_problem(path, False, update=True)
    path.write_text(json.dumps(old))
    assert tune.output_problem(path, False, update=True) is None
    assert "pass one of them" in tune.output_problem(path, True, update=True)
    path.write_text("{")
    assert "--update cannot read it" in tune.output_problem(path, False, update=True)
