"""``flash_attention`` on float8 (e4m3) inputs: the checks, the quantiser, the launch of the FP8 forward.

- ``quantize_qkv(q, k, v)``: ``(q8, k8, v8, q_descale, k_descale, v_descale)`` from 16- or 32-bit ``(B, H, N, D)``
  tensors, one float32 scale per (sequence, K/V head) as FlashAttention-3 takes them: for q the scale of the query
  heads of that K/V head's group together. Each scale is the group's amax over 448 (``flashlab.host.quantize``'s
  rule, shared with the 8-bit cache).
- ``dequantize_qkv(q8, k8, v8, q_descale, k_descale, v_descale)``: the float64 tensors they stand for, exactly as
  the kernel reads them: what the float64 reference is run on.
- ``fp8_attention(...)``: ``flash_attention``'s path for e4m3 inputs (``flashlab.kernels.fp8_forward``).

The descales' values are checked on the device, not read on the host (that read was one synchronisation a call):
a scale that is not finite and > 0 makes NaN of its group's output rows and lse, and the first such scale is
reported in the device's error record (``flashlab.host.kvcache_errors``), which the next FP8 call (or
``flashlab.check_kvcache_errors()``, which waits for the GPU first) raises as a ValueError naming it. On the CPU,
where the interpreter has finished when the call returns, the call itself raises.
"""

from __future__ import annotations

import torch

from flashlab.core.masking import visible_band
from flashlab.host.checks import check_causal, check_dense, check_scale
from flashlab.host.kvcache_errors import error_record, raise_recorded
from flashlab.host.quantize import FP8, check_quantisable, scales_from_amax, to_e4m3
from flashlab.kernels import fp8_forward
from flashlab.kernels.device import kernel_band

MIN_CAPABILITY = (8, 9)  # the 8-bit tensor cores' first generation (Ada); Hopper (9, 0) is the one measured
# On a GPU P is rounded to e4m3 before the second product: each weight moves by up to 2^-4 of itself, and the
# output, a weighted mean over many keys, by much less. The relative error allowed against float64 of the
# dequantised inputs (the inputs' own e4m3 rounding is the evaluation gate's, ``E4M3_TOLERANCE``).
FP8_FORWARD_TOLERANCE = 2.0**-5


def _group_view(x, hk: int) -> torch.Tensor:
    """``(B, H, N, D)`` as ``(B, Hk, H // Hk, N, D)``: the heads of each K/V head's group together."""
    b, h, n, d = x.shape
    return x.reshape(b, hk, h // hk, n, d)


def quantize_qkv(q, k, v):
    """``(q8, k8, v8, q_descale, k_descale, v_descale)``: q, k, v ``(B, Hq, Nq, D)`` / ``(B, Hk, Nk, D)`` (float16,
    bfloat16 or float32, finite) rounded to e4m3 with one float32 scale per (sequence, K/V head), the scales
    ``(B, Hk)``; q's scale covers the query heads of that K/V head's group."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_quantisable(name, x, "quantize_qkv", layout=" (B, H, N, D)", holder="e4m3")
    hk = k.shape[1]
    if q.shape[1] % hk or v.shape[1] != hk:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of the K/V heads ({hk}), v's the same")
    scales = []
    out = []
    for x in (_group_view(q, hk), k.unsqueeze(2), v.unsqueeze(2)):
        scale = scales_from_amax(x.abs().amax(dim=(2, 3, 4)))  # (B, Hk)
        scales.append(scale)
        out.append(to_e4m3(x, scale[:, :, None, None, None]).flatten(1, 2))
    return (*out, *scales)


def dequantize_qkv(q8, k8, v8, q_descale, k_descale, v_descale):
    """The float64 q, k, v that e4m3 tensors and their ``(B, Hk)`` scales stand for (``x8 * descale``)."""
    hk = k8.shape[1]
    q = (_group_view(q8.double(), hk) * q_descale.double()[:, :, None, None, None]).flatten(1, 2)
    return q, k8.double() * k_descale.double()[:, :, None, None], v8.double() * v_descale.double()[:, :, None, None]


def _check_descale(name: str, x, b: int, hk: int, device) -> torch.Tensor:
    """A descale as the kernel reads it, ``(B, Hk)`` float32 contiguous (``(Hk,)`` stands for every sequence)."""
    if x is None:
        raise TypeError(f"float8 inputs need q_descale, k_descale and v_descale; {name} is missing")
    check_dense(name, x)
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32; got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on q's device ({device}); got {x.device}")
    if tuple(x.shape) == (hk,):
        x = x.expand(b, hk)
    if tuple(x.shape) != (b, hk):
        raise ValueError(f"{name} must have shape (B, Hk) = ({b}, {hk}) or (Hk,); got {tuple(x.shape)}")
    return x.contiguous()  # its values are checked on the device (the module docstring)


def check_fp8_inputs(q, k, v, causal, window, scale, q_descale, k_descale, v_descale):
    """The FP8 forward's checks: a TypeError or ValueError naming the argument. Returns the three descales as the
    kernel reads them."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dense(name, x)
        if x.dtype != FP8:
            raise TypeError(f"{name} has dtype {x.dtype}: the FP8 forward takes q, k and v all float8_e4m3fn")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D); got shape {tuple(x.shape)}")
    b, hq, nq, d = q.shape
    _, hk, nk, _ = k.shape
    if k.shape[0] != b or v.shape != k.shape or k.shape[3] != d:
        raise ValueError(f"k and v must be (B, Hk, Nk, D) like each other, with q's B and D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")  # fmt: skip
    if hk < 1 or hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of the key/value heads ({hk})")
    if nq < 1 or nk < 1:
        raise ValueError(f"the FP8 forward needs at least one query and one key; got Nq = {nq}, Nk = {nk}")
    if d not in fp8_forward.HEAD_DIMS:
        raise ValueError(f"head dim {d}: the FP8 forward takes D in {fp8_forward.HEAD_DIMS}")
    if q.device.type == "cuda":
        capability = torch.cuda.get_device_capability(q.device)
        if capability < MIN_CAPABILITY:
            raise RuntimeError(f"{torch.cuda.get_device_name(q.device)} (sm_{capability[0]}{capability[1]}) has no "
                               "8-bit tensor cores: the FP8 forward needs sm_89 or later")  # fmt: skip
    elif q.device.type != "cpu":
        raise ValueError(f"the FP8 forward runs on CUDA (compiled) or CPU (interpreted) tensors; got {q.device}")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}); got {x.device}")
    check_causal(causal)
    visible_band(nq, nk, causal, window)  # ValueError for a malformed window
    check_scale(scale)
    return tuple(_check_descale(name, x, b, hk, q.device) for name, x in
                 (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))  # fmt: skip


def fp8_attention(q, k, v, causal, window, scale, return_lse, q_descale, k_descale, v_descale):
    """``flash_attention`` on e4m3 q, k, v with their descales: o ``(B, Hq, Nq, D)`` bfloat16 (and lse
    ``(B, Hq, Nq)`` float32 with ``return_lse``). Not differentiable."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("the FP8 forward runs eagerly: torch.compile does not trace it yet")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError("the FP8 forward has no backward: call it under torch.no_grad() or on tensors that do "
                           "not require grad")  # fmt: skip
    descales = check_fp8_inputs(q, k, v, causal, window, scale, q_descale, k_descale, v_descale)
    record = error_record(q.device)
    raise_recorded(record, earlier=True)  # a bad scale an earlier call's launch met (no wait: a plain load)
    fp8_forward.check_descales(*descales, record.tensor)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    b, hq, nq, d = q.shape
    offset, win_left, win_right, sm_scale_log2, negate = kernel_band(nq, k.shape[2], d, causal, window, scale)
    if negate:  # the running max needs a positive scale: -q8, its sign bits flipped, is exact
        q = (q.view(torch.uint8) ^ 0x80).view(FP8)
    o = torch.empty((b, hq, nq, d), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    band = (offset, win_left, win_right, sm_scale_log2)
    if q.is_cuda and fp8_forward.tma_available(q):
        from flashlab.kernels.ladder import rung4_overlap  # Gluon's import, only where a GPU runs it

        q, k = q.contiguous(), k.contiguous()  # the copy engine reads the rows of every head one after another
        if rung4_overlap.fp8_unavailable(q, k, v, causal, window) is None:  # rung 4's schedule: D = 64, 128
            rung4_overlap.launch_fp8(q, k, fp8_forward.transposed_v(v), o, lse, *descales, band, causal, window)
        else:
            fp8_forward.launch_tma(q, k, v, o, lse, *descales, band, causal, window)
    else:
        fp8_forward.launch(q, k, v, o, lse, *descales, band)
    if not q.is_cuda:  # the interpreter has finished: this call's own bad scale
        raise_recorded(record, earlier=False)
    return (o, lse) if return_lse else o


__all__ = [
    "FP8_FORWARD_TOLERANCE",
    "MIN_CAPABILITY",
    "check_fp8_inputs",
    "dequantize_qkv",
    "fp8_attention",
    "quantize_qkv",
]
