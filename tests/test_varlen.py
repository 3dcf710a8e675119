"""``flash_attention_varlen`` on the CPU (Triton's interpreter) against float64 attention on each sequence's slice.

Ragged batches packed end to end: lengths 0 and 1 among others, query and key lengths that differ per sequence,
grouped-query heads, causal and window masks aligned to each sequence's end, every dtype; the output, lse and the
gradients of q, k and v against ``flashlab.reference.torch_float64`` run sequence by sequence. Then every bad
argument, bit-identical reruns, and that a program never reaches into another sequence: the key tiles each
(sequence, head) visits are counted against ``flashlab.core.masking.tile_map``, and NaN in one sequence's keys
leaves every other sequence's output as it was.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashlab import flash_attention_varlen
from flashlab.core.integers import cdiv
from flashlab.core.masking import tile_map
from flashlab.core.numerics import grad_tolerance, relative_error, tolerance
from flashlab.host.varlen import varlen_forward
from flashlab.kernels import varlen
from flashlab.kernels.device import CPU_CONFIG, kernel_band
from flashlab.reference.torch_float64 import attention_float64, attention_float64_grads


def cu_seqlens(lengths) -> torch.Tensor:
    """int32 ``(B + 1,)``: the running sums of the lengths, from 0."""
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def packed_case(lq, lk, hq, hk, d, dtype=torch.float32, seed=0):
    """Packed q ``(sum lq, Hq, D)``, k, v ``(sum lk, Hk, D)``, an upstream gradient like q, and the boundaries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lk), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lk), hk, d, generator=g).to(dtype)
    do = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    return q, k, v, do, cu_seqlens(lq), cu_seqlens(lk)


def sequence(x, cu, b):
    """Sequence b of a packed ``(total, H, D)`` tensor as ``(1, H, N_b, D)``."""
    return x[int(cu[b]) : int(cu[b + 1])].transpose(0, 1).unsqueeze(0)


def varlen_attention_float64(q, k, v, cu_q, cu_k, causal=False, window=None, scale=None):
    """The float64 ground truth: ``attention_float64`` on each sequence's slice, packed back as ``o (total_q, Hq,
    D)`` and ``lse (Hq, total_q)``; a sequence with no keys gives zeros and lse -inf."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qb == qa or kb == ka:
            continue
        o_b, lse_b = attention_float64(sequence(q, cu_q, b), sequence(k, cu_k, b), sequence(v, cu_k, b), causal,
                                       window, scale)  # fmt: skip
        o[qa:qb] = o_b[0].transpose(0, 1)
        lse[:, qa:qb] = lse_b[0]
    return o, lse


def varlen_grads_float64(q, k, v, do, cu_q, cu_k, causal=False, window=None, scale=None):
    """float64 ``(dq, dk, dv)``, packed like q, k, v: ``attention_float64_grads`` per sequence."""
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    for b in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if qb == qa or kb == ka:
            continue
        parts = attention_float64_grads(sequence(q, cu_q, b), sequence(k, cu_k, b), sequence(v, cu_k, b),
                                        sequence(do, cu_q, b), causal, window, scale)  # fmt: skip
        for grad, part, (a, z) in zip(grads, parts, ((qa, qb), (ka, kb), (ka, kb)), strict=True):
            grad[a:z] = part[0].transpose(0, 1)
    return grads


def check_forward(o, lse, ref_o, ref_lse, cu_q, dtype):
    tol = tolerance(dtype)
    assert o.dtype == dtype and lse.dtype == torch.float32
    for b in range(len(cu_q) - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if rows.stop == rows.start:
            continue
        err = relative_error(o[rows], ref_o[rows])
        assert err <= tol, f"sequence {b}: o's relative error {err:.2e} over {tol:.0e} for {dtype}"
        seen = torch.isfinite(ref_lse[:, rows])
        assert torch.equal(torch.isfinite(lse[:, rows]), seen), f"sequence {b}: lse -inf on the wrong rows"
        if seen.any():
            gap = (lse[:, rows].double() - ref_lse[:, rows])[seen].abs().max().item()
            assert gap <= 10 * tol, f"sequence {b}: lse off by {gap:.2e}"


# (query lengths, key lengths, Hq, Hk, D, causal, window, dtype): a 0 and a 1 in every batch, Nq != Nk
CASES = [
    ([5, 0, 19, 1], [9, 3, 17, 4], 4, 2, 32, False, None, torch.float32),
    ([5, 0, 19, 1], [9, 3, 17, 4], 4, 2, 32, True, None, torch.float32),
    ([3, 1, 0, 21], [3, 0, 6, 33], 3, 1, 24, True, None, torch.float16),
    ([17, 1, 0, 6], [17, 2, 5, 0], 2, 2, 16, False, (4, 3), torch.bfloat16),
    ([12, 1, 0], [30, 1, 2], 4, 1, 40, True, (7, None), torch.float32),
]


@pytest.mark.parametrize("lq, lk, hq, hk, d, causal, window, dtype", CASES)
def test_forward_equals_float64_per_sequence(lq, lk, hq, hk, d, causal, window, dtype):
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, hq, hk, d, dtype, seed=len(lq) + d)
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, window=window,
                                    return_lse=True)  # fmt: skip
    assert o.shape == q.shape and lse.shape == (hq, q.shape[0])
    check_forward(o, lse, *varlen_attention_float64(q, k, v, cu_q, cu_k, causal, window), cu_q, dtype)


def test_query_sequence_without_keys_gives_zeros_and_minus_inf():
    q, k, v, _, cu_q, cu_k = packed_case([4, 3], [0, 5], 2, 1, 16)
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 5, return_lse=True)
    assert torch.equal(o[:4], torch.zeros_like(o[:4])) and torch.isneginf(lse[:, :4]).all()
    assert torch.isfinite(lse[:, 4:]).all()


def test_larger_max_seqlen_and_a_custom_scale():
    """max_seqlen above every length only adds tiles that exit at once; a negative scale runs as (-q, -scale)."""
    lq, lk = [7, 2], [5, 11]
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, 2, 2, 16, seed=3)
    for scale in (0.3, -0.2):
        o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 50, causal=True, scale=scale, return_lse=True)
        ref = varlen_attention_float64(q, k, v, cu_q, cu_k, True, None, scale)
        check_forward(o, lse, *ref, cu_q, torch.float32)


@pytest.mark.parametrize(
    "lq, lk, hq, hk, causal, window, scale, dtype",
    [
        ([6, 0, 11, 1], [6, 4, 9, 0], 2, 1, True, None, None, torch.float32),
        ([3, 1, 9], [8, 1, 9], 2, 1, False, (3, 2), None, torch.bfloat16),
        ([5, 2], [3, 7], 2, 2, True, None, -0.3, torch.float16),
    ],
)
def test_gradients_equal_float64_per_sequence(lq, lk, hq, hk, causal, window, scale, dtype):
    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, hq, hk, 16, dtype, seed=7)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    o = flash_attention_varlen(qg, kg, vg, cu_q, cu_k, max(lq), max(lk), causal=causal, window=window, scale=scale)
    o.backward(do)
    refs = varlen_grads_float64(q, k, v, do, cu_q, cu_k, causal, window, scale)
    tol = grad_tolerance(dtype)
    for name, x, ref, like in zip("qkv", (qg.grad, kg.grad, vg.grad), refs, (q, k, v), strict=True):
        assert x.shape == like.shape and x.dtype == dtype
        err = relative_error(x, ref)
        assert err <= tol, f"d{name}: relative error {err:.2e} over {tol:.0e} for {dtype}"
    # the rows of a sequence with no keys (or no queries) get exactly zero gradient
    for b in range(len(lq)):
        if lq[b] == 0 or lk[b] == 0:
            assert not sequence(qg.grad, cu_q, b).any() and not sequence(kg.grad, cu_k, b).any()


@pytest.mark.parametrize(
    "schedule",
    [
        {"dkdv": {"TILE_MAJOR": True}, "dq": {"TILE_MAJOR": True, "FROM_END": True}},
        {"dkdv": {"GROUP_SPLIT": 2}, "dq": {"FROM_END": True}},
        {"dkdv": {"GROUP_SPLIT": 4, "TILE_MAJOR": True}, "dq": {}},
    ],
)
def test_every_backward_schedule_gives_the_float64_gradients(schedule):
    """The grid orders and the GQA group split change which program does what, not the gradients: each schedule's
    dq, dk, dv (a sequence of 0 rows, of 1, several query tiles, a window) equal float64 per sequence, and a group
    split's parts add up to what one program per K/V head writes, run after run."""
    lq, lk, causal, window = [21, 0, 1, 35], [30, 5, 3, 35], True, (19, None)
    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, 4, 1, 16, torch.float32, seed=11)
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, max(lq), max(lk), causal, window, None)
    grads = varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal, window, None, schedule)
    refs = varlen_grads_float64(q, k, v, do, cu_q, cu_k, causal, window)
    for name, x, ref in zip("qkv", grads, refs, strict=True):
        err = relative_error(x, ref)
        assert err <= grad_tolerance(torch.float32), f"d{name} under {schedule}: relative error {err:.2e}"
    again = varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal, window, None, schedule)
    for x, y in zip(grads, again, strict=True):
        assert torch.equal(x, y)


def test_a_group_split_that_does_not_divide_the_group_is_an_error():
    q, k, v, do, cu_q, cu_k = packed_case([3], [3], 4, 2, 16)
    o, lse = varlen_forward(q, k, v, cu_q, cu_k, 3, 3, False, None, None)
    with pytest.raises(ValueError, match="GROUP_SPLIT=3"):
        varlen.backward(do, q, k, v, o, lse, cu_q, cu_k, 3, 3, False, None, None, {"dkdv": {"GROUP_SPLIT": 3}})


def test_loss_on_lse_is_an_error():
    q, k, v, _, cu_q, cu_k = packed_case([3, 2], [3, 2], 1, 1, 16)
    q.requires_grad_()
    o, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, return_lse=True)
    with pytest.raises(RuntimeError, match="lse"):
        (o.sum() + lse.sum()).backward()


def test_two_runs_are_bit_identical():
    q, k, v, do, cu_q, cu_k = packed_case([9, 1], [9, 5], 2, 1, 16, torch.bfloat16, seed=1)
    runs = []
    for _ in range(2):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        o = flash_attention_varlen(qg, kg, vg, cu_q, cu_k, 9, 9, causal=True)
        o.backward(do)
        runs.append((o, qg.grad, kg.grad, vg.grad))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_no_tile_crosses_a_sequence_boundary():
    """Every (sequence, head) visits exactly the key tiles its own band leaves (``tile_map`` of its lengths), and
    NaN in the keys and values of one sequence changes no other sequence's output."""
    lq, lk = [20, 0, 3, 17], [18, 6, 40, 17]
    hq, hk, d = 2, 1, 16
    q, k, v, _, cu_q, cu_k = packed_case(lq, lk, hq, hk, d, seed=5)
    causal, window = True, (9, None)
    _, win_left, win_right, qk_scale, _ = kernel_band(max(lq), max(lk), d, causal, window, None)
    o = torch.zeros_like(q)
    lse = torch.zeros(hq, q.shape[0])
    tiles = torch.zeros(len(lq) * hq, dtype=torch.int32)
    varlen.launch(q, k, v, o, lse, cu_q, cu_k, max(lq), max(lk), causal, window, (win_left, win_right, qk_scale),
                  tiles=tiles)  # fmt: skip
    bm, bn = CPU_CONFIG["BLOCK_M"], CPU_CONFIG["BLOCK_N"]
    for b, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        expected = tile_map(nq, nk, bm, bn, causal, window).n_computed if nq and nk else 0
        assert tiles[b * hq : (b + 1) * hq].tolist() == [expected] * hq, f"sequence {b}"
        assert expected <= cdiv(nq, bm) * cdiv(nk, bn)

    clean = varlen_forward(q, k, v, cu_q, cu_k, max(lq), max(lk), causal, window, None)[0]
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[int(cu_k[2]) : int(cu_k[3])] = float("nan")
    v_bad[int(cu_k[2]) : int(cu_k[3])] = float("nan")
    dirty = varlen_forward(q, k_bad, v_bad, cu_q, cu_k, max(lq), max(lk), causal, window, None)[0]
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[int(cu_q[2]) : int(cu_q[3])] = False
    assert torch.equal(dirty[others], clean[others])
    assert torch.isnan(dirty[~others]).all()  # the poisoned sequence itself does see its keys


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # NumPy's max, inside the interpreter
def test_nan_in_one_sequence_leaves_the_others_gradients():
    """The backward kernels stay inside each sequence too: NaN in one sequence's keys and values reaches that
    sequence's gradients only."""
    lq, lk = [17, 5, 9], [20, 17, 3]
    q, k, v, do, cu_q, cu_k = packed_case(lq, lk, 2, 1, 16, seed=9)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[int(cu_k[1]) : int(cu_k[2])] = float("nan")
    v_bad[int(cu_k[1]) : int(cu_k[2])] = float("nan")
    grads = []
    for keys, values in ((k, v), (k_bad, v_bad)):
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, keys, values))
        flash_attention_varlen(qg, kg, vg, cu_q, cu_k, max(lq), max(lk), causal=True).backward(do)
        grads.append((qg.grad, kg.grad, vg.grad))
    (dq, dk, dv), (dq_bad, dk_bad, dv_bad) = grads
    q_rows = torch.ones(q.shape[0], dtype=torch.bool)
    q_rows[int(cu_q[1]) : int(cu_q[2])] = False
    k_rows = torch.ones(k.shape[0], dtype=torch.bool)
    k_rows[int(cu_k[1]) : int(cu_k[2])] = False
    assert torch.equal(dq_bad[q_rows], dq[q_rows])
    assert torch.equal(dk_bad[k_rows], dk[k_rows]) and torch.equal(dv_bad[k_rows], dv[k_rows])
    assert torch.isnan(dq_bad[~q_rows]).all()


# ----------------------------------------------------------------------------------------------------------------
# Bad input: a clear error naming the problem
# ----------------------------------------------------------------------------------------------------------------


def good_args():
    q, k, v, _, cu_q, cu_k = packed_case([3, 2], [4, 1], 2, 1, 16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=4)


def with_(**changes):
    args = good_args()
    for name, change in changes.items():
        args[name] = change(args[name]) if callable(change) else change
    return args


BAD = [
    (with_(cu_seqlens_q=lambda c: c.long()), TypeError, "cu_seqlens_q must be int32"),
    (with_(cu_seqlens_k=lambda c: c.float()), TypeError, "cu_seqlens_k must be int32"),
    (with_(cu_seqlens_q=lambda c: c[None]), ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\)"),
    (with_(cu_seqlens_q=lambda c: c[:1]), ValueError, r"cu_seqlens_q must have shape \(B \+ 1,\)"),
    (with_(cu_seqlens_k=cu_seqlens([4, 1, 0])), ValueError, "must both have B \\+ 1 entries"),
    (with_(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (with_(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "cu_seqlens_k must not decrease"),
    (with_(cu_seqlens_q=cu_seqlens([3, 1])), ValueError, r"last entry \(4\) must equal the packed rows' count \(5\)"),
    (with_(max_seqlen_q=2), ValueError, "sequence 0 has 3 rows in cu_seqlens_q, more than max_seqlen_q = 2"),
    (with_(max_seqlen_k=3), ValueError, "more than max_seqlen_k = 3"),
    (with_(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    (with_(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
    (with_(cu_seqlens_q=lambda c: c.to("meta")), ValueError, "cu_seqlens_q must be on q's device"),
    (with_(q=lambda x: x.double()), TypeError, "float16, bfloat16, float32"),
    (with_(k=lambda x: x.half()), TypeError, "same dtype"),
    (
        with_(q=lambda x: x[..., :12], k=lambda x: x[..., :12], v=lambda x: x[..., :12]),
        ValueError,
        "head dim 12 is not supported",
    ),
    (with_(v=lambda x: x[..., :8]), ValueError, "same head dim"),
    (
        with_(q=lambda x: x[:, :1].expand(-1, 3, -1), k=lambda x: x.expand(-1, 2, -1), v=lambda x: x.expand(-1, 2, -1)),
        ValueError,
        r"query heads \(3\) must be a multiple",
    ),
    (with_(v=lambda x: x[:4]), ValueError, "k and v must have the same rows and heads"),
    (with_(q=lambda x: x[None]), ValueError, "q must have 3 dims"),
    (with_(cu_seqlens_q=[0, 3, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
]


@pytest.mark.parametrize("args, error, message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_a_clear_error(args, error, message):
    with pytest.raises(error, match=message):
        flash_attention_varlen(**args)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(causal=1), TypeError, "causal must be True or False"),
        (dict(window=(2,)), ValueError, "window must be a pair"),
        (dict(scale=float("nan")), ValueError, "scale"),
    ],
)
def test_bad_mask_or_scale_is_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        flash_attention_varlen(**good_args(), **kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Bad boundaries checked on the device: the same words as the host's check, no host read, NaN out, nothing read
# outside the tensors
# ----------------------------------------------------------------------------------------------------------------

BAD_BOUNDARIES = [
    (dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)), "cu_seqlens_q must start at 0; got 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)), r"cu_seqlens_k must not decrease: entry 2 \(3\)"),
    (dict(cu_seqlens_q=cu_seqlens([3, 1])), r"cu_seqlens_q's last entry \(4\) must equal the packed rows' count \(5\)"),
    (dict(max_seqlen_q=2), "sequence 0 has 3 rows in cu_seqlens_q, more than max_seqlen_q = 2"),
    (dict(max_seqlen_k=3), "sequence 0 has 4 rows in cu_seqlens_k, more than max_seqlen_k = 3"),
    (dict(cu_seqlens_k=torch.tensor([0, 10**6, 5], dtype=torch.int32)), r"must not decrease: entry 2 \(5\)"),
    (dict(cu_seqlens_q=torch.tensor([0, -7, 5], dtype=torch.int32)), r"must not decrease: entry 1 \(-7\)"),
]


@pytest.mark.parametrize("changes, message", BAD_BOUNDARIES, ids=[m for _, m in BAD_BOUNDARIES])
@pytest.mark.parametrize("check_values", [True, "sync"])
def test_the_device_check_and_the_hosts_name_the_same_bad_boundary(changes, message, check_values):
    """On the CPU the interpreter has run the device's check by the time the call returns: it raises at once, with
    the words of the host's check, and so does ``check_values="sync"``."""
    with pytest.raises(ValueError, match=message):
        flash_attention_varlen(**{**good_args(), **changes}, check_values=check_values)


@pytest.mark.parametrize("changes, message", BAD_BOUNDARIES, ids=[m for _, m in BAD_BOUNDARIES])
def test_unchecked_bad_boundaries_give_nan_and_read_nothing_outside(changes, message):
    """With ``check_values=False`` nothing is raised, and the outputs and gradients are NaN: the kernels walked no
    sequence (entries far outside the tensors, a negative one, included)."""
    args = {**good_args(), **changes}
    for name in ("q", "k", "v"):
        args[name] = args[name].clone().requires_grad_()
    o, lse = flash_attention_varlen(**args, return_lse=True, check_values=False)
    assert torch.isnan(o).all() and torch.isnan(lse).all()
    o.sum().backward()
    for name in ("q", "k", "v"):
        assert torch.isnan(args[name].grad).all(), name


def test_the_default_check_never_reads_the_boundaries_on_the_host(monkeypatch):
    """The default path makes no host read of cu_seqlens (which on a GPU is a synchronisation per call)."""
    from flashlab.host import varlen as host_varlen

    def host_read(*args):
        raise AssertionError("the boundaries were read on the host")

    monkeypatch.setattr(host_varlen, "check_cu_seqlens_values", host_read)
    monkeypatch.setattr(torch.Tensor, "tolist", host_read)
    flash_attention_varlen(**good_args())
    with pytest.raises(AssertionError, match="read on the host"):
        flash_attention_varlen(**good_args(), check_values="sync")


def test_a_bad_boundary_recorded_earlier_is_raised_by_the_next_checked_call():
    """What a GPU launch leaves in the device's record (here written by the check itself, as a GPU would before the
    host reads it) is raised by the next call that checks on that device, naming the earlier call."""
    from flashlab.host.kvcache_errors import error_record

    args = {**good_args(), "cu_seqlens_q": torch.tensor([0, 4, 3], dtype=torch.int32)}
    o = torch.empty(5, 2, 16)
    lse = torch.empty(2, 5)
    record = error_record(torch.device("cpu"))
    varlen.checked_boundaries(args["cu_seqlens_q"], args["cu_seqlens_k"], 5, 5, 3, 4, record.tensor, (o, lse))
    assert torch.isnan(o).all() and torch.isnan(lse).all()
    with pytest.raises(ValueError, match=r"an earlier flash_attention_varlen call on cpu met bad boundaries: "
                                         r"cu_seqlens_q must not decrease: entry 2 \(3\) < entry 1 \(4\)"):  # fmt: skip
        flash_attention_varlen(**good_args())
    flash_attention_varlen(**good_args())  # raised once, then cleared


def test_the_device_check_reads_boundaries_across_several_of_its_blocks():
    """More sequences than one block of the check holds (``CHECK_BLOCK``): a decrease past the first block and the
    longest sequence in a later block are found, with their indices."""
    b = varlen.CHECK_BLOCK + 300
    lengths = [1] * b
    lengths[b - 5] = 3
    good = cu_seqlens(lengths)
    safe_q, safe_k = varlen.checked_boundaries(good, good, b + 2, b + 2, 3, 3, torch.zeros(8, dtype=torch.int32), ())
    assert torch.equal(safe_q, good) and torch.equal(safe_k, good)
    from flashlab.host.kvcache_errors import ErrorRecord, raise_recorded

    for cu, most, message in [
        (torch.cat([good[: b - 100], good[b - 100 :] - 2]), 3, rf"cu_seqlens_q must not decrease: entry {b - 100} "),
        (good, 2, rf"sequence {b - 5} has 3 rows in cu_seqlens_q, more than max_seqlen_q = 2"),
    ]:
        record = ErrorRecord(torch.device("cpu"))
        safe_q, _ = varlen.checked_boundaries(cu, good, b + 2, b + 2, most, 3, record.tensor, ())
        assert not safe_q.any(), "bad boundaries: every sequence empty for the kernels"
        with pytest.raises(ValueError, match=message):
            raise_recorded(record, earlier=False)


def test_a_new_batch_of_lengths_compiles_no_new_binary():
    """Every int a varlen kernel takes per call (lengths, packed rows, the band, a stride that follows the totals)
    is unspecialised: Triton would otherwise compile a new binary each time one of them changed its divisibility by
    16, and the planned launches would not be shared across batches. Floats (the scales) are never specialised."""
    kernels = {"forward": varlen.attn_fwd_varlen, "check": varlen.check_boundaries,
               "preprocess": varlen.bwd_preprocess_varlen, "dkdv": varlen.bwd_dkdv_varlen,
               "dq": varlen.bwd_dq_varlen}  # fmt: skip
    floats = {"qk_scale", "dk_scale", "dq_scale"}
    assert set(kernels) == set(varlen.PLANNED)
    for name, fn in kernels.items():
        runtime, outputs = varlen.PLANNED[name]
        params = dict(zip(fn.arg_names, fn.params, strict=True))
        for arg in runtime:
            assert arg in params and not params[arg].is_constexpr, (name, arg)
            if arg not in floats:
                assert params[arg].do_not_specialize, f"{name}: {arg} is specialised"
        assert all(out in params for out in outputs), name
