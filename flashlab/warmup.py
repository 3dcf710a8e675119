"""``python -m flashlab.warmup``: compile the kernels a workload needs before its first real call.

Triton compiles a kernel the first time a launch brings a new combination of its compile-time arguments: the tile
config (one per length bucket, ``flashlab.kernels.configs``), the head dim, dtype and mask, and whether each
integer argument is 1 or a multiple of 16 (Triton specialises on both). A fresh machine's first calls therefore
spend seconds compiling inside the caller's step. This tool makes those first calls itself, on small tensors of
every bucket the workload will use, through the public entry points a user calls:

- prefill: ``flashlab.flash_attention`` at every length bucket from ``MIN_PREFILL`` to ``--max-len`` queries and
  keys, at a length that is a multiple of 16 and at one that is not (``bucket_lengths``);
- decode: ``flash_attention`` with one query row, and ``flash_attention_with_kvcache`` (pages of ``--page-size``
  tokens, 0 for a contiguous cache), at every cache-length bucket from 1 to ``--max-len``, both kinds of length;
- backward: autograd through ``flash_attention`` at the prefill lengths.

Each for the given head dims, dtypes, masks, GQA groups (``--kv-heads`` K/V heads, ``group`` times as many query
heads) and batch size, or a ``--model`` preset's (``MODELS``). A later call compiles nothing when it has the
same heads, head dim, dtype, mask and batch size as a warmed one and its lengths lie in the warmed buckets.
``--threads`` runs the calls from several threads at once, each on its own CUDA stream, so that Triton's compiles
(most of it in its C++ passes and ``ptxas``) overlap. On CPU tensors the kernels run through Triton's interpreter
and nothing is compiled: the calls only check that every entry point runs.

The Python API is ``warmup(...)`` (the same arguments), which returns a ``Warmed`` summary.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

from flashlab.kernels import configs

MIN_PREFILL = 17  # shorter queries (at most split_kv.MAX_SPLIT_QUERY_ROWS = 16 rows) take the decode path
MAX_LEN = configs.LENGTH_BUCKETS[-1]
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}


@dataclass(frozen=True)
class Workload:
    """What to warm up (see the module docstring); ``MODELS`` holds presets."""

    head_dims: tuple[int, ...] = (64, 128)
    dtypes: tuple[str, ...] = ("bfloat16",)
    masks: tuple[str, ...] = ("none", "causal")
    groups: tuple[int, ...] = (1,)
    kv_heads: int = 8
    max_len: int = 4096
    batch: int = 1
    window: int = 1024  # the "window" mask's left width: query i sees keys i - window ... i
    page_size: int = 256  # the KV cache's pages (0: a contiguous cache)
    decode: bool = True
    backward: bool = True

    def check(self) -> Workload:
        """The workload, or a ValueError naming its first bad field."""
        from flashlab.kernels.device import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

        for d in self.head_dims:
            if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and d % HEAD_DIM_MULTIPLE == 0):
                raise ValueError(f"head dims must be multiples of {HEAD_DIM_MULTIPLE} from {MIN_HEAD_DIM} to "
                                 f"{MAX_HEAD_DIM}; got {d}")  # fmt: skip
        for dtype in self.dtypes:
            configs.dtype_name(dtype)
        for mask in self.masks:
            if mask not in configs.MASKS:
                raise ValueError(f"masks must be among {', '.join(configs.MASKS)}; got {mask!r}")
        for name, values in (("head_dims", self.head_dims), ("dtypes", self.dtypes), ("masks", self.masks),
                             ("groups", self.groups)):  # fmt: skip
            if not values:
                raise ValueError(f"{name} must name at least one value")
        for name, value, most in (("groups", min(self.groups), 256), ("kv_heads", self.kv_heads, 256),
                                  ("max_len", self.max_len, MAX_LEN), ("batch", self.batch, 4096),
                                  ("window", self.window, MAX_LEN)):  # fmt: skip
            if not 1 <= value <= most:
                raise ValueError(f"{name} must be from 1 to {most}; got {value}")
        if max(self.groups) > 256:
            raise ValueError(f"groups must be from 1 to 256; got {max(self.groups)}")
        if self.page_size < 0 or self.page_size % 16:
            raise ValueError(f"page_size must be 0 (a contiguous cache) or a multiple of 16; got {self.page_size}")
        return self


# Presets: the attention layers of a few well-known model shapes.
MODELS = {
    "gpt2-small": Workload(head_dims=(64,), masks=("causal",), groups=(1,), kv_heads=12, max_len=1024),
    "llama-8b": Workload(head_dims=(128,), masks=("causal",), groups=(4,), kv_heads=8, max_len=8192),
    "mistral-7b": Workload(head_dims=(128,), masks=("window",), groups=(4,), kv_heads=8, max_len=32768, window=4096),
}


@dataclass(frozen=True)
class Call:
    """One warm-up call: which entry point, the inputs' dtype, head dim, heads, batch, lengths and mask."""

    kind: str  # "prefill", "decode", "kvcache" or "backward"
    dtype: str
    head_dim: int
    mask: str
    group: int
    kv_heads: int
    batch: int
    nq: int
    nk: int
    window: int = 0
    page_size: int = 0

    def label(self) -> str:
        page = f" pages {self.page_size}" if self.kind == "kvcache" else ""
        return (f"{self.kind} {self.dtype} D={self.head_dim} {self.mask} B={self.batch} "
                f"Hq={self.group * self.kv_heads} Hk={self.kv_heads} Nq={self.nq} Nk={self.nk}{page}")  # fmt: skip

    def causal_window(self):
        if self.mask == "none":
            return False, None
        return True, ((self.window, None) if self.mask == "window" else None)


def bucket_lengths(least: int, most: int) -> list[int]:
    """Lengths from ``least`` to ``most`` that cover each length bucket between them both ways: a multiple of 16
    where the bucket holds one and a length that is not (the bucket's top or ``most``, one less, and the
    multiple of 16 at or below it). Ascending, no repeats."""
    out = set()
    top = configs.length_bucket(least)
    while top <= configs.length_bucket(most):
        x = min(top, most)
        out |= {n for n in (x, x - 1, x // 16 * 16) if least <= n and configs.length_bucket(n) == top}
        top *= 2
    return sorted(out)


def plan_calls(work: Workload) -> list[Call]:
    """Every call ``warmup`` makes for a workload, in order."""
    calls = []
    prefill = bucket_lengths(MIN_PREFILL, work.max_len) if work.max_len >= MIN_PREFILL else []
    decode = bucket_lengths(1, work.max_len)
    # a decode query's causal band hides nothing: the same kernels as no mask
    decode_masks = list(dict.fromkeys("none" if m == "causal" else m for m in work.masks))
    for dtype in work.dtypes:
        for d in work.head_dims:
            for group in work.groups:
                base = Call("prefill", configs.dtype_name(dtype), d, "none", group, work.kv_heads, work.batch, 1, 1,
                            work.window)  # fmt: skip
                for mask in work.masks:
                    calls += [replace(base, mask=mask, nq=n, nk=n) for n in prefill]
                    if work.backward:
                        calls += [replace(base, kind="backward", mask=mask, nq=n, nk=n) for n in prefill]
                if work.decode:
                    for mask in decode_masks:
                        calls += [replace(base, kind="decode", mask=mask, nk=n) for n in decode]
                        calls += [replace(base, kind="kvcache", mask=mask, nk=n, page_size=work.page_size)
                                  for n in decode]  # fmt: skip
    return calls


# ----------------------------------------------------------------------------------------------------------------
# Making the calls
# ----------------------------------------------------------------------------------------------------------------


def run_call(call: Call, device) -> None:
    """Make one call through the public entry points, on random inputs of its shape."""
    import torch

    import flashlab.host as host

    dtype = getattr(torch, call.dtype)
    b, hk, hq, d = call.batch, call.kv_heads, call.group * call.kv_heads, call.head_dim
    g = torch.Generator(device=device).manual_seed(call.nk)
    causal, window = call.causal_window()
    q = torch.randn(b, hq, call.nq, d, device=device, generator=g).to(dtype)
    if call.kind == "kvcache":
        page = call.page_size
        if page:  # (pages, page size, Hk, D) and a block table of each sequence's pages in order
            blocks = -(-call.nk // page)
            k_cache = torch.randn(b * blocks, page, hk, d, device=device, generator=g).to(dtype)
            table = torch.arange(b * blocks, dtype=torch.int32, device=device).view(b, blocks)
        else:  # one slab per sequence, (B, Nk, Hk, D)
            k_cache = torch.randn(b, call.nk, hk, d, device=device, generator=g).to(dtype)
            table = None
        v_cache = torch.randn_like(k_cache)
        seqlens = torch.full((b,), call.nk, dtype=torch.int32, device=device)
        host.flash_attention_with_kvcache(q, k_cache, v_cache, seqlens, table, causal=causal, window=window)
        return
    k = torch.randn(b, hk, call.nk, d, device=device, generator=g).to(dtype)
    v = torch.randn_like(k)
    if call.kind == "backward":
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        o = host.flash_attention(q, k, v, causal=causal, window=window)
        o.backward(torch.randn_like(o))
        return
    host.flash_attention(q, k, v, causal=causal, window=window)


@dataclass
class Warmed:
    """What ``warmup`` did: the calls made, the seconds they took, the device and threads."""

    calls: list[Call] = field(default_factory=list)
    seconds: float = 0.0
    device: str = "cpu"
    threads: int = 1

    def summary(self) -> str:
        kinds = {}
        for c in self.calls:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        each = ", ".join(f"{n} {k}" for k, n in kinds.items())
        return (f"warmed {len(self.calls)} calls ({each}) on {self.device} in {self.seconds:.1f} s "
                f"with {self.threads} thread{'s' if self.threads > 1 else ''}")  # fmt: skip


def warmup(model: str | None = None, *, device=None, threads: int = 1, progress: bool = True, **fields) -> Warmed:
    """Make the warm-up calls of a workload: a ``MODELS`` preset, its fields overridden by ``fields`` (those of
    ``Workload``), or the default workload with them. ``device`` defaults to the current CUDA device, else the CPU;
    ``threads`` > 1 makes the calls from that many threads at once, each on its own CUDA stream."""
    import torch

    if model is not None and model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {model!r}")
    unknown = sorted(set(fields) - set(Workload.__dataclass_fields__))
    if unknown:
        raise ValueError(f"warmup takes no field {unknown[0]!r}; the workload's fields: "
                         f"{', '.join(Workload.__dataclass_fields__)}")  # fmt: skip
    if not 1 <= threads <= 64:
        raise ValueError(f"threads must be from 1 to 64; got {threads}")
    work = replace(MODELS[model] if model else Workload(), **fields).check()
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    calls = plan_calls(work)
    from tqdm import tqdm

    start = time.perf_counter()
    bar = tqdm(total=len(calls), desc="flashlab.warmup", unit="call", disable=not progress)
    if threads == 1:
        for call in calls:
            run_call(call, device)
            bar.update()
    else:
        streams = threading.local()

        def on_own_stream(call):
            if device.type != "cuda":
                return run_call(call, device)
            if not hasattr(streams, "stream"):
                streams.stream = torch.cuda.Stream(device)
            with torch.cuda.stream(streams.stream):
                run_call(call, device)
            streams.stream.synchronize()

        with ThreadPoolExecutor(threads, thread_name_prefix="flashlab-warmup") as pool:
            for done in as_completed([pool.submit(on_own_stream, c) for c in calls]):
                done.result()
                bar.update()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    bar.close()
    return Warmed(calls, time.perf_counter() - start, str(device), threads)


# ----------------------------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """Errors are one line on stderr, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def _list(kind):
    def parse(text: str):
        items = [x.strip().lower() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated values; got {text!r}")
        if kind is str:
            return tuple(dict.fromkeys(DTYPE_ALIASES.get(x, x) for x in items))
        try:
            return tuple(dict.fromkeys(int(x[:-1]) * 1024 if x.endswith("k") else int(x) for x in items))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers; got {text!r}") from None

    return parse


def _length(text: str) -> int:
    """'4096' or '4k' -> 4096."""
    x = text.strip().lower()
    try:
        return int(x[:-1]) * 1024 if x.endswith("k") else int(x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length like 4096 or 4k; got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    default = Workload()
    p = OneLineParser(
        prog="python -m flashlab.warmup",
        description="Compile ahead of time the kernels a workload's attention calls need: every length bucket up "
        "to --max-len, through flashlab's public entry points on small tensors.",
        epilog=f"Presets (--model): {'; '.join(f'{n}: {describe(w)}' for n, w in MODELS.items())}. Flags given with "
        "--model override its values.",
    )
    p.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    p.add_argument("--head-dims", type=_list(int), help=f"head dims (default: {_csv(default.head_dims)})")
    p.add_argument("--dtypes", type=_list(str), help="bf16, fp16, fp32 (default: bf16)")
    p.add_argument("--masks", type=_list(str), help=f"none, causal, window (default: {_csv(default.masks)})")
    p.add_argument("--gqa", type=_list(int), dest="groups", help="query heads per K/V head (default: 1)")
    p.add_argument("--kv-heads", type=int, help=f"K/V heads (default: {default.kv_heads})")
    p.add_argument("--batch", type=int, help=f"sequences per call (default: {default.batch})")
    p.add_argument("--max-len", type=_length, help=f"longest query or cache length, 1k = 1024 (default: "
                   f"{default.max_len})")  # fmt: skip
    p.add_argument("--window", type=int, help=f"the window mask's width in keys (default: {default.window})")
    p.add_argument("--page-size", type=int, help=f"KV-cache page size, 0 for a contiguous cache (default: "
                   f"{default.page_size})")  # fmt: skip
    p.add_argument("--decode", action=argparse.BooleanOptionalAction, help="warm the decode paths (default: on)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, help="warm the backward (default: on)")
    p.add_argument("--threads", type=int, default=1, help="make the calls from this many threads (default: 1)")
    p.add_argument("--device", help="where to run (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--dry-run", action="store_true", help="list the calls and exit")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def describe(work: Workload) -> str:
    return (f"D {_csv(work.head_dims)}, {_csv(work.masks)}, GQA {_csv(work.groups)} x {work.kv_heads} K/V heads, "
            f"up to {work.max_len}" + (f", window {work.window}" if "window" in work.masks else ""))  # fmt: skip


FLAG_FIELDS = ("head_dims", "dtypes", "masks", "groups", "kv_heads", "batch", "max_len", "window", "page_size",
               "decode", "backward")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> Warmed | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {name: getattr(args, name) for name in FLAG_FIELDS if getattr(args, name) is not None}
    try:
        if args.model is not None and args.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}; got {args.model!r}")
        work = replace(MODELS[args.model] if args.model else Workload(), **fields).check()
        if not 1 <= args.threads <= 64:
            raise ValueError(f"--threads must be from 1 to 64; got {args.threads}")
        import torch

        device = torch.device(args.device) if args.device else None
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: there is no CUDA GPU here")
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    if args.dry_run:
        calls = plan_calls(work)
        for call in calls:
            print(call.label())
        print(f"{len(calls)} calls")
        return None
    from dataclasses import asdict

    done = warmup(device=device, threads=args.threads, progress=not args.no_progress, **asdict(work))
    print(done.summary())
    return done


__all__ = ["Call", "MODELS", "Warmed", "Workload", "build_parser", "main", "plan_calls", "run_call", "warmup"]

if __name__ == "__main__":
    main()
