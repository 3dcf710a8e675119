"""Which of PyTorch's attention backends actually runs: pin each one in turn and see what runs and what refuses.

``torch.nn.functional.scaled_dot_product_attention`` (SDPA) is one function with several kernels behind it:

    MATH                 the plain materialised version (any device, any dtype, any head dim)
    FLASH_ATTENTION      FlashAttention-2 on CUDA; a tiled CPU kernel on CPU
    EFFICIENT_ATTENTION  the memory-efficient (xFormers / CUTLASS) kernel, CUDA only
    CUDNN_ATTENTION      NVIDIA's cuDNN fused attention, CUDA only

Left to itself, SDPA picks one from the dtype, head dim, mask, device and GPU generation, and silently falls back
to the next when a kernel cannot take the problem. ``probe_sdpa_backends`` makes that choice visible: for each
dtype / head dim / causal setting it records which backend the dispatcher would pick, then pins every backend
with ``torch.nn.attention.sdpa_kernel`` and records whether it ran (and matched the float64 reference within a
tolerance suited to the dtype) or raised (and why).

    python -m flashlab.sdpa --device cuda --head-dims 64,96,100,128,192,256,512,1024 \\
        --out data/results/h200-sdpa-backends.json

writes that table as JSON, stamped with the device, torch / triton / CUDA versions and the date.

Whose reason is it? When a pinned call finds no kernel, PyTorch re-runs every fused backend's checks and warns
what each one objected to, under a header per backend ("Memory efficient kernel not used because:", "Flash
attention kernel not used because:", "cuDNN attention kernel not used because:"; ``select_sdp_backend`` in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``). Pinning one backend switches the others off, so their
sections say only "... has been runtime disabled". ``backend_reasons`` keeps the lines of the pinned backend's own
section, so a row's ``reasons`` are that backend's and no other's.

On CPU, ``FLASH_ATTENTION`` is not the CUDA FlashAttention-2 kernel: it is PyTorch's own tiled C++ kernel
(``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``, the same online-softmax loop), and its gate
(``use_flash_attention_cpp`` in ``sdp_utils_cpp.cpp``) accepts float32 and float64 as well as float16 and
bfloat16. That is why it runs float32 on a CPU while the CUDA kernel refuses anything but fp16 / bf16.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashlab.core.checks import as_count
from flashlab.core.numerics import DTYPE_NAMES, TOLERANCE, relative_error
from flashlab.reference import attention as reference_attention

BACKENDS = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
CUDA_ONLY = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def _dtype(dtype) -> tuple[str, torch.dtype]:
    if isinstance(dtype, torch.dtype):
        names = [k for k, v in DTYPES.items() if v == dtype]
        if not names:
            raise TypeError(f"unsupported dtype {dtype}; choose from {', '.join(DTYPES)}")
        return names[0], dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype, DTYPES[dtype]
    raise TypeError(f"unsupported dtype {dtype!r}; choose from {', '.join(DTYPES)}")


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def selected_sdpa_backend(q, k, v, causal: bool = False) -> str | None:
    """The backend SDPA's dispatcher picks for these inputs when nothing is pinned, or None if torch cannot say.

    Asks ``torch._fused_sdp_choice``, the (private) function SDPA itself consults before dispatching.
    """
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return None
    try:
        return SDPBackend(int(choice(q, k, v, None, 0.0, causal))).name
    except Exception:  # a private API: if its signature moves, say "unknown" rather than fail the probe
        return None


# The header SDPA warns before each fused backend's reasons, and the words by which a warning names a backend.
_SECTION_HEADERS = {
    "memory efficient kernel not used because": "EFFICIENT_ATTENTION",
    "flash attention kernel not used because": "FLASH_ATTENTION",
    "cudnn attention kernel not used because": "CUDNN_ATTENTION",
}
_BACKEND_WORDS = {
    "EFFICIENT_ATTENTION": ("memory efficient", "mem efficient", "efficient attention"),
    "FLASH_ATTENTION": ("flash attention",),
    "CUDNN_ATTENTION": ("cudnn",),
}


def _clean(message) -> str:
    """A warning's first line without PyTorch's "(Triggered internally at <file>:<line>.)" suffix."""
    line = _first_line(message)
    cut = line.find(" (Triggered internally at ")
    return line[:cut].rstrip() if cut >= 0 else line


def _named_backends(line: str) -> set[str]:
    low = line.lower()
    return {b for b, words in _BACKEND_WORDS.items() if any(w in low for w in words)}


def backend_reasons(backend: str, messages: Sequence) -> list[str]:
    """The refusal reasons that ``backend`` itself gave, out of the warnings one pinned SDPA call raised.

    ``messages`` are the warnings in the order SDPA gave them (strings or ``warnings.WarningMessage``). Where
    SDPA's per-backend headers are present, only the lines under ``backend``'s own header are kept. Lines outside
    any section (or a list recorded without its headers) are kept unless they name another backend or say a
    backend "has been runtime disabled" -- which, in a pinned call, is only ever said of the backends the pin
    switched off.
    """
    lines = [_clean(getattr(m, "message", m)) for m in messages]
    reasons, section = [], None
    for line in lines:
        header = line.lower().rstrip(": ")
        if header in _SECTION_HEADERS:
            section = _SECTION_HEADERS[header]
            continue
        if not line or line in reasons:
            continue
        if section is not None:
            keep = section == backend
        else:
            named = _named_backends(line)
            keep = "runtime disabled" not in line.lower() and (not named or backend in named)
        if keep:
            reasons.append(line)
    return reasons


def _run_pinned(backend: str, q, k, v, causal: bool):
    """Run SDPA with only ``backend`` allowed. Returns (out, None, reasons) or (None, error line, reasons)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            error = None
        except Exception as e:  # "No available kernel" and friends: the backend refused the problem
            out, error = None, f"{type(e).__name__}: {_first_line(e)}"
    reasons = backend_reasons(backend, caught)
    if error is not None and not reasons and q.device.type != "cuda" and backend in CUDA_ONLY:
        reasons.append(f"{backend} has CUDA kernels only; there is none for {q.device.type}")
    return out, error, reasons


def probe_sdpa_backends(
    device=None,
    dtypes: Sequence = ("float16", "bfloat16", "float32"),
    head_dims: Sequence[int] = (64, 128, 256),
    causal: Sequence[bool] = (False, True),
    seq_len: int = 256,
    batch: int = 1,
    heads: int = 4,
    backends: Sequence[str] = BACKENDS,
    seed: int = 0,
    progress: bool = False,
) -> list[dict]:
    """Pin each SDPA backend on a small attention problem per dtype / head dim / causal setting.

    Returns one dict per (dtype, head_dim, causal, backend) with keys: ``dtype``, ``head_dim``, ``causal``,
    ``backend``, ``selected`` (the backend SDPA picks unpinned for this problem, or None if unknown), ``status``
    ("ran": matched the reference; "wrong": ran but missed the tolerance; "raised": refused), ``rel_error``
    (against the float64 reference, None if it raised), ``tolerance``, ``error`` (the exception's first line) and
    ``reasons`` (the warnings SDPA gave for refusing, one line each).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = [_dtype(d) for d in dtypes]
    head_dims = [int(d) for d in head_dims]
    for d in head_dims:
        if d < 1:
            raise ValueError(f"head dims must be >= 1; got {d}")
    for name, value in (("seq_len", seq_len), ("batch", batch), ("heads", heads)):
        as_count(name, value)
    unknown = [b for b in backends if b not in SDPBackend.__members__ or b == "ERROR"]
    if unknown:
        raise ValueError(f"unknown SDPA backend(s) {unknown}; torch knows {list(SDPBackend.__members__)}")
    causal = [bool(c) for c in causal]

    configs = [(dn, dt, hd, c) for dn, dt in dtypes for hd in head_dims for c in causal]
    if progress:
        from tqdm.auto import tqdm

        configs = tqdm(configs, desc="SDPA backends", unit="config")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for dtype_name, dtype, head_dim, is_causal in configs:
        shape = (batch, heads, seq_len, head_dim)  # (B, H, N, D)
        q64, k64, v64 = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
        ref, _ = reference_attention(q64.numpy(), k64.numpy(), v64.numpy(), causal=is_causal)
        q, k, v = (x.to(device=device, dtype=dtype) for x in (q64, k64, v64))
        selected = selected_sdpa_backend(q, k, v, is_causal)
        for backend in backends:
            out, error, reasons = _run_pinned(backend, q, k, v, is_causal)
            rel = None if out is None else relative_error(out, ref)
            if out is None:
                status = "raised"
            elif np.isfinite(rel) and rel <= TOLERANCE[dtype_name]:
                status = "ran"
            else:
                status = "wrong"
            rows.append(
                dict(
                    dtype=dtype_name,
                    head_dim=head_dim,
                    causal=is_causal,
                    backend=backend,
                    selected=selected,
                    status=status,
                    rel_error=rel,
                    tolerance=TOLERANCE[dtype_name],
                    error=error,
                    reasons=reasons,
                )
            )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The probe as a text table: one line per dtype / head dim / causal, one column per backend."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    keys = list(dict.fromkeys((r["dtype"], r["head_dim"], r["causal"]) for r in rows))
    cell = {(r["dtype"], r["head_dim"], r["causal"], r["backend"]): r for r in rows}
    header = f"{'dtype':<9} {'D':>4} {'causal':<6} {'selected':<20}" + "".join(f" {b:<20}" for b in backends)
    lines = [header, "-" * len(header)]
    for dtype, d, c in keys:
        first = cell[(dtype, d, c, backends[0])]
        line = f"{dtype:<9} {d:>4} {str(c):<6} {first['selected'] or 'unknown':<20}"
        for b in backends:
            r = cell.get((dtype, d, c, b))
            if r is None:
                text = ""
            elif r["status"] == "raised":
                text = "raised"
            else:
                text = f"{r['status']} {r['rel_error']:.1e}"
            line += f" {text:<20}"
        lines.append(line)
    return "\n".join(lines)


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m flashlab.sdpa",
        description="Pin each PyTorch SDPA backend in turn on a small attention problem and record which run "
        "(checked against the float64 reference) and which raise, per dtype / head dim / causal.",
    )
    p.add_argument("--out", type=Path, help="write the table as JSON to this file (with a device/version stamp)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available, else cpu)")
    p.add_argument(
        "--dtypes", default="float16,bfloat16,float32", help="comma-separated: float16,bfloat16,float32,float64"
    )
    p.add_argument("--head-dims", default="64,96,128,192,256,512", help="comma-separated head dims to try")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both", help="causal mask off, on, or both")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length N of the probe problem")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=4, help="heads H")
    p.add_argument("--seed", type=int, default=0, help="random seed for q, k, v")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    from flashlab.bench.stamp import environment_stamp

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    rows = probe_sdpa_backends(
        device=device,
        dtypes=[s.strip() for s in args.dtypes.split(",") if s.strip()],
        head_dims=[int(s) for s in args.head_dims.split(",") if s.strip()],
        causal=causal,
        seq_len=args.seq_len,
        batch=args.batch,
        heads=args.heads,
        seed=args.seed,
        progress=True,
    )
    meta = {
        **environment_stamp(torch.device(device).type),
        "tool": "flashlab.sdpa",
        "command": "python -m flashlab.sdpa " + " ".join(sys.argv[1:] if argv is None else argv),
        "problem": dict(batch=args.batch, heads=args.heads, seq_len=args.seq_len, seed=args.seed),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    print(f"{meta['device_name']}  torch {meta['torch']}  triton {meta['triton']}  CUDA {meta['cuda']}")
    print(format_table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
