"""What the varlen probes share: the varlen bar's log-normal batch on the GPU, and the host's time to issue a call
against the time a call takes back to back."""

import time

import torch

from flashlab.bench.varlen import VarlenPlan, mix_lengths


def lognormal_batch(tokens: int, head_dim: int, heads: int = 16, kv_heads: int = 4, seed: int = 0):
    """``(q, k, v, do, cu, nmax)``: packed bf16 q ``(tokens, heads, D)`` and k, v ``(tokens, kv_heads, D)`` that
    want gradients, an upstream gradient like q, the boundaries of the bar's log-normal lengths (int32) and the
    longest length."""
    lengths = mix_lengths("log-normal", VarlenPlan(tokens=tokens), seed=seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(h):
        return torch.randn(tokens, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = rand(heads).requires_grad_(), rand(kv_heads).requires_grad_(), rand(kv_heads).requires_grad_()
    return q, k, v, torch.randn_like(q), cu, max(lengths)


def issue_and_finish(fn, n: int) -> tuple[float, float]:
    """``(issued, done)``: µs a call of ``fn`` takes the host to issue, and µs it takes back to back, over ``n``
    calls after a synchronisation. Few enough calls that the driver's launch queue never fills, or the host waits
    for the GPU and the two read the same."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    issued = time.perf_counter() - t0
    torch.cuda.synchronize()
    return issued / n * 1e6, (time.perf_counter() - t0) / n * 1e6
