"""Rung 4 of the kernel ladder, ``flashlab.kernels.ladder.rung4_overlap`` (Gluon, Hopper only).

On CPU: where it refuses to run and why (each condition of ``unavailable`` on tensors that claim to live on a GPU
of a given compute capability), that a named ``rung="overlap"`` on CPU tensors warns and gives the fastest
runnable rung's right answer, and where ``flash_attention`` picks it by default.

On a GPU (``-m gpu``, compiled for sm_90): the shapes it runs against the float64 reference in bf16 and fp16 --
causal and not, GQA, Nq < Nk under a causal mask, D = 64 and 128 -- NaN in V rows the causal mask hides reaching
only the rows that see them (the repair pass), gradients through it, and the default picking it at D = 128.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_ladder import assert_matches_float64, make_qkv
from test_sm90_compile import compiled_for_sm90, exponentials_between_waits, sass

from flashlab import flash_attention
from flashlab.host import launches
from flashlab.kernels import fp8_forward, ladder
from flashlab.kernels.device import kernel_band
from flashlab.kernels.ladder import rung4_overlap as overlap
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads


class OnGpu:
    """A CPU tensor that says it lives on a CUDA GPU: enough for ``unavailable`` to read its shape, dtype and
    layout without a GPU."""

    is_cuda = True
    device = "cuda:0"

    def __init__(self, t):
        self.t = t
        self.shape, self.dtype = t.shape, t.dtype

    def stride(self, *dim):
        return self.t.stride(*dim)

    def data_ptr(self):
        return self.t.data_ptr()

    def element_size(self):
        return self.t.element_size()


@pytest.fixture
def capability(monkeypatch):
    """Set the compute capability the fake GPU reports (default 9.0, Hopper)."""
    value = {"cc": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: value["cc"])
    return value


def fake(b=1, hq=2, hk=2, nq=256, nk=256, d=128, dtype=torch.bfloat16):
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype, seed=0)
    return OnGpu(q), OnGpu(k), OnGpu(v)


needs_gluon = pytest.mark.skipif(overlap.GLUON_ERROR is not None, reason=str(overlap.GLUON_ERROR))


@pytest.fixture
def cpu_tables(monkeypatch):
    """A causal launch on ``OnGpu`` tensors plans its schedule table on the CPU (there is no GPU to copy it to)."""
    table = overlap.tile_schedule.table
    monkeypatch.setattr(overlap.tile_schedule, "table", lambda lengths, heads, programs, device: table(
        lengths, heads, programs, "cpu"))  # fmt: skip
    monkeypatch.setattr(overlap, "stream_capturing", lambda: False)


@needs_gluon
def test_runs_on_hopper_for_the_shapes_it_was_built_for(capability):
    for d in overlap.HEAD_DIMS:
        for causal in (False, True):
            assert overlap.unavailable(*fake(d=d), causal, None) is None
    assert overlap.unavailable(*fake(hq=8, hk=2, nq=128, nk=512), True, None) is None  # GQA, Nq < Nk
    assert overlap.unavailable(*fake(nq=200, nk=333), False, None) is None  # lengths no multiple of a tile
    assert overlap.unavailable(*fake(nq=100, nk=333), True, None) is None
    assert overlap.unavailable(*fake(nq=300, nk=300), True, (64, 0)) is None  # a sliding window
    assert overlap.unavailable(*fake(nq=300, nk=500), False, (100, 40)) is None


@needs_gluon
@pytest.mark.parametrize(
    "cc, inputs, causal, window, says",
    [
        ((8, 0), {}, False, None, "compute capability 9.x, not 8.0"),
        ((10, 0), {}, False, None, "compute capability 9.x, not 10.0"),
        ((9, 0), {"dtype": torch.float32}, False, None, "16-bit inputs only"),
        ((9, 0), {"d": 96}, False, None, "head dims 64, 128, 256, not 96"),
        ((9, 0), {"nq": 512, "nk": 256}, False, (0, 0), "leaves some query rows with no key"),
        ((9, 0), {"nq": 384, "nk": 256}, True, (None, 100), "no more queries than keys"),
        ((9, 0), {"nq": 512, "nk": 256}, True, None, "no more queries than keys"),
    ],
)
def test_unavailable_names_what_it_cannot_run(capability, cc, inputs, causal, window, says):
    capability["cc"] = cc
    why = overlap.unavailable(*fake(**inputs), causal, window)
    assert why is not None and says in why, why


@needs_gluon
def test_any_layout_the_copy_engine_can_describe_runs_and_the_others_say_why(capability):
    # The copy engine reads (B, H, N, D) with its own strides: heads interleaved with the rows, as a (B, N, H, D)
    # projection gives them, run as they are. A head dim that is not contiguous, or rows 2 bytes apart from a
    # 16-byte boundary, it cannot describe.
    q, k, v = make_qkv(1, 2, 2, 256, 256, 128, torch.bfloat16, seed=0)
    interleaved = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, N, H, D) memory viewed as (B, H, N, D)
    assert overlap.unavailable(OnGpu(interleaved), OnGpu(k), OnGpu(v), False, None) is None
    strided_d = torch.empty(1, 2, 256, 256, dtype=q.dtype)[..., ::2]
    why = overlap.unavailable(OnGpu(q), OnGpu(strided_d), OnGpu(v), False, None)
    assert why is not None and "cannot describe k" in why and "head dim is strided" in why
    odd_rows = torch.empty(1, 2, 256, 129, dtype=q.dtype)[..., :128]  # rows 258 bytes apart
    why = overlap.unavailable(OnGpu(q), OnGpu(k), OnGpu(odd_rows), False, None)
    assert why is not None and "cannot describe v" in why and "multiples of 16 bytes" in why
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    why = overlap.unavailable(OnGpu(shifted), OnGpu(k), OnGpu(v), False, None)
    assert why is not None and "cannot describe q" in why and "2 bytes past a 16-byte boundary" in why


def test_on_cpu_tensors_it_says_why_and_a_named_call_falls_back_to_a_right_answer():
    q, k, v = make_qkv(1, 2, 2, 40, 40, 32, torch.bfloat16, seed=3)
    why = overlap.unavailable(q, k, v, True, None)
    assert why is not None and ("GPU only" in why or "Gluon" in why)
    with pytest.warns(RuntimeWarning, match="rung 'overlap' cannot run here"):
        o, lse = flash_attention(q, k, v, causal=True, return_lse=True, rung="overlap")
    assert_matches_float64(o, lse, *attention_float64(q, k, v, True, None), q.dtype, "overlap on cpu")


def test_it_is_the_top_rung_and_preferred_at_every_head_dim_it_runs():
    assert ladder.names()[-1] == overlap.NAME
    cases = [(64, True, 1024, True), (128, False, 1024, True), (128, True, 2048, True), (128, True, 1024, True),
             (256, False, 4096, True), (96, False, 4096, False)]  # fmt: skip
    for d, causal, n, picked in cases:
        q = OnGpu(torch.empty(1, 1, n, d))
        assert overlap.preferred(q, q, q, causal, None) is picked, (d, causal, n)


# ---- compiled, on a GPU --------------------------------------------------------------------------------------------

GPU_CASES = [
    # b, hq, hk, nq, nk, d, causal
    (2, 16, 16, 1024, 1024, 128, False),
    (2, 16, 16, 1024, 1024, 128, True),
    (1, 8, 2, 512, 512, 64, True),  # GQA
    (2, 4, 4, 384, 384, 64, False),
    (1, 4, 4, 256, 768, 128, True),  # Nq < Nk: the diagonal ends at the last key
    (1, 4, 1, 640, 640, 128, True),  # 4 query heads on one K/V head
    (3, 2, 2, 128, 128, 128, True),  # one query tile, one key tile
    (8, 16, 16, 1024, 1024, 64, True),  # 512 units of two query tiles: each program takes about 4
    (2, 3, 3, 640, 640, 128, True),  # 5 query tiles a head: the middle one is a unit alone
    (2, 4, 4, 1000, 1000, 128, False),  # lengths no multiple of a tile: rows past a head's end
    (1, 8, 2, 200, 333, 128, False),  # GQA, a key tail in the last tile
    (1, 4, 4, 333, 777, 64, True),  # causal, Nq < Nk, both lengths odd (one warpgroup a program, three an SM)
    (1, 4, 4, 333, 1500, 64, True),  # the same rows, keys past 1K: two warpgroups again
    (1, 4, 4, 300, 400, 128, True),  # the diagonal 100 keys in: a warpgroup's last tile half hidden, or all
    (2, 2, 2, 500, 537, 64, True),  # 37 keys in: the first warpgroup's last tile wholly hidden
    (3, 2, 2, 65, 65, 64, True),  # one tile, the second warpgroup's rows mostly past the end
    (1, 4, 2, 1000, 700, 64, False),  # GQA, a key tail in the last tile, rows past a head's end
    (1, 4, 2, 2100, 2100, 64, False),  # three warpgroups of 64-key tiles: GQA, rows and keys past the ends
    (2, 4, 4, 512, 512, 256, False),  # D = 256: O through Q's buffer
    (1, 4, 2, 333, 600, 256, True),
]


def gpu_ready():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == overlap.CAPABILITY


WINDOW_CASES = [
    # b, hq, hk, nq, nk, d, causal, window
    (1, 4, 4, 1000, 1000, 128, True, (256, 0)),  # a causal sliding window: tiles left of the band never read
    (2, 2, 2, 700, 900, 64, False, (100, 50)),  # both sides bounded, Nq < Nk
    (1, 8, 2, 512, 512, 128, False, (0, 0)),  # each row sees only its diagonal key
    (1, 2, 2, 300, 300, 64, True, (1000, 0)),  # a window wider than the keys: causal again
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", [(*case, None) for case in GPU_CASES] + WINDOW_CASES, ids=lambda c: "x".join(str(x) for x in c)
)
def test_matches_the_float64_reference_on_hopper(case, dtype):
    if not gpu_ready():
        pytest.skip("needs a Hopper GPU")
    b, hq, hk, nq, nk, d, causal, window = case
    q, k, v = make_qkv(b, hq, hk, nq, nk, d, dtype, seed=nq + d + (nk if window is None else 0), device="cuda")
    assert overlap.unavailable(q, k, v, causal, window) is None
    o, lse = flash_attention(q, k, v, causal=causal, window=window, return_lse=True, rung="overlap")
    ref = attention_float64(q, k, v, causal, window)
    assert_matches_float64(o, lse, *ref, dtype, f"overlap {case}", 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_heads_interleaved_with_the_rows_run_as_they_are_on_hopper(causal):
    # q, k, v as a (B, N, H, D) projection lays them out, viewed as (B, H, N, D): no copy, the descriptors' strides
    if not gpu_ready():
        pytest.skip("needs a Hopper GPU")
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in make_qkv(2, 4, 4, 300, 300, 128, torch.bfloat16, seed=9, device="cuda"))  # fmt: skip
    assert not q.is_contiguous() and overlap.unavailable(q, k, v, causal, None) is None
    o, lse = flash_attention(q, k, v, causal=causal, return_lse=True, rung="overlap")
    assert_matches_float64(o, lse, *attention_float64(q, k, v, causal, None), q.dtype, "interleaved heads", 1e-3)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("d", [64, 128])  # one consumer warpgroup a program at D = 64 (a short causal call), two at 128
def test_nan_in_values_the_causal_mask_hides_reaches_only_the_rows_that_see_them(d):
    if not gpu_ready():
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_qkv(1, 2, 2, 512, 512, d, torch.bfloat16, seed=5, device="cuda")
    v[:, :, 300] = float("nan")  # key 300: rows 300 and after see it, rows before it must not be touched
    o = flash_attention(q, k, v, causal=True, rung="overlap")
    assert torch.isnan(o[:, :, 300:]).all()
    reference = flash_attention(q, k, v, causal=True, rung="skip_split")
    assert torch.isfinite(o[:, :, :300]).all()
    assert (o[:, :, :300].float() - reference[:, :, :300].float()).abs().max() < 2e-2


@pytest.mark.gpu
def test_gradients_through_the_overlap_rung():
    if not gpu_ready():
        pytest.skip("needs a Hopper GPU")
    q, k, v = make_qkv(2, 8, 2, 512, 512, 128, torch.bfloat16, seed=1, device="cuda")
    do = torch.randn_like(q)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    flash_attention(qg, kg, vg, causal=True, rung="overlap").backward(do)
    for got, ref in zip((qg.grad, kg.grad, vg.grad), attention_float64_grads(q, k, v, do, causal=True), strict=True):
        assert (got.double() - ref).norm() / ref.norm() < 3e-2


@pytest.mark.gpu
def test_the_default_runs_it_where_it_is_preferred_on_hopper():
    if not gpu_ready():
        pytest.skip("needs a Hopper GPU")
    for d in overlap.HEAD_DIMS:
        q, k, v = make_qkv(1, 4, 4, 2000, 2000, d, torch.bfloat16, seed=2, device="cuda")
        picked = ladder.select(None, q, k, v, True, None)[0].name == overlap.NAME
        assert picked == (d in overlap.PREFERRED_HEAD_DIMS), d


# H200 recordings with rung 4 and the rungs it displaces in one run: (file, the column that ran skip and split)
LADDER_RECORDINGS = [
    ("h200-ladder-bf16-2026-12-02-all-rungs.json", "flashlab_skip_split"),  # D = 64 and 128
    ("h200-ladder-bf16-2026-12-01-d256-overlap.json", "flashlab"),  # D = 256, when its default was skip and split
]


def test_the_default_picks_it_where_the_recordings_measured_it_faster_than_the_rungs_below():
    # ``preferred`` against the H200 recordings of the ladder, cell by cell: where it is preferred the rung ran at
    # least about as fast as both rungs it displaces (3 % for timing noise); where a measured head dim's cell is
    # not its, one of them ran faster. A head dim no recording holds is never preferred.
    import json

    from conftest import ROOT

    cells = []
    for name, skip_split_column in LADDER_RECORDINGS:
        recording = json.loads((ROOT / "data" / "results" / name).read_text())
        tflops = {(r["backend"], r["head_dim"], r["causal"], r["seq_len"]): r["tflops"]
                  for r in recording["rows"] if r["status"] == "ok"}  # fmt: skip
        for key in [key for key in tflops if key[0] == "flashlab_overlap"]:
            below = max(tflops[("flashlab_hopper", *key[1:])], tflops[(skip_split_column, *key[1:])])
            cells.append((*key[1:], tflops[key], below))
    assert len(cells) == 30
    for d, causal, n, mine, below in cells:
        q = OnGpu(torch.empty(1, 1, n, d))
        if overlap.preferred(q, q, q, causal, None):
            assert mine >= 0.97 * below, (d, causal, n, mine, below)
        else:
            assert mine < below, (d, causal, n, mine, below)
    recorded = {cell[0] for cell in cells}
    for d in set(overlap.HEAD_DIMS) - recorded:
        q = OnGpu(torch.empty(1, 1, 4096, d))
        assert not overlap.preferred(q, q, q, False, None), d


def test_its_plan_runs_skip_and_split_for_an_address_the_copy_engine_cannot_take():
    # A plan is kept per signature, and a signature has no addresses: q 2 bytes off 16 (same shape and strides as
    # the tensors it was planned on) must not reach the Gluon kernel, and comes out right from skip and split
    q, k, v = make_qkv(1, 2, 2, 48, 48, 32, torch.bfloat16, seed=4)
    planned = launches.overlap_plan(q, k, v, True, None, kernel_band(48, 48, 32, True, None, None)[:4])
    buf = torch.empty(q.numel() + 1, dtype=q.dtype)
    q_odd = buf[1:].view(q.shape).copy_(q)
    assert q_odd.stride() == q.stride() and q_odd.data_ptr() % 16
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    planned.run(planned, q_odd, k, v, o, lse)
    assert_matches_float64(o, lse, *attention_float64(q, k, v, True, None), q.dtype, "misaligned q")
    with pytest.raises(RuntimeError, match="the overlap rung cannot run these inputs"):  # aligned, on CPU: refused
        planned.run(planned, q, k, v, torch.empty_like(q), torch.empty(q.shape[:3]))


@needs_gluon
@pytest.mark.parametrize(
    "b,hq,nq,sms,programs", [(2, 4, 512, 132, 32), (16, 16, 1024, 132, 132), (1, 1, 128, 8, 1), (1, 3, 200, 132, 6)]
)
def test_its_grid_is_persistent_one_program_per_multiprocessor_at_most(capability, monkeypatch, cpu_tables, b, hq,
                                                                       nq, sms, programs):  # fmt: skip
    # The launch on the host, its kernel replaced by a recorder: min(query tiles x heads, multiprocessors) programs,
    # each walking the tiles (a length no multiple of the tile rounds its tiles up); the copy engine's descriptors
    # are (B, H, N, D) with the tensors' own strides, copied in tiles of one head's rows.
    import contextlib

    launched = {}

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **meta):
                launched.update(grid=grid, args=args, meta=meta)

            return run

    monkeypatch.setattr(overlap, "_attn_fwd_overlap", Recorder())
    monkeypatch.setattr(overlap, "sm_count", lambda index: sms)
    monkeypatch.setattr(overlap, "device_index", lambda x: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    q, k, v = fake(b=b, hq=hq, hk=hq, nq=nq, nk=nq, d=128)
    o, lse = OnGpu(torch.empty(q.shape, dtype=q.dtype)), torch.empty(q.shape[:3])
    overlap.launch(q, k, v, o, lse, False, None, (0, 0, 0, 1.0))
    assert launched["grid"] == (programs,)
    desc_q, desc_k, desc_v, desc_o = launched["args"][:4]
    num_wg, block_n, _ = overlap.TILES[128]
    assert launched["meta"]["NUM_WG"] == num_wg and launched["meta"]["KEY_TAIL"] == (nq % block_n != 0)
    for desc, rows in ((desc_q, overlap.WG_ROWS), (desc_o, overlap.WG_ROWS), (desc_k, block_n), (desc_v, block_n)):
        assert list(desc.shape) == [b, hq, nq, 128] and list(desc.block_shape) == [1, 1, rows, 128]
        assert list(desc.strides) == [hq * nq * 128, nq * 128, 128, 1]
    assert launched["args"][-1] == b * hq  # heads the programs walk
    repaired = []

    class RepairRecorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: repaired.append(grid)

    monkeypatch.setattr(overlap.hopper, "repair_parts", lambda *args: (RepairRecorder(), (3,), (), {}))
    overlap.launch(q, k, v, o, lse, True, None, (0, 0, 0, 1.0))
    # causal: at most one program per multiprocessor, each walking its list from the planned table (passed after
    # lse: the programs' starts, then every tile once); the repair pass follows
    n_m = -(-nq // (num_wg * overlap.WG_ROWS))
    tiles = n_m * b * hq
    assert launched["grid"] == (min(tiles, sms),) and launched["meta"]["SCHEDULED"]
    table = launched["args"][5].tolist()
    starts, listed = table[: min(tiles, sms) + 1], table[min(tiles, sms) + 1 : -1]
    assert starts[0] == 0 and starts[-1] == tiles and sorted(listed) == list(range(tiles))
    assert repaired == [(3,)]


@needs_gluon
@pytest.mark.parametrize("d", [64, 128, 256])
def test_windowed_calls_causal_or_not_take_one_binary(capability, monkeypatch, cpu_tables, d):
    # A window's band already holds what a causal mask adds (its right side at most 0), so a causal window and a
    # two-sided one compile the same kernel: one binary per head dim for every window. Where the head dim's causal
    # calls are scheduled, windows are too (tiles near a sequence's start read fewer keys).
    monkeypatch.setattr(overlap, "sm_count", lambda index: 132)
    monkeypatch.setattr(overlap, "device_index", lambda x: 0)
    q, k, _ = fake(hq=4, hk=4, nq=2048, nk=2048, d=d)
    metas = []
    for causal, window in ((True, (512, 0)), (False, (256, 256)), (False, (100, 0)), (True, (None, None))):
        band = kernel_band(2048, 2048, d, causal, window, None)[:4]
        _, table, _, meta = overlap.launch_shape(q, k, causal, window, band)
        assert (table is not None) == (d in overlap.SCHEDULED_HEAD_DIMS) == meta["SCHEDULED"]
        assert meta["WINDOW"] and not meta["CAUSAL"] and not meta["KEY_TAIL"]
        metas.append(meta)
    assert all(m is metas[0] for m in metas), "a window compiled another binary"
    band = kernel_band(2048, 2048, d, True, None, None)[:4]
    causal_meta = overlap.launch_shape(q, k, True, None, band)[3]
    assert causal_meta["CAUSAL"] and not causal_meta["WINDOW"], "a causal call without a window is its own kind"


@needs_gluon
@pytest.mark.parametrize(
    "nq, causal, window, num_wg",
    [(1024, False, None, 2), (2048, False, None, 3), (4096, True, None, 2), (4096, False, (256, 0), 2),
     (1024, True, None, 1), (1024, True, (256, 0), 2), (2048, True, None, 2)],
)  # fmt: skip
def test_head_dim_64_takes_three_warpgroups_for_long_unmasked_calls_and_one_for_short_causal_ones(
    capability, monkeypatch, cpu_tables, nq, causal, window, num_wg
):
    # At D = 64 three consumer warpgroups (192 rows) with 64-key tiles from 2K query rows without a mask or window;
    # one with 64-key tiles, three programs to a multiprocessor (each launch asking for the registers that lets
    # three fit), for causal calls of at most 1K rows without a window; two, with 128-key tiles, otherwise. The key
    # descriptors are cut in the launch's key tiles.
    import contextlib

    launched = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.update(args=args, meta=meta)

    monkeypatch.setattr(overlap, "_attn_fwd_overlap", Recorder())
    monkeypatch.setattr(overlap.hopper, "repair_parts", lambda *args: ({(1,): lambda *a, **m: None}, (1,), (), {}))
    monkeypatch.setattr(overlap, "sm_count", lambda index: 132)
    monkeypatch.setattr(overlap, "device_index", lambda x: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    q, k, v = fake(b=1, hq=2, hk=2, nq=nq, nk=nq, d=64)
    o, lse = OnGpu(torch.empty(q.shape, dtype=q.dtype)), torch.empty(q.shape[:3])
    band = kernel_band(nq, nq, 64, causal, window, None)[:4]
    overlap.launch(q, k, v, o, lse, causal, window, band)
    block_n = 128 if num_wg == 2 else 64
    meta = launched["meta"]
    assert (meta["NUM_WG"], meta["BLOCK_N"]) == (num_wg, block_n)
    assert meta["CONSUMER_REGS"] == overlap.CONSUMER_REGS[num_wg]
    assert meta["PINGPONG"] == (num_wg > 1)  # one warpgroup has no one to take turns with
    if num_wg == 1:
        assert overlap.PROGRAMS_PER_SM[1] == 3 and meta["maxnreg"] == overlap.LAUNCH_REGS[1]
        assert 3 * 256 * meta["maxnreg"] <= 65536  # three programs of a warpgroup and the loader's fit the registers
    else:
        assert "maxnreg" not in meta
    rows = [list(desc.block_shape)[2] for desc in launched["args"][:4]]  # q, k, v, o
    assert rows == [overlap.WG_ROWS, block_n, block_n, overlap.WG_ROWS]


def sm90_compiled(monkeypatch, d, causal, n=1024, fp8=False):
    """The kernel for one call shape compiled for sm_90 on this machine (Triton's compiler and the ptxas it ships;
    no GPU; ``compiled_for_sm90``); with ``fp8`` as ``launch_fp8`` launches it, on e4m3 q, k and V^T. Skipped
    where this Triton cannot."""
    monkeypatch.setattr(overlap, "sm_count", lambda index: 132)
    monkeypatch.setattr(overlap, "device_index", lambda x: 0)
    monkeypatch.setattr(overlap, "stream_capturing", lambda: False)
    b, h = 16384 // n, 2048 // d
    q = torch.empty(b, h, n, d, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    lse = torch.empty(b, h, n)
    band = kernel_band(n, n, d, causal, None, None)[:4]
    _, table, scalars, meta = overlap.launch_shape(q, q, causal, None, band)
    meta = dict(meta)  # launch_shape's dicts are kept
    options = {key: meta.pop(key) for key in ("num_warps", "maxnreg") if key in meta}
    o = torch.empty(q.shape, dtype=torch.bfloat16)
    if fp8:  # V^T's tiles: (D, BLOCK_N), the keys contiguous
        descriptors = overlap.fp8_descriptors(q, q, fp8_forward.transposed_v(q), o, meta["BLOCK_N"])
        meta.update(FP8=True, O_IN_Q=False)
    else:
        descriptors = overlap.descriptors(q, q, q, o, meta["BLOCK_N"])
    args = [*descriptors, lse, lse if table is None else table, lse, *scalars]
    return compiled_for_sm90(overlap.attn_fwd_overlap, args, meta, options)


def sm90_sass(monkeypatch, d, causal, n=1024):
    """``sm90_compiled``'s kernel as the list of its SASS instructions (``test_sm90_compile.sass``)."""
    return [op for _, op in sass(sm90_compiled(monkeypatch, d, causal, n))]


@needs_gluon
@pytest.mark.parametrize("d, causal", [(64, True), (128, False)])
def test_with_fp8_both_products_run_on_8_bit_operands(monkeypatch, d, causal):
    # The FP8 forward's Hopper kernel at D = 64 and 128 (``launch_fp8``): e4m3 q, k and V^T, so both wgmma take
    # 8-bit operands (twice the 16-bit rate) and nothing is widened to 16 bits; the output is bf16.
    assert d in overlap.FP8_HEAD_DIMS
    ptx = sm90_compiled(monkeypatch, d, causal, n=2048, fp8=True).asm["ptx"]
    products = re.findall(r"wgmma\.mma_async\S*", ptx)
    assert products and all(".e4m3.e4m3" in op for op in products), sorted(set(products))
    assert "setmaxnreg" in ptx  # the loader warp gives its registers to the consumer warpgroups, as in 16 bits
    assert "cvt.rn.bf16" in ptx or "cvt.rn.bf16x2" in ptx  # O leaves in bfloat16


@needs_gluon
@pytest.mark.slow
def test_at_head_dim_128_the_softmax_runs_under_its_own_pv_in_the_machine_code(monkeypatch):
    # The loop's written order puts tile j's softmax between the wait for its scores and the wait for tile j-1's
    # P V. ptxas keeps that order only where the second wait starts a basic block of its own (LATE_WAIT, D = 128):
    # there a tile's 64 exponentials per thread (64 x 128 scores over 128 threads) and the two of the rescale all
    # sit between the waits. At D = 64, where the early wait measured faster, ptxas moves the wait up above every
    # exponential.
    assert overlap.LATE_WAIT_HEAD_DIMS == (128,)
    late = exponentials_between_waits(sm90_sass(monkeypatch, 128, True))
    assert late and all(n >= 64 for n in late), late
    early = exponentials_between_waits(sm90_sass(monkeypatch, 64, True, n=2048))
    assert early and all(n == 0 for n in early), f"ptxas no longer moves the wait for P V up at D = 64: {early}"


@needs_gluon
@pytest.mark.slow
def test_three_programs_a_multiprocessor_keep_their_products_asynchronous_without_spilling(monkeypatch):
    # Short causal calls at D = 64 run three programs of one consumer warpgroup on each multiprocessor, the launch
    # asking for 80 registers a thread. The consumer then rises to CONSUMER_REGS[1] (setmaxnreg), and at that budget
    # ptxas must neither spill nor wait for each product as soon as it is issued (what it did at 104 registers, four
    # programs): the loop's wait for the scores still leaves P V in flight (``gsb0, 0x1``).
    assert overlap.tiles(64, 1024, 1024, True, None) == (1, 64, 2)
    code = sm90_sass(monkeypatch, 64, True, n=1024)
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {overlap.CONSUMER_REGS[1]:#x}" in code
    assert not [op for op in code if op.startswith(("STL", "LDL"))], "the consumer spills to local memory"
    assert any(op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1") for op in code), "ptxas serialised the products"


@pytest.mark.parametrize(
    "b, hq, hk, nq, nk, d, causal, window",
    [(1, 16, 16, 300, 4000, 128, True, None), (2, 8, 2, 1000, 1000, 64, False, (40, 3)),
     (1, 4, 4, 777, 5300, 256, True, (256, 0))],
)  # fmt: skip
def test_the_repair_pass_planned_from_integers_has_the_arguments_the_hopper_rung_gives(b, hq, hk, nq, nk, d, causal,
                                                                                        window):  # fmt: skip
    """Chunked prefill plans the repair pass for new lengths on every call, from integers (``repair_parts``); its
    arguments must be those of the Hopper rung's own ``arguments`` and ``repair_shape``, for sliced views too."""
    hopper = overlap.hopper
    q_buf, k_buf, v_buf = make_qkv(b, hq, hk, nq + 5, nk + 7, d, torch.bfloat16, seed=1)
    q, k, v = (OnGpu(x) for x in (q_buf[:, :, :nq], k_buf[:, :, :nk], v_buf[:, :, 2 : nk + 2]))
    band = kernel_band(nq, nk, d, causal, window, None)[:4]
    o_strides = (hq * nq * d, nq * d, d)
    kernel, grid, rargs, rmeta = hopper.repair_parts(q, k, v, o_strides, causal, window, band)
    scalars, _, meta = hopper.arguments(q, k, v, o_strides, causal, window, band, is_cuda=True)
    tiles, want_grid, want_meta = hopper.repair_shape(q, meta, True)
    assert kernel is hopper.repair_flagged and grid == want_grid
    assert rargs == (*scalars, *tiles) and rmeta == want_meta


class OnGpuView(OnGpu):
    """``OnGpu`` with what the host engine's planning reads of a tensor: its device, contiguity, device index."""

    device = torch.device("cuda", 0)

    def get_device(self):
        return 0

    def is_contiguous(self):
        return self.t.is_contiguous()


@needs_gluon
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("contiguous", [False, True])
def test_a_chunked_prefill_family_plans_each_new_shape_as_overlap_call_does(monkeypatch, cpu_tables, causal,
                                                                            contiguous):  # fmt: skip
    """Rung 4's family makes a new (Nq, Nk)'s call from integers (``launches.OverlapFamily``); it must equal
    ``overlap_call``'s for the same inputs -- plan, grid, schedule table, tensor maps and scalars, repair pass --
    for views of one buffer and for contiguous chunks, across tile choices and lengths that are no multiple of a
    tile. Planned on the CPU (nothing is launched)."""
    monkeypatch.setattr(overlap, "sm_count", lambda index: 132)
    monkeypatch.setattr(launches, "sm_count", lambda index: 132)
    monkeypatch.setattr(overlap, "device_index", lambda x: 0)
    monkeypatch.setattr(launches, "stream_capturing", lambda: False)
    from test_buckets import same_args

    q_buf, k_buf, v_buf = make_qkv(1, 16, 4, 1100, 5400, 128, torch.bfloat16, seed=2)
    shapes = [(300, 4000), (307, 4013), (650, 4650), (1000, 5300), (129, 129), (1024, 1024), (700, 5301), (64, 64)]
    family = None
    for nq, nk in shapes:
        parts = (q_buf[:, :, :nq], k_buf[:, :, :nk], v_buf[:, :, :nk])
        q, k, v = (OnGpuView(x.contiguous() if contiguous else x) for x in parts)
        band = kernel_band(nq, nk, 128, causal, None, None)[:4]
        full = launches.overlap_call(q, k, v, causal, None, band)
        full.o_like_q, full.o_shape, full.lse_shape = q.is_contiguous(), (1, 16, nq, 128), (1, 16, nq)
        if family is None:
            family = launches.OverlapFamily(full, q, k, causal, None, None, None)
        derived = family.call(q, k, v)
        assert derived.plan is full.plan and derived.grid == full.grid, (nq, nk)
        assert derived.values == full.values and same_args(derived.args, full.args), (nq, nk)
        assert (derived.o_like_q, derived.o_shape, derived.lse_shape) == (full.o_like_q, full.o_shape, full.lse_shape)
        derived = family.call(q, k, v)  # the second time through the family's own kept plan, not overlap_call
        assert derived is not family.prefill.last, "made from integers"
        assert derived.plan is full.plan and derived.values == full.values and same_args(derived.args, full.args)
    assert len(family.plans) == (1 if causal else 2), "one plan per key tail (non-causal)"


@pytest.mark.parametrize("nq, nk, block_m, block_n", [(300, 4000, 128, 128), (1000, 1000, 64, 64), (7, 5, 128, 64)])
def test_the_causal_key_tiles_in_one_expression_are_key_tiles(nq, nk, block_m, block_n):
    ts = overlap.tile_schedule
    n_m = -(-nq // block_m)
    want = tuple(ts.key_tiles(m * block_m, block_m, block_n, nq, nk, nk - nq, nq + nk + 1, 0, True, False)
                 for m in range(n_m))  # fmt: skip
    assert ts.causal_key_tiles(n_m, block_m, block_n, nk, nk - nq) == want
