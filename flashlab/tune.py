"""``python -m flashlab.tune``: make the tuned-config table of this GPU (``flashlab.kernels.configs``).

For each bucket of a small representative set, it runs the kernel's own Triton autotuner once on a shape of that
bucket, checks the output against the float64 reference (a sample of rows), and records the autotuner's pick. The
table it writes, ``flashlab/kernels/tuned/<family>.json`` by default, is what later launches on this GPU family
read instead of autotuning inside a call.

The default set is the buckets a call of each kernel most often lands in:

- decode, ``split_kv`` and ``kvcache`` (a contiguous cache and 256-token pages): bf16 and fp16, D 64 and 128, GQA
  groups 1, 4, 8, one query row, 1K to 128K keys, no mask; ``DECODE_BATCH`` sequences of ``DECODE_KV_HEADS`` K/V
  heads;
- prefill, ``skip_split`` (fp32 and bf16) and ``hopper`` (bf16): D 64 and 128, no mask and causal, 1K, 4K and 16K
  queries and keys, with ``PREFILL_TOKENS`` tokens per batch and a ``MODEL_DIM``-wide model (H = MODEL_DIM / D),
  as the benchmark sizes its prefill cells;
- the backward, ``backward_dkdv`` and ``backward_dq`` (bf16): the prefill buckets' shapes, dQ, dK and dV from a
  random dO; the gradients checked against float64 autograd on the first sequence and K/V head.

The flags widen or narrow it (``--kernels``, ``--dtypes``, ``--head-dims``, ``--groups``, ``--masks``,
``--kv-lengths``, ``--lengths``, ``--page-sizes``); ``--dry-run`` lists the buckets without running anything (on
any machine). A bucket a kernel cannot run on this GPU (the Hopper rung off Hopper) is skipped and said so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from flashlab.kernels import configs

DECODE_BATCH = 4  # sequences per decode step
DECODE_KV_HEADS = 8  # K/V heads of a decode step (query heads: group x this)
PREFILL_TOKENS = 16384  # tokens per prefill batch: B = PREFILL_TOKENS / N
MODEL_DIM = 2048  # query heads of a prefill cell: MODEL_DIM / D
WINDOW_FRACTION = 4  # a "window" bucket's shape sees the last N / WINDOW_FRACTION keys
CHECK_ROWS = 64  # query rows of a prefill shape checked against float64

DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
DTYPE_ALIASES_BACK = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DEFAULT_KERNELS = ("split_kv", "kvcache", "skip_split", "hopper", "backward_dkdv", "backward_dq")
DEFAULT_DTYPES = {
    "split_kv": ("bfloat16", "float16"),
    "kvcache": ("bfloat16", "float16"),
    "skip_split": ("float32", "bfloat16"),
    "hopper": ("bfloat16",),
    "lesson_loop": ("bfloat16",),
    "backward_dkdv": ("bfloat16",),
    "backward_dq": ("bfloat16",),
}
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_GROUPS = (1, 4, 8)
DEFAULT_DECODE_MASKS = ("none",)
DEFAULT_PREFILL_MASKS = ("none", "causal")
DEFAULT_KV_LENGTHS = tuple(2**i for i in range(10, 18))  # 1K ... 128K
DEFAULT_LENGTHS = (1024, 4096, 16384)
DEFAULT_PAGE_SIZES = (0, 256)
SMALL_PAGE = 128  # pages of fewer tokens take kvcache.SMALL_BLOCK_CONFIG on 16-bit inputs: nothing to tune


@dataclass(frozen=True)
class Shape:
    """One bucket's representative launch: the kernel, its inputs' dtype and head dim, the mask, the GQA group,
    the query and key lengths and (KV cache) the page size."""

    kernel: str
    dtype: str
    head_dim: int
    mask: str
    group: int
    nq: int
    nk: int
    page_size: int = 0

    @property
    def decode(self) -> bool:
        return self.kernel in configs.DECODE_KERNELS

    @property
    def backward(self) -> bool:
        return self.kernel in configs.BACKWARD_KERNELS

    def sizes(self) -> tuple[int, int, int]:
        """``(B, Hq, Hk)`` of the launch."""
        if self.decode:
            return DECODE_BATCH, self.group * DECODE_KV_HEADS, DECODE_KV_HEADS
        heads = max(1, MODEL_DIM // self.head_dim)
        return max(1, PREFILL_TOKENS // self.nq), heads, heads

    def causal_window(self):
        """``(causal, window)`` of the launch (``flashlab.flash_attention``'s arguments)."""
        if self.mask == "none":
            return False, None
        if self.mask == "causal":
            return True, None
        return True, (max(1, self.nk // WINDOW_FRACTION), None)

    @property
    def capacity(self) -> int:
        """Keys the launch covers: the KV cache's whole pages, else the keys."""
        return -(-self.nk // self.page_size) * self.page_size if self.page_size else self.nk

    def band(self):
        """``(offset, win_left, win_right, qk_scale)`` of the launch over ``capacity`` keys."""
        from flashlab.kernels.device import kernel_band

        causal, window = self.causal_window()
        return kernel_band(self.nq, self.capacity, self.head_dim, causal, window, None)[:4]

    def key(self) -> tuple:
        """The bucket the launch's ``configs.pick`` reads: the mask as its band hides keys, as in the launch."""
        offset, win_left, win_right, _ = self.band()
        mask = configs.mask_kind(self.nq, self.capacity, offset, win_left, win_right)
        extra = {"page_size": self.page_size} if self.kernel == "kvcache" else {}
        return configs.bucket(self.kernel, dtype=self.dtype, head_dim=self.head_dim, mask=mask, group=self.group,
                              nq=self.nq, nk=self.capacity, **extra)  # fmt: skip

    def label(self) -> str:
        b, hq, hk = self.sizes()
        page = f" pages {self.page_size}" if self.kernel == "kvcache" else ""
        return (f"{self.kernel} {self.dtype} D={self.head_dim} {self.mask} B={b} Hq={hq} Hk={hk} "
                f"Nq={self.nq} Nk={self.nk}{page}")  # fmt: skip


def plan_shapes(kernels, dtypes, head_dims, groups, masks, kv_lengths, lengths, page_sizes) -> list[Shape]:
    """The shapes to tune, one per bucket (a shape whose bucket an earlier one has is left out). ``dtypes`` and
    ``masks`` None: each kernel's defaults. fp32 is left out of the Hopper rung (16-bit only), pages smaller than
    ``SMALL_PAGE`` tokens out of 16-bit KV-cache buckets (a fixed config), and prefill groups (one bucket)."""
    shapes, seen = [], set()
    for kernel in kernels:
        decode = kernel in configs.DECODE_KERNELS
        kernel_dtypes = DEFAULT_DTYPES[kernel] if dtypes is None else dtypes
        kernel_masks = masks or (DEFAULT_DECODE_MASKS if decode else DEFAULT_PREFILL_MASKS)
        for dtype in kernel_dtypes:
            if kernel == "hopper" and dtype == "float32":
                continue
            for d in head_dims:
                for mask in kernel_masks:
                    for group in groups if decode else (1,):
                        pages = page_sizes if kernel == "kvcache" else (0,)
                        for page in pages:
                            if kernel == "kvcache" and 0 < page < SMALL_PAGE and dtype != "float32":
                                continue
                            for n in kv_lengths if decode else lengths:
                                shape = Shape(kernel, dtype, d, mask, group, 1 if decode else n, n, page)
                                if shape.key() not in seen:
                                    seen.add(shape.key())
                                    shapes.append(shape)
    return shapes


# ----------------------------------------------------------------------------------------------------------------
# Tuning one shape on the GPU
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def autotuning(warmup_ms: float, rep_ms: float) -> Iterator[None]:
    """Launches use the kernels' autotuners (``FLASHLAB_AUTOTUNE=1``) and each autotuner times a config over
    ``warmup_ms`` + ``rep_ms`` milliseconds (Triton's default is 25 + 100)."""
    import triton.testing

    bench = functools.partial(triton.testing.do_bench, warmup=warmup_ms, rep=rep_ms)
    tuners = list(autotuners().values())
    saved = [t.__dict__.get("do_bench") for t in tuners]
    before = os.environ.get(configs.AUTOTUNE_ENV)
    os.environ[configs.AUTOTUNE_ENV] = "1"
    for t in tuners:
        t.do_bench = bench  # an instance attribute: the autotuner's own is a cached property
    try:
        yield
    finally:
        for t, old in zip(tuners, saved, strict=True):
            if old is None:
                t.__dict__.pop("do_bench", None)
            else:
                t.do_bench = old
        if before is None:
            os.environ.pop(configs.AUTOTUNE_ENV, None)
        else:
            os.environ[configs.AUTOTUNE_ENV] = before


def autotuners() -> dict:
    """Each kernel's Triton autotuner."""
    from flashlab.kernels.backward import rung1_two_pass as two_pass
    from flashlab.kernels.decode import kvcache, split_kv
    from flashlab.kernels.ladder import rung1_lesson_loop, rung2_skip_split, rung3_hopper

    return {
        "split_kv": split_kv.split_kv_partial_tuned,
        "kvcache": kvcache.kvcache_partial_tuned,
        "skip_split": rung2_skip_split.attn_fwd_tuned,
        "hopper": rung3_hopper.hopper_fwd_tuned,
        "lesson_loop": rung1_lesson_loop.lesson_loop_fwd_tuned,
        "backward_dkdv": two_pass._bwd_dkdv_tuned,
        "backward_dq": two_pass._bwd_dq_tuned,
    }


def unavailable(shape: Shape, device) -> str | None:
    """Why a shape's kernel cannot run on this device, or None (only the Hopper rung has conditions)."""
    if shape.kernel != "hopper":
        return None
    import torch

    from flashlab.kernels.ladder import rung3_hopper

    probe = torch.empty(1, 1, 16, shape.head_dim, dtype=getattr(torch, shape.dtype), device=device)
    return rung3_hopper.unavailable(probe, probe, probe, *shape.causal_window())


def inputs(shape: Shape, device, seed: int = 0):
    """Random ``q (B, Hq, Nq, D)``, ``k``, ``v (B, Hk, Nk, D)`` of a shape, in its dtype."""
    import torch

    b, hq, hk = shape.sizes()
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    q = torch.randn(b, hq, shape.nq, shape.head_dim, device=device, generator=g).to(dtype)
    k = torch.randn(b, hk, shape.nk, shape.head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(b, hk, shape.nk, shape.head_dim, device=device, generator=g).to(dtype)
    return q, k, v


def launch(shape: Shape, q, k, v):
    """Run the shape's kernel through its plain launch: ``(o, lse)``."""
    import torch

    from flashlab.kernels.decode import kvcache, split_kv
    from flashlab.kernels.ladder import rung1_lesson_loop, rung2_skip_split, rung3_hopper

    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    offset, win_left, win_right, qk_scale = band = shape.band()
    if shape.kernel == "split_kv":
        split_kv.launch(q, k, v, o, lse, offset, win_left, win_right, qk_scale)
    elif shape.kernel == "kvcache":  # every sequence holds nk keys; the band covers the pages' capacity
        if shape.page_size:
            k_cache, v_cache, table, seqlens = kvcache.paged_kv_cache(k, v, shape.page_size)
        else:  # one slab per sequence, (B, Nk, Hk, D); the table is never read
            k_cache, v_cache = (x.transpose(1, 2).contiguous() for x in (k, v))
            table = seqlens = torch.full((q.shape[0],), shape.nk, dtype=torch.int32, device=q.device)
        kvcache.launch(q, k_cache, v_cache, table, seqlens, o, lse, shape.page_size, shape.capacity, win_left,
                       win_right, qk_scale)  # fmt: skip
    else:
        module = {"skip_split": rung2_skip_split, "hopper": rung3_hopper, "lesson_loop": rung1_lesson_loop}
        causal, window = shape.causal_window()
        module[shape.kernel].launch(q, k, v, o, lse, causal, window, band)
    return o, lse


def check(shape: Shape, q, k, v, o) -> None:
    """A RuntimeError where the launch's output differs from the float64 reference on a sample of rows by more
    than the dtype's tolerance (``flashlab.core.numerics``)."""
    import torch

    from flashlab.core.numerics import tolerance
    from flashlab.reference.torch_float64 import attention_float64

    causal, window = shape.causal_window()
    step = max(1, shape.nq // CHECK_ROWS)
    rows = list(range(shape.nq - 1, -1, -step))[:CHECK_ROWS]
    expected, _ = attention_float64(q, k, v, causal=causal, window=window, rows=rows)
    got = o[:, :, rows].double()
    error = float(torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected).clamp_min(1e-30))
    allowed = tolerance(q.dtype)
    if not error <= allowed:
        raise RuntimeError(f"{shape.label()}: relative error {error:.3g} against float64 exceeds {allowed:g}")


def launch_backward(shape: Shape, q, k, v, seed: int = 1):
    """The backward of the shape's attention from a random dO, through the two-pass rung's ``attention_backward``
    (its two main kernels' launches): ``((dq, dk, dv), do)``. The forward's o and lse come from skip and split."""
    import torch

    from flashlab.kernels.backward.rung1_two_pass import attention_backward
    from flashlab.kernels.ladder import rung2_skip_split

    causal, window = shape.causal_window()
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    rung2_skip_split.launch(q, k, v, o, lse, causal, window, shape.band())
    g = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(q.shape, device=q.device, generator=g).to(q.dtype)
    return attention_backward(do, q, k, v, o, lse, causal, window, None), do


def check_backward(shape: Shape, q, k, v, do, grads) -> None:
    """A RuntimeError where a gradient of the first sequence and K/V head (dK and dV need every query row, so rows
    are not sampled) differs from float64 autograd by more than the dtype's gradient tolerance."""
    from flashlab.core.numerics import grad_tolerance, relative_error
    from flashlab.reference.torch_float64 import attention_float64_grads, query_heads

    causal, window = shape.causal_window()
    expected = attention_float64_grads(q, k, v, do, causal, window, batch=[0], kv_heads=[0])
    heads = query_heads([0], q.shape[1] // k.shape[1])
    got = (grads[0][:1, heads], grads[1][:1, :1], grads[2][:1, :1])
    allowed = grad_tolerance(q.dtype)
    for name, x, want in zip(("dq", "dk", "dv"), got, expected, strict=True):
        error = relative_error(x, want)
        if not error <= allowed:
            message = f"{name} relative error {error:.3g} against float64 exceeds {allowed:g}"
            raise RuntimeError(f"{shape.label()}: {message}")


def tune_shape(shape: Shape, device) -> dict:
    """The autotuner's pick for one shape (inside ``autotuning``), after checking its output."""
    import torch

    q, k, v = inputs(shape, device)
    if shape.backward:
        grads, do = launch_backward(shape, q, k, v)
        torch.cuda.synchronize(device)
        check_backward(shape, q, k, v, do, grads)
    else:
        o, _ = launch(shape, q, k, v)
        torch.cuda.synchronize(device)
        check(shape, q, k, v, o)
    picked = autotuners()[shape.kernel].best_config.all_kwargs()
    return {name: value for name, value in picked.items() if isinstance(value, (bool, int))}


def table_entry(shape: Shape, config: dict) -> dict:
    key = shape.key()
    fields = dict(zip(("kernel", "dtype", "head_dim", "mask", "group", "nq", "nk"), key[:7], strict=True))
    return {**fields, "extra": dict(key[7]), "config": config}


def table_document(entries: list[dict], device, command: str) -> dict:
    """The table file's contents (format: ``flashlab.kernels.configs``) for entries tuned on ``device``."""
    import torch
    import triton

    return {
        "version": configs.TABLE_VERSION,
        "family": configs.device_family(device),
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "entries": entries,
    }


RUN_FIELDS = ("gpu", "torch", "triton", "cuda", "python", "date", "command")


def updated_table(old: dict, new: dict) -> dict:
    """``new``'s header and entries, with ``old``'s entries of the buckets ``new`` did not tune kept (first), and
    the runs that made them listed under ``earlier_runs``."""
    tuned = {configs.entry_key(e) for e in new["entries"]}
    kept = [e for e in old["entries"] if configs.entry_key(e) not in tuned]
    runs = [*old.get("earlier_runs", []), {f: old.get(f) for f in RUN_FIELDS}]
    return {**new, "earlier_runs": runs, "entries": kept + new["entries"]}


# ----------------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """Errors are one line on stderr, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def _names(choices, aliases=None, what="names"):
    def parse(text: str) -> tuple[str, ...]:
        out = []
        for name in (x.strip() for x in text.split(",")):
            name = (aliases or {}).get(name.lower(), name.lower())
            if name not in choices:
                raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(choices)}; got {text!r}")
            if name not in out:
                out.append(name)
        return tuple(out)

    return parse


def _ints(least: int, most: int, *, multiple: int = 1, power_of_two: bool = False, zero: bool = False):
    def parse(text: str) -> tuple[int, ...]:
        out = []
        for x in text.split(","):
            x = x.strip().lower()
            try:
                value = int(x[:-1]) * 1024 if x.endswith("k") else int(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers; got {text!r}") from None
            if zero and value == 0:
                out.append(0)
                continue
            if not least <= value <= most or value % multiple or (power_of_two and value & (value - 1)):
                kind = "powers of two " if power_of_two else (f"multiples of {multiple} " if multiple > 1 else "")
                raise argparse.ArgumentTypeError(f"expected {kind}from {least} to {most}; got {x!r} in {text!r}")
            out.append(value)
        return tuple(dict.fromkeys(out))

    return parse


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds; got {text!r}") from None
    if not 0 < value <= 10_000:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 10000 ms; got {text!r}")
    return value


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def build_parser() -> argparse.ArgumentParser:
    from flashlab.kernels.device import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

    longest = configs.LENGTH_BUCKETS[-1]
    dtype_names = tuple(configs.DTYPE_NAMES.values())
    defaults = "; ".join(f"{k} {_csv(DTYPE_ALIASES_BACK[d] for d in v)}" for k, v in DEFAULT_DTYPES.items())
    p = OneLineParser(
        prog="python -m flashlab.tune",
        description="Run each kernel's autotuner once per bucket of a representative set on this GPU, check each "
        "pick against float64, and write the table later launches read instead of autotuning inside a call.",
        epilog="The table goes to the package's flashlab/kernels/tuned/<gpu family>.json unless --out says "
        "otherwise; FLASHLAB_CONFIGS=PATH makes launches read another file, FLASHLAB_AUTOTUNE=1 makes them autotune "
        "inside calls instead.",
    )
    p.add_argument(
        "--kernels",
        type=_names(configs.KERNELS, what="kernels"),
        default=DEFAULT_KERNELS,
        help=f"kernels to tune, among {_csv(configs.KERNELS)} (default: {_csv(DEFAULT_KERNELS)})",
    )
    p.add_argument(
        "--dtypes",
        type=_names(dtype_names, DTYPE_ALIASES, "dtypes"),
        help=f"input dtypes for every kernel: bf16, fp16, fp32 (default: {defaults})",
    )
    p.add_argument(
        "--head-dims",
        type=_ints(MIN_HEAD_DIM, MAX_HEAD_DIM, multiple=HEAD_DIM_MULTIPLE),
        default=DEFAULT_HEAD_DIMS,
        help=f"head dims; a bucket is the tile width a head dim pads to (default: {_csv(DEFAULT_HEAD_DIMS)})",
    )
    p.add_argument(
        "--groups",
        type=_ints(1, configs.MAX_GROUP_BUCKET, power_of_two=True),
        default=DEFAULT_GROUPS,
        help=f"query heads per K/V head of the decode buckets (default: {_csv(DEFAULT_GROUPS)})",
    )
    p.add_argument(
        "--masks",
        type=_names(configs.MASKS, what="masks"),
        help="masks among none, causal, window (default: none for decode, none,causal for prefill)",
    )
    p.add_argument(
        "--kv-lengths",
        type=_ints(1, longest, power_of_two=True),
        default=DEFAULT_KV_LENGTHS,
        help="decode cache lengths, powers of two, 1k = 1024 (default: 1k,2k,...,128k)",
    )
    p.add_argument(
        "--lengths",
        type=_ints(1, longest, power_of_two=True),
        default=DEFAULT_LENGTHS,
        help=f"prefill lengths, queries = keys, powers of two (default: {_csv(DEFAULT_LENGTHS)})",
    )
    p.add_argument(
        "--page-sizes",
        type=_ints(SMALL_PAGE, 4096, multiple=16, zero=True),
        default=DEFAULT_PAGE_SIZES,
        help="KV-cache page sizes: 0 (a contiguous cache) or 128 tokens and up; smaller pages run a fixed config "
        f"(default: {_csv(DEFAULT_PAGE_SIZES)})",
    )
    p.add_argument("--warmup-ms", type=_milliseconds, default=10.0, help="autotuner warm-up per config (default: 10)")
    p.add_argument("--rep-ms", type=_milliseconds, default=40.0, help="autotuner timing per config (default: 40)")
    p.add_argument("--out", type=Path, help="the table file to write (default: the package's table of this GPU)")
    p.add_argument("--overwrite", action="store_true", help="replace the --out file if it exists")
    p.add_argument(
        "--update",
        action="store_true",
        help="add the buckets tuned now to the existing --out table, replacing those it has and keeping the others "
        "(a set too long for one run, a wider set)",
    )
    p.add_argument("--dry-run", action="store_true", help="list the buckets and exit (runs anywhere, no GPU needed)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def output_problem(path: Path, overwrite: bool, update: bool = False) -> str | None:
    """Why the table cannot be written to ``path``, or None."""
    if overwrite and update:
        return "--overwrite replaces the table and --update adds to it: pass one of them"
    if path.is_dir():
        return f"{path} is a folder; name the table file, e.g. {path / 'gpu.json'}"
    if update:
        if not path.is_file():
            return f"{path} does not exist: --update adds to a table that is there"
        try:
            configs.check_table(json.loads(path.read_text()), source=str(path))
        except ValueError as e:  # json.JSONDecodeError too
            return f"--update cannot read it: {e}"
    elif path.exists() and not overwrite:
        return f"{path} already exists; pass --overwrite to replace it, --update to add to it, or choose another --out"
    if path.suffix != ".json":
        return f"{path}: a table file ends in .json"
    return None


def main(argv: Sequence[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    shapes = plan_shapes(args.kernels, args.dtypes, args.head_dims, args.groups, args.masks, args.kv_lengths,
                         args.lengths, args.page_sizes)  # fmt: skip
    if not shapes:
        parser.error("these flags leave no bucket to tune (fp32 is not for hopper; pages under 128 tokens are fixed)")
    if args.dry_run:
        for shape in shapes:
            print(shape.label())
        kernels = sorted({s.kernel for s in shapes})
        counts = ", ".join(f"{k} {sum(s.kernel == k for s in shapes)}" for k in kernels)
        print(f"{len(shapes)} buckets ({counts})")
        return None
    import torch

    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA GPU (Triton's interpreter on the CPU has no configs to time); "
                     "--dry-run lists the buckets anywhere")  # fmt: skip
    device = torch.device("cuda", torch.cuda.current_device())
    out = args.out or configs.table_path(configs.device_family(device))
    problem = output_problem(out, args.overwrite, args.update)
    if not problem and args.update and json.loads(out.read_text())["family"] != configs.device_family(device):
        problem = f"its family is not this GPU's ({configs.device_family(device)})"
    if problem:
        parser.error(f"--out {out}: {problem}")
    from tqdm import tqdm

    command = shlex.join(["python", "-m", "flashlab.tune", *argv])
    entries, skipped, start = [], [], time.perf_counter()
    with autotuning(args.warmup_ms, args.rep_ms):
        for shape in tqdm(shapes, desc="flashlab.tune", unit="bucket", disable=args.no_progress):
            why = unavailable(shape, device)
            if why is not None:
                skipped.append(f"{shape.label()}: {why}")
                continue
            entries.append(table_entry(shape, tune_shape(shape, device)))
            torch.cuda.empty_cache()
    doc = table_document(entries, device, command)
    if args.update:
        doc = updated_table(json.loads(out.read_text()), doc)
    configs.check_table(doc, source=str(out))  # what is written is what launches can read
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w" if args.overwrite or args.update else "x") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    configs.clear_cache()
    for line in skipped:
        print(f"skipped {line}")
    print(f"tuned {len(entries)} buckets in {time.perf_counter() - start:.0f} s; wrote {out}")
    return doc


__all__ = [
    "Shape",
    "build_parser",
    "check_backward",
    "launch_backward",
    "main",
    "plan_shapes",
    "table_document",
    "table_entry",
    "tune_shape",
]

if __name__ == "__main__":
    main()
