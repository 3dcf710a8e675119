"""Training-step memory of attention, naive against flashlab, on a CUDA GPU: what notebook 09 shows as recorded.

    python scripts/backward_memory.py [--out data/results/h200-backward-memory.json] [--seq-lens 1024 2048 ...]

For each sequence length N (bf16, D = 128, B = 1, H = 16, causal), one forward + backward of attention alone, with
q, k, v requiring grad, for two implementations:

- ``naive``: ``flashlab.bench.implementations.naive_attention`` (matmul -> softmax -> matmul, eager PyTorch);
- ``flashlab``: ``flashlab.flash_attention`` (the FlashAttention-2 backward, recomputing P from the saved lse).

Two numbers per cell, both in bytes:

- ``saved_bytes`` -- the tensors autograd keeps from the forward for the backward (distinct storages, counted by
  ``flashlab.bench.training_memory``): for naive Q, K, V, P and the boolean mask; for flashlab Q, K, V, O and
  lse.
- ``peak_bytes`` -- ``torch.cuda.max_memory_allocated`` during forward + backward, minus what was allocated
  before (q, k, v and dO): saved tensors, temporaries (S, dP, dS for naive) and the gradients.

``--device cpu`` runs the same code on tiny sizes as a smoke test (``peak_bytes`` is then null); never commit that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flashlab
from flashlab.bench.implementations import naive_attention
from flashlab.bench.stamp import environment_stamp
from flashlab.bench.training_memory import training_step_memory

IMPLEMENTATIONS = {"naive": naive_attention, "flashlab": flashlab.flash_attention}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/results/h200-backward-memory.json", help="JSON file to write")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --device cpu for a smoke test", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for n in args.seq_lens:
        shape = (1, args.heads, n, args.head_dim)  # (B, H, N, D)
        q, k, v, do = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        for name, attention in IMPLEMENTATIONS.items():
            saved, peak = training_step_memory(attention, q, k, v, do, causal=True)
            row = dict(backend=name, n=n, d=args.head_dim, heads=args.heads, batch=1, dtype=str(dtype)[6:])
            row.update(causal=True, saved_bytes=saved, peak_bytes=peak)
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = environment_stamp(device.type)
    meta.update(tool="scripts/backward_memory.py", command="python " + " ".join(sys.argv))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
