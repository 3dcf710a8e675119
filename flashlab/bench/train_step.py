"""One training step of a GPT-style model, timed whole, with each attention in turn: a kernel speedup is not a step
speedup.

    python -m flashlab.bench --mode step                       # on a GPU: 12 layers, d 768, contexts 4K and 16K
    python -m flashlab.bench --mode step --device cpu --quick  # 2 layers, d 64, context 64, 2 steps (interpreter)
    python -m flashlab.bench --mode step --dry-run             # what would run, nothing allocated

The model is ``flashlab.bench.gpt.GPT``: 12 pre-norm blocks, d_model 768, 12 heads (D = 64), vocabulary 50304
(GPT-2's 50257 tokens rounded up to a multiple of 128, so the output head's matrix multiply tiles evenly; the head
and the embeddings are a real share of a small model's step, and a smaller vocabulary would flatter attention).
Tokens per step are fixed (16K: B = 4 at context 4K, B = 1 at 16K), data are random tokens from a seeded
generator, weights PyTorch's default initialisation under the same seed for every attention, bf16 autocast over
float32 weights, AdamW. No ``torch.compile``: the step is the eager model a reader can follow.

The attention inside every block is one of

- ``flashlab`` -- ``flashlab.flash_attention``, causal, forward and backward kernels in Triton;
- ``sdpa_flash``, ``sdpa_cudnn`` -- ``F.scaled_dot_product_attention`` pinned to ``SDPBackend.FLASH_ATTENTION`` or
  ``CUDNN_ATTENTION`` (``torch.nn.attention.sdpa_kernel``: no silent fallback);
- ``naive`` -- ``softmax(Q K^T) V`` with the score matrix in memory; at long context it runs out of memory, which
  is recorded as the status ``oom``, not a crash;
- ``stand_in`` -- ``return v``: the same step with attention costing nothing. Its step time is the rest of the
  model, so ``1 - stand_in / step`` is the share of a backend's step that is attention.

For every attention: ``--warmup-steps`` steps (compiles and autotuning) not timed, then ``--steps`` steps timed one
by one (CUDA events on a GPU); the median step, tokens per second and the peak memory allocated are reported.
Before any timing the first step's loss is compared with the same model's loss computed in float32 with float64
attention (``flashlab.reference.torch_float64``), to the dtype's tolerance; a backend that fails is ``wrong``.

Then the attention op alone -- forward and backward of one layer's ``(B, 12, N, 64)`` q, k, v under the step's
autocast -- is timed for each backend (``triton.testing.do_bench``). Its ratio is the kernel speedup of flashlab
over that backend, measured apart from the step. Amdahl's law with the backend's attention share,
``flashlab.calculators.roofline.end_to_end_speedup(share, kernel_speedup)``, predicts the step ratio, printed
next to the measured one (backend's step time over flashlab's). The share comes from the stand-in step and the
speedup from the isolated op so that the prediction is not the measurement rewritten: from step times alone,
Amdahl's formula returns the measured ratio exactly.

Results: ``PREFIX.json`` (meta, rows with every step's time), ``PREFIX.csv`` (rows, stamp columns in each) and
``PREFIX.txt`` (the printed table); by default ``data/results/<gpu>-step-<date>`` on a GPU and
``test-artifacts/bench/cpu-step-<date>`` on the CPU.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from flashlab.bench.args import MAX_SEED, output_prefix, size_list, whole_number
from flashlab.bench.gpt import GPT, parameter_count
from flashlab.bench.grid import DTYPES, STAMP_COLUMNS
from flashlab.bench.implementations import BACKENDS
from flashlab.bench.measure import is_oom, one_line, time_ms
from flashlab.bench.results import (
    default_folder,
    folder_problem,
    output_problem,
    ratio_text,
    recording_prefix,
    save_tables,
)
from flashlab.bench.stamp import environment_stamp
from flashlab.calculators.roofline import end_to_end_speedup
from flashlab.core.numerics import tolerance
from flashlab.reference.torch_float64 import attention_float64

ATTENTIONS = ("flashlab", "sdpa_flash", "sdpa_cudnn", "naive")
STAND_IN = "stand_in"  # return v: attention at no cost
BASELINE = "flashlab"  # the predictions are flashlab's step over each other backend's

ROW_COLUMNS = (
    "context", "batch", "tokens", "backend", "status", "reason", "dtype", "layers", "d_model", "heads", "head_dim",
    "vocab", "params", "warmup_steps", "steps", "step_ms", "step_ms_min", "step_spread", "tokens_per_s",
    "peak_mem_gb", "first_loss", "ref_loss", "loss_rel_err", "loss_tol", "last_loss", "attn_ms", "attn_status",
    "attention_share", "isolated_share", "kernel_speedup", "predicted_speedup", "measured_speedup",
) + STAMP_COLUMNS  # fmt: skip
MEASURED = ROW_COLUMNS[ROW_COLUMNS.index("step_ms") : ROW_COLUMNS.index("measured_speedup") + 1]  # None until measured


# ----------------------------------------------------------------------------------------------------------------
# What a run measures


@dataclass(frozen=True)
class StepPlan:
    """The model, the contexts, the tokens per step and how many steps are warm-up and timed."""

    layers: int
    d_model: int
    heads: int
    vocab: int
    contexts: tuple
    tokens: int
    warmup_steps: int
    steps: int
    dtype: str  # "bf16": bf16 autocast over float32 weights; "fp32": no autocast
    backends: tuple = ATTENTIONS
    lr: float = 3e-4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def batch(self, context: int) -> int:
        """Sequences per step: ``tokens // context``, at least one."""
        return max(1, self.tokens // context)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


GPU_PLAN = StepPlan(layers=12, d_model=768, heads=12, vocab=50304, contexts=(4096, 16384), tokens=16384,
                    warmup_steps=3, steps=10, dtype="bf16")  # fmt: skip
# On the CPU flashlab runs in Triton's interpreter (about a second per layer's forward + backward at these sizes):
# a tiny model tests the code path; its times say nothing about a GPU. A 256-token vocabulary keeps the head tiny.
CPU_PLAN = StepPlan(layers=2, d_model=64, heads=2, vocab=256, contexts=(64,), tokens=64, warmup_steps=1, steps=2,
                    dtype="fp32")  # fmt: skip


def attention_call(name: str) -> Callable:
    """The attention a block calls, ``fn(q, k, v, causal=True)`` on ``(B, H, N, D)``: a backend of the harness
    (``flashlab.bench.implementations.BACKENDS``) or the stand-in."""
    if name == STAND_IN:
        return lambda q, k, v, causal=True: v  # (B, H, N, D): the values, untouched
    run = BACKENDS[name].run
    return lambda q, k, v, causal=True: run(q, k, v, causal)


def float64_attention(q, k, v, causal=True):
    """The reference a first step's loss is checked against: float64 attention, returned in q's dtype."""
    return attention_float64(q, k, v, causal=causal)[0].to(q.dtype)  # (B, H, N, D)


def synthetic_batches(plan: StepPlan, context: int, count: int, seed: int, device: str) -> list:
    """``count`` batches of random tokens ``(x, y)``, each ``(B, context)``; y is x shifted by one token."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = torch.randint(0, plan.vocab, (plan.batch(context), context + 1), generator=gen)  # (B, N + 1)
        out.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))  # (B, N) each
    return out


def build_model(plan: StepPlan, seed: int, device: str) -> GPT:
    """The model every attention starts from: the same seed gives the same weights (float32)."""
    torch.manual_seed(seed)
    model = GPT(attention_call(STAND_IN), plan.vocab, max(plan.contexts), plan.d_model, plan.heads, plan.layers)
    return model.to(device)


def _autocast(plan: StepPlan, device: str):
    return torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=plan.dtype == "bf16")


def step_loss(model: GPT, x, y, plan: StepPlan, device: str) -> torch.Tensor:
    """The forward: cross-entropy of the next token, in float32."""
    with _autocast(plan, device):
        logits = model(x)  # (B, N, vocab)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))


def train_step(model: GPT, opt, x, y, plan: StepPlan, device: str) -> torch.Tensor:
    """One step: forward, backward, AdamW. Returns the loss (not synchronised)."""
    loss = step_loss(model, x, y, plan, device)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class StepTimer:
    """Milliseconds of each step: CUDA events on a GPU (read after one synchronise), perf_counter on the CPU."""

    def __init__(self, device: str):
        self.device, self.marks = device, []

    def time(self, fn: Callable):
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.marks.append((start, end))
        else:
            t0 = time.perf_counter()
            out = fn()
            self.marks.append(time.perf_counter() - t0)
        return out

    def ms(self) -> list[float]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in self.marks]
        return [s * 1e3 for s in self.marks]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _failure(e: BaseException) -> tuple[str, str]:
    if is_oom(e):
        return "oom", one_line(f"out of memory: {e}")
    return "error", one_line(f"{e.__class__.__name__}: {e}")


def run_training(model: GPT, initial: dict, name: str, batches: list, plan: StepPlan, device: str, row: dict):
    """Warm-up and timed steps of one attention from the initial weights; fills ``row`` (status, times, losses)."""
    model.load_state_dict(initial)
    model.set_attention(attention_call(name))
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.1)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    try:
        losses, timer = [], StepTimer(device)
        for i, (x, y) in enumerate(batches):
            if i == 0:  # the first step's loss, checked before anything is timed
                first = train_step(model, opt, x, y, plan, device).item()
                row["first_loss"] = first
                if name != STAND_IN and row["ref_loss"] is not None:
                    row["loss_rel_err"] = abs(first - row["ref_loss"]) / abs(row["ref_loss"])
                    if not row["loss_rel_err"] <= row["loss_tol"]:  # NaN fails too
                        row.update(status="wrong", reason=f"first loss {first:.6g} against float64 attention's "
                                   f"{row['ref_loss']:.6g}: relative difference {row['loss_rel_err']:.3g} > "
                                   f"{row['loss_tol']:g}; not timed")  # fmt: skip
                        return
                continue
            if i < plan.warmup_steps:
                train_step(model, opt, x, y, plan, device)
                continue
            losses.append(timer.time(lambda x=x, y=y: train_step(model, opt, x, y, plan, device)))
        times = timer.ms()
        row["step_times_ms"] = times
        row["step_ms"] = statistics.median(times)
        row["step_ms_min"] = min(times)
        row["step_spread"] = (max(times) - min(times)) / row["step_ms"]
        row["tokens_per_s"] = row["tokens"] / (row["step_ms"] * 1e-3)
        row["last_loss"] = losses[-1].item()
        if device == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    except Exception as e:  # noqa: BLE001 -- recorded in the row; the other attentions still run
        row["status"], row["reason"] = _failure(e)
    finally:
        model.zero_grad(set_to_none=True)  # the optimiser's state goes with this call; the caller frees the memory


def isolated_attention_ms(name: str, plan: StepPlan, context: int, device: str, seed: int) -> tuple:
    """Forward + backward of one layer's attention alone, ``(B, H, N, D)`` causal, under the step's autocast:
    ``(ms, status)``. do_bench after one untimed call on a GPU; on the CPU the median of ``plan.steps`` calls."""
    gen = torch.Generator().manual_seed(seed)
    shape = (plan.batch(context), plan.heads, context, plan.head_dim)  # (B, H, N, D)
    dtype = torch.bfloat16 if plan.dtype == "bf16" else torch.float32
    q, k, v, do = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    run = attention_call(name)

    def forward_backward():
        with _autocast(plan, device):
            o = run(q, k, v, causal=True)  # (B, H, N, D)
        return torch.autograd.grad(o, (q, k, v), do)

    try:
        if device == "cuda":
            forward_backward()  # compiles and tunes outside the timing
            return time_ms(forward_backward, device, warmup=25, rep=100), "ok"
        times = []  # the interpreter compiles nothing: no warm-up call
        for _ in range(plan.steps):
            t0 = time.perf_counter()
            forward_backward()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "ok"
    except Exception as e:  # noqa: BLE001 -- recorded in the row
        return None, _failure(e)[0]


def reference_loss(model: GPT, initial: dict, x, y, plan: StepPlan, device: str) -> float:
    """The first step's loss with float32 weights, no autocast and float64 attention (no gradient)."""
    model.load_state_dict(initial)
    model.set_attention(float64_attention)
    with torch.no_grad():
        loss = step_loss(model, x, y, replace(plan, dtype="fp32"), device).item()
    _free(device)
    return loss


def compare(rows: list[dict]) -> None:
    """Fill each row's attention share (from the stand-in's step) and, for every backend but flashlab, flashlab's
    isolated kernel speedup over it, the Amdahl prediction of the step ratio and the measured step ratio."""
    by = {r["backend"]: r for r in rows}
    stand, base = by.get(STAND_IN), by.get(BASELINE)
    rest_ms = stand["step_ms"] if stand and stand["status"] == "ok" else None
    for r in rows:
        if r["backend"] == STAND_IN or r["status"] != "ok":
            continue
        if rest_ms is not None:
            r["attention_share"] = min(1.0, max(0.0, 1 - rest_ms / r["step_ms"]))  # noise can put rest above step
        if r["attn_ms"] is not None:
            r["isolated_share"] = r["layers"] * r["attn_ms"] / r["step_ms"]
        if r["backend"] == BASELINE or base is None or base["status"] != "ok":
            continue
        r["measured_speedup"] = r["step_ms"] / base["step_ms"]
        if r["attn_ms"] is not None and base["attn_ms"] is not None:
            r["kernel_speedup"] = r["attn_ms"] / base["attn_ms"]
            if r["attention_share"] is not None:
                r["predicted_speedup"] = end_to_end_speedup(r["attention_share"], r["kernel_speedup"])


def empty_row(plan: StepPlan, context: int, name: str, params: int, meta: dict) -> dict:
    b = plan.batch(context)
    row = dict(context=context, batch=b, tokens=b * context, backend=name, status="ok", reason=None,
               dtype=plan.dtype, layers=plan.layers, d_model=plan.d_model, heads=plan.heads, head_dim=plan.head_dim,
               vocab=plan.vocab, params=params, warmup_steps=plan.warmup_steps, steps=plan.steps)  # fmt: skip
    row.update(dict.fromkeys(MEASURED))
    row.update(step_times_ms=[], loss_tol=tolerance(DTYPES[plan.dtype]), attn_status=None)
    row.update({col: meta[col] for col in STAMP_COLUMNS})
    return row


def unavailable(name: str, plan: StepPlan, device: str) -> str | None:
    """Why an attention cannot run here (SDPA's cuDNN backend has no CPU kernel), or None."""
    if name == STAND_IN:
        return None
    return BACKENDS[name].unavailable(device, DTYPES["bf16" if plan.dtype == "bf16" else "fp32"])


def run_step_bench(plan: StepPlan, device: str, seed: int = 0, progress: bool = True, command: str | None = None):
    """Every context of ``plan``, every attention and the stand-in; returns ``{"meta", "rows"}``."""
    from tqdm import tqdm

    meta = environment_stamp(device)
    meta.update(mode="step", command=command, config=dict(mode="step", seed=seed, **plan.as_dict()))
    meta["timing"] = ("each step timed alone (CUDA events on a GPU) after the warm-up steps; median step reported; "
                      "attention alone: triton.testing.do_bench of one layer's forward + backward")  # fmt: skip
    meta["attention_share"] = "1 - stand_in step / backend step (the stand-in returns v: attention at no cost)"
    meta["prediction"] = ("end_to_end_speedup(attention share of the backend's step, backend's attention ms / "
                          "flashlab's attention ms) against backend's step ms / flashlab's step ms")  # fmt: skip
    names = [*plan.backends, STAND_IN]
    bar = tqdm(total=len(plan.contexts) * len(names), desc="flashlab.bench step", unit="run", disable=not progress)
    say = bar.write if progress else (lambda line: print(line, flush=True))
    model = build_model(plan, seed, device)
    params = parameter_count(model)
    initial = {k: t.detach().clone() for k, t in model.state_dict().items()}
    say(f"model: {plan.layers} layers, d_model {plan.d_model}, {plan.heads} heads of {plan.head_dim}, vocab "
        f"{plan.vocab}: {params / 1e6:.1f}M parameters; {plan.dtype}, {device}")  # fmt: skip
    rows, start = [], time.perf_counter()
    for n, context in enumerate(plan.contexts):
        batches = synthetic_batches(plan, context, plan.warmup_steps + plan.steps, seed + 1 + n, device)
        ref = reference_loss(model, initial, *batches[0], plan, device)
        say(f"context {_k(context)}, B = {plan.batch(context)}: first loss with float64 attention {ref:.4f}")
        context_rows = []
        for name in names:
            bar.set_postfix_str(f"N={context} {name}")
            row = empty_row(plan, context, name, params, meta)
            row["ref_loss"] = ref
            reason = unavailable(name, plan, device)
            if reason:
                row.update(status="skipped", reason=reason)
            else:
                run_training(model, initial, name, batches, plan, device, row)
                _free(device)
                if row["status"] == "ok" and name != STAND_IN:
                    row["attn_ms"], row["attn_status"] = isolated_attention_ms(name, plan, context, device, seed)
                    _free(device)
            context_rows.append(row)
            bar.update(1)
            say(run_line(row, len(rows) + len(context_rows), bar.total))
        compare(context_rows)
        rows += context_rows
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    del model, initial
    _free(device)
    return dict(meta=meta, rows=rows)


# ----------------------------------------------------------------------------------------------------------------
# The table


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _x(x) -> str:
    return "-" if x is None else ratio_text(x) + "x"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def run_line(row: dict, done: int, total: int) -> str:
    """One line of progress: a finished run's step time and tokens/s, or why it has none."""
    what = f"[{done}/{total}] N={_k(row['context'])} B={row['batch']} {row['backend']}"
    if row["status"] != "ok":
        return f"{what}: {row['status']} ({row['reason']})"
    speed = f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s"
    return f"{what}: {speed}, first loss {row['first_loss']:.4f}"


def summary(results: dict) -> str:
    """Per context: each attention's step, tokens/s, memory and loss check; then flashlab's predicted and measured
    step speedup over each other backend."""
    m, c = results["meta"], results["meta"]["config"]
    out = [f"{m['device_name']}, torch {m['torch']}, triton {m['triton']}, {m['date']} -- one training step of a "
           f"GPT ({c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads, vocab {c['vocab']}, {c['dtype']}), "
           f"median of {c['steps']} steps after {c['warmup_steps']} warm-up"]  # fmt: skip
    head = (f"{'attention':<11} {'step ms':>9} {'tokens/s':>11} {'peak GB':>8} {'first loss':>10} {'vs f64':>8} "
            f"{'attn share':>10} {'attn ms':>8}  status")  # fmt: skip
    for context in dict.fromkeys(r["context"] for r in results["rows"]):
        rows = [r for r in results["rows"] if r["context"] == context]
        out += ["", f"context {_k(context)}, B = {rows[0]['batch']} ({rows[0]['tokens']:,} tokens per step), "
                f"float64-attention loss {_fmt(rows[0]['ref_loss'], '.4f')}", head]  # fmt: skip
        for r in rows:
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
            share = "-" if r["attention_share"] is None else f"{r['attention_share']:.0%}"
            out.append(f"{r['backend']:<11} {_fmt(r['step_ms'], '.1f'):>9} {_fmt(r['tokens_per_s'], ',.0f'):>11} "
                       f"{_fmt(r['peak_mem_gb'], '.1f'):>8} {_fmt(r['first_loss'], '.4f'):>10} "
                       f"{_fmt(r['loss_rel_err'], '.1e'):>8} {share:>10} {_fmt(r['attn_ms'], '.2f'):>8}  "
                       f"{status}")  # fmt: skip
        for r in rows:
            if r["measured_speedup"] is None:
                continue
            out.append(f"  flashlab over {r['backend']}: kernel {_x(r['kernel_speedup'])}, attention "
                       f"{_fmt(r['attention_share'], '.0%')} of its step -> predicted step "
                       f"{_x(r['predicted_speedup'])}, measured {_x(r['measured_speedup'])}")  # fmt: skip
    return "\n".join(out)


def dry_run_lines(plan: StepPlan, device: str) -> list[str]:
    """What a run would measure, without allocating anything (the model is built on the meta device)."""
    with torch.device("meta"):
        params = parameter_count(GPT(attention_call(STAND_IN), plan.vocab, max(plan.contexts), plan.d_model,
                                     plan.heads, plan.layers))  # fmt: skip
    lines = [f"model: {plan.layers} layers, d_model {plan.d_model}, {plan.heads} heads of D = {plan.head_dim}, vocab "
             f"{plan.vocab}, {params / 1e6:.1f}M parameters; {plan.dtype}, AdamW, on {device}",
             f"{plan.warmup_steps} warm-up + {plan.steps} timed steps per attention; attentions: "
             f"{', '.join(plan.backends)}, and {STAND_IN} (return v)"]  # fmt: skip
    for context in plan.contexts:
        b = plan.batch(context)
        lines.append(f"context {_k(context)}: B = {b}, {b * context:,} tokens per step")
    return lines


# ----------------------------------------------------------------------------------------------------------------
# The picture


def plot_step(results: dict):
    """Two panels from a result (``{"meta", "rows"}``, as the JSON holds it): tokens/s per attention and context
    (a run that did not finish is marked with its status), and flashlab's predicted step speedup over each other
    backend against the measured one. Returns the figure."""
    import matplotlib.pyplot as plt

    rows, meta = results["rows"], results["meta"]
    contexts = list(dict.fromkeys(r["context"] for r in rows))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for j, context in enumerate(contexts):
            r = next((r for r in rows if r["backend"] == name and r["context"] == context), None)
            x = j + (i - (len(names) - 1) / 2) * width
            if r is not None and r["status"] == "ok":
                left.bar(x, r["tokens_per_s"], width, color=f"C{i}", label=name if j == 0 else None)
            else:
                left.bar(x, 0, width, color=f"C{i}", label=name if j == 0 else None)
                left.annotate("-" if r is None else r["status"], (x, 0), ha="center", va="bottom", rotation=90,
                              fontsize=8)  # fmt: skip
    left.set(xticks=range(len(contexts)), xticklabels=[f"context {_k(c)}" for c in contexts], ylabel="tokens / s",
             title="one training step, tokens per second")  # fmt: skip
    left.legend(fontsize=8)
    points = [r for r in rows if r["predicted_speedup"] is not None and r["measured_speedup"] is not None]
    for r in points:
        right.plot(r["predicted_speedup"], r["measured_speedup"], "o", color=f"C{names.index(r['backend'])}")
        right.annotate(f"over {r['backend']}, {_k(r['context'])}", (r["predicted_speedup"], r["measured_speedup"]),
                       textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
    if points:
        values = [v for r in points for v in (r["predicted_speedup"], r["measured_speedup"])]
        lo, hi = min(values + [1.0]) * 0.9, max(values + [1.0]) * 1.1
        right.plot([lo, hi], [lo, hi], ":", color="k", lw=0.8, label="measured = predicted")
        right.legend(fontsize=8)
    right.set(xlabel="predicted step speedup (Amdahl)", ylabel="measured step speedup",
              title="flashlab's step over each backend's")  # fmt: skip
    fig.suptitle(f"{meta['device_name']}, {meta['date'][:10]}", fontsize=9)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flashlab.bench --mode step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--mode", default="step", help=argparse.SUPPRESS)
    p.add_argument("--contexts", type=size_list, help="context lengths, comma-separated ('4k' = 4096; default 4k,16k "
                   "on a GPU, 64 on the CPU)")  # fmt: skip
    p.add_argument("--tokens", type=whole_number(1), help="tokens per step; B = tokens // context, at least 1 "
                   "(default 16k on a GPU, 64 on the CPU)")  # fmt: skip
    p.add_argument("--backends", help=f"attentions to run, comma-separated, from {','.join(ATTENTIONS)} (the "
                   f"stand-in always runs; default all)")  # fmt: skip
    p.add_argument("--steps", type=whole_number(1), help="timed steps per attention; median reported (default 10, "
                   "CPU 2)")  # fmt: skip
    p.add_argument("--warmup-steps", type=whole_number(1), help="steps before the timed ones, not timed; the first "
                   "one's loss is checked (default 3, CPU 1)")  # fmt: skip
    p.add_argument("--device", choices=["cuda", "cpu"], help="where to run (default: cuda if torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="the CPU's tiny model and steps, on any device")
    p.add_argument("--dry-run", action="store_true", help="say what would run; run nothing")
    p.add_argument("--seed", type=whole_number(0, MAX_SEED), default=0, help="seed of the weights and the tokens")
    p.add_argument("--out", type=output_prefix, help="write PREFIX.json, PREFIX.csv and PREFIX.txt (default: "
                   "data/results/<gpu>-step-<date> on a GPU, test-artifacts/bench/cpu-step-<date> on the "
                   "CPU)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace the files of an --out that exist")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (a line per finished run instead)")
    return p


def plan_from_args(args: argparse.Namespace, device: str, parser: argparse.ArgumentParser) -> StepPlan:
    plan = CPU_PLAN if (args.quick or device == "cpu") else GPU_PLAN
    if plan is CPU_PLAN and device == "cuda":  # the tiny model on a GPU: SDPA's fused kernels take 16-bit inputs
        plan = replace(plan, dtype="bf16")
    if args.backends is not None:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = [b for b in backends if b not in ATTENTIONS]
        if unknown or not backends:
            parser.error(f"--backends: unknown {unknown or 'none given'}; choose from {','.join(ATTENTIONS)}")
        plan = replace(plan, backends=tuple(dict.fromkeys(backends)))
    plan = replace(plan, contexts=tuple(args.contexts or plan.contexts), tokens=args.tokens or plan.tokens,
                   steps=args.steps or plan.steps, warmup_steps=args.warmup_steps or plan.warmup_steps)  # fmt: skip
    return plan


def default_prefix(meta: dict) -> Path:
    """``data/results/<gpu>-step-<date>`` on a GPU, ``test-artifacts/bench/cpu-step-<date>`` on the CPU."""
    return recording_prefix(meta, "step")


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda: torch sees no CUDA GPU here")
    plan = plan_from_args(args, device, parser)
    if args.dry_run:
        print("\n".join(dry_run_lines(plan, device)))
        return None
    problem = output_problem(args.out, args.overwrite) if args.out else folder_problem(default_folder(
        device == "cuda"))  # fmt: skip
    if problem:
        parser.error(f"--out {args.out}: {problem}" if args.out else f"{problem} (or pass --out)")
    mode = [] if "--mode" in argv else ["--mode", "step"]
    command = shlex.join(["python", "-m", "flashlab.bench", *mode, *argv])
    results = run_step_bench(plan, device, args.seed, progress=not args.no_progress, command=command)
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
