"""The host side of a call: decisions made once per call signature and reused, without weakening the checks.

``flash_attention`` remembers, per signature (shapes, strides, dtypes, devices, mask, scale), that the inputs passed
its checks and what the launch needs (``flashlab.host.plan.Call``, in ``CALLS``, with the plan of its bucket in
``PLANS``); these tests make sure a remembered signature gives the same answer, that a different signature is
planned afresh, and that arguments which only compare equal to a checked one (``True == 1``) are still refused.
tests/test_buckets.py checks the buckets themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernel import check_against_reference, make_qkv

from flashlab import flash_attention
from flashlab.host import attention as forward
from flashlab.host import launcher, launches, scratch
from flashlab.host.plan import CALLS, CHECKED
from flashlab.kernels.decode import split_kv
from flashlab.kernels.device import kernel_band
from flashlab.reference import attention


def count_plans(monkeypatch):
    made = []
    real = forward.attention_call

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "attention_call", counting)
    return made


@pytest.mark.parametrize("nq", [1, 20], ids=["decode", "prefill"])
def test_a_signature_is_planned_once(monkeypatch, nq):
    made = count_plans(monkeypatch)
    q, k, v = make_qkv(1, 4, 2, nq, 45, 16, torch.float32, seed=nq)
    first = flash_attention(q, k, v, causal=True, scale=0.3)
    q2, k2, v2 = make_qkv(1, 4, 2, nq, 45, 16, torch.float32, seed=nq + 100)  # same signature, new values
    second = flash_attention(q2, k2, v2, causal=True, scale=0.3)
    assert len(made) <= 1  # planned on the first call (or already, by an earlier test), not again
    check_against_reference(q2, k2, v2, causal=True, scale=0.3)
    assert not torch.equal(first, second)
    flash_attention(q, k, v, causal=False, scale=0.3)  # another mask: another plan
    assert len(made) >= 1 and made[-1][3] is False


def test_forget_drops_the_kept_plans_and_the_next_call_plans_again(monkeypatch):
    from flashlab.host import plan

    q, k, v = make_qkv(1, 4, 2, 1, 45, 16, torch.float32, seed=7)
    flash_attention(q, k, v, causal=True, scale=0.3)
    assert plan.PLANS and plan.CALLS
    plan.forget()
    assert not plan.PLANS and not plan.CALLS and not plan.FAMILIES
    made = count_plans(monkeypatch)
    flash_attention(q, k, v, causal=True, scale=0.3)
    assert len(made) == 1


def test_single_chunk_decode_writes_the_output_directly():
    q, k, v = make_qkv(2, 4, 2, 1, 100, 16, torch.float32, seed=3)
    o, lse = forward.forward(q, k, v, False, None, None)
    call = next(c for c in CALLS.values() if c.path == launches.SPLIT_KV and c.o_shape == (2, 4, 1, 16))
    assert call.args.direct and call.args.num_splits == 1  # 100 keys: one chunk, no merge
    check_against_reference(q, k, v)
    # asked for 100 chunks (the most 100 keys allow): chunks start at multiples of KEY_ALIGN, so still one
    o3, _ = forward.forward(q, k, v, False, None, None, num_splits=100)
    assert CALLS[forward.signature(q, k, v, False, None, None, 100, None)].args.num_splits == 1
    torch.testing.assert_close(o3, o, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_splits must be between 1 and"):
        forward.forward(q, k, v, False, None, None, num_splits=split_kv.MAX_SPLITS)


@pytest.fixture
def launched(monkeypatch):
    """The names of the split-KV kernels the interpreter launches, in order."""
    names = []
    real = launches.interpreted

    def counting(kernel):
        names.append(kernel.fn.__name__)
        return real(kernel)

    monkeypatch.setattr(launches, "interpreted", counting)
    return names


def test_chunks_are_merged_in_the_same_launch(launched):
    # The chunks' last finishers merge them in the kernel itself, so a decode step is one launch, however many
    # chunks it has (19: three groups of the merge's tree); the answer still equals the reference's.
    q, k, v = make_qkv(2, 8, 2, 1, 300, 24, torch.float32, seed=5)  # GQA, D = 24 (padded to 32)
    o, lse = flash_attention(q, k, v, return_lse=True, num_splits=5)
    assert launched == ["_split_kv_partial"]
    ro, rlse = attention(q.double().numpy(), k.double().numpy(), v.double().numpy())
    np.testing.assert_allclose(o.double().numpy(), ro, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.double().numpy(), rlse, rtol=1e-5, atol=1e-5)
    o_only = flash_attention(q, k, v, num_splits=5)  # no lse asked for: written to scratch, same output
    torch.testing.assert_close(o_only, o, rtol=0, atol=0)
    o_all, _ = forward.forward(q, k, v, False, None, None, num_splits=5, need_lse=True)
    assert forward.forward(q, k, v, False, None, None, num_splits=5, need_lse=False)[1] is None
    torch.testing.assert_close(o_all, o, rtol=0, atol=0)
    launched.clear()
    many = 2 * split_kv.TREE_GROUP + 3
    q, k, v = make_qkv(1, 2, 1, 1, many * split_kv.KEY_ALIGN, 16, torch.float32, seed=6)
    o = flash_attention(q, k, v, num_splits=many)
    assert launched == ["_split_kv_partial"]
    ro, _ = attention(q.double().numpy(), k.double().numpy(), v.double().numpy())
    np.testing.assert_allclose(o.double().numpy(), ro, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("num_splits", [5, split_kv.MAX_FOLD_SPLITS])
def test_the_one_level_fold_matches_the_reference(launched, num_splits):
    # Without the tree (the paged kernel's small blocks, on a GPU) one program folds up to MAX_FOLD_SPLITS chunks,
    # in the same launch. Forced here on a contiguous plan, so the CPU runs it.
    q, k, v = make_qkv(1, 4, 2, 2, num_splits * split_kv.KEY_ALIGN - 7, 16, torch.float32, seed=num_splits)
    call = launches.attention_call(q, k, v, True, None, None, num_splits, None)
    call.args.meta = {**call.args.meta, **split_kv.merge_arguments(num_splits, 2, tree=False).constexprs}
    o, lse = launches.run_attention(call, q, k, v)
    assert launched == ["_split_kv_partial"] and call.args.meta["MERGE_GROUP"] == 0
    ro, rlse = attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), causal=True)
    np.testing.assert_allclose(o.double().numpy(), ro, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse.double().numpy(), rlse, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one-level fold"):
        split_kv.merge_arguments(split_kv.MAX_FOLD_SPLITS + 1, 2, tree=False)


def test_remembered_signatures_still_refuse_bad_arguments():
    q, k, v = make_qkv(1, 2, 1, 1, 20, 16, torch.float32, seed=4)
    flash_attention(q, k, v, causal=True, scale=1)
    with pytest.raises(TypeError, match="scale must be a number"):
        flash_attention(q, k, v, causal=True, scale=True)  # True == 1, but it is not a scale
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_attention(q, k, v, causal=1, scale=1)
    flash_attention(q, k, v, window=(3, None))
    with pytest.raises(ValueError, match="window left"):
        flash_attention(q, k, v, window=(True, None))
    with pytest.raises(TypeError, match="same dtype"):
        flash_attention(q, k.half(), v)


def test_fast_launch_fills_the_tensor_slots_of_tritons_own_binding(monkeypatch):
    # Triton's binder gives every parameter's value in signature order; a FastLaunch keeps those and swaps in the
    # new call's tensors where the named tensor parameters sit, then calls the kernel's launcher the way
    # JITFunction.run does. A stand-in kernel records what the launcher receives.
    from types import SimpleNamespace

    def binder(Q, n, O, BLOCK: int = 16, num_warps=4):  # noqa: N803 -- kernel parameter names
        return {"Q": Q, "n": n, "O": O, "BLOCK": BLOCK}, None, None

    calls = []
    jit = SimpleNamespace(device_caches={0: (None, None, binder)})
    kernel = SimpleNamespace(run=lambda *a: calls.append(a), function="fn", packed_metadata="meta")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launcher, "FAST_LAUNCH", True)
    first_q, first_o = torch.zeros(1), torch.zeros(1)
    meta = {"BLOCK": 32, "num_warps": 8}
    fast = launcher.FastLaunch.build(jit, kernel, (3, 2), (first_q, 7, first_o), meta, ("Q", "O"))
    assert fast is not None and fast.values == [None, 7, None, 32]  # no reference kept to the first call's tensors
    q, o = torch.ones(2), torch.ones(3)
    fast("stream", q, o)
    (args,) = calls[:1]
    assert args[:9] == (3, 2, 1, "stream", "fn", "meta", None, None, None)
    assert args[9] is q and args[10] == 7 and args[11] is o and args[12] == 32

    # flashlab's kernels take their tensors first: then the launch passes them ahead of the fixed values
    def leading(Q, O, n, BLOCK: int = 16):  # noqa: N803
        return {"Q": Q, "O": O, "n": n, "BLOCK": BLOCK}, None, None

    jit2 = SimpleNamespace(device_caches={0: (None, None, leading)})
    fast2 = launcher.FastLaunch.build(jit2, kernel, (5,), (first_q, first_o, 9), {"BLOCK": 64}, ("Q", "O"))
    assert fast2.tail == (9, 64)
    fast2("s2", q, o)
    assert calls[-1][:9] == (5, 1, 1, "s2", "fn", "meta", None, None, None)
    assert calls[-1][9] is q and calls[-1][10] is o and calls[-1][11:] == (9, 64)
    monkeypatch.setattr(launcher, "FAST_LAUNCH", False)
    assert launcher.FastLaunch.build(jit, kernel, (3,), (q, 7, o), {}, ("Q", "O")) is None


def test_a_direct_launch_is_kept_only_if_it_writes_the_same_bits():
    # the check every plan runs once on its direct launch: bit for bit against what the JIT launch wrote, a NaN
    # equal to the same NaN, 0.0 and -0.0 told apart, a launcher that raises refused
    o = torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16)
    lse = torch.tensor([0.5, float("-inf")])

    def writing(o_value, lse_value):
        def launch_into(o2, lse2):
            o2.copy_(o_value)
            lse2.copy_(lse_value)

        return launch_into

    assert launcher.reproduces(writing(o, lse), o, lse)
    assert not launcher.reproduces(writing(torch.tensor([1.0, float("nan"), -0.0]), lse), o, lse)
    assert not launcher.reproduces(writing(o, torch.tensor([0.5, 0.0])), o, lse)

    def raising(o2, lse2):
        raise TypeError("this launcher does not take these arguments")

    assert not launcher.reproduces(raising, o, lse)
    assert not launcher.same_bits(o, o.float())  # another dtype is never the same bits


def test_direct_launch_packs_each_parameter_at_its_size_in_signature_order():
    # Triton's signature types: constexprs are not parameters; pointers are the tensor slots (8 bytes); scalars
    # take their own sizes; Triton's launcher appends two null scratch pointers, and so does the packing.
    import struct

    from flashlab.host import direct_launch

    types = ["*bf16", "i32", "constexpr", "fp32", "*fp32", "i64", "bf16", "u1"]
    values = [None, -7, 64, 0.5, None, 2**40, 1.5, True]
    cells, sizes, tensor_params = direct_launch.pack(types, values, (4, 0))
    assert list(sizes) == [8, 4, 4, 8, 8, 2, 1, 8, 8]  # no cell for the constexpr; two scratch pointers last
    assert tensor_params == (3, 0)  # slot 4 of the arguments is parameter 3, slot 0 parameter 0
    cell = [cells[8 * i : 8 * i + 8] for i in range(len(sizes))]
    assert cell[1] == struct.pack("<i", -7) + bytes(4)
    assert cell[2] == struct.pack("<f", 0.5) + bytes(4)
    assert cell[4] == (2**40).to_bytes(8, "little")
    assert cell[5] == bytes.fromhex("c03f") + bytes(6)  # bf16 1.5: the top half of float32 0x3fc00000
    assert cell[6] == b"\x01" + bytes(7)
    assert cell[0] == cell[3] == cell[7] == cell[8] == bytes(8)
    # what it does not pack exactly is left to Triton's launcher
    assert direct_launch.pack(["*bf16", "i32"], [None, 3], ()) is None  # a pointer that is no tensor slot
    assert direct_launch.pack(["constexpr", "i32"], [None, 3], (0,)) is None  # a tensor specialised away
    assert direct_launch.pack(["*bf16", "tensordesc<bf16[64, 64]>"], [None, 3], (0,)) is None


def test_direct_launch_writes_each_tensors_address_into_its_parameter():
    from flashlab.host import direct_launch

    module = direct_launch.native()
    if module is None:
        pytest.skip("no C compiler here to build flashlab's launcher")
    if torch.cuda.is_available():  # the driver checks a real function's parameters: function 0 has none
        pytest.skip("a CUDA driver is present: the GPU tests check packing on compiled kernels")
    cells, sizes, slots = direct_launch.pack(["*fp32", "i32", "*fp32"], [None, 5, None], (2, 0))
    handle = module.make(0, 1, 1, 1, 128, 0, cells, sizes, slots, 0)
    a, b = torch.zeros(3), torch.zeros(4)
    filled = module.packed(handle, a, b)  # a goes to argument 2 (parameter 2), b to argument 0
    words = [int.from_bytes(filled[i : i + 8], "little") for i in range(0, len(filled), 8)]
    assert words[:3] == [b.data_ptr(), 5, a.data_ptr()] and words[3:] == [0, 0]
    with pytest.raises(TypeError, match="takes 2 tensors; got 1"):
        module.packed(handle, a)
    with pytest.raises(ValueError, match="not a pointer parameter"):
        module.make(0, 1, 1, 1, 128, 0, cells, sizes, (1,), 0)  # the i32
    with pytest.raises(RuntimeError, match="CUDA driver"):
        module.launch(handle, 0, a, b)


FAKE_DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* A stand-in for libcuda.so.1: records what cuLaunchKernel receives; parameter sizes from FAKE_SIZES. */
static int sizes[64], n_sizes = -1;
static void read_sizes(void) {
  if (n_sizes >= 0) return;
  n_sizes = 0;
  char buf[256];
  strncpy(buf, getenv("FAKE_SIZES"), sizeof(buf) - 1);
  for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) sizes[n_sizes++] = atoi(t);
}
int cuFuncGetParamInfo(void *f, size_t i, size_t *offset, size_t *size) {
  read_sizes();
  if ((int)i >= n_sizes) return 1;
  *offset = 0, *size = sizes[i];
  return 0;
}
int cuGetErrorString(int status, const char **why) { *why = "the fake driver says no"; return 0; }
/* no context is current until one is set, as in a thread that has made no CUDA call */
static void *current = NULL;
static void note(const char *what, long value) {
  FILE *log = fopen(getenv("FAKE_LOG"), "a");
  fprintf(log, "%s %ld\n", what, value);
  fclose(log);
}
int cuCtxGetCurrent(void **ctx) { *ctx = current; return 0; }
int cuCtxSetCurrent(void *ctx) { current = ctx; note("set", (long)ctx); return 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = 100 + ordinal; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(long)(1000 + dev); note("retain", dev); return 0; }
/* a tensor map: its arguments logged, and the map marked with the address (first 8 bytes) and 0xAB (last byte) */
int cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *address, const unsigned long long *dims,
                           const unsigned long long *strides, const unsigned *box, const unsigned *element_strides,
                           int interleave, int swizzle, int l2, int fill) {
  FILE *log = fopen(getenv("FAKE_LOG"), "a");
  fprintf(log, "encode %d %u %llu", dtype, rank, (unsigned long long)address);
  for (unsigned i = 0; i < rank; i++) fprintf(log, " %llu", dims[i]);
  for (unsigned i = 0; i + 1 < rank; i++) fprintf(log, " %llu", strides[i]);
  for (unsigned i = 0; i < rank; i++) fprintf(log, " %u", box[i]);
  for (unsigned i = 0; i < rank; i++) fprintf(log, " %u", element_strides[i]);
  fprintf(log, " %d %d %d %d\n", interleave, swizzle, l2, fill);
  fclose(log);
  memset(map, 0, 128);
  memcpy(map, &address, 8);
  ((unsigned char *)map)[127] = 0xAB;
  return 0;
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *stream, void **params, void **extra) {
  read_sizes();
  FILE *log = fopen(getenv("FAKE_LOG"), "a");
  fprintf(log, "%llu %u %u %u %u %u %u %u %llu", (unsigned long long)f, gx, gy, gz, bx, by, bz, shared,
          (unsigned long long)stream);
  for (int i = 0; i < n_sizes; i++) {
    unsigned long long value = 0;
    memcpy(&value, params[i], sizes[i] < 8 ? sizes[i] : 8);  /* the driver reads each parameter's own size */
    if (sizes[i] == 128)  /* a tensor map: its address, its mark, and whether it sits on a 64-byte boundary */
      fprintf(log, " map:%llu:%d:%d", value, ((unsigned char *)params[i])[127] == 0xAB,
              (int)((unsigned long)params[i] % 64 == 0));
    else
      fprintf(log, " %llu", value);
  }
  fprintf(log, "\n");
  fclose(log);
  return atoi(getenv("FAKE_RESULT"));
}
"""

LAUNCH_THROUGH_FAKE_DRIVER = """
import os
import torch
from flashlab.host import direct_launch
module = direct_launch.native()
types = ["*fp32", "i32", "fp32", "*fp32", "i64"]
cells, sizes, slots = direct_launch.pack(types, [None, -3, 0.25, None, 2**33], (3, 0))
try:
    module.make(77, 1, 1, 1, 128, 0, cells[:-8], sizes[:-1], slots, 3)  # the driver says there is one more
except ValueError as e:
    print("refused:", e)
handle = module.make(77, 5, 6, 7, 256, 4096, cells, sizes, slots, 3)  # loaded on device 3
a, b = torch.zeros(2), torch.zeros(3)
module.launch(handle, 1234, a, b)  # a to argument 3, b to argument 0
print("addresses:", b.data_ptr(), a.data_ptr())
os.environ["FAKE_RESULT"] = "1"  # the next launch fails
try:
    module.launch(handle, 99, a, b)
except RuntimeError as e:
    print("error:", e)
"""


def run_through_fake_driver(tmp_path, script, sizes):
    """Run ``script`` in a fresh Python whose libcuda.so.1 is ``FAKE_DRIVER`` (built here with gcc, found first on
    the library path), the compiled function's parameters of ``sizes`` bytes; its output and the driver's log.
    Skips where there is no C compiler to build flashlab's launcher or the stand-in."""
    import os
    import shutil
    import subprocess
    import sys

    from flashlab.host import direct_launch

    if direct_launch.native() is None or shutil.which("gcc") is None:
        pytest.skip("no C compiler here to build flashlab's launcher")
    (tmp_path / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", tmp_path / "libcuda.so.1", tmp_path / "fake.c"], check=True)
    log = tmp_path / "launches.log"
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path), FAKE_LOG=str(log), FAKE_RESULT="0")
    env["FAKE_SIZES"] = ",".join(map(str, sizes))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out, log


def test_direct_launch_hands_the_driver_the_packed_parameters(tmp_path):
    # flashlab's launcher against a stand-in driver (a libcuda.so.1 of our own, found first on the library path):
    # the grid, the block, shared memory, the stream, and every parameter at its own size, the tensors' addresses
    # in their slots; a thread with no current CUDA context gets the function's device's primary context; a packing
    # the compiled function does not take is refused, a failed launch is an error naming the driver's reason.
    import struct

    out, log = run_through_fake_driver(tmp_path, LAUNCH_THROUGH_FAKE_DRIVER, [8, 4, 4, 8, 8, 8, 8])
    assert "refused: the kernel takes more parameters than were packed" in out.stdout
    b_ptr, a_ptr = (int(x) for x in out.stdout.split("addresses:")[1].split()[:2])
    # the first launch finds no current context and makes device 3's primary context current, once
    retain, made_current, first, second = log.read_text().splitlines()
    assert (retain, made_current) == ("retain 103", "set 1103")
    f, gx, gy, gz, bx, by, bz, shared, stream, *params = (int(x) for x in first.split())
    assert (f, gx, gy, gz, bx, by, bz, shared, stream) == (77, 5, 6, 7, 256, 1, 1, 4096, 1234)
    neg3 = int.from_bytes((-3).to_bytes(4, "little", signed=True), "little")
    quarter = int.from_bytes(struct.pack("<f", 0.25), "little")
    assert params == [b_ptr, neg3, quarter, a_ptr, 2**33, 0, 0]  # two null scratch pointers last
    assert int(second.split()[8]) == 99
    assert "error: cuLaunchKernel failed: the fake driver says no (CUresult 1)" in out.stdout


LAUNCH_A_TENSOR_MAP_THROUGH_FAKE_DRIVER = """
from types import SimpleNamespace
import torch
from flashlab.host import direct_launch
module = direct_launch.native()
types = ["i32", "tensordesc<bf16[1, 1, 64, 128]>", "*fp32"]
desc = SimpleNamespace(shape=[2, 3, 100, 128], strides=[38400, 12800, 128, 1], padding="zero")
meta = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 1, 64, 128], fp4_padded=False)]
cells, sizes, slots = direct_launch.pack(types, [5, desc, None], (1, 2), tensordesc_meta=meta)
print("sizes:", list(sizes))
print("slots:", slots)
handle = module.make(77, 4, 1, 1, 288, 1024, cells, sizes, slots, 0)
x, lse = torch.zeros(8), torch.zeros(3)
module.launch(handle, 55, x, lse)
print("addresses:", x.data_ptr(), lse.data_ptr())
"""


def test_direct_launch_encodes_a_tensor_map_from_each_launchs_tensor(tmp_path):
    # A kernel taking a host-side tensor descriptor (Gluon's) gets, as Triton's launcher passes it, the tensor map
    # (128 bytes, by value), then the descriptor's shape (i32) and strides (i64). flashlab's launcher encodes the map
    # on every launch from the launch's tensor, with the arguments packed once: the driver's dtype (Triton's device
    # enum 9 is the host's 8), dims, byte strides and box innermost first, unit element strides, no interleave,
    # the swizzle of the compiled kernel, 128-byte L2 promotion (2), no NaN fill -- the map on a 64-byte boundary.
    sizes = [4, 128, 4, 4, 4, 4, 8, 8, 8, 8, 8, 8, 8]  # i32; the map, shape, strides; the pointer; two scratch
    out, log = run_through_fake_driver(tmp_path, LAUNCH_A_TENSOR_MAP_THROUGH_FAKE_DRIVER, sizes)
    assert f"sizes: {sizes}" in out.stdout
    assert "slots: ((1, 8, 3, 0, (128, 100, 3, 2), (256, 25600, 76800), (128, 64, 1, 1)), 10)" in out.stdout
    x_ptr, lse_ptr = (int(n) for n in out.stdout.split("addresses:")[1].split()[:2])
    lines = [line for line in log.read_text().splitlines() if not line.startswith(("retain", "set"))]
    encode, launched = lines
    assert encode.split() == ["encode", "8", "4", str(x_ptr), "128", "100", "3", "2", "256", "25600", "76800",
                              "128", "64", "1", "1", "1", "1", "1", "1", "0", "3", "2", "0"]  # fmt: skip
    params = launched.split()[9:]
    assert params == ["5", f"map:{x_ptr}:1:1", "2", "3", "100", "128", "38400", "12800", "128", "1", str(lse_ptr),
                      "0", "0"]  # fmt: skip


def test_direct_launch_packs_only_the_descriptors_it_can_encode():
    # a descriptor the programs build themselves (no slot), one with no encoding from the compiled kernel, and
    # sub-byte packed types are left to Triton's launcher; without a driver no map can be encoded, and it says so
    from types import SimpleNamespace

    from flashlab.host import direct_launch

    types = ["tensordesc<bf16[1, 64]>", "*fp32"]
    desc = SimpleNamespace(shape=[100, 64], strides=[64, 1], padding="zero")
    meta = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 64], fp4_padded=False)]
    assert direct_launch.pack(types, [desc, None], (1,), tensordesc_meta=meta) is None  # not a slot
    assert direct_launch.pack(types, [desc, None], (0, 1)) is None  # no encoding given
    assert direct_launch.pack(types, [desc, None], (0, 1), tensordesc_meta=[{**meta[0], "fp4_padded": True}]) is None
    packed = direct_launch.pack(types, [desc, None], (0, 1), tensordesc_meta=meta)
    assert packed is not None and list(packed[1]) == [128, 4, 4, 8, 8, 8, 8, 8]
    module = direct_launch.native()
    if module is None or torch.cuda.is_available():
        return
    handle = module.make(0, 1, 1, 1, 128, 0, *packed, 0)
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
        module.packed(handle, torch.zeros(64), torch.zeros(1))


@pytest.mark.gpu
@pytest.mark.parametrize("nk", [100, 1024, 32768])  # 100 keys: one chunk, the kernel writes o without partials
def test_decode_relaunches_directly_and_stays_exact_on_gpu(nk):
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(nk)
    plan = None
    for step in range(6):  # autotune, JIT launch (FastLaunch built), checked against the JIT once, then direct
        q = torch.randn(2, 64, 1, 128, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(2, 8, nk, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
        o, lse = forward.forward(q, k, v, False, None, None)
        ro, rlse = attention_float64(q, k, v)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (step, err)
        torch.testing.assert_close(lse.double(), rlse, rtol=1e-3, atol=1e-3)
        call = next(c for key, c in CALLS.items() if key[0] == q.shape and key[2] == k.shape)
        plan = call.plan
    assert plan.path == launches.SPLIT_KV and plan.state == CHECKED, plan.state  # the direct launches are in use
    assert is_flashlab_launch(plan.fast[0])  # packed once, launched by flashlab's own launcher
    assert call.args.direct == (nk == 100)
    work, counters, kept = scratch.scratch(q.device, launcher.current_stream(q.device.index), 0, 0)
    assert kept
    assert int(counters.abs().sum()) == 0  # every block's last chunk set its counter back for the next launch


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal", [(128, True), (128, False)])
def test_prefill_relaunches_directly_and_stays_exact_on_gpu(d, causal):
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(d)
    for step in range(5):
        q, k, v = (torch.randn(1, 16, 700, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        o = forward.forward(q, k, v, causal, None, None, rung="skip_split")[0]  # the rung flashlab launches itself
        ro, _ = attention_float64(q, k, v, causal=causal)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (step, err)
    plan = next(c for key, c in CALLS.items() if key[0] == q.shape and key[8] is causal).plan
    assert plan.path == "skip_split" and plan.state == CHECKED, plan.state
    assert is_flashlab_launch(plan.fast[0])


@pytest.mark.gpu
def test_a_planned_decode_call_gives_the_same_bits_from_a_new_thread_on_gpu():
    # A serving engine may call from a worker thread that has made no CUDA call of its own: flashlab's launcher
    # must make the device's context current there, as Triton's launcher does, and launch the same kernel.
    import threading

    g = torch.Generator(device="cuda").manual_seed(12)
    q = torch.randn(2, 16, 1, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 5000, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    for _ in range(5):  # planned, direct launch built and checked
        o_main = flash_attention(q, k, v)
    plan = next(c for key, c in CALLS.items() if key[0] == q.shape and key[2] == k.shape).plan
    assert is_flashlab_launch(plan.fast[0]) and plan.state == CHECKED
    out = {}

    def worker():
        try:
            out["o"] = flash_attention(q, k, v)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- reported below
            out["error"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    assert torch.equal(out["o"], o_main)


def is_flashlab_launch(fast) -> bool:
    """Whether a plan's direct launch is flashlab's own packed launcher (direct_launch), not Triton's."""
    from flashlab.host import direct_launch

    module = direct_launch.native()
    return getattr(fast, "func", None) in (module.launch, module.launch_with)


@pytest.mark.gpu
def test_direct_launch_refuses_a_packing_the_compiled_kernel_does_not_take():
    # The driver knows the size of every parameter of the compiled function: a packing that disagrees (one
    # parameter too few, or an i32 packed as 8 bytes) is refused when the handle is made, never launched.
    from flashlab.host import direct_launch

    q, k, v = (x.cuda() for x in make_qkv(1, 8, 8, 1, 4096, 128, torch.bfloat16, seed=9))
    for _ in range(4):
        forward.forward(q, k, v, False, None, None)
    plan = next(c for key, c in CALLS.items() if key[0] == q.shape and key[2] == k.shape).plan
    assert is_flashlab_launch(plan.fast[0])
    kernel = next(iter(split_kv.split_kv_partial.device_caches[q.get_device()][0].values()))
    types = list(kernel.src.signature.values())
    names = list(kernel.src.signature)
    values = [None if n in split_kv.PARTIAL_TENSORS else 1 for n in names]
    slots = tuple(names.index(n) for n in split_kv.PARTIAL_TENSORS)
    cells, sizes, params = direct_launch.pack(types, values, slots)
    module = direct_launch.native()
    with pytest.raises(ValueError, match="more parameters than were packed"):
        module.make(kernel.function, 1, 1, 1, 128, 0, cells[:-8], sizes[:-1], params, q.get_device())
    wrong = bytearray(sizes)
    wrong[wrong.index(4)] = 8
    with pytest.raises(ValueError, match="not the size packed"):
        module.make(kernel.function, 1, 1, 1, 128, 0, cells, bytes(wrong), params, q.get_device())


def planned_after_fresh_calls(rung, q_shape, kv_heads, calls, seed, causal, window):
    """``calls`` calls of ``flash_attention(..., rung=rung)`` on fresh bf16 tensors (new addresses every call), each
    within 1.5e-2 of float64 (relative norm); the last call's q, k, v, o and its call of the rung."""
    from flashlab.reference.torch_float64 import attention_float64

    g = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, n, d = q_shape
    for step in range(calls):
        q = torch.randn(b, hq, n, d, device="cuda", generator=g).bfloat16()
        k, v = (torch.randn(b, kv_heads, n, d, device="cuda", generator=g).bfloat16() for _ in range(2))
        o = flash_attention(q, k, v, causal=causal, window=window, rung=rung)
        ro, _ = attention_float64(q, k, v, causal=causal, window=window)
        err = float((o.double() - ro).norm() / ro.norm())
        assert err < 1.5e-2, (step, err)
    call = next(c for key, c in CALLS.items() if key[0] == q.shape and key[8] is causal and key[9] == window)
    return q, k, v, o, call


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, (300, 40))])
def test_hopper_prefill_is_planned_and_relaunches_directly_on_gpu(causal, window):
    # The Hopper rung (named: the overlap rung is the default there now) is planned once per signature, then
    # launched directly with its descriptors' global scratch from the stream's scratch; 1100 keys leave a partial
    # last tile, so its repair pass runs after it every time. Each call still equals float64.
    from flashlab.kernels.ladder import rung3_hopper as hopper

    if torch.cuda.get_device_capability()[0] < hopper.MIN_CAPABILITY:
        pytest.skip("the Hopper rung needs sm_90 or newer")
    # autotune; JIT launch (direct launch built); checked against the JIT once; direct
    q, k, v, o, call = planned_after_fresh_calls("hopper", (2, 16, 1100, 128), 4, 6, 11, causal, window)
    planned = call.plan
    assert planned.path == hopper.NAME and planned.state == CHECKED, planned.state
    assert is_flashlab_launch(planned.fast[0]) and planned.scratch_bytes > 0
    assert len(planned.fast) == 2  # the kernel and its repair pass
    # the same signature at an address the copy engine cannot take (2 bytes off 16): skip-and-split runs it
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_odd = buf[1:].view(q.shape).copy_(q)
    assert q_odd.stride() == q.stride() and q_odd.data_ptr() % 16
    torch.testing.assert_close(flash_attention(q_odd, k, v, causal=causal, window=window), o, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal, window, nq", [(False, None, 1000), (True, None, 1100), (False, (300, 20), 1100)])
def test_overlap_rung_is_planned_and_relaunches_directly_on_gpu(causal, window, nq):
    # Rung 4 takes host-side tensor descriptors: after its first two calls (JIT launch, then a check against it)
    # flashlab's launcher encodes the four tensor maps from the tensors' addresses and launches it directly, with
    # the repair pass after it under a mask. Fresh tensors every call (new addresses), and each call equals float64;
    # the direct launch gives the JIT launch's bits.
    from flashlab.kernels.ladder import rung4_overlap as overlap

    if torch.cuda.get_device_capability()[0] != overlap.CAPABILITY or overlap.GLUON_ERROR is not None:
        pytest.skip("rung 4 needs Hopper (sm_90) and Gluon")
    q, k, v, o, call = planned_after_fresh_calls("overlap", (2, 8, nq, 128), 2, 5, 12, causal, window)
    planned = call.plan
    assert planned.path == overlap.NAME and planned.state == CHECKED, planned.state
    assert is_flashlab_launch(planned.fast[0])
    assert (len(planned.fast) == 2) == (causal or window is not None)  # the repair pass under a mask
    o2, lse2 = torch.empty_like(o), torch.empty(q.shape[:3], device="cuda")
    planned.run(call, q, k, v, o2, lse2)
    o3, lse3 = torch.empty_like(o), torch.empty(q.shape[:3], device="cuda")
    overlap.launch(q, k, v, o3, lse3, causal, window, kernel_band(nq, nq, 128, causal, window, None)[:4])
    assert launcher.same_bits(o2, o3) and launcher.same_bits(lse2, lse3)


def test_the_launcher_source_ships_with_the_package():
    # flashlab's launcher is compiled from launcher.c at first use: it must be in the package data, and every
    # package-data pattern must name files that exist
    from importlib import resources

    from conftest import ROOT

    tomllib = pytest.importorskip("tomllib")
    assert resources.files("flashlab.host").joinpath("launcher.c").is_file()
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["flashlab"]
    assert "host/*.c" in patterns
    for pattern in patterns:
        assert list((ROOT / "flashlab").glob(pattern)), f"package data {pattern!r} names no file"


def test_a_plans_second_kernel_compiles_beside_its_first(monkeypatch, capfd):
    # rung 4's first causal call compiles two kernels (the forward and its repair pass): the second is compiled in
    # a thread while the first compiles, through Triton's warmup (compiled, never launched), with the launch's
    # grid and constexprs; a failure there is left for the launch itself to raise
    import threading

    calls = []

    class Jit:
        def warmup(self, *args, grid, **meta):
            calls.append((threading.current_thread().name, args, grid, meta))

    monkeypatch.setattr(launches, "COMPILE_BESIDE", True)
    thread = launches.compile_beside(Jit(), (3, 1, 1), ("q", 7), {"BLOCK_N": 64}, torch.device("cpu"))
    thread.join()
    assert calls == [("flashlab-compile", ("q", 7), (3, 1, 1), {"BLOCK_N": 64})]
    assert threading.current_thread().name != "flashlab-compile"

    class Failing:
        def warmup(self, *args, grid, **meta):
            raise RuntimeError("ptxas: out of resources")

    capfd.readouterr()
    launches.compile_beside(Failing(), (1,), (), {}, torch.device("cpu")).join()
    assert "out of resources" not in capfd.readouterr().err  # caught in the thread, not reported there
    monkeypatch.setattr(launches, "COMPILE_BESIDE", False)
    assert launches.compile_beside(Jit(), (1,), (), {}, torch.device("cpu")) is None
    assert len(calls) == 1


def test_the_direct_launchers_module_is_built_once_whichever_thread_asks(monkeypatch):
    # a first GPU call starts building the C module in a thread (direct_launch.prepare) while its kernel compiles;
    # the launch that then needs it waits for that build instead of starting a second one
    import threading
    import time

    from flashlab.host import direct_launch

    builds = []

    def slow_build():
        builds.append(threading.current_thread().name)
        time.sleep(0.2)
        return "module"

    cached = direct_launch.functools.cache(slow_build)
    monkeypatch.setattr(direct_launch, "_native", cached)
    monkeypatch.setattr(direct_launch, "_PREPARED", [])
    direct_launch.prepare()
    direct_launch.prepare()  # once a process
    time.sleep(0.05)
    assert direct_launch.native() == "module"  # waits for the thread's build
    assert builds == ["flashlab-launcher-build"]


def test_no_launcher_is_built_beside_where_this_triton_builds_none_per_signature():
    # Tritons whose launcher is one generic module have no make_launcher: nothing to build beside a compile
    from triton.backends.nvidia import driver as nvidia

    if not hasattr(nvidia, "make_launcher"):
        assert launches._launcher_maker() is None


def test_the_options_worked_out_beside_a_launch_are_in_the_order_triton_binds_them():
    # Triton's cache key is the str of the options dict its binder passes through: the same options in another
    # order name a binary never compiled, and every compiled binary would look new
    import inspect
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    run = inspect.getsource(JITFunction.run)
    if 'kwargs["instrumentation_mode"]' not in run:
        pytest.skip("this Triton's launches add other options")
    assert run.index('kwargs["debug"] =') < run.index('kwargs["instrumentation_mode"] =')  # appended, in this order
    knobs = SimpleNamespace(runtime=SimpleNamespace(debug=False), compilation=SimpleNamespace(instrumentation_mode=""))
    options = launches.run_options(SimpleNamespace(debug=False), {"BLOCK_M": 16, "num_warps": 1}, knobs)
    assert list(options) == ["BLOCK_M", "num_warps", "debug", "instrumentation_mode"]
    options = launches.run_options(SimpleNamespace(debug=False), {"debug": True, "num_warps": 1}, knobs)
    assert list(options) == ["debug", "num_warps", "instrumentation_mode"] and options["debug"] is True


@pytest.mark.gpu
def test_the_launcher_built_beside_a_first_compile_is_the_one_triton_builds():
    # launcher_beside builds, while a kernel compiles, the launcher source Triton would build after it: worked out
    # from the same binding before the compile, it must be Triton's own, or the build is wasted
    from flashlab.kernels.ladder import rung2_skip_split as skip_split

    if launches._launcher_maker() is None:
        pytest.skip("this Triton builds no launcher module per kernel signature")
    from triton.backends.nvidia import driver as nvidia

    q, k, v = (x.cuda() for x in make_qkv(1, 3, 1, 45, 70, 24, torch.float16, seed=5))  # a binary no test makes
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    band = kernel_band(45, 70, 24, False, None, None)[:4]
    args = (q, k, v, o, lse, q, k, v, o, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
            3, 3, 45, 70, *band, *skip_split.tune_key(1, 3, 45, 70, False, None), 24)  # fmt: skip
    meta = {**skip_split.kernel_meta(q, False), "USE_TMA": False, "BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1,
            "num_stages": 1}  # fmt: skip
    jit = skip_split.attn_fwd
    caches = jit.device_caches[torch.cuda.current_device()]
    parts = launches.launcher_parts(jit, caches, args, meta)
    assert parts is not None, "the binary was compiled before the test"
    kernel = jit[(3, 3)](*args, **meta)
    assert launches.launcher_parts(jit, caches, args, meta) is None  # compiled now: nothing left to build
    ours = nvidia.make_launcher(*parts, None)
    theirs = nvidia.make_launcher(
        kernel.src.constants, kernel.src.signature, getattr(kernel.metadata, "tensordesc_meta", None)
    )
    assert ours == theirs
    check = attention(q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy())[0]
    assert np.abs(o.double().cpu().numpy() - check).max() < 1e-2


def test_a_planned_launchs_key_splits_on_what_triton_specialises_only():
    """``launches.launch_key`` (the packed varlen kernels' plans): a new batch of lengths keeps the key where the
    kernel takes the lengths unspecialised, and moves it where Triton would compile another binary (an int that
    becomes divisible by 16, or 1; a tensor's alignment; a constexpr)."""
    from flashlab.kernels import varlen

    fn = varlen.bwd_dkdv_varlen  # TOTAL_Q is do_not_specialize; stride_qm (fixed) is keyed by value
    names = fn.arg_names
    positions = launches.runtime_positions(fn, ("TOTAL_Q", "qk_scale"))
    assert list(positions) == [names.index("TOTAL_Q"), names.index("qk_scale")]
    assert positions[names.index("TOTAL_Q")] is False  # do_not_specialize (qk_scale's flag is not read: a float)
    t = torch.zeros(64)
    args = [t] * names.index("stride_qm") + [1] * (names.index("HEAD_DIM") - names.index("stride_qm"))
    args[names.index("qk_scale")] = 0.5

    def key(**changes):
        a = list(args)
        for name, value in changes.items():
            a[names.index(name)] = value
        return launches.launch_key(fn, a, {"BLOCK_M": 64}, ("TOTAL_Q", "qk_scale"), 0)

    assert key(TOTAL_Q=17, qk_scale=0.1) == key(TOTAL_Q=32, qk_scale=0.3) == key(TOTAL_Q=1)
    assert key(TOTAL_Q=2**31) != key(TOTAL_Q=17)  # 64-bit
    assert key(stride_qm=16) != key(stride_qm=32)  # a fixed scalar: its value
    assert key(Q=t[1:]) != key()  # an address off 16 bytes
    assert launches.launch_key(fn, args, {"BLOCK_M": 32}, ("TOTAL_Q", "qk_scale"), 0) != key()
    specialised = ("stride_qm",)
    assert list(launches.runtime_positions(fn, specialised).values()) == [True]
    a, b = list(args), list(args)
    a[names.index("stride_qm")], b[names.index("stride_qm")] = 17, 18
    assert launches.launch_key(fn, a, {}, specialised, 0) == launches.launch_key(fn, b, {}, specialised, 0)
    b[names.index("stride_qm")] = 32
    assert launches.launch_key(fn, a, {}, specialised, 0) != launches.launch_key(fn, b, {}, specialised, 0)
    a[names.index("stride_qh")] = object()  # a scalar this cannot key
    assert launches.launch_key(fn, a, {}, specialised, 0) is None
