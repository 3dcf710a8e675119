"""What the softmax of rung 4's key loop costs in issued instructions, read from its sm_90 machine code (no GPU:
Triton's compiler, its ptxas and cuobjdump on this machine), in 16 and 8 bits at D = 128, no mask.

A Hopper SM issues at most 128 thread-instructions a clock (four schedulers, one warp instruction each) and its
special-function units finish 16 exponentials a clock (``MUFU.EX2``). So an exponential ties up the SM for 1/16 of a
clock on MUFU and for n/128 of a clock on issue, where n is the instructions the loop spends per exponential: below
8, MUFU is the softmax's bound; above, issue is. FlashAttention-4's software exp2 replaces some MUFU.EX2 with a
polynomial on the FMA units, about 8 instructions each, which moves time from MUFU to issue.

The key loop is found as the shortest backward branch whose body holds at least 32 exponentials (one warpgroup's
copy of the loop over key tiles: 64 scores a thread a tile).

python lab/probes/fp8_softmax_issue.py OUT_FILE"""

import collections
import os
import re
import sys

import pytest
import triton
from probe_log import log_to

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from test_overlap import sm90_compiled  # noqa: E402 -- the tests' sm_90 build of rung 4 (no GPU)
from test_sm90_compile import sass  # noqa: E402

say = log_to(sys.argv[1])
say(f"triton {triton.__version__}, rung 4 compiled for sm_90, D = 128, N = 4096, no mask")
patch = pytest.MonkeyPatch()  # sm90_compiled gives the kernel an H100 / H200's launch shape through it


def opcode(instruction):
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def key_loop(instructions):
    """The shortest loop (a branch back to an earlier address) whose body holds 32 or more exponentials."""
    loops = []
    for at, op in instructions:
        target = re.search(r"BRA \S*?0x([0-9a-f]+)", op)
        if target and int(target.group(1), 16) < at:
            body = [o for a, o in instructions if int(target.group(1), 16) <= a <= at]
            if sum(opcode(o) == "MUFU" and "EX2" in o for o in body) >= 32:
                loops.append(body)
    return min(loops, key=len)


for fp8 in (False, True):
    loop = key_loop(sass(sm90_compiled(patch, 128, False, n=4096, fp8=fp8)))
    counts = collections.Counter(opcode(op) for op in loop)
    exps = sum(opcode(o) == "MUFU" and "EX2" in o for o in loop)
    per_exp = len(loop) / exps
    say(f"{'e4m3' if fp8 else 'bf16'}: key loop {len(loop)} instructions, {exps} exponentials: {per_exp:.1f} an"
        f" exponential -> issue {per_exp / 128:.4f} clk, MUFU {1 / 16:.4f} clk an exponential an SM")  # fmt: skip
    say("    " + ", ".join(f"{name} {n}" for name, n in counts.most_common(16)))
