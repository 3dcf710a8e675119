"""What the softmax of rung 4's loop costs in issued instructions, read from its sm_90 machine code (no GPU: Triton's
compiler, its ptxas and cuobjdump on this machine), in 16 and 8 bits at D = 128, no mask.

A Hopper SM issues at most 128 thread-instructions a clock (four schedulers, one warp instruction each) and its
special-function units finish 16 exponentials a clock (``MUFU.EX2``). So an exponential ties up the SM for 1/16 of a
clock on MUFU and for n/128 of a clock on issue, where n is the instructions the loop spends per exponential. With n
above 8, issue, not MUFU, is the softmax's bound, and FlashAttention-4's software exp2 (a polynomial on the FMA units
in place of some MUFU.EX2, about 8 instructions for each one it replaces) would lengthen the softmax, not shorten it.

The loop is taken as the code between its two waits for the scores (``WARPGROUP.DEPBAR.LE gsb0, 0x1``).

python lab/probes/fp8_softmax_issue.py OUT_FILE"""

import collections
import os
import subprocess
import sys
import tempfile

import torch
import triton
from probe_log import log_to

from flashlab.kernels import fp8_forward
from flashlab.kernels.device import kernel_band
from flashlab.kernels.ladder import rung4_overlap as overlap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from test_sm90_compile import compiled_for_sm90  # noqa: E402 -- the tests' sm_90 compile harness

say = log_to(sys.argv[1])
say(f"triton {triton.__version__}, rung 4 compiled for sm_90, D = 128, N = 4096, no mask")
overlap.sm_count = lambda index: 132  # the launch shape of an H100 / H200, without a GPU
overlap.device_index = lambda x: 0
overlap.stream_capturing = lambda: False


def sass(fp8, d=128, n=4096):
    b, h = 16384 // n, 2048 // d
    q = torch.empty(b, h, n, d, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    lse = torch.empty(b, h, n)
    _, table, scalars, meta = overlap.launch_shape(q, q, False, None, kernel_band(n, n, d, False, None, None)[:4])
    meta = dict(meta)
    options = {key: meta.pop(key) for key in ("num_warps", "maxnreg") if key in meta}
    o = torch.empty(q.shape, dtype=torch.bfloat16)
    if fp8:
        descriptors = overlap.fp8_descriptors(q, q, fp8_forward.transposed_v(q), o, meta["BLOCK_N"])
        meta.update(FP8=True, O_IN_Q=False)
    else:
        descriptors = overlap.descriptors(q, q, q, o, meta["BLOCK_N"])
    args = [*descriptors, lse, lse if table is None else table, lse, *scalars]
    cubin = compiled_for_sm90(overlap.attn_fwd_overlap, args, meta, options).asm["cubin"]
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in text.splitlines()
            if line.strip().startswith("/*") and "*/" in line and line.strip()[2:6].isalnum()]  # fmt: skip


def opcode(instruction):
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


for fp8 in (False, True):
    ops = sass(fp8)
    marks = [i for i, op in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")]
    loop = ops[marks[0] : marks[1]]
    counts = collections.Counter(opcode(op) for op in loop)
    per_exp = len(loop) / counts["MUFU"]
    say(f"{'e4m3' if fp8 else 'bf16'}: {len(loop)} instructions, {counts['MUFU']} MUFU: {per_exp:.1f} an exponential"
        f" -> issue {per_exp / 128:.3f} clk against MUFU {1 / 16:.4f} clk an exponential an SM")  # fmt: skip
    say("    " + ", ".join(f"{name} {n}" for name, n in counts.most_common(16)))
