"""Whole loops timed the way a user runs them, each beside the loop it should cost no more than.

    python -m flashlab.bench --mode loops                      # on a GPU: the three loops below
    python -m flashlab.bench --mode loops --device cpu --quick # a few steps of tiny loops in Triton's interpreter
    python -m flashlab.bench --mode loops --dry-run            # list the loops, run nothing

The other modes time one shape called again and again. A real loop rarely repeats a shape:

- **growing decode** -- a decode step against a contiguous cache ``k_buf (B, Hk, Nmax, D)`` that grows by one
  token a step: step t calls ``flash_attention(q, k_buf[:, :, :n], v_buf[:, :, :n])`` with ``n = n0 + t``, a new
  length every call. Beside it: the same loop at one fixed n (the middle of the lengths the growing loop meets),
  and PyTorch's SDPA FLASH backend on the growing loop (GQA through ``enable_gqa``);
- **chunked prefill** -- a chunk of Nq new queries against Nk keys, causal, with a new ``(Nq, Nk)`` every call
  (Nq from 300 to 1000 in steps of 7, Nk from 4000 to 5300 in steps of 13). Beside it: the loop repeating one
  shape from the middle of that range, and SDPA FLASH on the changing loop (its causal mask aligned bottom-right,
  as flashlab's, through ``torch.nn.attention.bias.causal_lower_right``);
- **paged decode** -- ``flash_attention_with_kvcache`` with its default arguments (it reads the lengths and the
  block table on the host to check them) on a pool of shuffled blocks, beside ``flash_attention`` decode on the
  same keys in a contiguous ``(B, Hk, N, D)`` cache, and the paged call with ``check_values=False`` for reference.

A loop's time is the wall clock over the whole loop with one synchronise at the end, which is what a user sees
(host and device together); per call = total / steps. Each loop first runs one pass the bars do not use (its
"first pass": compiles and autotuning included, reported separately), then ``--passes`` timed passes, the
variants' passes taken in rounds whose order turns; the median pass is reported. A last pass synchronises after
every call, for a per-step picture (``step_us`` against ``step_nk`` in the JSON). A loop with changing shapes
meets new shapes in every pass: its call counter runs on across the passes, so no timed call repeats a
shape its own loop met before. Before any pass is timed, the first pass's first and last outputs are
compared with the float64 reference (``flashlab.reference.torch_float64``); a variant that fails is reported as
``wrong`` and not timed.

Each comparison is a ratio of per-call times and is held to a bar, printed with pass or fail:

    growing / fixed                      <= 1.5   a new length per step costs at most half a step more
    changing / repeated                  <= 1.5   likewise for a new (Nq, Nk) per call
    changing / SDPA FLASH changing       <= 1.0   and no slower than FlashAttention-2 on the same loop
    contiguous / paged default           >= 0.9   the paged cache, default arguments, at 90 % of contiguous speed

Results: ``PREFIX.json`` (meta, rows with the per-step lists, comparisons), ``PREFIX.csv`` (rows, stamp columns in
each) and ``PREFIX.txt`` (the printed table); by default ``data/results/<gpu>-loops-<date>`` on a GPU and
``test-artifacts/bench/cpu-loops-<date>`` on the CPU.
"""

from __future__ import annotations

import argparse
import operator
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from flashlab.bench.args import output_prefix, whole_number
from flashlab.bench.grid import DTYPES, STAMP_COLUMNS
from flashlab.bench.results import (
    default_folder,
    folder_problem,
    output_problem,
    ratio_text,
    recording_prefix,
    save_tables,
)
from flashlab.bench.stamp import environment_stamp
from flashlab.core.numerics import relative_error, tolerance
from flashlab.host import flash_attention, flash_attention_with_kvcache
from flashlab.kernels.decode.kvcache import paged_kv_cache
from flashlab.reference.torch_float64 import attention_float64

FAMILIES = ("growing", "chunked", "paged")
# comparison -> (operator, bar): ratio = per-call time of the first variant over the second's
BARS = {
    "growing / fixed": ("<=", 1.5),
    "changing / repeated": ("<=", 1.5),
    "changing / SDPA FLASH": ("<=", 1.0),
    "contiguous / paged default": (">=", 0.9),
}
OPERATORS = {"<=": operator.le, ">=": operator.ge}
CHECK_ROWS = 64  # query rows of a prefill call checked against float64 (spread, first and last included)

ROW_COLUMNS = (
    "family", "case", "variant", "status", "reason", "dtype", "batch", "q_heads", "kv_heads", "head_dim", "causal",
    "block_size", "steps", "passes", "nq_first", "nq_last", "nk_first", "nk_last", "rel_err", "tol",
    "first_pass_ms", "loop_ms", "per_call_us", "pass_spread",
) + STAMP_COLUMNS  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# What a loop is


@dataclass
class Variant:
    """One loop: ``step(g)`` makes call number ``g`` (a global counter that runs on across passes) and returns its
    output; ``inputs(g)`` gives that call's ``(q, k, v, causal)`` as ``(B, H, N, D)`` tensors for the float64
    check; ``lengths(g)`` its ``(Nq, Nk)``."""

    name: str
    step: Callable[[int], torch.Tensor]
    inputs: Callable[[int], tuple]
    lengths: Callable[[int], tuple[int, int]]


@dataclass
class Case:
    """A family's loops on one set of parameters, and the comparisons between them: (label, first, second)."""

    family: str
    label: str
    params: dict
    build: Callable[[], list[Variant]]  # allocates the tensors (shared by the variants) and returns the loops
    comparisons: list[tuple[str, str, str]]
    lengths: dict = field(default_factory=dict)  # variant -> lengths(g), known before anything is allocated


def _randn(shape, dtype, device, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)


def _sdpa_flash(q, k, v, mask=None):
    """SDPA pinned to its FLASH backend; K/V heads shared by query heads through ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def growing_decode_case(batch, n0, q_heads, kv_heads, head_dim, dtype, device, calls, seed) -> Case:
    """Decode against a contiguous cache that grows one token per call: call g reads ``n0 + g`` keys. ``calls``
    is every call the passes make together, so the buffer holds ``n0 + calls`` keys; the fixed loop reads the
    middle length every call."""
    n_max, n_fixed = n0 + calls, n0 + calls // 2
    lengths = {"flashlab growing": lambda g: (1, n0 + g), "flashlab fixed": lambda g: (1, n_fixed),
               "sdpa_flash growing": lambda g: (1, n0 + g)}  # fmt: skip

    def build():
        gen = torch.Generator().manual_seed(seed)
        q = _randn((batch, q_heads, 1, head_dim), DTYPES[dtype], device, gen)  # (B, Hq, 1, D): the new token
        k_buf = _randn((batch, kv_heads, n_max, head_dim), DTYPES[dtype], device, gen)  # (B, Hk, Nmax, D)
        v_buf = _randn((batch, kv_heads, n_max, head_dim), DTYPES[dtype], device, gen)  # (B, Hk, Nmax, D)

        def cache(n):  # the first n keys: views of the buffers, (B, Hk, n, D)
            return k_buf[:, :, :n], v_buf[:, :, :n]

        def loop(name, call):
            size = lengths[name]
            return Variant(name, lambda g: call(q, *cache(size(g)[1])), lambda g: (q, *cache(size(g)[1]), False),
                           size)  # fmt: skip

        return [loop("flashlab growing", flash_attention), loop("flashlab fixed", flash_attention),
                loop("sdpa_flash growing", _sdpa_flash)]  # fmt: skip

    params = dict(dtype=dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, causal=False)
    label = f"B={batch} n0={_k(n0)}"
    comparisons = [("growing / fixed", "flashlab growing", "flashlab fixed"),
                   ("growing / SDPA FLASH", "flashlab growing", "sdpa_flash growing")]  # fmt: skip
    return Case("growing", label, params, build, comparisons, lengths)


def chunk_lengths(g: int, nq: tuple[int, int, int], nk: tuple[int, int, int]) -> tuple[int, int]:
    """Call ``g``'s ``(Nq, Nk)`` for ranges ``(start, stop, step)``: Nq walks its range; Nk walks its own, one
    place further on every time Nq starts again, so consecutive calls and consecutive passes never repeat a pair
    (``count**2`` distinct pairs, for ``count`` values in the shorter range)."""
    count = min(len(range(*nq)), len(range(*nk)))
    i, lap = g % count, g // count
    return nq[0] + nq[2] * i, nk[0] + nk[2] * ((i + lap) % count)


def chunked_prefill_case(heads, head_dim, dtype, device, nq, nk, seed) -> Case:
    """Causal chunks of prefill with a new ``(Nq, Nk)`` every call (``chunk_lengths``); the repeated loop calls
    the middle shape of the range every time."""
    count = min(len(range(*nq)), len(range(*nk)))
    middle = (nq[0] + nq[2] * (count // 2), nk[0] + nk[2] * (count // 2))
    lengths = {"flashlab changing": lambda g: chunk_lengths(g, nq, nk), "flashlab repeated": lambda g: middle,
               "sdpa_flash changing": lambda g: chunk_lengths(g, nq, nk)}  # fmt: skip
    nq_max, nk_max = nq[0] + nq[2] * (count - 1), nk[0] + nk[2] * (count - 1)

    def build():
        from torch.nn.attention.bias import causal_lower_right

        gen = torch.Generator().manual_seed(seed)
        q_buf = _randn((1, heads, nq_max, head_dim), DTYPES[dtype], device, gen)  # (1, H, Nq_max, D)
        k_buf = _randn((1, heads, nk_max, head_dim), DTYPES[dtype], device, gen)  # (1, H, Nk_max, D)
        v_buf = _randn((1, heads, nk_max, head_dim), DTYPES[dtype], device, gen)

        def inputs(size):  # this call's chunk of queries and the keys so far: (1, H, Nq, D), (1, H, Nk, D)
            return q_buf[:, :, : size[0]], k_buf[:, :, : size[1]], v_buf[:, :, : size[1]]

        def flashlab_loop(name):
            size = lengths[name]
            return Variant(name, lambda g: flash_attention(*inputs(size(g)), causal=True),
                           lambda g: (*inputs(size(g)), True), size)  # fmt: skip

        def sdpa_step(g):
            q, k, v = inputs(lengths["sdpa_flash changing"](g))
            return _sdpa_flash(q, k, v, causal_lower_right(q.shape[2], k.shape[2]))

        sdpa = Variant("sdpa_flash changing", sdpa_step, lambda g: (*inputs(lengths["sdpa_flash changing"](g)),
                       True), lengths["sdpa_flash changing"])  # fmt: skip
        return [flashlab_loop("flashlab changing"), flashlab_loop("flashlab repeated"), sdpa]

    params = dict(dtype=dtype, batch=1, q_heads=heads, kv_heads=heads, head_dim=head_dim, causal=True)
    label = f"Nq {nq[0]}-{nq_max}, Nk {nk[0]}-{nk_max}"
    comparisons = [("changing / repeated", "flashlab changing", "flashlab repeated"),
                   ("changing / SDPA FLASH", "flashlab changing", "sdpa_flash changing")]  # fmt: skip
    return Case("chunked", label, params, build, comparisons, lengths)


def paged_decode_case(batch, n, q_heads, kv_heads, head_dim, block_size, dtype, device, seed) -> Case:
    """Decode against N keys per sequence: contiguous ``flash_attention`` against the same keys in a shuffled pool
    of ``block_size``-token blocks through ``flash_attention_with_kvcache`` (default arguments, and with
    ``check_values=False``)."""
    names = ("flashlab contiguous", f"paged{block_size} default", f"paged{block_size} unchecked")
    lengths = dict.fromkeys(names, lambda g: (1, n))

    def build():
        gen = torch.Generator().manual_seed(seed)
        q = _randn((batch, q_heads, 1, head_dim), DTYPES[dtype], device, gen)  # (B, Hq, 1, D)
        k = _randn((batch, kv_heads, n, head_dim), DTYPES[dtype], device, gen)  # (B, Hk, N, D)
        v = _randn((batch, kv_heads, n, head_dim), DTYPES[dtype], device, gen)
        k_cache, v_cache, table, seqlens = paged_kv_cache(k, v, block_size, seed=seed)  # (blocks, bs, Hk, D)
        calls = (
            lambda g: flash_attention(q, k, v),
            lambda g: flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, table),
            lambda g: flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, table, check_values=False),
        )
        return [Variant(name, call, lambda g: (q, k, v, False), lengths[name])
                for name, call in zip(names, calls, strict=True)]  # fmt: skip

    params = dict(dtype=dtype, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, causal=False,
                  block_size=block_size)  # fmt: skip
    comparisons = [("contiguous / paged default", names[0], names[1]),
                   ("contiguous / paged unchecked", names[0], names[2])]  # fmt: skip
    return Case("paged", f"B={batch} N={_k(n)} blocks of {block_size}", params, build, comparisons, lengths)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


@dataclass(frozen=True)
class LoopPlan:
    """What a run measures: the loops' sizes, the steps per pass, the timed passes."""

    steps: int
    passes: int
    growing: tuple = ()  # (batch, n0) pairs
    chunked: tuple = ()  # ((nq start, stop, step), (nk start, stop, step)) pairs
    paged: tuple = ()  # (batch, n, block_size) triples
    q_heads: int = 32
    kv_heads: int = 8
    prefill_heads: int = 16
    head_dim: int = 128
    dtype: str = "bf16"

    @property
    def calls(self) -> int:
        """Calls each loop makes: the first pass, the timed passes and the step-by-step pass."""
        return self.steps * (self.passes + 2)


GPU_PLAN = LoopPlan(
    steps=200,
    passes=3,
    growing=((1, 4096), (8, 4096), (1, 32768), (8, 32768)),
    chunked=(((300, 1001, 7), (4000, 5301, 13)),),
    paged=((8, 32768, 16), (8, 32768, 256), (8, 65536, 16), (8, 65536, 256)),
)
# On the CPU every call runs in Triton's interpreter: a few steps of tiny, awkward sizes test the code path.
CPU_PLAN = LoopPlan(
    steps=3,
    passes=1,
    growing=((2, 37),),
    chunked=(((5, 12, 3), (40, 55, 5)),),
    paged=((2, 53, 16),),
    q_heads=4,
    kv_heads=2,
    prefill_heads=2,
    head_dim=24,
    dtype="fp32",
)


def cases(plan: LoopPlan, device: str, families: Sequence[str] = FAMILIES, seed: int = 0) -> list[Case]:
    out = []
    if "growing" in families:
        out += [growing_decode_case(b, n0, plan.q_heads, plan.kv_heads, plan.head_dim, plan.dtype, device,
                                    plan.calls, seed) for b, n0 in plan.growing]  # fmt: skip
    if "chunked" in families:
        out += [chunked_prefill_case(plan.prefill_heads, plan.head_dim, plan.dtype, device, nq, nk, seed)
                for nq, nk in plan.chunked]  # fmt: skip
    if "paged" in families:
        out += [paged_decode_case(b, n, plan.q_heads, plan.kv_heads, plan.head_dim, bs, plan.dtype, device, seed)
                for b, n, bs in plan.paged]  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------
# Timing a loop


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def loop_seconds(step: Callable[[int], torch.Tensor], calls: range, device: str, keep=()) -> tuple[float, dict]:
    """Wall-clock seconds of ``step(g)`` for every g in ``calls``, one synchronise at the end (the GPU idle at the
    start); the outputs of the calls numbered in ``keep``, by number."""
    kept = {}
    _sync(device)
    start = time.perf_counter()
    for g in calls:
        o = step(g)
        if g in keep:
            kept[g] = o
    _sync(device)
    return time.perf_counter() - start, kept


def step_seconds(step: Callable[[int], torch.Tensor], calls: range, device: str) -> list[float]:
    """Wall-clock seconds of each call on its own, synchronised after each: one call's latency, host and device."""
    out = []
    _sync(device)
    for g in calls:
        start = time.perf_counter()
        step(g)
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def check_outputs(variant: Variant, kept: dict, dtype: str) -> tuple[float, float]:
    """The largest relative error of the kept outputs against the float64 reference, and the dtype's tolerance."""
    errors = []
    for g, o in kept.items():
        q, k, v, causal = variant.inputs(g)
        rows = torch.unique(torch.linspace(0, q.shape[2] - 1, min(q.shape[2], CHECK_ROWS)).round().long())
        ref, _ = attention_float64(q, k, v, causal=causal, rows=rows.to(q.device))
        errors.append(relative_error(o[:, :, rows.to(o.device)].double().cpu(), ref.cpu()))
    worst = float("nan") if any(e != e for e in errors) else max(errors)  # NaN stays NaN: it fails every check
    return worst, tolerance(DTYPES[dtype])


def run_case(case: Case, plan: LoopPlan, device: str, bar=None) -> list[dict]:
    """Every variant of ``case``: first pass, check, timed passes in turning rounds, the step-by-step pass."""
    steps, passes = plan.steps, plan.passes
    variants = case.build()
    rows = {}
    for v in variants:
        first, last = 0, steps - 1
        row = dict(family=case.family, case=case.label, variant=v.name, steps=steps, passes=passes, **case.params,
                   nq_first=v.lengths(steps)[0], nq_last=v.lengths(steps * (passes + 1) - 1)[0],
                   nk_first=v.lengths(steps)[1], nk_last=v.lengths(steps * (passes + 1) - 1)[1],
                   status="ok", reason=None, rel_err=None, tol=None, first_pass_ms=None, loop_ms=None,
                   per_call_us=None, pass_spread=None, pass_ms=[], step_nk=[], step_us=[])  # fmt: skip
        try:
            seconds, kept = loop_seconds(v.step, range(first, steps), device, keep=(first, last))
            row["first_pass_ms"] = seconds * 1e3
            row["rel_err"], row["tol"] = check_outputs(v, kept, case.params["dtype"])
            if not row["rel_err"] <= row["tol"]:
                row.update(status="wrong", reason=f"relative error {row['rel_err']:.3g} > {row['tol']:g}")
        except Exception as e:  # noqa: BLE001 -- recorded in the row; the other variants still run
            row.update(status="error", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        rows[v.name] = row
        if bar is not None:
            bar.update(1)
    ok = [v for v in variants if rows[v.name]["status"] == "ok"]
    for p in range(passes):  # round p starts at variant p: none is always timed first
        calls = range(steps * (p + 1), steps * (p + 2))
        for i in range(len(ok)):
            v = ok[(p + i) % len(ok)]
            rows[v.name]["pass_ms"].append(loop_seconds(v.step, calls, device)[0] * 1e3)
        if bar is not None:
            bar.update(len(ok))
    for v in ok:
        row = rows[v.name]
        calls = range(steps * (passes + 1), steps * (passes + 2))
        row["step_us"] = [s * 1e6 for s in step_seconds(v.step, calls, device)]
        row["step_nk"] = [v.lengths(g)[1] for g in calls]
        row["loop_ms"] = statistics.median(row["pass_ms"])
        row["per_call_us"] = row["loop_ms"] * 1e3 / steps
        row["pass_spread"] = (max(row["pass_ms"]) - min(row["pass_ms"])) / row["loop_ms"]
    if bar is not None:
        bar.update(len(ok))
    del variants
    if device == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def compare(case: Case, rows: list[dict]) -> list[dict]:
    """The case's comparisons: ratio of per-call times, the bar it is held to (None: shown, not held) and whether
    it passes (None where either loop was not timed)."""
    by_name = {r["variant"]: r for r in rows}
    out = []
    for what, first, second in case.comparisons:
        a, b = by_name[first]["per_call_us"], by_name[second]["per_call_us"]
        ratio = a / b if a is not None and b is not None else None
        op, bar = BARS.get(what, (None, None))
        passed = None if ratio is None or bar is None else bool(OPERATORS[op](ratio, bar))
        out.append(dict(family=case.family, case=case.label, comparison=what, first=first, second=second,
                        ratio=ratio, op=op, bar=bar, passed=passed))  # fmt: skip
    return out


def run_loops(plan: LoopPlan, device: str, families=FAMILIES, seed: int = 0, progress: bool = True,
              command: str | None = None) -> dict:  # fmt: skip
    """Run every case of ``plan`` on ``device``; returns ``{"meta", "rows", "comparisons"}``."""
    from tqdm import tqdm

    todo = cases(plan, device, families, seed)
    meta = environment_stamp(device)
    meta.update(mode="loops", command=command, config=dict(mode="loops", steps=plan.steps, passes=plan.passes,
                families=list(families), seed=seed, plan=_plan_dict(plan)))  # fmt: skip
    meta["timing"] = ("wall clock (time.perf_counter) over a whole loop of calls, one synchronise at its end; "
                      "per call = median pass / steps; first pass (compiles included) reported apart")  # fmt: skip
    meta["bars"] = {k: f"{op} {bar}" for k, (op, bar) in BARS.items()}
    total = sum(len(c.lengths) * (2 + plan.passes) for c in todo)
    bar = tqdm(total=total, desc="flashlab.bench loops", unit="pass", disable=not progress)
    rows, comparisons = [], []
    start = time.perf_counter()
    for case in todo:
        bar.set_postfix_str(f"{case.family} {case.label}")
        case_rows = run_case(case, plan, device, bar)
        for r in case_rows:
            r.update({col: meta[col] for col in STAMP_COLUMNS})
        rows += case_rows
        comparisons += compare(case, case_rows)
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return dict(meta=meta, rows=rows, comparisons=comparisons)


def _plan_dict(plan: LoopPlan) -> dict:
    return {k: getattr(plan, k) for k in plan.__dataclass_fields__}


# ----------------------------------------------------------------------------------------------------------------
# The table


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary(results: dict) -> str:
    """Per case: each loop's first pass and per-call time, then its comparisons with their bars."""
    m = results["meta"]
    out = [f"{m['device_name']}, torch {m['torch']}, triton {m['triton']}, {m['date']} -- whole loops of "
           f"{m['config']['steps']} calls, wall clock, one synchronise per loop; median of "
           f"{m['config']['passes']} pass(es)"]  # fmt: skip
    head = f"{'loop':<28} {'Nk first-last':>15} {'first pass ms':>14} {'per call us':>12} {'spread':>7}  status"
    for case in dict.fromkeys((r["family"], r["case"]) for r in results["rows"]):
        out += ["", f"{case[0]} decode, {case[1]}" if case[0] != "chunked" else f"chunked prefill, {case[1]}", head]
        for r in (r for r in results["rows"] if (r["family"], r["case"]) == case):
            nk = f"{r['nk_first']}-{r['nk_last']}" if r["nk_first"] != r["nk_last"] else str(r["nk_first"])
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            out.append(f"{r['variant']:<28} {nk:>15} {_fmt(r['first_pass_ms'], '.1f'):>14} "
                       f"{_fmt(r['per_call_us'], '.1f'):>12} {_fmt(r['pass_spread'], '.1%'):>7}  {status}")  # fmt: skip
        for c in (c for c in results["comparisons"] if (c["family"], c["case"]) == case):
            ratio = "-" if c["ratio"] is None else ratio_text(c["ratio"])
            held = "shown, no bar" if c["bar"] is None else f"bar {c['op']} {c['bar']:g}: " + (
                "not timed" if c["passed"] is None else "PASS" if c["passed"] else "FAIL")  # fmt: skip
            out.append(f"  {c['comparison']:<32} {ratio:>8}  {held}")
    held = [c for c in results["comparisons"] if c["bar"] is not None]
    passed = sum(1 for c in held if c["passed"])
    out += ["", f"bars: {passed} of {len(held)} pass"]
    return "\n".join(out)


def dry_run_lines(plan: LoopPlan, families=FAMILIES) -> list[str]:
    """What a run would measure, one line per loop, without allocating anything."""
    lines = [f"{plan.steps} calls per pass, first pass + {plan.passes} timed + 1 step-by-step pass per loop; "
             f"{plan.dtype}, D = {plan.head_dim}"]  # fmt: skip
    for case in cases(plan, "cpu", families):
        for name, size in case.lengths.items():
            first, last = size(plan.steps), size(plan.steps * (plan.passes + 1) - 1)
            lines.append(f"{case.family:<8} {case.label:<28} {name:<26} (Nq, Nk) {first} ... {last}")
        for what, a, b in case.comparisons:
            op, bar = BARS.get(what, (None, None))
            lines.append(f"{'':<8} {'':<28} {what}: {a} / {b}" + (f" {op} {bar:g}" if bar else " (shown)"))
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.bench --mode loops", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--mode", default="loops", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=whole_number(1), help="calls per pass of each loop (default 200 on a GPU, 3 CPU)")
    p.add_argument("--passes", type=whole_number(1), help="timed passes per loop; median reported (default 3, CPU 1)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"loops to run, comma-separated, from "
                   f"{','.join(FAMILIES)}")  # fmt: skip
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="tiny loops, a few steps (the CPU's sizes, on any device)")
    p.add_argument("--dry-run", action="store_true", help="list the loops and their lengths; run nothing")
    p.add_argument("--seed", type=whole_number(0), default=0, help="random seed for q, k, v")
    p.add_argument(
        "--out",
        type=output_prefix,
        help="write PREFIX.json, PREFIX.csv and PREFIX.txt (default: "
        "data/results/<gpu>-loops-<date> on a GPU, test-artifacts/bench/cpu-loops-<date> on the CPU)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the files of an --out that exist")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def default_prefix(meta: dict) -> Path:
    """``data/results/<gpu>-loops-<date>`` on a GPU, ``test-artifacts/bench/cpu-loops-<date>`` on the CPU."""
    return recording_prefix(meta, "loops")


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        parser.error(f"--families: unknown {unknown or 'none given'}; choose from {','.join(FAMILIES)}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda: torch sees no CUDA GPU here")
    plan = CPU_PLAN if (args.quick or device == "cpu") else GPU_PLAN
    if plan is CPU_PLAN and device == "cuda":  # the tiny loops on a GPU: SDPA's FLASH kernel takes 16-bit inputs
        plan = LoopPlan(**{**_plan_dict(plan), "dtype": "bf16", "head_dim": 32})
    plan = LoopPlan(**{**_plan_dict(plan), "steps": args.steps or plan.steps, "passes": args.passes or plan.passes})
    if args.dry_run:
        print("\n".join(dry_run_lines(plan, families)))
        return None
    problem = output_problem(args.out, args.overwrite) if args.out else folder_problem(default_folder(
        device == "cuda"))  # fmt: skip
    if problem:
        parser.error(f"--out {args.out}: {problem}" if args.out else f"{problem} (or pass --out)")
    mode = [] if "--mode" in argv else ["--mode", "loops"]
    command = shlex.join(["python", "-m", "flashlab.bench", *mode, *argv])
    results = run_loops(plan, device, families, args.seed, progress=not args.no_progress, command=command)
    table = summary(results)
    prefix = args.out or default_prefix(results["meta"])
    json_path, csv_path = save_tables(prefix, results, results["rows"], ROW_COLUMNS, overwrite=args.overwrite)
    txt_path = json_path.with_suffix(".txt")
    txt_path.write_text(table + "\n")
    print(table)
    print(f"wrote {json_path}, {csv_path} and {txt_path}")
    return results


if __name__ == "__main__":
    main()
