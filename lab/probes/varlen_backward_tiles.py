"""The packed varlen forward + backward on the varlen bar's cells (log-normal batches of 32 documents, H = 16 over
4 K/V heads, bf16) under several dK/dV and dQ tile configs, beside torch's varlen_attn: a training step's
attention, timed as the bench times it (forward, then backward of a fixed upstream gradient). Each config's
gradients are compared with varlen_attn's first.

python lab/probes/varlen_backward_tiles.py OUT_FILE"""

import sys
import time

import torch
from probe_log import log_to
from varlen_batch import TrainingCell, tile_config

from flashlab.bench.varlen import torch_varlen_attn
from flashlab.host import varlen as host_varlen

say = log_to(sys.argv[1])


CANDIDATES = {
    64: [((64, 128, 8, 3), (128, 64, 8, 3)), ((64, 64, 4, 3), (128, 64, 8, 3)), ((32, 64, 4, 3), (128, 64, 8, 3)),
         ((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 3), (64, 64, 4, 3))],
    128: [((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 128, 8, 2), (128, 64, 8, 2)), ((64, 64, 4, 3), (128, 64, 8, 2)),
          ((32, 64, 4, 2), (64, 64, 8, 3))],
}  # fmt: skip
theirs = torch_varlen_attn()
say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}")


def run_cell(tokens, d, causal):
    cell = TrainingCell(theirs, tokens, d, causal)
    row = [f"{cell.label}: varlen_attn {cell.ms_ref * 1e3:7.0f}"]
    for dkdv, dq in CANDIDATES[d]:
        host_varlen.backward_config = lambda kernel, q_, a=dkdv, b=dq: tile_config(a if kernel == "dkdv" else b)
        err = cell.error()
        ms = cell.time(cell.step)
        row.append(f"dkdv {dkdv} dq {dq}: {ms * 1e3:7.0f} us x{cell.ms_ref / ms:.2f} err {err:.0e}")
    say(" | ".join(row))


for tokens, d in ((16384, 64), (16384, 128), (65536, 64), (65536, 128)):
    for causal in (False, True):
        run_cell(tokens, d, causal)
