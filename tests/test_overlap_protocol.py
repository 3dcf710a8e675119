"""The model of rung 4's synchronisation (``scripts/overlap_protocol_model.py``), run on CPU.

The model writes the overlap kernel's loader warp and consumer warpgroups as Python generators, interleaves them
at random with the copies and products finishing at random later steps, and fails on a deadlock, a product that
reads the wrong or an unfinished tile, or a buffer overwritten while something still reads it. Here it runs a
small share of its configurations, and each mutation below -- a change the kernel must not make -- is shown to
make it fail, so a model that checks nothing would not pass.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MODEL_PATH = Path(__file__).resolve().parents[1] / "scripts" / "overlap_protocol_model.py"
SEEDS = 12
# (warpgroups, stages, O through Q's buffer, ping-pong, query tiles per head, heads, key tiles, causal, offset,
# programs): both ring depths, three warpgroups, O through Q, causal with and without an offset, several programs
CONFIGS = [
    (2, 2, False, True, 3, 2, 3, False, 0, 1),
    (2, 2, False, True, 4, 3, 4, True, 0, 2),
    (2, 3, False, False, 3, 2, 5, True, 2, 1),
    (3, 2, False, True, 4, 3, 4, True, 0, 3),
    (2, 2, True, True, 3, 2, 3, True, 0, 2),
    (2, 2, True, False, 2, 5, 2, False, 0, 1),
]


@pytest.fixture()
def model():
    spec = importlib.util.spec_from_file_location("overlap_protocol_model", MODEL_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_all(model, configs=CONFIGS, seeds=SEEDS):
    """Every configuration under ``seeds`` interleavings; the first failure's message, or None."""
    for num_wg, stages, o_in_q, pingpong, n_m, n_bh, nk, causal, off, nprog in configs:
        for seed in range(seeds):
            try:
                model.simulate(seed, num_wg, stages, o_in_q, pingpong, n_m, n_bh, nk, causal, off, seed % nprog, nprog)
            except AssertionError as failure:
                return str(failure)
    return None


def test_the_kernels_synchronisation_has_no_deadlock_or_hazard(model):
    assert run_all(model) is None


def _no_wait(w, wg, n):
    """warpgroup_mma_wait that waits for nothing."""
    return iter(())


def test_products_not_waited_for_are_caught(model, monkeypatch):
    # a consumer that releases K and V without waiting for the products reading them
    monkeypatch.setattr(model, "mma_wait", _no_wait)
    assert "while a product reads it" in (run_all(model) or "")


def test_a_ring_that_does_not_wait_for_its_consumers_is_caught(model, monkeypatch):
    # a loader whose waits on the "empty" barriers pass at once: it overwrites buffers still being read
    real_wait = model.wait

    def wait(bar, parity):
        if bar.count > 1:  # the K/V "empty" barriers, released by every consumer warpgroup
            return iter(())
        return real_wait(bar, parity)

    monkeypatch.setattr(model, "wait", wait)
    assert run_all(model) is not None


def test_a_missed_release_is_a_deadlock(model, monkeypatch):
    # consumers that never release K or V: once the ring comes round the loader waits for ever
    real_arrive = model.Barrier.arrive

    def arrive(self):
        if self.count > 1:  # the K/V "empty" barriers, one arrival per consumer warpgroup
            return
        real_arrive(self)

    monkeypatch.setattr(model.Barrier, "arrive", arrive)
    assert "deadlock" in (run_all(model, CONFIGS[:1], seeds=1) or "")
