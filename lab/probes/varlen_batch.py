"""What the varlen probes share: the varlen bar's log-normal batch on the GPU, one of its cells as a training step
two ways (torch's varlen_attn and flashlab varlen), a backward tile config from its tuple, and the host's time to
issue a call against the time a call takes back to back."""

import time

import torch
from triton.testing import do_bench

from flashlab import flash_attention_varlen
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


class TrainingCell:
    """A cell of the bar (``tokens`` packed tokens, head dim ``head_dim``, ``causal`` or not) as one training
    step's attention, forward then backward of a fixed upstream gradient: ``step_theirs`` through ``theirs``
    (torch's varlen_attn, ``flashlab.bench.varlen.torch_varlen_attn``), run once for the reference gradients
    ``ref`` and timed (``ms_ref``), and ``step`` through ``flash_attention_varlen`` under whatever config the host
    engine is given."""

    def __init__(self, theirs, tokens: int, head_dim: int, causal: bool):
        q, k, v, do, cu, nmax = lognormal_batch(tokens, head_dim)
        self.inputs = (q, k, v)
        self.step_theirs = lambda: theirs(q, k, v, cu, nmax, causal).backward(do)
        self.step = lambda: flash_attention_varlen(q, k, v, cu, cu, nmax, nmax, causal=causal).backward(do)
        self.label = f"{tokens // 1024}K D{head_dim} {'causal' if causal else 'full'}"
        self.step_theirs()
        self.ref = [x.grad.clone() for x in self.inputs]
        self.ms_ref = self.time(self.step_theirs)

    def time(self, fn) -> float:
        """ms a call of ``fn`` takes (``do_bench``, the inputs' gradients reset between calls)."""
        return do_bench(fn, rep=200, grad_to_none=list(self.inputs))

    def error(self) -> float:
        """One ``step`` from fresh gradients: the largest of q's, k's and v's gradient errors against the reference,
        each relative to the reference's largest entry."""
        for x in self.inputs:
            x.grad = None
        self.step()
        return max(((x.grad.float() - r.float()).abs().max() / r.float().abs().max()).item()
                   for x, r in zip(self.inputs, self.ref, strict=True))  # fmt: skip


def tile_config(tiles) -> dict:
    """A backward kernel's tiles ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` as the host engine's config."""
    return {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1], "num_warps": tiles[2], "num_stages": tiles[3]}


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
