"""``python -m flashlab.warmup``: the calls it plans cover every requested bucket both ways (lengths that are and
are not multiples of 16), it makes them through the public entry points (counted here with stand-ins, and once for
real through the interpreter), from several threads too, and bad arguments are one-line errors."""

from __future__ import annotations

import threading

import pytest
import torch

import flashlab.host as host
from flashlab import warmup as wu
from flashlab.kernels import configs


def test_bucket_lengths_cover_each_bucket_both_ways():
    lengths = wu.bucket_lengths(17, 1000)
    buckets = {configs.length_bucket(n) for n in lengths}
    assert buckets == {32, 64, 128, 256, 512, 1024}
    for top in buckets:
        inside = [n for n in lengths if configs.length_bucket(n) == top]
        assert any(n % 16 == 0 for n in inside) and any(n % 16 for n in inside), (top, inside)
    assert max(lengths) == 1000 and min(lengths) >= 17
    assert wu.bucket_lengths(1, 4) == [1, 2, 3, 4]  # the smallest buckets hold no multiple of 16


def test_the_plan_covers_every_requested_bucket():
    work = wu.Workload(head_dims=(64, 96), dtypes=("bfloat16", "float16"), masks=("none", "causal", "window"),
                       groups=(1, 8), max_len=3000, page_size=256)  # fmt: skip
    calls = wu.plan_calls(work.check())
    seen = {(c.kind, c.dtype, c.head_dim, c.mask, c.group, configs.length_bucket(c.nk)) for c in calls}
    for kind in ("prefill", "backward"):
        for dtype in ("bfloat16", "float16"):
            for d in (64, 96):
                for mask in ("none", "causal", "window"):
                    for g in (1, 8):
                        for top in (32, 64, 128, 256, 512, 1024, 2048, 4096):
                            assert (kind, dtype, d, mask, g, top) in seen
    decode = {c for c in seen if c[0] in ("decode", "kvcache")}
    assert {c[3] for c in decode} == {"none", "window"}  # a decode causal band is no mask
    assert {c[5] for c in decode} == {2**i for i in range(13)}
    assert all(c.nq == c.nk for c in calls if c.kind in ("prefill", "backward"))
    assert all(c.nq == 1 and c.page_size == 256 for c in calls if c.kind == "kvcache")


def test_switches_and_presets():
    base = dict(head_dims=(64,), max_len=64)
    assert {c.kind for c in wu.plan_calls(wu.Workload(**base, decode=False))} == {"prefill", "backward"}
    assert {c.kind for c in wu.plan_calls(wu.Workload(**base, backward=False))} == {"prefill", "decode", "kvcache"}
    llama = wu.plan_calls(wu.MODELS["llama-8b"])
    assert {(c.head_dim, c.group, c.kv_heads) for c in llama} == {(128, 4, 8)}
    assert max(c.nk for c in llama) == 8192
    assert {c.window for c in wu.plan_calls(wu.MODELS["mistral-7b"]) if c.mask == "window"} == {4096}


class Recorder:
    """Stand-ins for the two entry points that record each call's shapes, mask and thread."""

    def __init__(self, monkeypatch):
        self.calls, self.threads = [], set()
        self.lock = threading.Lock()
        monkeypatch.setattr(host, "flash_attention", self.flash_attention)
        monkeypatch.setattr(host, "flash_attention_with_kvcache", self.with_kvcache)

    def note(self, kind, q, nk, causal, window, **extra):
        with self.lock:
            self.calls.append((kind, q.dtype, q.shape[1], q.shape[2], q.shape[3], nk, causal, window, extra))
            self.threads.add(threading.get_ident())

    def flash_attention(self, q, k, v, causal=False, window=None):
        self.note("grad" if q.requires_grad else "plain", q, k.shape[2], causal, window, kv_heads=k.shape[1])
        return q * 1.0  # differentiable, like the real output

    def with_kvcache(self, q, k_cache, v_cache, seqlens, table, causal=False, window=None):
        capacity = k_cache.shape[1] * table.shape[1] if table is not None else k_cache.shape[1]
        self.note("kvcache", q, int(seqlens.max()), causal, window, capacity=capacity)


def test_warmup_makes_every_planned_call(monkeypatch):
    rec = Recorder(monkeypatch)
    done = wu.warmup(head_dims=(32,), dtypes=("float16",), masks=("causal", "window"), groups=(4,), kv_heads=2,
                     max_len=100, window=16, page_size=32, progress=False)  # fmt: skip
    planned = done.calls
    assert len(rec.calls) == len(planned) > 0
    kinds = [c[0] for c in rec.calls]
    assert kinds.count("grad") == sum(c.kind == "backward" for c in planned)
    assert kinds.count("kvcache") == sum(c.kind == "kvcache" for c in planned)
    for kind, dtype, hq, nq, d, nk, causal, window, extra in rec.calls:
        assert (dtype, hq, d) == (torch.float16, 8, 32)
        assert causal == (nq > 16 or window is not None)  # a decode step's causal band runs as no mask
        assert nq == (1 if kind == "kvcache" or nq <= 16 else nk)
        assert window in (None, (16, None))
        if kind == "kvcache":
            assert extra["capacity"] == -(-nk // 32) * 32  # whole 32-token pages
    recorded = {(nq, nk, window is not None) for _, _, _, nq, _, nk, _, window, _ in rec.calls}
    assert recorded == {(c.nq, c.nk, c.mask == "window") for c in planned}
    assert "calls (" in done.summary() and done.device == "cpu"


def test_threads_make_the_same_calls(monkeypatch):
    rec = Recorder(monkeypatch)
    done = wu.warmup(head_dims=(16,), max_len=300, kv_heads=1, threads=4, progress=False)
    assert len(rec.calls) == len(done.calls) and done.threads == 4
    assert rec.threads and threading.get_ident() not in rec.threads


def test_warmup_runs_the_real_entry_points_on_the_interpreter():
    # nothing to compile on CPU; the calls run end to end (the backward through autograd) at tiny sizes
    done = wu.warmup(head_dims=(16,), dtypes=("float32",), masks=("causal",), groups=(2,), kv_heads=1, max_len=20,
                     page_size=16, device="cpu", progress=False)  # fmt: skip
    assert {c.kind for c in done.calls} == {"prefill", "backward", "decode", "kvcache"}


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(head_dims=(65,)), "head dims must be multiples of 8"),
        (dict(dtypes=("int8",)), "dtype must be one of"),
        (dict(masks=("sliding",)), "masks must be among"),
        (dict(groups=(0,)), "groups must be from 1"),
        (dict(max_len=0), "max_len must be from 1"),
        (dict(page_size=20), "page_size must be 0"),
        (dict(head_dims=()), "head_dims must name at least one value"),
        (dict(model="llama"), "model must be one of"),
        (dict(threads=0), "threads must be from 1 to 64"),
        (dict(seq_len=4), "takes no field 'seq_len'"),
    ],
)
def test_bad_api_arguments_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        wu.warmup(progress=False, **fields)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--head-dims", "65"], "head dims must be multiples of 8"),
        (["--masks", "sliding"], "masks must be among"),
        (["--model", "llama"], "--model must be one of"),
        (["--max-len", "1m"], "expected a length like 4096"),
        (["--threads", "0"], "--threads must be from 1 to 64"),
        (["--kv-heads", "x"], "invalid int value"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        wu.main([*argv, "--dry-run"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_dry_run_and_a_cpu_run_from_the_command_line(monkeypatch, capsys):
    assert wu.main(["--model", "gpt2-small", "--max-len", "64", "--dry-run"]) is None
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == f"{len(out) - 1} calls" and all("Hq=12 Hk=12" in line for line in out[:-1])
    rec = Recorder(monkeypatch)
    done = wu.main(["--model", "gpt2-small", "--max-len", "64", "--no-backward", "--device", "cpu", "--no-progress"])
    assert len(rec.calls) == len(done.calls) and "warmed" in capsys.readouterr().out
