"""A packed batch of sequences of different lengths, timed the way it is used, beside the ways around packing.

    python -m flashlab.bench --mode varlen                       # on a GPU: three length mixes, 32K tokens a batch
    python -m flashlab.bench --mode varlen --mixes log-normal --tokens 16384,65536 --head-dim 64,128 --kv-heads 4
                                                                 # the bar's long-tailed batches, GQA 4:1
    python -m flashlab.bench --mode varlen --mixed-batch --kv-heads 4   # a serving step: prefill chunks + decode rows
    python -m flashlab.bench --mode varlen --device cpu --quick  # tiny mixes through Triton's interpreter
    python -m flashlab.bench --mode varlen --dry-run             # list the mixes and what runs, run nothing

A training batch of documents, or a serving batch of prompts, holds sequences of many lengths. There are four
ways to run attention over it, and this mode times each, forward and forward + backward, masked causally and not:

- **flashlab varlen** -- ``flashlab.flash_attention_varlen`` on the sequences packed end to end, ``(total, H,
  D)``, one launch for the batch; each program finds its sequence in ``cu_seqlens``;
- **flashlab padded** -- every sequence padded with zeros to the longest, one ``flash_attention`` call on the
  ``(B, H, Nmax, D)`` batch: the padding's tiles are computed and thrown away;
- **flashlab loop** -- one ``flash_attention`` call per sequence, ``(1, H, n, D)`` each: no wasted tile, but one
  launch (and its host work) per sequence, and short sequences too small to fill the GPU;
- **torch varlen_attn** -- PyTorch's ``torch.nn.attention.varlen.varlen_attn`` (PyTorch 2.10 and later, CUDA) on
  the same packed tensors; recorded as ``absent`` where the installed PyTorch has no such module;
- **sdpa_flash padded** -- PyTorch's SDPA pinned to its FLASH backend (FlashAttention-2) on the padded batch.

Making the padded runs fair. flashlab's dense API, like SDPA's FLASH backend, takes no key-padding mask. The
sequences sit at the start of their padded rows (right padding), so under the causal mask a real query row i sees
only keys j <= i, all of them real: the padded causal runs are exact for every real row (and, with dO zero on the
padded rows, so are their gradients). Without the mask a real row also sees the padded keys, whose scores are 0:
the output is not the sequence's attention. Those runs are still timed, as the least that padding costs (a
kernel that masks the padded keys computes the same tiles and more), and they are marked ``exact = False``: each
variant's output is compared with the float64 reference of the sequence itself (``seq_err``) and, for the padded
runs, with the float64 reference of the padded row it computed (``rel_err``, the check that gates timing). The
padding copies are made before timing, so the padded runs are timed on inputs already in their layout (the
cost of padding is its wasted tiles only); likewise the loop's per-sequence tensors.

Every rate counts useful FLOPs only: per sequence ``4 n^2 D`` per head, halved under the causal mask
(``flashlab.calculators.roofline.attention_flops``), summed over the real sequences; forward + backward counts
3.5 times the forward (the backward's five matrix products against the forward's two). The padded layouts'
own count, every sequence at the longest length, is recorded beside it (``layout_flops``). ``varlen_speedup`` is
a variant's time over flashlab varlen's on the same mix, mask and direction (above 1: varlen is faster).

Before anything is timed, every output is checked against the float64 reference
(``flashlab.reference.torch_float64``) on every sequence, on a sample of its query rows (first and last
included); forward + backward also checks dq, dk, dv of the first K/V head on two sequences (the shortest, and
the longest of at most ``GRAD_CHECK_MAX_LEN`` rows). A variant that fails is ``wrong`` and not timed. On a GPU
the variants of a mix, mask and direction are timed together with ``do_bench`` in rounds whose order turns (the
median round reported); on the CPU, one call after the checked one (the interpreter's times say nothing about a
GPU).

``--mixed-batch`` times a serving engine's step instead (``MixedBatch``): 8 sequences' prefill chunks of 256-2048
tokens and 56 sequences' single decode rows against one paged cache (1K-32K tokens a sequence, 16-token blocks,
causal), as one ``flash_attention_with_kvcache`` launch with ``cu_seqlens_q`` against one call per chunk and one for
the decode rows; both checked against float64 per sequence first.

The summary ends with the bar, read on the long-tailed mixes (``BAR_MIXES``): flashlab varlen against
``varlen_attn``, forward and forward + backward (geo-mean at least 1.0, no cell below 0.9), and against the padded
batch (at least 1.5 in every cell).

Results: ``PREFIX.json`` (meta with the mixes' lengths, rows), ``PREFIX.csv`` (rows, stamp columns in each) and
``PREFIX.txt`` (the printed table); by default ``data/results/<gpu>-varlen-<date>`` on a GPU and
``test-artifacts/bench/cpu-varlen-<date>`` on the CPU.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flashlab.bench.args import finite_number, name_list, output_prefix, whole_number
from flashlab.bench.grid import CAUSAL_CHOICES, DTYPES, STAMP_COLUMNS
from flashlab.bench.measure import check_rows, one_line, time_rounds
from flashlab.bench.results import (
    default_folder,
    folder_problem,
    output_problem,
    ratio_text,
    recording_prefix,
    save_tables,
)
from flashlab.bench.stamp import environment_stamp
from flashlab.calculators import roofline
from flashlab.core.numerics import grad_tolerance, relative_error, tolerance
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads

MIXES = ("uniform", "long-tail", "documents", "log-normal")
DEFAULT_MIXES = MIXES[:3]
VARIANTS = ("flashlab_varlen", "flashlab_padded", "flashlab_loop", "torch_varlen_attn", "sdpa_flash_padded")
DIRECTIONS = {"both": ("forward", "train"), "forward": ("forward",), "train": ("train",)}
TRAIN_FLOPS_FACTOR = 3.5  # forward + backward FLOPs / forward FLOPs: two matrix products, then five
GRAD_CHECK_MAX_LEN = 4096  # the float64 gradient check materialises a sequence's n x n scores per head

ROW_COLUMNS = (
    "mix", "causal", "direction", "variant", "status", "reason", "exact", "dtype", "heads", "kv_heads", "head_dim",
    "tokens",
    "sequences", "min_len", "max_len", "layout_tokens", "useful_flops", "layout_flops", "rel_err", "seq_err",
    "grad_err", "tol", "time_ms", "time_spread", "tflops", "varlen_speedup",
) + STAMP_COLUMNS  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The length mixes


@dataclass(frozen=True)
class VarlenPlan:
    """What a run measures: ``tokens`` per batch in each mix, its query heads, K/V heads (``kv_heads``, None: as
    many as query heads; fewer: grouped-query attention), head dim and dtype, and the mixes' ranges.

    uniform: lengths uniform in ``uniform = (lo, hi)``; long-tail: ``long_tail = (long, lo, hi)``, one sequence of
    ``long`` tokens and the rest uniform in ``(lo, hi)``; documents: ``documents = (row, lo, hi)``, rows of
    ``row`` tokens each filled with documents of log-uniform length in ``(lo, hi)``, the last one cut at the row's
    end (a pre-training batch, attention kept inside each document); log-normal: ``lognormal = (count, sigma)``,
    ``count`` documents whose lengths are drawn from a log-normal of that sigma and scaled to ``tokens`` in all."""

    tokens: int = 32768
    heads: int = 16
    head_dim: int = 128
    kv_heads: int | None = None
    dtype: str = "bf16"
    uniform: tuple[int, int] = (512, 4096)
    long_tail: tuple[int, int, int] = (16384, 128, 1024)
    documents: tuple[int, int, int] = (16384, 64, 8192)
    lognormal: tuple[int, float] = (32, 1.0)
    warmup: float = 25.0  # ms, do_bench's warmup
    rep: float = 100.0  # ms, do_bench's rep, shared by the rounds
    rounds: int = 3
    check_rows: int = 64  # query rows checked per sequence


GPU_PLAN = VarlenPlan()
# On the CPU every call runs in Triton's interpreter: a few sequences of tiny, awkward lengths test the code path.
CPU_PLAN = VarlenPlan(tokens=48, heads=2, head_dim=16, dtype="fp32", uniform=(7, 19), long_tail=(29, 3, 8),
                      documents=(24, 2, 17), lognormal=(5, 1.0), warmup=0.0, rep=0.0, rounds=1,
                      check_rows=8)  # fmt: skip


def uniform_lengths(lo: int, hi: int, total: int, rng: random.Random) -> list[int]:
    """Lengths in ``[lo, hi]`` summing to ``total`` exactly: each drawn uniformly, leaving at least ``lo`` for
    the rest, the last one what is left (needs ``hi >= 2 lo`` and ``total >= lo``)."""
    out, left = [], total
    while left > hi:
        out.append(rng.randint(lo, min(hi, left - lo)))
        left -= out[-1]
    return out + [left]


def lognormal_lengths(count: int, sigma: float, total: int, rng: random.Random) -> list[int]:
    """``count`` lengths of at least 1 summing to ``total`` exactly, in proportion to draws from a log-normal of
    ``sigma`` (the remainder of the rounding goes to the largest fractions; needs ``total >= count``)."""
    draws = [math.exp(rng.gauss(0.0, sigma)) for _ in range(count)]
    spare = total - count  # every length is 1 plus its share of the rest
    shares = [spare * x / sum(draws) for x in draws]
    out = [1 + int(x) for x in shares]
    for i in sorted(range(count), key=lambda i: int(shares[i]) - shares[i])[: total - sum(out)]:
        out[i] += 1
    return out


def mix_lengths(mix: str, plan: VarlenPlan, seed: int = 0) -> list[int]:
    """The sequence lengths of ``mix`` (one of ``MIXES``) under ``plan``, summing to ``plan.tokens``; the same
    for the same seed."""
    rng = random.Random(f"{mix}-{seed}")
    if mix == "uniform":
        return uniform_lengths(*plan.uniform, plan.tokens, rng)
    if mix == "long-tail":
        long, lo, hi = plan.long_tail
        out = uniform_lengths(lo, hi, plan.tokens - long, rng)
        out.insert(rng.randint(0, len(out)), long)  # the long sequence anywhere in the batch
        return out
    if mix == "log-normal":
        return lognormal_lengths(*plan.lognormal, plan.tokens, rng)
    if mix == "documents":
        row, lo, hi = plan.documents
        out = []
        for _ in range(plan.tokens // row):
            left = row
            while left:
                n = min(left, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
                out.append(n)
                left -= n
        return out
    raise ValueError(f"unknown mix {mix!r}; choose from {', '.join(MIXES)}")


def plan_problem(plan: VarlenPlan, mixes=MIXES) -> str | None:
    """Why ``plan``'s ``mixes`` cannot be drawn, or its heads not grouped, or None."""
    lo, hi = plan.uniform
    if "uniform" in mixes and not (1 <= lo and hi >= 2 * lo and plan.tokens >= lo):
        return f"uniform lengths ({lo}, {hi}) need 1 <= lo, hi >= 2 lo and --tokens ({plan.tokens}) >= lo"
    long, lo, hi = plan.long_tail
    if "long-tail" in mixes and not (1 <= lo and hi >= 2 * lo and plan.tokens - long >= lo):
        return f"long-tail ({long}, {lo}, {hi}) needs hi >= 2 lo and --tokens ({plan.tokens}) >= {long} + {lo}"
    row, lo, hi = plan.documents
    if "documents" in mixes and not (1 <= lo <= hi and plan.tokens % row == 0):
        return f"documents rows of {row} must divide --tokens ({plan.tokens}) and 1 <= lo ({lo}) <= hi ({hi})"
    count, sigma = plan.lognormal
    if "log-normal" in mixes and not (1 <= count <= plan.tokens and sigma >= 0):
        return f"log-normal ({count} documents, sigma {sigma}) needs --tokens ({plan.tokens}) >= {count}"
    kv = plan.heads if plan.kv_heads is None else plan.kv_heads
    if not (1 <= kv <= plan.heads and plan.heads % kv == 0):
        return f"--kv-heads ({kv}) must divide --heads ({plan.heads})"
    return None


def useful_flops(lengths: Sequence[int], heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of the real tokens: per sequence and head ``4 n^2 D``, halved under the causal mask."""
    return float(sum(heads * roofline.attention_flops(n, head_dim, causal=causal) for n in lengths if n))


def padded_flops(lengths: Sequence[int], heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of the padded batch: every sequence at the longest length."""
    return useful_flops([max(lengths)] * len(lengths), heads, head_dim, causal)


def mix_summary(lengths: Sequence[int]) -> str:
    n = sorted(lengths)
    return (f"{len(n)} sequences, {n[0]}-{n[-1]} tokens (median {n[len(n) // 2]}), padded to {len(n)} x {n[-1]} "
            f"= {len(n) * n[-1]} tokens")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The variants: each runs on its own layout of the same q, k, v


@dataclass
class Layout:
    """One way to lay the batch out: ``q, k, v, do`` in it (tensors, or lists of tensors for the loop); ``seq(x,
    b)`` sequence b of an output or gradient in it as ``(1, H, n, D)``; ``padded`` where its rows are the padded
    batch's (its float64 check then runs on the padded row)."""

    q: object
    k: object
    v: object
    do: object
    seq: Callable
    padded: bool = False


def _flat(x) -> list:
    return list(x) if isinstance(x, list) else [x]


def layouts(q, k, v, do, lengths: Sequence[int]) -> dict[str, Layout]:
    """The packed ``(T, H, D)`` tensors, the padded ``(B, H, Nmax, D)`` batch (zeros past each sequence's end) and
    the per-sequence list of ``(1, H, n, D)``, made once before anything is timed."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    nmax, b_count = max(lengths), len(lengths)

    def packed_seq(x, b):  # rows of sequence b: (n, H, D) -> (1, H, n, D)
        return x[bounds[b] : bounds[b + 1]].transpose(0, 1).unsqueeze(0)

    def pad(x):  # (T, H, D) -> (B, H, Nmax, D), zeros past each end
        out = x.new_zeros((b_count, x.shape[1], nmax, x.shape[2]))
        for b in range(b_count):
            out[b, :, : lengths[b]] = x[bounds[b] : bounds[b + 1]].transpose(0, 1)
        return out

    def split(x):  # (T, H, D) -> B tensors (1, H, n, D), each contiguous
        return [packed_seq(x, b).contiguous() for b in range(b_count)]

    return {
        "packed": Layout(q, k, v, do, packed_seq),
        "padded": Layout(*(pad(x) for x in (q, k, v, do)), lambda x, b: x[b : b + 1, :, : lengths[b]], padded=True),
        "loop": Layout(*(split(x) for x in (q, k, v, do)), lambda x, b: x[b]),
    }


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # grouped-query heads, without copying K/V
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)


def torch_varlen_attn():
    """PyTorch's ``varlen_attn`` as ``call(q, k, v, cu, max_len, causal)``, or None where this PyTorch has none.
    PyTorch 2.10 takes ``is_causal``; later versions a ``window_size``, ``(-1, 0)`` for the causal mask."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    windowed = "window_size" in inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu, max_len, causal):
        mask = {"window_size": (-1, 0) if causal else (-1, -1)} if windowed else {"is_causal": causal}
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **mask)

    return call


def variant_runs(lengths: Sequence[int], device: str) -> dict[str, tuple[str, Callable] | str]:
    """Per variant: ``(layout name, run(q, k, v, causal))``, or the reason it cannot run here."""
    from flashlab.host import flash_attention, flash_attention_varlen

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)  # (B + 1,) running sums of the lengths
    nmax = max(lengths)
    runs: dict[str, tuple[str, Callable] | str] = {
        "flashlab_varlen": ("packed", lambda q, k, v, c: flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, c)),
        "flashlab_padded": ("padded", lambda q, k, v, c: flash_attention(q, k, v, causal=c)),
        "flashlab_loop": ("loop", lambda q, k, v, c: [flash_attention(*x, causal=c) for x in zip(q, k, v,
                                                                                               strict=True)]),
        "sdpa_flash_padded": ("padded", _sdpa_flash),
    }  # fmt: skip
    call = torch_varlen_attn()
    if call is None:
        runs["torch_varlen_attn"] = f"absent: torch {torch.__version__} has no torch.nn.attention.varlen"
    else:
        runs["torch_varlen_attn"] = ("packed", lambda q, k, v, c: call(q, k, v, cu, nmax, c))
    return runs


# ----------------------------------------------------------------------------------------------------------------
# Checking and timing one mix


def _inputs(lengths, plan: VarlenPlan, device: str, seed: int):
    """q, k, v and the upstream gradient dO, packed: q and dO ``(T, H, D)``, k and v ``(T, Hk, D)``."""
    gen = torch.Generator().manual_seed(seed)
    kv = plan.heads if plan.kv_heads is None else plan.kv_heads
    shapes = [(sum(lengths), h, plan.head_dim) for h in (plan.heads, kv, kv, plan.heads)]
    return [torch.randn(shape, generator=gen).to(device=device, dtype=DTYPES[plan.dtype]) for shape in shapes]


def _leaves(layout: Layout) -> tuple[list, list, list]:
    return tuple([x.detach().requires_grad_() for x in _flat(t)] for t in (layout.q, layout.k, layout.v))


def _unflat(like, xs):
    return list(xs) if isinstance(like, list) else xs[0]


def forward_step(run: Callable, layout: Layout, causal: bool) -> Callable:
    def step():
        with torch.no_grad():
            return run(layout.q, layout.k, layout.v, causal)

    return step


def train_step(run: Callable, layout: Layout, causal: bool) -> Callable:
    """Forward with autograd recording, then dq, dk, dv from dO; returns ``(o, (dq, dk, dv))`` in the layout."""
    qs, ks, vs = _leaves(layout)

    def step():
        with torch.enable_grad():
            o = run(_unflat(layout.q, qs), _unflat(layout.k, ks), _unflat(layout.v, vs), causal)
            grads = torch.autograd.grad(_flat(o), qs + ks + vs, _flat(layout.do))
        n = len(qs)
        return o, tuple(_unflat(layout.q, grads[i * n : (i + 1) * n]) for i in range(3))

    return step


class References:
    """The float64 references of one mix and mask, computed once and shared by the variants: per sequence the
    sampled rows' output, and the gradients of the first K/V head on the checked sequences."""

    def __init__(self, layouts_: dict[str, Layout], lengths, causal: bool, rows_per_seq: int):
        self.layouts, self.lengths, self.causal, self.count = layouts_, lengths, causal, rows_per_seq
        self._out: dict = {}
        self._grads: dict = {}
        short = min(range(len(lengths)), key=lambda b: lengths[b])
        fits = [b for b in range(len(lengths)) if lengths[b] <= GRAD_CHECK_MAX_LEN]
        longest = max(fits, key=lambda b: lengths[b]) if fits else short
        self.grad_seqs = sorted({short, longest})

    def rows(self, b: int) -> torch.Tensor:
        return check_rows(self.lengths[b], self.count)

    def _inputs(self, b: int, padded: bool):
        lay = self.layouts["padded" if padded else "packed"]
        return [lay.seq(x, b) if not padded else x[b : b + 1] for x in (lay.q, lay.k, lay.v, lay.do)]

    def output(self, b: int, padded: bool) -> torch.Tensor:
        """Sequence b's sampled rows in float64, ``(1, H, R, D)``: of the sequence, or of its padded row."""
        padded = padded and not self.causal  # under the causal mask the padded row's real rows are the sequence's
        if (b, padded) not in self._out:
            q, k, v, _ = self._inputs(b, padded)
            self._out[b, padded] = attention_float64(q, k, v, self.causal, rows=self.rows(b).to(q.device))[0]
        return self._out[b, padded]

    def grads(self, b: int, padded: bool) -> tuple:
        """dq, dk, dv of K/V head 0 for sequence b's real rows in float64, each ``(1, 1, n, D)``."""
        padded = padded and not self.causal
        if (b, padded) not in self._grads:
            q, k, v, do = self._inputs(b, padded)
            n = self.lengths[b]
            self._grads[b, padded] = tuple(g[:, :, :n] for g in attention_float64_grads(q, k, v, do, self.causal,
                                                                                        kv_heads=[0]))  # fmt: skip
        return self._grads[b, padded]


def check_variant(out, grads, layout: Layout, refs: References, dtype) -> dict:
    """The largest relative error of the variant's sampled rows (and checked gradients) against the float64
    reference of what it computes (``rel_err``) and of each sequence itself (``seq_err``)."""
    rel, seq = [], []
    for b in range(len(refs.lengths)):
        got = layout.seq(out, b)[:, :, refs.rows(b).to(layout.seq(out, b).device)]
        rel.append(relative_error(got, refs.output(b, layout.padded)))
        seq.append(relative_error(got, refs.output(b, False)) if layout.padded else rel[-1])
    grad_rel = []
    if grads is not None:
        for b in refs.grad_seqs:
            dq, dk, dv = (layout.seq(g, b) for g in grads)
            group = dq.shape[1] // dk.shape[1]  # K/V head 0 and the query heads that read it
            got = [dq[:, :group], dk[:, :1], dv[:, :1]]
            grad_rel += [relative_error(x, r) for x, r in zip(got, refs.grads(b, layout.padded), strict=True)]
    worst = lambda xs: float("nan") if any(x != x for x in xs) else max(xs, default=0.0)  # noqa: E731 -- NaN stays
    return dict(rel_err=worst(rel), seq_err=worst(seq), grad_err=worst(grad_rel) if grads is not None else None,
                tol=tolerance(dtype), grad_tol=grad_tolerance(dtype))  # fmt: skip


def run_group(mix: str, lengths, causal: bool, direction: str, variants, lays, refs, plan: VarlenPlan,
              device: str, meta: dict) -> list[dict]:  # fmt: skip
    """Check, then time, every variant on one mix, mask and direction; one row per variant."""
    dtype = DTYPES[plan.dtype]
    useful = useful_flops(lengths, plan.heads, plan.head_dim, causal)
    factor = TRAIN_FLOPS_FACTOR if direction == "train" else 1.0
    runs = variant_runs(lengths, device)
    rows, steps = [], {}
    for name in variants:
        padded = name.endswith("padded")
        row = dict(mix=mix, causal=causal, direction=direction, variant=name, status="ok", reason=None, exact=None,
                   dtype=plan.dtype, heads=plan.heads, kv_heads=plan.heads if plan.kv_heads is None else plan.kv_heads,
                   head_dim=plan.head_dim, tokens=sum(lengths),
                   sequences=len(lengths), min_len=min(lengths), max_len=max(lengths),
                   layout_tokens=len(lengths) * max(lengths) if padded else sum(lengths), useful_flops=factor * useful,
                   layout_flops=factor * (padded_flops(lengths, plan.heads, plan.head_dim, causal) if padded else
                                          useful), rel_err=None, seq_err=None, grad_err=None, tol=None,
                   time_ms=None, round_ms=[], time_spread=None, tflops=None, varlen_speedup=None)  # fmt: skip
        row.update({col: meta[col] for col in STAMP_COLUMNS})
        rows.append(row)
        run = runs[name]
        if isinstance(run, str):
            row.update(status="absent", reason=run)
            continue
        layout = lays[run[0]]
        step = (train_step if direction == "train" else forward_step)(run[1], layout, causal)
        try:
            result = step()
            out, grads = result if direction == "train" else (result, None)
            row.update(check_variant(out, grads, layout, refs, dtype))
            del out, grads, result
        except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
            row.update(status="skipped", reason=one_line(f"{type(e).__name__}: {e}"))
            continue
        row["exact"] = bool(row["seq_err"] <= row["tol"])
        if not row["rel_err"] <= row["tol"] or (direction == "train" and not row["grad_err"] <= row["grad_tol"]):
            what = f"output {row['rel_err']:.3g} (tolerance {row['tol']:g})"
            if row["grad_err"] is not None:
                what += f", gradients {row['grad_err']:.3g} (tolerance {row['grad_tol']:g})"
            row.update(status="wrong", reason=f"relative error against float64: {what}; not timed")
            continue
        if not row["exact"]:
            row["reason"] = ("no key-padding mask: real rows also attend to the padded keys; timed as the least "
                             "padding costs")  # fmt: skip
        steps[name] = step
    time_variants(rows, steps, "flashlab_varlen", plan, device)
    del steps
    return rows


def time_variants(rows: list[dict], steps: dict[str, Callable], base: str, plan: VarlenPlan, device: str) -> None:
    """Time the checked ``steps`` (variant name -> call) and fill their ``rows``: the median milliseconds, the
    rounds, their spread, useful TFLOP/s, and each row's time over the ``base`` variant's (``varlen_speedup``). On
    a GPU in rounds whose order turns (``time_rounds``); on the interpreter one call after the checked one."""
    timed = list(steps)
    if device == "cuda":
        times, failed = time_rounds([steps[n] for n in timed], device, plan.warmup, plan.rep, plan.rounds)
    else:  # the interpreter: one call after the checked one
        times, failed = [], {}
        for n in timed:
            start = time.perf_counter()
            steps[n]()
            times.append([(time.perf_counter() - start) * 1e3])
    by_name = {r["variant"]: r for r in rows}
    for i, n in enumerate(timed):
        row = by_name[n]
        if i in failed:
            row.update(status="error", reason=one_line(f"{type(failed[i]).__name__}: {failed[i]}"))
            continue
        ms = statistics.median(times[i])
        row.update(time_ms=ms, round_ms=times[i], time_spread=(max(times[i]) - min(times[i])) / ms,
                   tflops=row["useful_flops"] / (ms * 1e-3) / 1e12)  # fmt: skip
    base_ms = by_name.get(base, {}).get("time_ms")
    for row in rows:
        if base_ms and row["time_ms"]:
            row["varlen_speedup"] = row["time_ms"] / base_ms


def run_varlen(
    plan,
    device: str,
    mixes=DEFAULT_MIXES,
    causals=(False, True),
    directions=("forward", "train"),
    variants=VARIANTS,
    seed: int = 0,
    progress: bool = True,
    command: str | None = None,
    mixed_batch: MixedBatch | None = None,
) -> dict:
    """Every mix, mask, direction and variant of ``plan`` on ``device`` (a ``VarlenPlan``, or a list of them: one
    per batch size and head dim, run one after the other); returns ``{"meta", "rows"}``. With ``mixed_batch``, the
    serving step ``run_mixed_batch`` instead of the mixes, once per head dim."""
    from tqdm import tqdm

    plans = [plan] if isinstance(plan, VarlenPlan) else list(plan)
    meta = environment_stamp(device)
    by_tokens = {p.tokens: {mix: mix_lengths(mix, p, seed) for mix in mixes} for p in plans}
    meta.update(mode="varlen", command=command, config=dict(mode="varlen", plan=_plan_dict(plans[0]),
                shapes=[dict(tokens=p.tokens, head_dim=p.head_dim) for p in plans], mixes=list(mixes),
                causal=list(causals), directions=list(directions), variants=list(variants), seed=seed),
                lengths=by_tokens[plans[0].tokens],
                lengths_by_tokens={str(t): ls for t, ls in by_tokens.items()})  # fmt: skip
    meta["timing"] = ("do_bench median per call, variants timed together in rounds whose order turns; median round"
                      if device == "cuda" else "one call after the checked one (Triton's interpreter)")  # fmt: skip
    meta["flops"] = (f"useful FLOPs only: per sequence 4 n^2 D per head, causal half; forward + backward "
                     f"{TRAIN_FLOPS_FACTOR}x the forward")  # fmt: skip
    if mixed_batch is not None:
        mixes, rows_of = (), mixed_batch_lengths(mixed_batch, seed)
        meta["mixed_batch"] = dict(batch={k: getattr(mixed_batch, k) for k in mixed_batch.__dataclass_fields__},
                                   rows=rows_of[0], lengths=rows_of[1])  # fmt: skip
        meta["lengths"], meta["lengths_by_tokens"] = {}, {}
        meta["config"]["mixes"] = ["mixed-batch"]
        plans = list({p.head_dim: p for p in plans}.values())  # its sizes are the batch's, not --tokens
    meta["padded_fairness"] = (
        "padded runs: right padding with zeros, no key-padding mask (flashlab's dense API and SDPA FLASH take none); "
        "exact under the causal mask, not without it (exact = False, timed as the least padding costs); padding "
        "copies made before timing"
    )
    total = len(plans) * (len(mixes) * len(causals) * len(directions) if mixed_batch is None else 1)
    bar = tqdm(total=total, desc="flashlab.bench varlen", unit="group", disable=not progress)
    rows = []
    start = time.perf_counter()
    for shape in plans:
        where = f"{shape.tokens} tokens D={shape.head_dim} " if len(plans) > 1 else ""
        if mixed_batch is not None:
            bar.set_postfix_str(f"mixed batch D={shape.head_dim}")
            group = run_mixed_batch(shape, mixed_batch, device, meta, seed)
            rows += group
            bar.update(1)
            if not progress:
                times = ", ".join(f"{r['variant']} {_fmt(r['time_ms'], '.3f')}" if r["status"] == "ok" else
                                  f"{r['variant']} {r['status']}" for r in group)  # fmt: skip
                print(f"[{len(rows) // 2}/{total}] mixed batch D={shape.head_dim} (ms): {times}", flush=True)
        for mix in mixes:
            lengths = by_tokens[shape.tokens][mix]
            lays = layouts(*_inputs(lengths, shape, device, seed), lengths)
            for causal in causals:
                refs = References(lays, lengths, causal, shape.check_rows)
                for direction in directions:
                    bar.set_postfix_str(f"{where}{mix} {'causal' if causal else 'full'} {direction}")
                    group = run_group(mix, lengths, causal, direction, variants, lays, refs, shape, device, meta)
                    rows += group
                    bar.update(1)
                    if not progress:  # one line per group, so a log shows where the run is
                        done = len(rows) // max(len(variants), 1)
                        times = ", ".join(f"{r['variant']} {_fmt(r['time_ms'], '.3f')}" if r["status"] == "ok"
                                          else f"{r['variant']} {r['status']}" for r in group)  # fmt: skip
                        print(f"[{done}/{total}] {where}{mix} {'causal' if causal else 'full'} {direction} (ms): "
                              f"{times}", flush=True)  # fmt: skip
            del lays, refs
            if device == "cuda":
                torch.cuda.empty_cache()
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    return dict(meta=meta, rows=rows)


def _plan_dict(plan: VarlenPlan) -> dict:
    return {k: getattr(plan, k) for k in plan.__dataclass_fields__}


# ----------------------------------------------------------------------------------------------------------------
# A serving step: prefill chunks and decode rows over one paged cache


@dataclass(frozen=True)
class MixedBatch:
    """A serving engine's step: ``prefills`` sequences each adding a chunk of ``chunk = (lo, hi)`` new tokens
    (uniform), ``decodes`` sequences each adding one, every sequence's cache (its new tokens included) uniform in
    ``cache = (lo, hi)`` tokens, in shuffled blocks of ``block_size`` tokens; causal, each sequence aligned to its
    own end."""

    prefills: int = 8
    decodes: int = 56
    chunk: tuple[int, int] = (256, 2048)
    cache: tuple[int, int] = (1024, 32768)
    block_size: int = 16


GPU_MIXED = MixedBatch()
CPU_MIXED = MixedBatch(prefills=2, decodes=3, chunk=(3, 9), cache=(12, 40), block_size=16)
MIXED_VARIANTS = ("one_launch", "separate_calls")


def mixed_batch_lengths(batch: MixedBatch, seed: int = 0) -> tuple[list[int], list[int]]:
    """``(rows, lengths)``: each sequence's new query rows and its cache length (prefills first); the same for the
    same seed."""
    rng = random.Random(f"mixed-batch-{seed}")
    rows = [rng.randint(*batch.chunk) for _ in range(batch.prefills)] + [1] * batch.decodes
    lengths = [max(n, rng.randint(*batch.cache)) for n in rows]
    return rows, lengths


@dataclass
class MixedCase:
    """One step of a mixed batch, ready to run: each sequence's new rows (``rows_of``) and cache length
    (``lengths``), the packed q ``(total_q, Hq, D)`` and its boundaries (``bounds``), the paged cache (``kc``,
    ``vc``, ``table``), and the step two ways: ``one_launch()`` (q packed, with ``cu_seqlens_q``) and
    ``separate_calls()`` (one call per prefill chunk, one for all decode rows, each in ``calls`` with a label)."""

    rows_of: list[int]
    lengths: list[int]
    bounds: list[int]
    q: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    table: torch.Tensor
    one_launch: Callable
    separate_calls: Callable
    calls: list[tuple[str, Callable]]


def mixed_batch_case(plan: VarlenPlan, batch: MixedBatch, device: str, seed: int = 0) -> MixedCase:
    """``batch``'s step (``mixed_batch_lengths``) with random inputs of ``plan``'s heads, head dim and dtype, its
    16-bit cache paged in ``batch.block_size``-token blocks, as a ``MixedCase``; the same for the same seed."""
    from flashlab.host import flash_attention_with_kvcache
    from flashlab.kernels.decode.kvcache import paged_kv_cache

    rows_of, lengths = mixed_batch_lengths(batch, seed)
    dtype, kv = DTYPES[plan.dtype], plan.heads if plan.kv_heads is None else plan.kv_heads
    gen = torch.Generator().manual_seed(seed)
    b, nmax, d = len(lengths), max(lengths), plan.head_dim
    k, v = (torch.randn(b, kv, nmax, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    kc, vc, table, seqlens = paged_kv_cache(k, v, batch.block_size, lengths=lengths, seed=seed)
    del k, v
    q = torch.randn(sum(rows_of), plan.heads, d, generator=gen).to(device=device, dtype=dtype)
    bounds = [0]
    for n in rows_of:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    p = batch.prefills
    chunks = [q[bounds[i] : bounds[i + 1]].transpose(0, 1).unsqueeze(0).contiguous() for i in range(p)]
    q_decode = q[bounds[p] :].unsqueeze(2).contiguous()  # (decodes, Hq, 1, D)

    def one_launch():
        return flash_attention_with_kvcache(q, kc, vc, seqlens, table, causal=True, cu_seqlens_q=cu,
                                            max_seqlen_q=max(rows_of), check_values=False)  # fmt: skip

    def chunk_call(i):
        return lambda: flash_attention_with_kvcache(chunks[i], kc, vc, seqlens[i : i + 1], table[i : i + 1],
                                                    causal=True, check_values=False)  # fmt: skip

    calls = [(f"prefill chunk of {rows_of[i]} rows over {lengths[i]} keys", chunk_call(i)) for i in range(p)]
    if batch.decodes:
        calls.append((f"{batch.decodes} decode rows", lambda: flash_attention_with_kvcache(
            q_decode, kc, vc, seqlens[p:], table[p:], causal=True, check_values=False)))  # fmt: skip

    def separate_calls():
        return [call() for _, call in calls]

    return MixedCase(rows_of, lengths, bounds, q, kc, vc, table, one_launch, separate_calls, calls)


def run_mixed_batch(plan: VarlenPlan, batch: MixedBatch, device: str, meta: dict, seed: int = 0) -> list[dict]:
    """One step of ``batch`` through ``flash_attention_with_kvcache``: in one launch (q packed ``(total_q, Hq,
    D)`` with ``cu_seqlens_q``) and as separate calls (one per prefill chunk, one for all decode rows), both
    checked against float64 per sequence on sampled rows, then timed; one row each."""
    case = mixed_batch_case(plan, batch, device, seed)
    rows_of, lengths, bounds, q = case.rows_of, case.lengths, case.bounds, case.q
    kc, vc, table = case.kc, case.vc, case.table
    dtype, kv = DTYPES[plan.dtype], plan.heads if plan.kv_heads is None else plan.kv_heads
    b, d, p = len(lengths), plan.head_dim, batch.prefills

    def per_sequence(name, out):  # sequence i's rows as (1, Hq, n, D)
        if name == "one_launch":
            return [out[bounds[i] : bounds[i + 1]].transpose(0, 1).unsqueeze(0) for i in range(b)]
        return [*out[:p], *(out[p][j : j + 1] for j in range(batch.decodes))]

    pool_k, pool_v = (x[table.long()].flatten(1, 2) for x in (kc, vc))  # (B, blocks * block_size, Hk, D)
    refs = []
    for i in range(b):
        sample = check_rows(rows_of[i], plan.check_rows)
        keys, values = (x[i : i + 1, : lengths[i]].transpose(1, 2) for x in (pool_k, pool_v))
        qi = q[bounds[i] : bounds[i + 1]].transpose(0, 1).unsqueeze(0)
        refs.append((sample, attention_float64(qi, keys, values, True, rows=sample.to(device))[0]))
    del pool_k, pool_v
    flops = float(sum(plan.heads * 4 * d * sum(n_k - n_q + j + 1 for j in range(n_q))
                      for n_q, n_k in zip(rows_of, lengths, strict=True)))  # fmt: skip
    steps, rows = {"one_launch": case.one_launch, "separate_calls": case.separate_calls}, []
    for name in MIXED_VARIANTS:
        row = dict(mix="mixed-batch", causal=True, direction="forward", variant=name, status="ok", reason=None,
                   exact=None, dtype=plan.dtype, heads=plan.heads, kv_heads=kv, head_dim=d, tokens=sum(rows_of),
                   sequences=b, min_len=min(lengths), max_len=max(lengths), layout_tokens=sum(rows_of),
                   useful_flops=flops, layout_flops=flops, rel_err=None, seq_err=None, grad_err=None,
                   tol=tolerance(dtype), time_ms=None, round_ms=[], time_spread=None, tflops=None,
                   varlen_speedup=None)  # fmt: skip
        row.update({col: meta[col] for col in STAMP_COLUMNS})
        rows.append(row)
        try:
            got = per_sequence(name, steps[name]())
            errs = [relative_error(g[:, :, s.to(g.device)], r) for g, (s, r) in zip(got, refs, strict=True)]
        except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
            row.update(status="skipped", reason=one_line(f"{type(e).__name__}: {e}"))
            continue
        row["rel_err"] = row["seq_err"] = float("nan") if any(e != e for e in errs) else max(errs)
        row["exact"] = bool(row["rel_err"] <= row["tol"])
        if not row["exact"]:
            row.update(status="wrong", reason=f"relative error against float64 {row['rel_err']:.3g}; not timed")
    checked = {r["variant"]: steps[r["variant"]] for r in rows if r["status"] == "ok"}
    time_variants(rows, checked, "one_launch", plan, device)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The table


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


BAR_MIXES = ("long-tail", "log-normal")  # the long-tailed batches the varlen bar is set on


def _geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def bar_lines(rows) -> list[str]:
    """The varlen bar on the long-tailed mixes' cells (``BAR_MIXES``): flashlab varlen against torch's
    ``varlen_attn``, forward and forward + backward (geo-mean >= 1.0, no cell below 0.9), and against flashlab on
    the padded batch (>= 1.5 in every cell)."""
    cells: dict = {}
    for r in rows:
        if r["mix"] in BAR_MIXES and r["status"] == "ok" and r["time_ms"]:
            key = (r["tokens"], r["head_dim"], r["mix"], r["causal"], r["direction"])
            cells.setdefault(key, {})[r["variant"]] = r["time_ms"]
    out = []
    for direction, what in (("forward", "forward"), ("train", "forward + backward")):
        ratios = [c["torch_varlen_attn"] / c["flashlab_varlen"] for k, c in cells.items()
                  if k[4] == direction and "torch_varlen_attn" in c and "flashlab_varlen" in c]  # fmt: skip
        if ratios:
            ok = _geomean(ratios) >= 1.0 and min(ratios) >= 0.9
            out.append(f"flashlab varlen / torch varlen_attn, {what}: geo-mean {_geomean(ratios):.3g}x over "
                       f"{len(ratios)} cells (min {min(ratios):.3g}x); bar >= 1.0, no cell below 0.9: "
                       f"{'PASS' if ok else 'FAIL'}")  # fmt: skip
    padded = [c["flashlab_padded"] / c["flashlab_varlen"] for c in cells.values()
              if "flashlab_padded" in c and "flashlab_varlen" in c]  # fmt: skip
    if padded:
        out.append(f"flashlab padded / flashlab varlen: min {min(padded):.3g}x over {len(padded)} cells "
                   f"(geo-mean {_geomean(padded):.3g}x); bar >= 1.5 in every cell: "
                   f"{'PASS' if min(padded) >= 1.5 else 'FAIL'}")  # fmt: skip
    if out:
        out.insert(0, f"the bar, on the {' and '.join(BAR_MIXES)} cells:")
    for r in rows:
        if r["mix"] == "mixed-batch" and r["variant"] == "separate_calls" and r["varlen_speedup"]:
            x = r["varlen_speedup"]
            # three decimals: a ratio just under the bar must not print as the bar itself
            out.append(f"mixed batch, D = {r['head_dim']}: separate prefill and decode calls / one launch {x:.3f}x; "
                       f"bar >= 1.2: {'PASS' if x >= 1.2 else 'FAIL'}")  # fmt: skip
    return out


def summary(results: dict) -> str:
    """Per batch size, head dim, mix, mask and direction: each variant's time, useful TFLOP/s and how much faster
    flashlab varlen is; then the bar's lines (``bar_lines``)."""
    m = results["meta"]
    plan = m["config"]["plan"]
    shapes = m["config"].get("shapes") or [dict(tokens=plan["tokens"], head_dim=plan["head_dim"])]
    kv = plan.get("kv_heads") or plan["heads"]
    dims = ", ".join(str(d) for d in dict.fromkeys(s_["head_dim"] for s_ in shapes))
    heads = f"H = {plan['heads']}" + (f", {kv} K/V heads" if kv != plan["heads"] else "")
    out = [f"{m['device_name']}, torch {m['torch']}, triton {m['triton']}, {m['date']} -- packed variable-length "
           f"attention, {plan['dtype']}, {heads}, D = {dims}; useful TFLOP/s (real tokens only, causal "
           "half)"]  # fmt: skip
    by_tokens = m.get("lengths_by_tokens") or {str(plan["tokens"]): m["lengths"]}
    several = len(shapes) > 1
    for tokens, lengths_of in by_tokens.items():
        for mix, lengths in lengths_of.items():
            out.append(f"{mix}{f' ({tokens} tokens)' if len(by_tokens) > 1 else ''}: {mix_summary(lengths)}")
    if m.get("mixed_batch"):
        mb, rows_of, lengths = m["mixed_batch"]["batch"], m["mixed_batch"]["rows"], m["mixed_batch"]["lengths"]
        chunks = rows_of[: mb["prefills"]]
        out.append(f"mixed batch: {mb['prefills']} prefill chunks of {min(chunks, default=0)}-{max(chunks, default=0)} "
                   f"tokens and {mb['decodes']} decode rows, caches of {min(lengths)}-{max(lengths)} tokens in "
                   f"{mb['block_size']}-token blocks, causal; one launch (cu_seqlens_q) against one call per chunk "
                   "and one for the decode rows")  # fmt: skip
    head = f"{'variant':<20} {'ms':>10} {'TFLOP/s':>9} {'varlen faster':>14} {'exact':>6}  status"
    group_of = lambda r: (r["tokens"], r["head_dim"], r["mix"], r["causal"], r["direction"])  # noqa: E731
    for key in dict.fromkeys(group_of(r) for r in results["rows"]):
        tokens, d, mix, causal, direction = key
        what = "forward" if direction == "forward" else "forward + backward"
        where = f"{tokens} tokens, D = {d}, " if several else ""
        out += ["", f"{where}{mix}, {'causal' if causal else 'no mask'}, {what}", head]
        for r in (r for r in results["rows"] if group_of(r) == key):
            speed = "-" if r["varlen_speedup"] is None else ratio_text(r["varlen_speedup"]) + "x"
            exact = "-" if r["exact"] is None else "yes" if r["exact"] else "no"
            status = r["status"] if not r["reason"] else f"{r['status']}: {r['reason']}"
            out.append(f"{r['variant']:<20} {_fmt(r['time_ms'], '.3f'):>10} {_fmt(r['tflops'], '.3g'):>9} "
                       f"{speed:>14} {exact:>6}  {status}")  # fmt: skip
    out += ["", "varlen faster: the variant's time over flashlab varlen's (above 1: varlen is faster; in the mixed "
            "batch, over the one launch's); exact: the real rows equal each sequence's own attention"]  # fmt: skip
    bars = bar_lines(results["rows"])
    if bars:
        out += ["", *bars]
    return "\n".join(out)


def dry_run_lines(plan, mixes=DEFAULT_MIXES, causals=(False, True), directions=("forward", "train"),
                  variants=VARIANTS, seed: int = 0) -> list[str]:  # fmt: skip
    """What a run would measure (``plan``: one ``VarlenPlan`` or a list, as ``run_varlen`` takes), without
    allocating anything."""
    plans = [plan] if isinstance(plan, VarlenPlan) else list(plan)
    masks = "/".join("causal" if c else "no mask" for c in causals)
    lines = []
    for p in plans:
        kv = p.heads if p.kv_heads is None else p.kv_heads
        heads = f"H = {p.heads}" + (f" ({kv} K/V heads)" if kv != p.heads else "")
        lines.append(f"{p.tokens} tokens a batch, {heads}, D = {p.head_dim}, {p.dtype}; {masks}; "
                     f"{' and '.join(directions)}; variants {', '.join(variants)}")  # fmt: skip
        for mix in mixes:
            lengths = mix_lengths(mix, p, seed)
            waste = 1 - useful_flops(lengths, 1, 1, False) / padded_flops(lengths, 1, 1, False)
            lines.append(f"{mix:<10} {mix_summary(lengths)}; padding wastes {waste:.0%} of the padded FLOPs")
            for causal in causals:
                for direction in directions:
                    flops = useful_flops(lengths, p.heads, p.head_dim, causal) * (
                        TRAIN_FLOPS_FACTOR if direction == "train" else 1.0
                    )
                    lines.append(f"{'':<10} {'causal' if causal else 'no mask':<8} {direction:<8} "
                                 f"{flops / 1e9:.4g} useful GFLOP")  # fmt: skip
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        names = name_list(text)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {','.join(choices)}")
        return list(dict.fromkeys(names))

    return parse


def _numbers(lo: int, hi: int | None = None):
    """A comma-separated list of whole numbers in ``[lo, hi]``, repeats dropped."""
    one = whole_number(lo, hi) if hi is not None else whole_number(lo)

    def parse(text: str) -> list[int]:
        return list(dict.fromkeys(one(x) for x in name_list(text)))

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.bench --mode varlen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--mode", default="varlen", help=argparse.SUPPRESS)
    p.add_argument("--mixes", type=_choice_list(MIXES), default=",".join(DEFAULT_MIXES), help="length mixes, "
                   f"comma-separated, from {','.join(MIXES)}")  # fmt: skip
    p.add_argument(
        "--variants",
        type=_choice_list(VARIANTS),
        default=",".join(VARIANTS),
        help=f"what to time, comma-separated, from {','.join(VARIANTS)}",
    )
    p.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), default="both", help="causal mask: yes, no or both")
    p.add_argument(
        "--direction", choices=sorted(DIRECTIONS), default="both", help="forward, train (forward + backward) or both"
    )
    p.add_argument("--tokens", type=_numbers(1), help="tokens per batch, or several comma-separated, each run in "
                   "turn (default 32768 on a GPU, 48 CPU)")  # fmt: skip
    p.add_argument("--heads", type=whole_number(1), help="query heads (default 16 on a GPU, 2 CPU)")
    p.add_argument("--kv-heads", type=whole_number(1), help="K/V heads, dividing --heads: fewer than the query "
                   "heads is grouped-query attention (default: as many)")  # fmt: skip
    p.add_argument("--head-dim", type=_numbers(16, 256), help="head dim D, or several comma-separated, each run in "
                   "turn (default 128 on a GPU, 16 CPU)")  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype (default bf16 on a GPU, fp32 CPU)")
    p.add_argument("--warmup", type=finite_number(0.0), help="warm-up per measurement, ms (default 25)")
    p.add_argument("--rep", type=finite_number(0.0, above=True), help="timed ms per measurement, shared by the "
                   "rounds (default 100)")  # fmt: skip
    p.add_argument("--rounds", type=whole_number(1), help="timing rounds, the order turning (default 3 on a GPU)")
    p.add_argument("--check-rows", type=whole_number(1), help="query rows per sequence checked against float64 "
                   "(default 64 on a GPU, 8 CPU)")  # fmt: skip
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="the CPU's tiny mixes, on any device")
    p.add_argument("--mixed-batch", action="store_true", help="instead of the mixes: a serving step of prefill "
                   "chunks and decode rows over one paged cache (8 chunks of 256-2048 tokens and 56 decode rows, "
                   "caches of 1K-32K tokens in 16-token blocks; tiny on the CPU), in one launch against separate "
                   "calls")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="list the mixes and what runs; run nothing")
    p.add_argument("--seed", type=whole_number(0), default=0, help="random seed for the lengths and q, k, v")
    p.add_argument(
        "--out",
        type=output_prefix,
        help="write PREFIX.json, PREFIX.csv and PREFIX.txt (default: "
        "data/results/<gpu>-varlen-<date> on a GPU, test-artifacts/bench/cpu-varlen-<date> on the CPU)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the files of an --out that exist")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar: one line per mix, mask and "
                   "direction instead")  # fmt: skip
    return p


def default_prefix(meta: dict) -> Path:
    """``data/results/<gpu>-varlen-<date>`` on a GPU, ``test-artifacts/bench/cpu-varlen-<date>`` on the CPU."""
    return recording_prefix(meta, "varlen")


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda: torch sees no CUDA GPU here")
    tiny = args.quick or device == "cpu"
    plan = CPU_PLAN if tiny else GPU_PLAN
    if plan is CPU_PLAN and device == "cuda":  # the tiny mixes on a GPU: SDPA's FLASH kernel takes 16-bit inputs
        plan = replace(plan, dtype="bf16", head_dim=32)
    given = dict(heads=args.heads, kv_heads=args.kv_heads, dtype=args.dtype, warmup=args.warmup, rep=args.rep,
                 rounds=args.rounds, check_rows=args.check_rows)  # fmt: skip
    plan = replace(plan, **{k: v for k, v in given.items() if v is not None})
    bad = [d for d in args.head_dim or () if d % 8]
    if bad:
        parser.error(f"--head-dim must be a multiple of 8; got {bad[0]}")
    plans = [replace(plan, tokens=t, head_dim=d) for t in args.tokens or [plan.tokens]
             for d in args.head_dim or [plan.head_dim]]  # fmt: skip
    for shape in plans:
        problem = plan_problem(shape, args.mixes)
        if problem:
            parser.error(problem)
    causals, directions = CAUSAL_CHOICES[args.causal], DIRECTIONS[args.direction]
    mixed = None if not args.mixed_batch else CPU_MIXED if tiny else GPU_MIXED
    if args.dry_run and mixed is not None:
        rows_of, lengths = mixed_batch_lengths(mixed, args.seed)
        chunks = rows_of[: mixed.prefills]
        print(f"mixed batch: {mixed.prefills} prefill chunks of {min(chunks)}-{max(chunks)} tokens and "
              f"{mixed.decodes} decode rows, caches of {min(lengths)}-{max(lengths)} tokens in "
              f"{mixed.block_size}-token blocks, causal, H = {plan.heads} ({plan.kv_heads or plan.heads} K/V "
              f"heads), D = {', '.join(str(p.head_dim) for p in plans)}, {plan.dtype}; "
              f"{', '.join(MIXED_VARIANTS)}")  # fmt: skip
        return None
    if args.dry_run:
        print("\n".join(dry_run_lines(plans, args.mixes, causals, directions, args.variants, args.seed)))
        return None
    problem = output_problem(args.out, args.overwrite) if args.out else folder_problem(default_folder(
        device == "cuda"))  # fmt: skip
    if problem:
        parser.error(f"--out {args.out}: {problem}" if args.out else f"{problem} (or pass --out)")
    mode = [] if "--mode" in argv else ["--mode", "varlen"]
    command = shlex.join(["python", "-m", "flashlab.bench", *mode, *argv])
    results = run_varlen(plans, device, args.mixes, causals, directions, args.variants, args.seed,
                         progress=not args.no_progress, command=command, mixed_batch=mixed)  # fmt: skip
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
