"""Context parallelism (``flashlab.distributed``) on 2 and 4 processes against one process.

The ranks are real processes joined by gloo (NCCL on the GPU test), each running Triton's interpreter on its slice.
Every rank builds the same whole sequence from one seed, keeps its slice (``shard_sequence``), runs
``ring_attention`` or ``all_gather_attention`` forward and backward, and saves its local output and gradients; this
process puts the slices back together (``unshard_sequence``) and compares them with ``flash_attention`` on the
whole sequence in one process and with the float64 reference. One launch of each world size runs every case of
that size, so the processes start twice, not once per case. The ranks are forked from a fork server that has
imported torch, Triton and flashlab once (spawning re-imports them in every rank, several seconds each on a small
machine; forking this process itself is refused once its autograd has run); every launch has a deadline, and the
process group a timeout, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import datetime
import itertools
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashlab.bench import context_parallel
from flashlab.core.masking import visible_mask
from flashlab.core.numerics import grad_tolerance, relative_error, tolerance
from flashlab.distributed import (
    all_gather_attention,
    block_call,
    chunk_pairs,
    global_band,
    rank_chunks,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from flashlab.host import flash_attention
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads

DEADLINE_S = 240  # one launch, every case of its world size; about 10 s on two idle cores
GROUP_TIMEOUT = datetime.timedelta(seconds=60)  # a collective that waits longer raises instead of hanging
METHODS = {"ring": ring_attention, "all_gather": all_gather_attention}

# name: (world, method, layout, causal, window, dtype, (B, Hq, Hk, N, D))
CASES = {
    "2-ring-head_tail-causal-gqa": (2, "ring", "head_tail", True, None, torch.float32, (1, 4, 2, 16, 16)),
    "2-ring-contiguous-causal": (2, "ring", "contiguous", True, None, torch.float32, (1, 2, 2, 24, 16)),
    "2-ring-head_tail-full": (2, "ring", "head_tail", False, None, torch.float32, (2, 2, 1, 16, 16)),
    "2-ring-contiguous-window": (2, "ring", "contiguous", False, (5, 3), torch.float32, (1, 2, 2, 32, 16)),
    "2-ring-head_tail-causal-window": (2, "ring", "head_tail", True, (6, None), torch.float32, (1, 2, 1, 32, 16)),
    "2-ring-head_tail-causal-bf16": (2, "ring", "head_tail", True, None, torch.bfloat16, (1, 2, 2, 32, 16)),
    "2-all_gather-head_tail-causal-gqa": (2, "all_gather", "head_tail", True, None, torch.float32, (1, 4, 2, 16, 16)),
    "4-ring-head_tail-causal-gqa": (4, "ring", "head_tail", True, None, torch.float32, (1, 2, 1, 16, 16)),
    "4-ring-contiguous-window": (4, "ring", "contiguous", False, (5, 2), torch.float32, (1, 2, 2, 16, 16)),
    "4-all_gather-contiguous-full": (4, "all_gather", "contiguous", False, None, torch.float32, (1, 2, 1, 16, 16)),
    "4-ring-in-two-groups": (4, "ring", "head_tail", True, None, torch.float32, (1, 2, 1, 16, 16)),
}
IN_PAIRS = {"4-ring-in-two-groups"}  # run on two process groups of two ranks (the group argument)
# name: (world, what each rank passes) -- every rank must raise a ValueError naming the problem
BAD_CASES = {
    "uneven": (2, "rank 1 holds one position fewer"),
    "heads": (2, "rank 1 has another number of query heads"),
    "layout": (2, "an unknown layout"),
    "odd_head_tail": (2, "an odd local length under head_tail"),
}
BAD_MESSAGES = {
    "uneven": "uneven sequence slices",
    "heads": "same shapes",
    "layout": "layout must be one of",
    "odd_head_tail": "local length must be even",
}


def whole_inputs(name, device="cpu"):
    """The whole sequence's q, k, v and upstream gradient of a case: the same on every rank (one seed)."""
    _, _, _, _, _, dtype, (b, hq, hk, n, d) = CASES[name]
    g = torch.Generator().manual_seed(sorted(CASES).index(name))
    shapes = [(b, hq, n, d), (b, hk, n, d), (b, hk, n, d), (b, hq, n, d)]
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


def run_case(name, world, rank, device):
    _, method, layout, causal, window, _, _ = CASES[name]
    group = None
    if name in IN_PAIRS:  # ranks {0, 1} and {2, 3}: two rings of two, each over the whole sequence
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in one order
        group, world, rank = pairs[rank // 2], 2, rank % 2
    q, k, v, do = (shard_sequence(x, world, rank, layout) for x in whole_inputs(name, device))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = METHODS[method](q, k, v, causal=causal, window=window, group=group, layout=layout)
    o.backward(do)
    return {"o": o.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu(), "dv": v.grad.cpu()}


def run_bad_case(name, rank, device):
    q = torch.randn(1, 2, 8, 16, device=device)
    k = v = torch.randn(1, 2, 8, 16, device=device)
    layout = "head_tail"
    if name == "uneven" and rank == 1:
        q, k, v = q[:, :, :6], k[:, :, :6], v[:, :, :6]
    if name == "heads" and rank == 1:
        q = torch.randn(1, 4, 8, 16, device=device)
    if name == "layout":
        layout = "zigzag"
    if name == "odd_head_tail":
        q, k, v = q[:, :, :7], k[:, :, :7], v[:, :, :7]
    try:
        ring_attention(q, k, v, causal=True, layout=layout)
    except ValueError as err:
        return str(err)
    return None


BENCH_ARGS = ["--seq-len", "16", "--check-len", "16", "--head-dim", "16", "--heads", "2", "--kv-heads", "1"]
BENCH_ARGS += ["--dtype", "fp32", "--warmup", "0", "--rep", "1"]


def run_bench(device):
    return context_parallel.measure(context_parallel.build_parser().parse_args(BENCH_ARGS), torch.device(device))


def worker(rank, world, backend, init_file, out_dir, names, bad_names, bench=False):
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)  # fmt: skip
    try:
        results = {name: run_case(name, world, rank, device) for name in names}
        results.update({f"bad:{name}": run_bad_case(name, rank, device) for name in bad_names})
        if bench:
            results["bench"] = run_bench(device)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def launch(world, backend="gloo", names=(), bad_names=(), bench=False):
    """Run ``worker`` on ``world`` processes; returns each rank's results. Fails past ``DEADLINE_S``."""
    with tempfile.TemporaryDirectory() as tmp:
        # CUDA cannot be forked; nor can a process whose autograd has started its threads (torch >= 2.14 refuses,
        # and this suite runs backwards before). A fork server forks ranks from a clean process that has imported
        # torch and flashlab once, so each rank starts in a fraction of a spawn's time.
        method = "forkserver" if backend == "gloo" else "spawn"
        if method == "forkserver":
            mp.set_forkserver_preload(["torch", "triton", "flashlab", "flashlab.distributed", __name__])
        args = (world, backend, os.path.join(tmp, "init"), tmp, list(names), list(bad_names), bench)
        context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    pytest.fail(f"{world} ranks did not finish within {DEADLINE_S} s")
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def results():
    """Every case's slices from every rank, two launches in all (2 ranks, then 4)."""
    out = {}
    for world in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == world]
        bad = [n for n, case in BAD_CASES.items() if case[0] == world]
        out[world] = launch(world, names=names, bad_names=bad, bench=world == 2)
    return out


def gathered(rank_results, name, key):
    layout = CASES[name][2]
    if name in IN_PAIRS:  # both rings computed the same sequence
        pairs = (rank_results[:2], rank_results[2:])
        first, second = (unshard_sequence([r[name][key] for r in pair], layout) for pair in pairs)
        assert torch.equal(first, second), f"{name}: the two rings of two disagree on {key}"
        return first
    return unshard_sequence([r[name][key] for r in rank_results], layout)


def one_process(name):
    """``flash_attention`` on the whole sequence in one process: o and the gradients."""
    _, _, _, causal, window, _, _ = CASES[name]
    q, k, v, do = whole_inputs(name)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, causal=causal, window=window)
    o.backward(do)
    return {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def float64_reference(name):
    _, _, _, causal, window, _, _ = CASES[name]
    q, k, v, do = whole_inputs(name)
    o, _ = attention_float64(q, k, v, causal, window)
    dq, dk, dv = attention_float64_grads(q, k, v, do, causal, window)
    return {"o": o, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_equals_one_process(results, name):
    world, dtype = CASES[name][0], CASES[name][5]
    mine = {key: gathered(results[world], name, key) for key in ("o", "dq", "dk", "dv")}
    for ref_name, ref in (("one-process flash_attention", one_process(name)), ("float64", float64_reference(name))):
        for key, out in mine.items():
            tol = tolerance(dtype) if key == "o" else grad_tolerance(dtype)
            err = relative_error(out.float().numpy(), ref[key].double().numpy())
            assert err <= tol, f"{name}: {key} differs from the {ref_name} result by {err:.2e} (allowed {tol:.0e})"


@pytest.mark.parametrize("name", list(BAD_CASES))
def test_bad_inputs_fail_on_every_rank(results, name):
    world = BAD_CASES[name][0]
    messages = [r[f"bad:{name}"] for r in results[world]]
    for rank, message in enumerate(messages):
        assert message is not None, f"{name} ({BAD_CASES[name][1]}): rank {rank} raised no ValueError"
        assert BAD_MESSAGES[name] in message, f"{name}: rank {rank} said {message!r}"


def test_the_benchmark_checks_then_times_every_method(results):
    rows = results[2][0]["bench"]
    assert [r["method"] for r in rows] == ["one_gpu", "ring", "all_gather"]
    for r in rows[1:]:
        assert r["check"]["ok"], f"{r['method']} failed its check: {r['check']['errors']}"
        assert set(r["check"]["errors"]) == {"o", "o_float64", "dq", "dk", "dv"}
    for r in rows:
        assert r["time_ms"] > 0 and r["speedup"] > 0
    assert results[2][1]["bench"] == rows  # every rank reports the same rows
    assert "ring" in context_parallel.summary(rows)


def test_without_a_process_group_it_says_so():
    x = torch.randn(1, 1, 8, 16)
    for fn in METHODS.values():
        with pytest.raises(RuntimeError, match="init_process_group"):
            fn(x, x, x)


@pytest.mark.parametrize("layout", ["head_tail", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_sequence(world, layout):
    n = 2 * world * 3
    x = torch.arange(n).reshape(1, 1, n, 1)
    shards = [shard_sequence(x, world, r, layout) for r in range(world)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    if layout == "head_tail" and world > 1:  # rank 0 holds the first and the last chunk
        c = n // (2 * world)
        assert shards[0].flatten().tolist() == [*range(c), *range(n - c, n)]


def test_an_uneven_sequence_is_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        rank_chunks(10, 2, 0, "head_tail")
    with pytest.raises(ValueError, match="layout must be one of"):
        rank_chunks(8, 2, 0, "zigzag")


WINDOWS = [None, (0, 0), (3, 0), (0, 4), (5, 2), (None, 3), (7, None), (40, 40)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_every_block_call_is_the_global_mask(causal, window):
    # for every pair of chunk ranges, the kernel's bottom-right mask on the cut pair is the whole sequence's mask
    # there, and everything the cut leaves out is hidden
    n = 24
    full = visible_mask(n, n, causal, window)  # (n, n) the whole sequence's mask
    band = global_band(n, causal, window)
    edges = [0, 3, 8, 11, 16, 24]
    ranges = list(itertools.pairwise(edges))
    for (qs, qe), (ks, ke) in itertools.product(ranges, ranges):
        want = full[qs:qe, ks:ke]
        call = block_call((qs, qe), (ks, ke), band)
        got = np.zeros_like(want)
        if call is not None:
            nq, nk = call.q1 - call.q0, call.k1 - call.k0
            got[call.q0 : call.q1, call.k0 : call.k1] = visible_mask(nq, nk, call.causal, call.window)
        assert np.array_equal(got, want), f"queries {qs}:{qe}, keys {ks}:{ke}: {call}"
        assert call is not None or not want.any()


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA GPUs")
def test_ring_on_two_gpus_with_nccl():
    names = ["2-ring-head_tail-causal-gqa", "2-ring-contiguous-window", "2-ring-head_tail-causal-bf16"]
    ranks = launch(2, backend="nccl", names=names)
    for name in names:
        dtype = CASES[name][5]
        ref = one_process(name)
        for key in ("o", "dq", "dk", "dv"):
            tol = tolerance(dtype) if key == "o" else grad_tolerance(dtype)
            err = relative_error(gathered(ranks, name, key).float().numpy(), ref[key].double().numpy())
            assert err <= tol, f"{name} on NCCL: {key} differs from one process by {err:.2e} (allowed {tol:.0e})"


@pytest.mark.parametrize("layout", ["head_tail", "contiguous"])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (False, (5, 3)), (True, (6, None))])
def test_the_pairs_of_a_step_cover_the_mask_once(layout, causal, window):
    # what a rank computes against another rank's slice, all its kernel calls together: every visible (query, key)
    # exactly once, nothing hidden
    world, n = 3, 36
    full = visible_mask(n, n, causal, window)
    band = global_band(n, causal, window)
    for rank, source in itertools.product(range(world), range(world)):
        q_pos = np.concatenate([np.arange(a, b) for a, b in rank_chunks(n, world, rank, layout)])
        k_pos = np.concatenate([np.arange(a, b) for a, b in rank_chunks(n, world, source, layout)])
        want = full[np.ix_(q_pos, k_pos)]  # (N_local, N_local) in local order
        seen = np.zeros(want.shape, dtype=int)
        for rows, keys, call in chunk_pairs(rank_chunks(n, world, rank, layout),
                                            rank_chunks(n, world, source, layout), band):  # fmt: skip
            seen[rows, keys] += visible_mask(rows.stop - rows.start, keys.stop - keys.start, call.causal, call.window)
        assert np.array_equal(seen, want.astype(int)), f"rank {rank} against rank {source}'s slice"


def test_the_bench_cli_hands_context_parallel_to_its_own_runner(monkeypatch):
    # without torchrun's environment the mode says how to launch it, instead of running on one process
    from flashlab.bench.cli import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        main(["--mode", "context-parallel", "--seq-len", "1k"])
