"""Materialised attention in float64 with torch, on the inputs' own device: the reference for GPU-sized checks.

``flashlab.reference.attention`` (NumPy) is the definition; this is the same function for tensors that live on a
GPU and are too big to copy to the CPU, computed in float64 so that any kernel's error is measured against
something far more exact than itself. The tests, the benchmark's check before it times, and the notebooks use it.
"""

from __future__ import annotations

import math

import torch

from flashlab.core.masking import visible_band


def attention_float64(q, k, v, causal: bool = False, window=None, scale=None, rows=None, max_bytes: int = 256 * 2**20):
    """``(o, lse)`` in float64 for q ``(B, Hq, Nq, D)``, k/v ``(B, Hk, Nk, D)`` (GQA: query head h reads K/V head
    ``h // (Hq // Hk)``), masks as ``flashlab.core.masking`` (bottom-right aligned).

    ``rows`` (a sequence of query indices) computes only those rows: ``o (B, Hq, len(rows), D)``, ``lse (B, Hq,
    len(rows))``. A row's output depends on its own query and all keys, so a sample of rows checks a kernel without
    the full N x N float64 score matrix. Heads go in groups of about ``max_bytes`` of float64 scores and K/V.
    Rows that see no key give zeros and lse = -inf, as everywhere in flashlab.
    """
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = torch.arange(nq, device=q.device) if rows is None else torch.as_tensor(rows, device=q.device).long()
    offset, left, right = visible_band(nq, nk, causal, window)
    diag = (rows + offset)[:, None]  # (R, 1) each row's diagonal key
    j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
    visible = (j >= diag - left) & (j <= diag + right)  # (R, Nk)
    b, h = q.shape[:2]
    group = h // k.shape[1]
    heads_per_step = max(1, max_bytes // (8 * nk * (len(rows) + 2 * d)))
    out = torch.empty(b, h, len(rows), v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(b, h, len(rows), dtype=torch.float64, device=q.device)
    for h0 in range(0, h, heads_per_step):
        hs = slice(h0, min(h, h0 + heads_per_step))
        kv = torch.arange(hs.start, hs.stop, device=q.device) // group  # the K/V head each query head reads
        qs = q[:, hs][:, :, rows].double()  # (B, h, R, D)
        s = (qs @ k[:, kv].double().transpose(-2, -1)) * scale  # (B, h, R, Nk)
        s = s.masked_fill(~visible, float("-inf"))
        lse[:, hs] = torch.logsumexp(s, dim=-1)  # (B, h, R); -inf on rows that see no key
        p = torch.exp(s - lse[:, hs].nan_to_num(neginf=0.0)[..., None]).nan_to_num(0.0)
        out[:, hs] = p @ v[:, kv].double()  # (B, h, R, D)
    return out, lse


def attention_float64_grads(q, k, v, do, causal: bool = False, window=None, scale=None, batch=None, kv_heads=None):
    """``(dq, dk, dv)`` in float64: ``torch.autograd`` through ``attention_float64`` with upstream gradient ``do``.

    dK and dV of a key need every query row that sees it, so there is no row sampling here; instead ``batch`` (a
    list of batch indices) and ``kv_heads`` (a list of K/V heads) restrict the work to those batch entries, those
    K/V heads and the query heads that read them (``query_heads(kv_heads, group)``). The results are shaped
    ``(len(batch), len(query heads), Nq, D)`` and ``(len(batch), len(kv_heads), Nk, D)``; None means all.
    """
    group = q.shape[1] // k.shape[1]
    batch = list(range(q.shape[0])) if batch is None else list(batch)
    kv_heads = list(range(k.shape[1])) if kv_heads is None else list(kv_heads)
    grads = []
    for h in kv_heads:  # one K/V head and its query heads at a time: one graph in memory, freed after its backward
        heads = query_heads([h], group)
        qd = q[batch][:, heads].detach().double().requires_grad_()
        kd = k[batch][:, [h]].detach().double().requires_grad_()
        vd = v[batch][:, [h]].detach().double().requires_grad_()
        with torch.enable_grad():
            o, _ = attention_float64(qd, kd, vd, causal, window, scale, max_bytes=2**62)  # all heads in one step
            grads.append(torch.autograd.grad(o, (qd, kd, vd), do[batch][:, heads].double()))
    dq, dk, dv = (torch.cat(parts, dim=1) for parts in zip(*grads, strict=True))
    return dq, dk, dv


def query_heads(kv_heads, group: int) -> list[int]:
    """The query heads that read the K/V heads ``kv_heads`` under grouped-query attention with ``group`` query
    heads per K/V head (query head h reads K/V head ``h // group``)."""
    return [h * group + g for h in kv_heads for g in range(group)]


__all__ = ["attention_float64", "attention_float64_grads", "query_heads"]
