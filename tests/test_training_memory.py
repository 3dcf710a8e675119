"""flashlab.bench.training_memory: what autograd keeps for attention's backward, against counts worked out here.

For one head of causal attention in float32, N = 48, D = 16 (N D = 768, N^2 = 2,304):
- naive (eager matmul -> softmax -> matmul) keeps Q, K, V (3 x 768 x 4 B = 9,216 B), P (2,304 x 4 B = 9,216 B)
  and the boolean mask (2,304 x 1 B): 20,736 B;
- flashlab keeps Q, K, V, O (4 x 768 x 4 B = 12,288 B) and lse (48 x 4 B = 192 B): 12,480 B.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from flashlab.bench.implementations import naive_attention
from flashlab.bench.training_memory import saved_for_backward_bytes, training_step_memory
from flashlab.calculators.roofline import flash_saved_for_backward_bytes, naive_saved_for_backward_bytes

# flash_attention is differentiable once flashlab.host.autograd exists; until then it refuses tensors that need grad
needs_differentiable_kernel = pytest.mark.skipif(
    importlib.util.find_spec("flashlab.host.autograd") is None, reason="flash_attention has no backward here"
)


def qkv(n, d, heads=1, device="cpu", dtype=torch.float32):
    return tuple(torch.randn(1, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))


def test_naive_attention_keeps_q_k_v_p_and_its_mask():
    q, k, v = qkv(48, 16)
    saved, o = saved_for_backward_bytes(naive_attention, q, k, v, causal=True)
    assert saved == 20_736
    assert o.shape == (1, 1, 48, 16)
    assert saved == naive_saved_for_backward_bytes(48, 16, dtype_bytes=4) + 48 * 48


def test_nothing_saved_without_grad_and_views_count_once():
    q, k, v = (x.detach() for x in qkv(48, 16))
    assert saved_for_backward_bytes(naive_attention, q, k, v, causal=True)[0] == 0
    x = torch.randn(64, 8, requires_grad=True)
    saved, _ = saved_for_backward_bytes(lambda a: (a @ a.T).sum(), x)  # x and its transposed view: one storage
    assert saved == 64 * 8 * 4


def test_training_step_memory_clears_grads_and_has_no_peak_on_cpu():
    q, k, v = qkv(20, 8)
    do = torch.randn(1, 1, 20, 8)
    saved, peak = training_step_memory(naive_attention, q, k, v, do)
    assert saved == 3 * 20 * 8 * 4 + 20 * 20 * 4 + 20 * 20 and peak is None
    assert q.grad is None and k.grad is None and v.grad is None


@needs_differentiable_kernel
def test_flash_attention_keeps_q_k_v_o_and_lse():
    import flashlab

    q, k, v = qkv(48, 16)
    saved, _ = saved_for_backward_bytes(flashlab.flash_attention, q, k, v, causal=True)
    assert saved == 12_480 == flash_saved_for_backward_bytes(48, 16, dtype_bytes=4)


@needs_differentiable_kernel
def test_recording_script_runs_on_cpu(tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "scripts/backward_memory.py", "--device", "cpu", "--seq-lens", "16", "--heads", "1"]
    cmd += ["--head-dim", "16", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["naive"]["saved_bytes"] == 3 * 16 * 16 * 4 + 16 * 16 * 4 + 16 * 16  # 4,352
    assert rows["flashlab"]["saved_bytes"] == 4 * 16 * 16 * 4 + 16 * 4  # 4,160


@pytest.mark.gpu
@needs_differentiable_kernel
def test_on_gpu_flash_keeps_o_of_n_and_peaks_far_below_naive():
    import flashlab

    n, d, h = 4096, 128, 4
    q, k, v = qkv(n, d, heads=h, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(q)
    naive_saved, naive_peak = training_step_memory(naive_attention, q, k, v, do)
    flash_saved, flash_peak = training_step_memory(flashlab.flash_attention, q, k, v, do)
    assert naive_saved == h * naive_saved_for_backward_bytes(n, d, dtype_bytes=2) + n * n  # + the boolean mask
    assert flash_saved == h * flash_saved_for_backward_bytes(n, d, dtype_bytes=2)
    p_bytes = h * n * n * 2  # one bf16 P: 134 MB
    assert naive_peak > 2 * p_bytes  # P kept, plus the backward's dP / dS temporaries
    assert flash_peak < p_bytes / 4, (flash_peak, p_bytes)
